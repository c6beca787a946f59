"""Inline SVG plots for the HTML report (matplotlib's SVG backend, no pyplot state).

Books describe their figures as data (``reward_lens.measure.figures``); this module draws
any of them. matplotlib is imported only here, and only when HTML is rendered.

Determinism: the SVG ``hashsalt`` is fixed and the ``Date`` metadata dropped, so the same
data gives byte-identical SVG; element ids are prefixed per figure so several figures can
live in one HTML page without colliding. Text is kept as text (``svg.fonttype = none``).

Size: a line of more than ``MAX_POINTS`` points is reduced to the minimum and maximum of each
of ``MAX_POINTS / 2`` bins (in x order), so every spike stays visible and a plot costs
O(width), not O(steps). A log-scaled panel draws only positive values (no spikes at zero).
"""

from __future__ import annotations

import io
import re

import numpy as np

from reward_lens.measure.figures import FigureOut, Panel, Series

MAX_POINTS = 2000
_RC = {"svg.hashsalt": "reward-lens", "svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
       "axes.spines.right": False, "font.family": "sans-serif"}
_ID = re.compile(r'(id="|url\(#|href="#)([^")]+)')
_COLORS = ["#1f5fa8", "#c0392b", "#1f7a4d", "#8e44ad", "#d35400", "#2c3e50", "#16a085", "#7f8c8d", "#b7950b"]


def reduce_minmax(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most about ``max_points`` points: the min and the max of y in each of max_points/2
    bins of consecutive points, in their x order; NaNs (line breaks) are kept where they are."""
    n = len(x)
    if n <= max_points:
        return x, y
    b = _bin_of(n, max_points)
    finite = np.isfinite(y)
    idx = np.nonzero(finite)[0]
    order = idx[np.lexsort((y[idx], b[idx]))]  # by bin, then by y
    sb = b[order]
    first = np.r_[True, sb[1:] != sb[:-1]]
    last = np.r_[sb[1:] != sb[:-1], True]
    keep = np.union1d(order[first], order[last])  # each bin's min and max
    keep = np.union1d(keep, np.nonzero(~finite)[0])  # and every break
    return x[keep], y[keep]


def _bin_of(n: int, max_points: int = MAX_POINTS) -> np.ndarray:
    """The bin of each of n consecutive points: max_points / 2 bins of (nearly) equal size."""
    return (np.arange(n) * (max_points // 2)) // n


def _per_bin(values: np.ndarray, bins: np.ndarray, reduce) -> np.ndarray:
    """``reduce`` (np.min, np.max, np.mean) of ``values`` over each bin, in bin order."""
    starts = np.r_[0, np.nonzero(np.diff(bins))[0] + 1]
    if reduce is np.mean:
        return np.add.reduceat(values, starts) / np.diff(np.r_[starts, len(values)])
    return (np.minimum if reduce is np.min else np.maximum).reduceat(values, starts)


def _broken(s: Series) -> tuple[np.ndarray, np.ndarray]:
    """x, y with a NaN after every x in ``gaps``: a line is never drawn across a gap."""
    x = np.asarray(s.x, dtype=float)
    y = np.asarray(s.y, dtype=float)
    if s.gaps:
        cut = np.searchsorted(x, np.asarray(s.gaps, dtype=float), side="right")
        x = np.insert(x, cut, np.nan)
        y = np.insert(y, cut, np.nan)
    return x, y


def _draw(ax, panel: Panel, legend: bool) -> None:
    stacks = [s for s in panel.series if s.style == "stack"]
    colors = iter(_COLORS)
    if stacks:
        x = np.asarray(stacks[0].x, float)
        ys = np.array([st.y for st in stacks], float)
        if len(x) > MAX_POINTS:  # each bin's mean, so the stack keeps its totals' shape
            b = _bin_of(len(x))
            x = _per_bin(x, b, np.min)
            ys = np.array([_per_bin(row, b, np.mean) for row in ys])
        ax.stackplot(x, ys, labels=[st.label for st in stacks], linewidth=0)
    for s in panel.series:
        if s.style == "stack":
            continue
        color = s.color or next(colors)
        x, y = _broken(s)
        if panel.log_y:
            y = np.where(y > 0, y, np.nan)
        if s.style in ("line", "dashed"):
            xr, yr = reduce_minmax(x, y)
            ax.plot(xr, yr, lw=0.9, ls="--" if s.style == "dashed" else "-", color=color, label=s.label)
        elif s.style == "band":
            xs, lo, hi = np.asarray(s.x, float), np.asarray(s.lo, float), np.asarray(s.hi, float)
            if len(xs) > MAX_POINTS:  # each bin's envelope: its lowest lo and highest hi
                b = _bin_of(len(xs))
                xs, lo, hi = _per_bin(xs, b, np.min), _per_bin(lo, b, np.min), _per_bin(hi, b, np.max)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.25, lw=0, label=s.label)
        elif s.style == "interval":
            ax.vlines(np.asarray(s.x, float), np.asarray(s.lo, float), np.asarray(s.hi, float), lw=0.6, color=color,
                      label=s.label)
        elif s.style == "points":
            ax.scatter(s.x, s.y, s=9, color=color, zorder=3, label=s.label)
        elif s.style == "hollow":
            ax.scatter(s.x, s.y, s=9, facecolors="none", edgecolors=color, zorder=3, label=s.label)
    for xv, label in panel.v_lines:
        ax.axvline(xv, lw=0.7, ls=":", color="#555555")
        ax.annotate(label, (xv, 1), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top", ha="right")
    if panel.zero_line:
        ax.axhline(0, lw=0.5, color="#555555")
    if panel.log_y:
        ys = np.concatenate([np.asarray(s.y, float) for s in panel.series if s.style != "band"] or [np.array([])])
        if (ys > 0).any():
            ax.set_yscale("log")
            ax.set_ylim(bottom=ys[ys > 0].min() / 2)
    if panel.title:
        ax.set_title(panel.title, fontsize=8)
    ax.set_ylabel(panel.y_label, fontsize=8)
    ax.tick_params(labelsize=7)
    if legend and any(s.label for s in panel.series):
        ax.legend(frameon=False, fontsize=7, ncol=3 if len(panel.series) > 4 else 1)


# Margins in inches, fixed (tight_layout drew every figure twice to measure its labels: a third
# of the report's drawing time): room for 7-8 pt tick labels, axis labels and panel titles.
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 0.85, 0.15, 0.3, 0.5
GAP_ROWS, GAP_COLS = 0.6, 0.75


def _fixed_margins(fig, rows: int, cols: int) -> None:
    w, h = fig.get_size_inches()
    axes_h = max(0.3, (h - MARGIN_TOP - MARGIN_BOTTOM - GAP_ROWS * (rows - 1)) / rows)
    axes_w = max(0.3, (w - MARGIN_LEFT - MARGIN_RIGHT - GAP_COLS * (cols - 1)) / cols)
    fig.subplots_adjust(left=MARGIN_LEFT / w, right=1 - MARGIN_RIGHT / w, top=1 - MARGIN_TOP / h,
                        bottom=MARGIN_BOTTOM / h, hspace=GAP_ROWS / axes_h, wspace=GAP_COLS / axes_w)


def render_figure(fig_spec: FigureOut) -> str:
    import matplotlib
    from matplotlib.figure import Figure

    cols = max(1, fig_spec.columns)
    rows = (len(fig_spec.panels) + cols - 1) // cols
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, (2.5 if cols == 1 else 1.8) * rows))
        for j, panel in enumerate(fig_spec.panels):
            ax = fig.add_subplot(rows, cols, j + 1)
            _draw(ax, panel, legend=cols == 1)
            if cols == 1:
                ax.set_xlabel(fig_spec.x_label, fontsize=8)
        if cols > 1:
            fig.supxlabel(fig_spec.x_label, fontsize=8)
        _fixed_margins(fig, rows, cols)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG needs neither
    return _ID.sub(lambda m: f"{m.group(1)}{fig_spec.id}-{m.group(2)}", text)
