"""The training curves every user expects, from what the record holds: reward (and each
reward function's), completion length, D_t (with the engine-trainer mismatch beside it, where an
engine sampled the rollouts), grad norms before and after clipping, learning
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


class RolloutCurves:
    """Mean reward (total and each reward function's) and completion length per step, from the
    rollouts. A ``RowCollector``: fed by the pass that computes the samples' features, or by a
    pass of its own (``read``)."""

    def __init__(self, run: Run):
        cols = [c for c in ("reward", "rewards", "num_tokens", "completion_ids") if c in run.rollout_columns()]
        self.columns = tuple(c for c in cols if c != "completion_ids" or "num_tokens" not in cols)
        self.steps: list[np.ndarray] = []
        self.reward: list[np.ndarray] = []
        self.length: list[np.ndarray] = []
        self.funcs: dict[str, tuple[list, list]] = {}

    def take(self, t: pa.Table, z=None) -> None:
        st = t.column("step").to_numpy()
        self.steps.append(st)
        if "reward" in self.columns:
            self.reward.append(t.column("reward").cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))
        if "num_tokens" in self.columns:
            self.length.append(t.column("num_tokens").cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))
        elif "completion_ids" in self.columns:
            self.length.append(pc.list_value_length(t.column("completion_ids")).cast(pa.float64()).fill_null(np.nan)
                               .to_numpy(zero_copy_only=False))
        if "rewards" in self.columns:
            m = t.column("rewards").combine_chunks()
            lens = np.diff(np.asarray(m.offsets))
            vals = m.items.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
            rep = np.repeat(st, lens)
            for k in m.keys.unique().to_pylist():  # a handful of reward functions: one vectorised compare each
                sel = pc.equal(m.keys, k).to_numpy(zero_copy_only=False)
                self.funcs.setdefault(k, ([], []))
                self.funcs[k][0].append(rep[sel])
                self.funcs[k][1].append(vals[sel])

    def read(self, run: Run) -> None:
        """A pass of its own over the rollouts."""
        if run.n_rollouts and self.columns:
            for t in run.iter_rollouts(self.columns):
                self.take(t)

    def panels(self) -> list[Panel]:
        if not self.steps or not self.columns:
            return []
        steps_all = np.concatenate(self.steps)
        panels = []
        if self.reward:
            r = np.concatenate(self.reward)
            ok = np.isfinite(r)
            series = []
            if ok.any():
                x, y = _per_step(steps_all[ok], r[ok])
                series.append(Series(label="reward (total)", x=x.tolist(), y=y.tolist()))
            for k, (s, v) in sorted(self.funcs.items()):
                s, v = np.concatenate(s), np.concatenate(v)
                ok = np.isfinite(v)
                if ok.any():
                    x, y = _per_step(s[ok], v[ok])
                    series.append(Series(label=f"reward `{k}`", x=x.tolist(), y=y.tolist(), style="dashed"))
            if series:
                panels.append(Panel(title="mean reward per step", y_label="reward units", series=series))
        if self.length:
            n = np.concatenate(self.length)
            ok = np.isfinite(n)
            if ok.any():
                x, y = _per_step(steps_all[ok], n[ok])
                panels.append(Panel(title="mean completion length", y_label="tokens", series=[Series(x=x.tolist(),
                                                                                                     y=y.tolist())]))
        return panels


def _mismatch_series(run: Run, with_d_t: bool) -> list[Series]:
    """Where an engine sampled the rollouts (``logp_sampler``): KL(pi_sampler || pi_t) per step
    (``measure.mismatch``, nats per sequence, the unit of D_t it is drawn beside), so a mismatch
    the size of the updates is seen against them. A line, not a band: the panel's scale is
    logarithmic and an interval's lower end at or below zero has no place on it (the report's
    finding states the SE)."""
    from reward_lens.measure.mismatch import run_mismatch

    m = run_mismatch(run)
    if not m:
        return []
    xs = sorted(m)
    return [Series(label="engine mismatch" if with_d_t else None, x=[float(s) for s in xs],
                   y=[m[s].kl_seq for s in xs], style="dashed")]


def training_curves(run: Run, rollout_panels: list[Panel]) -> list[FigureOut]:
    """The training curves of ``run``: the rollouts' panels (``RolloutCurves.panels``), then the
    telemetry's."""
    panels = list(rollout_panels)
    for fields, title, unit, log in TELEMETRY:
        series = []
        for f in fields:
            col = run.telemetry_column(f) if f in run.telemetry.column_names else {}
            if col:
                xs = sorted(col)
                series.append(Series(label=f if len(fields) > 1 else None, x=[float(s) for s in xs],
                                     y=[float(col[s]) for s in xs], style="line" if len(series) == 0 else "dashed"))
        if fields == ("kl_to_previous",):
            series += _mismatch_series(run, with_d_t=bool(series))
            if len(series) > 1:
                series[0] = series[0].model_copy(update={"label": "D_t, the update"})
                title = "D_t beside the engine mismatch KL(π_sampler ‖ π_t)"
        if series:
            panels.append(Panel(title=title, y_label=unit, log_y=log, series=series))
    if not panels:
        return []
    return [FigureOut(id="curves", x_label="optimizer step", columns=2, panels=panels, caption=(
        "Training curves from the record (per step; a line of more than 2,000 points is drawn as the minimum and "
        "maximum of each bin; log scales draw positive values only)."))]
