"""Inline SVG plots for the HTML report (matplotlib's SVG backend, no pyplot state).

Determinism: the SVG ``hashsalt`` is fixed and the ``Date`` metadata dropped, so the same
data gives byte-identical SVG; element ids are prefixed per figure so several figures can
live in one HTML page without colliding. Text is kept as text (``svg.fonttype = none``),
so the page's own font renders it and no glyph paths bloat the file.
"""

from __future__ import annotations

import io
import re

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from reward_lens.report.model import CostSection

_RC = {"svg.hashsalt": "reward-lens", "svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
       "axes.spines.right": False, "font.family": "sans-serif"}
_ID = re.compile(r'(id="|url\(#|href="#)([^")]+)')


def _svg(fig: Figure, prefix: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG needs neither
    return _ID.sub(lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text)


def _x(pairs) -> np.ndarray:
    return np.array([p[0] for p in pairs], dtype=float)


def _segments(pairs) -> list[np.ndarray]:
    """Indices of runs of consecutive step pairs: a line is never drawn across a gap (a refused
    or missing step pair)."""
    if not pairs:
        return []
    starts = [0] + [i for i in range(1, len(pairs)) if pairs[i][0] != pairs[i - 1][1]]
    return [np.arange(a, b) for a, b in zip(starts, starts[1:] + [len(pairs)])]


def kl_min_plot(section: CostSection) -> str:
    rows = section.kl_min
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.6))
        ax = fig.add_subplot()
        x = _x([r.step_pair for r in rows])
        kl = np.array([r.kl_min for r in rows])
        floor = np.array([r.noise_floor for r in rows])
        for n, seg in enumerate(_segments([r.step_pair for r in rows])):
            ax.plot(x[seg], kl[seg], lw=1, color="#1f5fa8", label="KL_min" if n == 0 else None)
            ax.plot(x[seg], floor[seg], lw=1, ls="--", color="#c0392b",
                    label="noise floor ½ tr(G⁻¹Σ_Δz)" if n == 0 else None)
        res = np.array([r.resolved for r in rows], dtype=bool)
        if res.any():
            ax.scatter(x[res], kl[res], s=8, color="#1f5fa8", zorder=3, label="resolved (BH, q = 0.05)")
        positive = np.concatenate([kl[kl > 0], floor[floor > 0]])
        if len(positive):  # log scale only over positive values: zeros are not drawn as spikes
            ax.set_yscale("log")
            ax.set_ylim(bottom=positive.min() / 2)
        ax.set_xlabel("step t (pair t → t+1)")
        ax.set_ylabel("nats per sequence")
        ax.legend(frameon=False, fontsize=8)
        return _svg(fig, "klmin")


def shares_plot(section: CostSection) -> str | None:
    names = [f.name for f in section.features if f.status == "priced"]
    rows = section.kl_min
    ys = np.array([[r.shares.get(n, 0.0) for r in rows] for n in names])
    if not names or not ys.size or not np.any(ys > 0):
        return None  # nothing priced: no shares to stack
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.8))
        ax = fig.add_subplot()
        x = _x([r.step_pair for r in rows])
        ax.stackplot(x, ys, labels=names, linewidth=0)
        ax.set_xlabel("step t (pair t → t+1)")
        ax.set_ylabel("share of KL_min (nats per sequence)")
        ax.legend(frameon=False, fontsize=7, ncol=3, loc="upper right")
        return _svg(fig, "shares")


def efficiency_plot(section: CostSection) -> str | None:
    rows = [r for r in section.efficiency if r.efficiency_debiased is not None]
    if not rows:
        return None
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.4))
        ax = fig.add_subplot()
        x = _x([r.step_pair for r in rows])
        y = np.array([r.efficiency_debiased for r in rows])
        lo = np.array([r.interval[0] if r.interval else v for r, v in zip(rows, y)])
        hi = np.array([r.interval[1] if r.interval else v for r, v in zip(rows, y)])
        res = np.array([r.status == "resolved" for r in rows])
        for seg in _segments([r.step_pair for r in rows]):
            ax.plot(x[seg], y[seg], lw=0.6, color="#9aa5a0")
        ax.vlines(x, lo, hi, lw=0.6, color="#9aa5a0")
        ax.scatter(x[res], y[res], s=10, color="#1f7a4d", zorder=3, label="resolved")
        ax.scatter(x[~res], y[~res], s=10, facecolors="none", edgecolors="#8a8a8a", zorder=3, label="unresolved")
        ax.axhline(0, lw=0.5, color="#555555")
        ax.set_ylim(min(-0.1, float(np.nanmin(lo))), max(1.0, float(np.nanmax(hi))))
        ax.set_xlabel("step t (pair t → t+1)")
        ax.set_ylabel("η debiased (dimensionless)")
        ax.legend(frameon=False, fontsize=8)
        return _svg(fig, "eta")


def feature_means_plot(section: CostSection) -> str:
    names = [f.name for f in section.features]
    units = [f.unit for f in section.features]
    k = len(names)
    cols = 3
    rows = (k + cols - 1) // cols
    steps = np.array([m.step for m in section.feature_means], dtype=float)
    mean = np.array([m.mean for m in section.feature_means])
    se = np.array([m.se for m in section.feature_means])
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 1.7 * rows))
        for j, name in enumerate(names):
            ax = fig.add_subplot(rows, cols, j + 1)
            ax.fill_between(steps, mean[:, j] - se[:, j], mean[:, j] + se[:, j], color="#9bbce0", lw=0)
            ax.plot(steps, mean[:, j], lw=0.8, color="#1f5fa8")
            ax.set_title(f"{name} ({units[j]})", fontsize=8)
            ax.tick_params(labelsize=7)
        fig.supxlabel("step (mean ± one standard error)", fontsize=8)
        fig.tight_layout()
        return _svg(fig, "means")
