"""Inline SVG plots for the HTML report, written directly (no plotting library).

Books describe their figures as data (``reward_lens.measure.figures``); this module draws
any of them as one ``<svg>`` element: axes with "nice" ticks (1, 2, 2.5, 5 x 10^k, or
decades on a log axis), lines, bands, points, intervals, stacked areas, reference lines and
a legend. Writing the SVG text directly costs a few milliseconds a figure; matplotlib's SVG
backend took 0.3-0.4 s a figure and half a second to import.

Determinism: the same data gives byte-identical SVG (coordinates are written with one
decimal); element ids are prefixed with the figure's id so several figures can live in one
HTML page without colliding. Text is kept as text.

Size: a line of more points than its panel is wide in pixels, twice over (at most
``MAX_POINTS``), is reduced to the minimum and maximum of each of that many bins (in x order):
one bin per pixel column at most, so every spike stays visible and a plot costs O(width), not
O(steps); points likewise, bands and intervals to each bin's envelope, stacks to each bin's
mean. A log-scaled panel draws only positive values (no spikes at zero).
"""

from __future__ import annotations

import math
from html import escape

import numpy as np

from reward_lens.measure.figures import FigureOut, Panel, Series

MAX_POINTS = 2000
_COLORS = ["#1f5fa8", "#c0392b", "#1f7a4d", "#8e44ad", "#d35400", "#2c3e50", "#16a085", "#7f8c8d", "#b7950b"]
_STACK_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"]
_AXIS = "#333333"
_REF = "#555555"

# Layout in px (the figure is 750 px wide and scales with the page): room for tick labels,
# axis labels and panel titles around each panel.
WIDTH = 750
PANEL_HEIGHT, PANEL_HEIGHT_GRID = 250, 180
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 85, 15, 30, 50
GAP_ROWS, GAP_COLS = 60, 75
FONT_TICK, FONT_LABEL = 9.5, 11


def reduce_minmax(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most about ``max_points`` points: the min and the max of y in each of max_points/2
    bins of consecutive points, in their x order; NaNs (line breaks) are kept where they are."""
    n = len(x)
    if n <= max_points:
        return x, y
    finite = np.isfinite(y)
    idx = np.flatnonzero(finite)
    keep = np.flatnonzero(~finite)  # every break
    if len(idx):
        # each bin's first point at its min and last point at its max: the points a stable sort
        # by bin, then y, puts first and last in each bin (in one pass over the bins, no sort)
        b = _bin_of(n, max_points)[idx]  # bins never decrease along the points
        new_bin = np.r_[True, b[1:] != b[:-1]]
        seg = np.cumsum(new_bin) - 1
        starts = np.flatnonzero(new_bin)
        yf = y[idx]
        at_lo = np.flatnonzero(yf == np.minimum.reduceat(yf, starts)[seg])
        at_hi = np.flatnonzero(yf == np.maximum.reduceat(yf, starts)[seg])
        first = at_lo[np.r_[True, seg[at_lo][1:] != seg[at_lo][:-1]]]
        last = at_hi[np.r_[seg[at_hi][1:] != seg[at_hi][:-1], True]]
        keep = np.union1d(np.union1d(idx[first], idx[last]), keep)
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


# ---- scales and ticks -------------------------------------------------------------------

def nice_ticks(lo: float, hi: float, target: int = 5) -> tuple[np.ndarray, int]:
    """Ticks at multiples of 1, 2, 2.5 or 5 x 10^k covering [lo, hi] with at most about
    ``target`` intervals, and the decimals that show them exactly."""
    span = hi - lo
    mag = 10.0 ** math.floor(math.log10(span / target))
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if span / step <= target:
            break
    first = math.ceil(lo / step - 1e-9)
    ticks = (first + np.arange(int(math.floor(hi / step + 1e-9)) - first + 1)) * step
    decimals = max(0, -math.floor(math.log10(step) + 1e-12) + (1 if m == 2.5 else 0))
    return ticks, decimals


def tick_label(v: float, decimals: int) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or decimals > 5:
        mant, exp = f"{v:.1e}".split("e")
        return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"
    return f"{v:.{decimals}f}"


_SUP = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


class _Scale:
    """Data to pixels along one axis; ``lo`` maps to ``p0`` and ``hi`` to ``p1``."""

    def __init__(self, lo: float, hi: float, p0: float, p1: float, log: bool = False):
        self.log = log
        f = np.log10 if log else (lambda v: v)
        self.lo, self.hi = float(f(lo)), float(f(hi))
        self.p0, self.p1 = p0, p1

    def __call__(self, v) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        if self.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                v = np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
        return self.p0 + (v - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)

    def ticks(self) -> list[tuple[float, str]]:
        if not self.log:
            ticks, dec = nice_ticks(self.lo, self.hi)
            return [(t, tick_label(t, dec)) for t in ticks]
        first, last = math.ceil(self.lo - 1e-9), math.floor(self.hi + 1e-9)
        stride = max(1, math.ceil((last - first + 1) / 6))
        decades = list(range(first, last + 1, stride))
        if len(decades) >= 2:
            return [(10.0 ** d, "10" + str(d).translate(_SUP)) for d in decades]
        ticks, dec = nice_ticks(10 ** self.lo, 10 ** self.hi)  # under two decades: linear steps
        ticks = ticks[ticks > 0]
        return [(t, f"{t:.3g}") for t in ticks]


def _limits(values: list[np.ndarray], log: bool, include: list[float]) -> tuple[float, float]:
    v = np.concatenate([np.asarray(a, float).ravel() for a in values] + [np.asarray(include, float)])
    v = v[np.isfinite(v) & (v > 0)] if log else v[np.isfinite(v)]
    if not len(v):
        return (0.1, 10.0) if log else (0.0, 1.0)
    # any finite float is data a record may hold: limits kept where their padding and the
    # decades between them stay finite (a subnormal or a 1e308 is drawn at the edge)
    lo, hi = (float(x) for x in np.clip([v.min(), v.max()], -1e300, 1e300))
    if log:
        lo, hi = max(math.log10(lo), -290.0), min(math.log10(hi), 290.0)
    if hi == lo:
        pad = max(abs(lo) * 0.1, 0.5 if log else 1e-9 if lo else 1.0)
        lo, hi = lo - pad, hi + pad
    pad = 0.05 * (hi - lo)  # matplotlib's default margins
    lo, hi = lo - pad, hi + pad
    if log:
        lo, hi = max(lo, -300.0), min(hi, 300.0)
        if hi <= lo:
            lo, hi = hi - 1.0, hi
    return (10 ** lo, 10 ** hi) if log else (lo, hi)


# ---- SVG pieces ---------------------------------------------------------------------------

def _num(v: float) -> str:
    return f"{v:.1f}"


def _pairs(px: np.ndarray, py: np.ndarray) -> list[str]:
    """"x,y" with one decimal for each point: the coordinates interleaved and written by one
    ``%`` (as ``f"{x:.1f},{y:.1f}"`` each, 40 % faster), split at the NULs between points."""
    n = min(len(px), len(py))
    if not n:
        return []
    flat = np.empty(2 * n)
    flat[0::2], flat[1::2] = px[:n], py[:n]
    return ("%.1f,%.1f\x00" * n % tuple(flat.tolist()))[:-1].split("\x00")


def _polyline_d(px: np.ndarray, py: np.ndarray) -> str:
    """A path through the finite points, broken wherever either coordinate is NaN."""
    ok = np.isfinite(px) & np.isfinite(py)
    parts = []
    for seg in _runs(ok):
        pts = _pairs(px[seg], py[seg])
        parts.append("M" + pts[0] + ("L" + " ".join(pts[1:]) if len(pts) > 1 else ""))
    return "".join(parts)


def _runs(mask: np.ndarray) -> list[slice]:
    """The maximal runs of True in ``mask``, as slices."""
    m = np.r_[False, mask, False].astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [slice(a, b) for a, b in zip(edges[::2], edges[1::2])]


def _area_d(px: np.ndarray, top: np.ndarray, bottom: np.ndarray) -> str:
    """Closed polygons between ``bottom`` and ``top``, one per run where all are finite."""
    ok = np.isfinite(px) & np.isfinite(top) & np.isfinite(bottom)
    parts = []
    for seg in _runs(ok):
        fwd = _pairs(px[seg], top[seg])
        back = _pairs(px[seg][::-1], bottom[seg][::-1])
        parts.append("M" + fwd[0] + "L" + " ".join(fwd[1:] + back) + "Z")
    return "".join(parts)


def _dots_d(px: np.ndarray, py: np.ndarray, r: float = 2.2) -> str:
    ok = np.isfinite(px) & np.isfinite(py)
    return "".join(f"M{a - r:.1f},{b:.1f}a{r},{r} 0 1,0 {2 * r},0a{r},{r} 0 1,0 {-2 * r},0"
                   for a, b in zip(px[ok].tolist(), py[ok].tolist()))


def _text(x: float, y: float, s: str, size: float, anchor: str = "middle", rotate: bool = False,
          baseline: str | None = None, weight: str | None = None) -> str:
    attrs = f'x="{_num(x)}" y="{_num(y)}" font-size="{size}" text-anchor="{anchor}"'
    if rotate:
        attrs += f' transform="rotate(-90 {_num(x)} {_num(y)})"'
    if baseline:
        attrs += f' dominant-baseline="{baseline}"'
    if weight:
        attrs += f' font-weight="{weight}"'
    return f"<text {attrs}>{escape(s)}</text>"


def points_for(width: float) -> int:
    """Points a series in a panel ``width`` px wide is drawn with at most: a minimum and a
    maximum for each pixel column, and never more than ``MAX_POINTS``."""
    return int(min(MAX_POINTS, 2 * math.ceil(width)))


def _prepared(s: Series, log: bool, max_points: int = MAX_POINTS) -> dict[str, np.ndarray]:
    """A series' arrays after gaps, log masking and the reduction to at most ``max_points``."""
    if s.style in ("line", "dashed"):
        x, y = _broken(s)
        if log:
            y = np.where(y > 0, y, np.nan)
        x, y = reduce_minmax(x, y, max_points)
        return {"x": x, "y": y}
    x = np.asarray(s.x, float)
    if s.style in ("band", "interval"):
        lo, hi = np.asarray(s.lo, float), np.asarray(s.hi, float)
        if len(x) > max_points:  # each bin's envelope: its lowest lo and highest hi
            b = _bin_of(len(x), max_points)
            x, lo, hi = _per_bin(x, b, np.min), _per_bin(lo, b, np.nanmin), _per_bin(hi, b, np.nanmax)
        return {"x": x, "lo": lo, "hi": hi}
    y = np.asarray(s.y, float)
    if log:
        y = np.where(y > 0, y, np.nan)
    x, y = reduce_minmax(x, y, max_points)
    return {"x": x, "y": y}


def _stacked(stacks: list[Series], max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(stacks[0].x, float)
    ys = np.array([st.y for st in stacks], float)
    if len(x) > max_points:  # each bin's mean, so the stack keeps its totals' shape
        b = _bin_of(len(x), max_points)
        x = _per_bin(x, b, np.min)
        ys = np.array([_per_bin(row, b, np.mean) for row in ys])
    return x, np.vstack([np.zeros(len(x)), np.cumsum(np.nan_to_num(ys), axis=0)])


def _panel(out: list[str], panel: Panel, fid: str, j: int, box: tuple[float, float, float, float],
           x_label: str | None, legend: bool) -> None:
    x0, y0, w, h = box
    stacks = [s for s in panel.series if s.style == "stack"]
    others = [s for s in panel.series if s.style != "stack"]
    most = points_for(w)
    data = [(s, _prepared(s, panel.log_y, most)) for s in others]
    xs = [d["x"] for _, d in data] + [np.asarray(s.x, float) for s in stacks] + [[v for v, _ in panel.v_lines]]
    ys = [d[key] for _, d in data for key in ("y", "lo", "hi") if key in d]
    stack_x, cum = _stacked(stacks, most) if stacks else (None, None)
    if cum is not None:
        ys.append(cum)
    sx = _Scale(*_limits(xs, False, []), x0, x0 + w)
    sy = _Scale(*_limits(ys, panel.log_y, [0.0] if panel.zero_line else []), y0 + h, y0, log=panel.log_y)

    clip = f"{fid}-clip{j}"
    out.append(f'<clipPath id="{clip}"><rect x="{_num(x0)}" y="{_num(y0)}" width="{_num(w)}" '
               f'height="{_num(h)}"/></clipPath>')
    # ticks and labels
    for v, label in sx.ticks():
        p = float(sx(v))
        if x0 - 0.5 <= p <= x0 + w + 0.5:
            out.append(f'<path d="M{_num(p)},{_num(y0 + h)}v4" stroke="{_AXIS}" stroke-width="0.8"/>')
            out.append(_text(p, y0 + h + 15, label, FONT_TICK))
    widest = 1
    for v, label in sy.ticks():
        p = float(sy(v))
        if y0 - 0.5 <= p <= y0 + h + 0.5:
            out.append(f'<path d="M{_num(x0)},{_num(p)}h-4" stroke="{_AXIS}" stroke-width="0.8"/>')
            out.append(_text(x0 - 7, p, label, FONT_TICK, anchor="end", baseline="middle"))
            widest = max(widest, len(label))
    out.append(f'<g clip-path="url(#{clip})">')
    colors = iter(_COLORS)
    if stacks:
        px = sx(stack_x)
        for i, s in enumerate(stacks):
            out.append(f'<path d="{_area_d(px, sy(cum[i + 1]), sy(cum[i]))}" fill="{_STACK_COLORS[i % 10]}"/>')
    items = [(s.label, "area", _STACK_COLORS[i % 10]) for i, s in enumerate(stacks) if s.label]
    for s, d in data:
        color = s.color or next(colors)
        px = sx(d["x"])
        if s.style in ("line", "dashed"):
            dash = ' stroke-dasharray="4,2"' if s.style == "dashed" else ""
            out.append(f'<path d="{_polyline_d(px, sy(d["y"]))}" fill="none" stroke="{color}" stroke-width="1.1"'
                       f' stroke-linejoin="round"{dash}/>')
        elif s.style == "band":
            out.append(f'<path d="{_area_d(px, sy(d["hi"]), sy(d["lo"]))}" fill="{color}" fill-opacity="0.25"/>')
        elif s.style == "interval":
            lo, hi = sy(d["lo"]), sy(d["hi"])
            ok = np.isfinite(px) & np.isfinite(lo) & np.isfinite(hi)
            segs = "".join(f"M{a:.1f},{b:.1f}V{c:.1f}" for a, b, c in zip(px[ok].tolist(), lo[ok].tolist(),
                                                                         hi[ok].tolist()))
            out.append(f'<path d="{segs}" stroke="{color}" stroke-width="0.7"/>')
        elif s.style in ("points", "hollow"):
            fill = f'fill="{color}"' if s.style == "points" else f'fill="none" stroke="{color}" stroke-width="0.9"'
            out.append(f'<path d="{_dots_d(px, sy(d["y"]))}" {fill}/>')
        if s.label:
            items.append((s.label, {"line": "line", "dashed": "dashed", "band": "band", "hollow": "hollow"}.get(
                s.style, "dot"), color))
    for v, label in panel.v_lines:
        p = float(sx(v))
        out.append(f'<path d="M{_num(p)},{_num(y0)}V{_num(y0 + h)}" stroke="{_REF}" stroke-width="0.8" '
                   f'stroke-dasharray="1,2"/>')
        out.append(_text(p - 3, y0 + 3, label, 8.5, anchor="end", rotate=True, baseline="text-after-edge"))
    if panel.zero_line:
        p = float(sy(0.0))
        out.append(f'<path d="M{_num(x0)},{_num(p)}h{_num(w)}" stroke="{_REF}" stroke-width="0.6"/>')
    out.append("</g>")
    # axes: left and bottom spines only
    out.append(f'<path d="M{_num(x0)},{_num(y0)}V{_num(y0 + h)}H{_num(x0 + w)}" fill="none" stroke="{_AXIS}" '
               f'stroke-width="0.8"/>')
    if panel.title:
        out.append(_text(x0 + w / 2, y0 - 8, panel.title, FONT_LABEL))
    # the axis label just clear of the widest tick label (about 0.6 em a character)
    out.append(_text(max(x0 - MARGIN_LEFT + 12, x0 - 15 - widest * FONT_TICK * 0.6), y0 + h / 2, panel.y_label,
                     FONT_LABEL, rotate=True))
    if x_label:
        out.append(_text(x0 + w / 2, y0 + h + 36, x_label, FONT_LABEL))
    if legend and items:
        _legend(out, items, x0 + w, y0)


def _legend(out: list[str], items: list[tuple[str, str, str]], right: float, top: float) -> None:
    """Labels with their marks in the panel's upper right corner, on a translucent ground."""
    ncol = 3 if len(items) > 4 else 1
    width = max(len(label) for label, _, _ in items) * 5.6 + 26
    rows = (len(items) + ncol - 1) // ncol
    x = right - ncol * width - 4
    out.append(f'<rect x="{_num(x - 4)}" y="{_num(top + 2)}" width="{_num(ncol * width + 6)}" '
               f'height="{_num(rows * 13 + 6)}" fill="#ffffff" fill-opacity="0.8"/>')
    for i, (label, kind, color) in enumerate(items):
        cx, cy = x + (i % ncol) * width, top + 11 + (i // ncol) * 13
        if kind in ("area", "band"):
            out.append(f'<rect x="{_num(cx)}" y="{_num(cy - 4)}" width="14" height="8" fill="{color}" '
                       f'fill-opacity="{0.25 if kind == "band" else 1}"/>')
        elif kind in ("dot", "hollow"):
            fill = f'fill="{color}"' if kind == "dot" else f'fill="none" stroke="{color}" stroke-width="0.9"'
            out.append(f'<circle cx="{_num(cx + 7)}" cy="{_num(cy)}" r="2.5" {fill}/>')
        else:
            dash = ' stroke-dasharray="4,2"' if kind == "dashed" else ""
            out.append(f'<path d="M{_num(cx)},{_num(cy)}h14" stroke="{color}" stroke-width="1.4"{dash}/>')
        out.append(_text(cx + 18, cy, label, 9, anchor="start", baseline="middle"))


def render_figure(fig_spec: FigureOut) -> str:
    """One figure as an ``<svg>`` element: its panels in a grid of ``columns``."""
    cols = max(1, fig_spec.columns)
    rows = max(1, (len(fig_spec.panels) + cols - 1) // cols)
    height = (PANEL_HEIGHT if cols == 1 else PANEL_HEIGHT_GRID) * rows
    axes_w = max(30.0, (WIDTH - MARGIN_LEFT - MARGIN_RIGHT - GAP_COLS * (cols - 1)) / cols)
    axes_h = max(30.0, (height - MARGIN_TOP - MARGIN_BOTTOM - GAP_ROWS * (rows - 1)) / rows)
    fid = escape(fig_spec.id, quote=True)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" fill="{_AXIS}" role="img" '
           f'aria-label="{escape(fig_spec.caption, quote=True)}">',
           f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>']
    for j, panel in enumerate(fig_spec.panels):
        r, c = divmod(j, cols)
        box = (MARGIN_LEFT + c * (axes_w + GAP_COLS), MARGIN_TOP + r * (axes_h + GAP_ROWS), axes_w, axes_h)
        _panel(out, panel, fid, j, box, fig_spec.x_label if cols == 1 else None, legend=cols == 1)
    if cols > 1:
        out.append(_text(WIDTH / 2, height - 10, fig_spec.x_label, FONT_LABEL))
    out.append("</svg>\n")
    return "\n".join(out)
