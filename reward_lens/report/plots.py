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


def kl_min_plot(section: CostSection) -> str:
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.6))
        ax = fig.add_subplot()
        x = _x([r.step_pair for r in section.kl_min])
        ax.plot(x, [r.kl_min for r in section.kl_min], lw=1, color="#1f5fa8", label="KL_min")
        ax.plot(x, [r.noise_floor for r in section.kl_min], lw=1, ls="--", color="#c0392b",
                label="noise floor ½ tr(G⁻¹Σ_Δz)")
        clear = [r for r in section.kl_min if r.clears_noise_floor]
        if clear:
            ax.scatter(_x([r.step_pair for r in clear]), [r.kl_min for r in clear], s=8, color="#1f5fa8",
                       zorder=3, label="clears the floor")
        ax.set_yscale("log")
        ax.set_xlabel("step t (pair t → t+1)")
        ax.set_ylabel("nats per sequence")
        ax.legend(frameon=False, fontsize=8)
        return _svg(fig, "klmin")


def shares_plot(section: CostSection) -> str:
    names = [f.name for f in section.features if f.status == "priced"]
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.8))
        ax = fig.add_subplot()
        x = _x([r.step_pair for r in section.kl_min])
        ys = np.array([[r.shares.get(n, 0.0) for r in section.kl_min] for n in names])
        ax.stackplot(x, ys, labels=names, linewidth=0)
        ax.set_xlabel("step t (pair t → t+1)")
        ax.set_ylabel("share of KL_min (nats)")
        ax.legend(frameon=False, fontsize=7, ncol=3, loc="upper right")
        return _svg(fig, "shares")


def efficiency_plot(section: CostSection) -> str:
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.4))
        ax = fig.add_subplot()
        x = _x([r.step_pair for r in section.efficiency])
        ax.plot(x, [r.efficiency for r in section.efficiency], lw=1, marker=".", color="#1f7a4d")
        ax.set_ylim(0, 1)
        ax.set_xlabel("step t (pair t → t+1)")
        ax.set_ylabel("efficiency η = KL_min / D_t")
        return _svg(fig, "eta")


def feature_means_plot(section: CostSection) -> str:
    names = [f.name for f in section.features]
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
            ax.set_title(name, fontsize=8)
            ax.tick_params(labelsize=7)
        fig.supxlabel("step (mean ± one standard error)", fontsize=8)
        fig.tight_layout()
        return _svg(fig, "means")
