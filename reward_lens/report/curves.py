"""The training curves every user expects, from what the record holds: reward (and each
reward function's), completion length, D_t, grad norms before and after clipping, learning
rate and update norm. Drawn by ``plots.render_figure`` (reduced to at most 2,000 points a line).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.record.reader import Run

TELEMETRY = [  # (fields drawn together, panel title, unit, log scale)
    (("kl_to_previous",), "D_t = KL(π_{t+1} ‖ π_t)", "nats per sequence", True),
    (("grad_norm_unclipped", "grad_norm"), "gradient norm (before / after clipping)", "L2 norm", True),
    (("update_norm",), "update norm ‖θ_{t+1} − θ_t‖", "L2 norm", True),
    (("learning_rate",), "learning rate", "per step", False),
    (("kl_to_ref",), "KL to the reference (TRL's `kl`)", "nats per token", False),
]


def _per_step(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, codes = np.unique(steps, return_inverse=True)
    return uniq, np.bincount(codes, weights=values) / np.bincount(codes)


def rollout_curves(run: Run) -> list[Panel]:
    cols = [c for c in ("reward", "rewards", "num_tokens", "completion_ids") if c in run.rollout_columns()]
    if not run.n_rollouts or not cols:
        return []
    want = [c for c in cols if c != "completion_ids" or "num_tokens" not in cols]
    steps, reward, length, funcs = [], [], [], {}
    for t in run.iter_rollouts(want):
        st = t.column("step").to_numpy()
        steps.append(st)
        if "reward" in t.column_names:
            reward.append(t.column("reward").cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))
        if "num_tokens" in t.column_names:
            length.append(t.column("num_tokens").cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))
        elif "completion_ids" in t.column_names:
            length.append(pc.list_value_length(t.column("completion_ids")).cast(pa.float64()).fill_null(np.nan)
                          .to_numpy(zero_copy_only=False))
        if "rewards" in t.column_names:
            m = t.column("rewards").combine_chunks()
            lens = np.diff(np.asarray(m.offsets))
            vals = m.items.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
            rep = np.repeat(st, lens)
            for k in m.keys.unique().to_pylist():  # a handful of reward functions: one vectorised compare each
                sel = pc.equal(m.keys, k).to_numpy(zero_copy_only=False)
                funcs.setdefault(k, ([], []))
                funcs[k][0].append(rep[sel])
                funcs[k][1].append(vals[sel])
    steps_all = np.concatenate(steps)
    panels = []
    if reward:
        r = np.concatenate(reward)
        ok = np.isfinite(r)
        series = []
        if ok.any():
            x, y = _per_step(steps_all[ok], r[ok])
            series.append(Series(label="reward (total)", x=x.tolist(), y=y.tolist()))
        for k, (s, v) in sorted(funcs.items()):
            s, v = np.concatenate(s), np.concatenate(v)
            ok = np.isfinite(v)
            if ok.any():
                x, y = _per_step(s[ok], v[ok])
                series.append(Series(label=f"reward `{k}`", x=x.tolist(), y=y.tolist(), style="dashed"))
        if series:
            panels.append(Panel(title="mean reward per step", y_label="reward units", series=series))
    if length:
        n = np.concatenate(length)
        ok = np.isfinite(n)
        if ok.any():
            x, y = _per_step(steps_all[ok], n[ok])
            panels.append(Panel(title="mean completion length", y_label="tokens", series=[Series(x=x.tolist(),
                                                                                                 y=y.tolist())]))
    return panels


def training_curves(run: Run) -> list[FigureOut]:
    panels = rollout_curves(run)
    for fields, title, unit, log in TELEMETRY:
        series = []
        for f in fields:
            col = run.telemetry_column(f) if f in run.telemetry.column_names else {}
            if col:
                xs = sorted(col)
                series.append(Series(label=f if len(fields) > 1 else None, x=[float(s) for s in xs],
                                     y=[float(col[s]) for s in xs], style="line" if len(series) == 0 else "dashed"))
        if series:
            panels.append(Panel(title=title, y_label=unit, log_y=log, series=series))
    if not panels:
        return []
    return [FigureOut(id="curves", x_label="optimizer step", columns=2, panels=panels, caption=(
        "Training curves from the record (per step; a line of more than 2,000 points is drawn as the minimum and "
        "maximum of each bin; log scales draw positive values only)."))]
