"""From a record to per-step feature samples and per-step-pair ledgers.

A ``StepSample`` is what pi_t produced at step t: the n x k feature matrix in the basis
``names``, with rewards and advantages. A ``Ledger`` is one consecutive step pair (t, t+1):
the movement dz of the feature means, its standard error and full sampling covariance, and
the learning rate of step t. Ledgers are the cost book's input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.record.reader import Run, Window


@dataclass(frozen=True, eq=False)
class StepSample:
    step: int
    names: tuple[str, ...]
    z: np.ndarray  # (n, k) float64, features of each rollout in basis `names`
    rewards: np.ndarray | None = None  # (n,)
    advantages: np.ndarray | None = None  # (n,)

    @property
    def n(self) -> int:
        return self.z.shape[0]


@dataclass(frozen=True, eq=False)
class Ledger:
    """The feature movement of one optimizer step t: pi_t -> pi_{t+1}."""

    step_pair: tuple[int, int]
    names: tuple[str, ...]
    delta_z: np.ndarray  # (k,) mean at t+1 minus mean at t, in feature units
    se: np.ndarray  # (k,) standard error of delta_z
    cov_delta: np.ndarray  # (k, k) sampling covariance of delta_z: C_t / n_t + C_{t+1} / n_{t+1}
    n_pre: int
    n_post: int
    learning_rate: float | None = None

    @property
    def t(self) -> np.ndarray:
        """delta_z in units of its standard error (0 where the SE is 0)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.se > 0, self.delta_z / np.where(self.se > 0, self.se, 1), 0.0)


def whole_run(run: Run) -> Window:
    """The window of every step the record has rollouts for."""
    steps = run.rollout_steps
    if not len(steps):
        raise ValueError(f"record {run.path} has no rollouts, so it has no window of steps")
    return Window(int(steps[0]), int(steps[-1]))


def steps_from_run(run: Run, features: SurfaceFeatures, window: Window | None = None) -> list[StepSample]:
    """One StepSample per step in ``window``, reading only the columns the features need."""
    window = window or whole_run(run)
    available = set(run.rollout_columns())
    extra = [c for c in ("reward", "advantage") if c in available]
    parts: dict[int, list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]] = {}
    for table in run.iter_rollouts([*features.columns, *extra], window):
        if not table.num_rows:
            continue
        z = features.compute(table, source=str(run.path / "rollouts.parquet"))
        steps = table.column("step").to_numpy()
        rew = table.column("reward").to_numpy(zero_copy_only=False).astype(float) if "reward" in extra else None
        adv = table.column("advantage").to_numpy(zero_copy_only=False).astype(float) if "advantage" in extra else None
        uniq, starts = np.unique(steps, return_index=True)
        bounds = [*starts[1:], len(steps)]
        for s, a, b in zip(uniq, starts, bounds):
            parts.setdefault(int(s), []).append((z[a:b], None if rew is None else rew[a:b],
                                                 None if adv is None else adv[a:b]))
    out = []
    for s in sorted(parts):
        chunks = parts[s]
        z = np.vstack([c[0] for c in chunks])
        rew = None if chunks[0][1] is None else np.concatenate([c[1] for c in chunks])
        adv = None if chunks[0][2] is None else np.concatenate([c[2] for c in chunks])
        out.append(StepSample(s, features.names, z, rew, adv))
    return out


def learning_rates(run: Run, window: Window | None = None) -> dict[int, float]:
    """``{step: learning rate used}`` for the steps in ``window`` whose telemetry has it."""
    lrs = run.telemetry_column("learning_rate")
    return {s: float(v) for s, v in lrs.items() if window is None or s in window}


def ledger_series(samples: Sequence[StepSample], eta_by_step: Mapping[int, float] | None = None) -> list[Ledger]:
    """One Ledger per consecutive step pair (t, t+1) present in ``samples``.

    Pairs whose steps are not adjacent (a gap in the record) are not formed: a ledger spans
    exactly one optimizer step. Each side needs at least two rollouts for a standard error.
    """
    if not samples:
        return []
    names = samples[0].names
    for s in samples:
        if s.names != names:
            raise ValueError(f"step {s.step} is in basis {s.names}, step {samples[0].step} in {names}: "
                             "samples must share one feature basis")
    by_step = {s.step: s for s in samples}
    ledgers = []
    for t in sorted(by_step):
        if t + 1 not in by_step:
            continue
        pre, post = by_step[t], by_step[t + 1]
        for side in (pre, post):
            if side.n < 2:
                raise ValueError(f"step {side.step} has {side.n} rollout(s); a ledger needs at least 2 per step "
                                 "to estimate the standard error of dz")
        c_pre = np.atleast_2d(np.cov(pre.z, rowvar=False, ddof=1))
        c_post = np.atleast_2d(np.cov(post.z, rowvar=False, ddof=1))
        cov = c_pre / pre.n + c_post / post.n
        ledgers.append(Ledger(
            step_pair=(t, t + 1), names=names,
            delta_z=post.z.mean(axis=0) - pre.z.mean(axis=0),
            se=np.sqrt(np.clip(np.diag(cov), 0, None)), cov_delta=cov,
            n_pre=pre.n, n_post=post.n,
            learning_rate=None if eta_by_step is None else eta_by_step.get(t),
        ))
    return ledgers
