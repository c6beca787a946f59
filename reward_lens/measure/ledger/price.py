"""From a record to per-step feature samples and per-step-pair ledgers.

A ``StepSample`` is what pi_t produced at step t: the n x k feature matrix in the basis
``names``, with rewards and advantages. A ``Ledger`` is one consecutive step pair (t, t+1):
the movement dz of the feature means, its standard error and full sampling covariance, and
the learning rate of step t. Ledgers are the cost book's input.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.record.reader import Run, Window, table_source


@dataclass(frozen=True, eq=False)
class StepSample:
    step: int
    names: tuple[str, ...]
    z: np.ndarray  # (n, k) float64, features of each rollout in basis `names`
    rewards: np.ndarray | None = None  # (n,)
    advantages: np.ndarray | None = None  # (n,)
    groups: np.ndarray | None = None  # (n,) prompt group of each rollout: any labels (a record's are coded 0..G-1)
    logp: np.ndarray | None = None  # (n,) log pi_t(y): the sampling policy (record `logp_pre`)
    logp_prev: np.ndarray | None = None  # (n,) log pi_{t-1}(y): the policy before the last step
    kl_prev: np.ndarray | None = None  # (n,) sum of token KL(pi_t || pi_{t-1}) along y's prefixes
    logp_prev_step: np.ndarray | None = None  # (n,) the step whose policy logp_prev is under (t-1 by default)
    prompts: np.ndarray | None = None  # (n,) prompt of each rollout: any labels (a record's are integer ids)
    # set only when ``groups`` are already codes 0..n_groups-1 in order of first appearance
    # (``steps_from_run`` codes them once for all steps), so nothing has to code them again
    n_groups: int | None = None

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
    cov_delta: np.ndarray  # (k, k) sampling covariance of delta_z (``step_moments`` of both steps)
    n_pre: int
    n_post: int
    learning_rate: float | None = None
    kind: str = "unpaired"  # which ledger made it: "unpaired" (two samples) or "paired"
    units: int = 0  # independent units behind cov_delta (prompt groups, or rollouts); 0: n_pre + n_post
    matched: bool = False  # dz is a mean of per-prompt differences over prompts both steps share

    @property
    def t(self) -> np.ndarray:
        """delta_z in units of its standard error (0 where the SE is 0)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.se > 0, self.delta_z / np.where(self.se > 0, self.se, 1), 0.0)


def group_codes(groups) -> tuple[np.ndarray, int]:
    """Integer codes 0..G-1 for any array of group labels, in order of first appearance."""
    groups = np.asarray(groups)
    if groups.dtype.kind in "iu" and len(groups) and groups[0] == 0:
        # already codes in order of first appearance iff none is negative and the running
        # maximum starts at 0 and never grows by more than 1 (each new code is the next integer)
        top = np.maximum.accumulate(groups)
        if (np.diff(top) <= 1).all() and groups.min() >= 0:
            return groups.astype(np.int64, copy=False), int(top[-1]) + 1
    _, first, inverse = np.unique(np.asarray(groups), return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse].astype(np.int64), len(first)


def sample_codes(s: StepSample) -> tuple[np.ndarray, int]:
    """``group_codes`` of a sample's groups, without recomputing codes a reader already made."""
    if s.n_groups is not None:
        return s.groups, s.n_groups
    return group_codes(s.groups)


def segment_codes(starts: np.ndarray, n: int, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``group_codes`` within each segment of rows [starts[i], starts[i+1]) of ``labels``
    (integers), for all segments at once: the codes, and each segment's number of groups."""
    seg = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
    lab = np.unique(labels, return_inverse=True)[1].reshape(-1).astype(np.int64)
    key = seg.astype(np.int64) * (int(lab.max(initial=0)) + 1) + lab
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # rows are in segment order,
    counts = np.bincount(seg[first], minlength=len(starts))         # so ranks run segment by segment
    offsets = np.r_[0, np.cumsum(counts)[:-1]]
    return rank[inverse.reshape(-1)] - offsets[seg], counts


def step_moments(s: StepSample) -> tuple[np.ndarray, np.ndarray, int]:
    """A step's feature mean, the sampling covariance of that mean, and its independent units.

    With two or more prompt groups, the groups are the units: Cov(group means) / G, which
    carries the between-prompt variance (two steps see different prompts, and the rollouts of
    one prompt are not independent of each other). With one group (one prompt per step), the
    between-prompt variance cannot be estimated from the step and the rollouts are taken as
    the units, C / n -- an understatement whenever prompts differ in what they elicit.
    """
    return all_step_moments([s])[s.step]


def all_step_moments(samples: Sequence[StepSample]) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """``step_moments`` of every sample in one segmented pass (no Python per step): the
    rollouts of all steps stacked, group sums by one bincount per feature over global group
    ids, and each step's scatter of its units (group means, or rollouts for a step with one
    group) summed by segment. Same definitions, same numbers to rounding."""
    if not samples:
        return {}
    k = samples[0].z.shape[1]
    z = np.concatenate([s.z for s in samples])
    ns = np.array([s.n for s in samples])
    # units: each step's groups where it has two or more, else each rollout
    unit_ids, offset, n_units = [], 0, []
    for s in samples:
        codes, g = sample_codes(s) if s.groups is not None else (None, 0)
        if codes is None or g < 2:
            codes, g = np.arange(s.n), s.n
        unit_ids.append(codes + offset)
        offset += g
        n_units.append(g)
    uid = np.concatenate(unit_ids)
    size = np.bincount(uid, minlength=offset).astype(float)
    um = np.stack([np.bincount(uid, weights=z[:, j], minlength=offset) for j in range(k)], axis=1) / size[:, None]
    n_units = np.array(n_units)
    step_of_unit = np.repeat(np.arange(len(samples)), n_units)
    ustart = np.concatenate([[0], np.cumsum(n_units)[:-1]])
    rstart = np.concatenate([[0], np.cumsum(ns)[:-1]])
    means = np.add.reduceat(z, rstart, axis=0) / ns[:, None]
    unit_mean = np.add.reduceat(um, ustart, axis=0) / n_units[:, None]
    scatter = segment_scatter(um - unit_mean[step_of_unit], ustart, n_units)
    out = {}
    for i, s in enumerate(samples):
        g = int(n_units[i])
        cov = scatter[i] / (g - 1) / g if g > 1 else np.full((k, k), np.nan)
        out[s.step] = (means[i], cov, g)
    return out


def segment_scatter(dev: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """sum_i dev_i dev_i^T over each segment [starts[j], starts[j] + lengths[j]) of the rows of
    ``dev`` (zero for an empty segment): segments of one length stacked, one batched matrix
    product per length (an outer product per row, summed, held rows x k x k floats)."""
    k = dev.shape[1]
    out = np.zeros((len(starts), k, k))
    for length in np.unique(lengths[lengths > 0]).tolist():
        which = np.flatnonzero(lengths == length)
        block = dev[(starts[which][:, None] + np.arange(length)).reshape(-1)].reshape(len(which), length, k)
        out[which] = block.transpose(0, 2, 1) @ block
    return out


# Consecutive steps are matched by prompt when they share at least this many prompts: the
# per-prompt differences then need a covariance across prompts.
MATCH_MIN_PROMPTS = 2


def matched_by_prompt(pre: StepSample, post: StepSample) -> tuple[np.ndarray, np.ndarray, int] | None:
    """dz as the mean over the prompts both steps saw of (mean z at t+1 - mean z at t), its
    sampling covariance Cov_p(differences) / P, and P -- or None when fewer than
    ``MATCH_MIN_PROMPTS`` prompts are shared. Matching removes the between-prompt variance
    from dz instead of adding it to Sigma."""
    if pre.prompts is None or post.prompts is None:
        return None
    shared = sorted(set(pre.prompts.tolist()) & set(post.prompts.tolist()))
    if len(shared) < MATCH_MIN_PROMPTS:
        return None
    diffs = np.stack([post.z[post.prompts == p].mean(axis=0) - pre.z[pre.prompts == p].mean(axis=0)
                      for p in shared])
    return diffs.mean(axis=0), np.atleast_2d(np.cov(diffs, rowvar=False, ddof=1)) / len(shared), len(shared)


def whole_run(run: Run) -> Window:
    """The window of every step the record has rollouts for."""
    steps = run.rollout_steps
    if not len(steps):
        raise ValueError(f"record {run.path} has no rollouts, so it has no window of steps")
    return Window(int(steps[0]), int(steps[-1]))


# Columns read when present: the paired ledger needs the groups and both log-probabilities.
OPTIONAL_COLUMNS = {"reward": "rewards", "advantage": "advantages", "group_id": "groups", "prompt": "prompts",
                    "logp_pre": "logp",
                    "logp_prev": "logp_prev", "kl_prev": "kl_prev", "logp_prev_step": "logp_prev_step"}


def steps_from_run(run: Run, features: FeatureBasis, window: Window | None = None) -> list[StepSample]:
    """One StepSample per step in ``window``, reading only the columns the features need
    (plus rewards, advantages, groups and log-probabilities where the record has them)."""
    window = window or whole_run(run)
    available = set(run.rollout_columns())
    extra = [c for c in OPTIONAL_COLUMNS if c in available]
    context = feature_context(run)
    wanted = [c for c in features.columns if c in available or c not in ("completion_ids", "num_tokens")]
    if {"completion_ids", "num_tokens"} & set(features.columns) and not {"completion_ids", "num_tokens"} & set(wanted):
        wanted.append("num_tokens")  # neither is there: the feature names the column it lacks
    zs, step_parts, col_parts = [], [], {c: [] for c in extra}
    labels: dict[str, dict] = {}  # group ids and prompts -> integers, the same across row groups
    tables = (t for t in run.iter_rollouts([*dict.fromkeys([*wanted, *extra])], window) if t.num_rows)

    def compute(table: pa.Table) -> np.ndarray:
        return features.compute(table, source=table_source(table, run.path / "rollouts.parquet"), context=context)

    for table, z in in_threads(tables, compute):
        zs.append(z)
        step_parts.append(table.column("step").to_numpy())
        for c in extra:
            col = table.column(c)
            if c in ("group_id", "prompt"):
                col_parts[c].append(_label_ids(col, labels.setdefault(c, {})))
            elif col.null_count == 0:
                col_parts[c].append(col.to_numpy(zero_copy_only=False).astype(float))
            else:  # partly null (e.g. logp_prev of the first step): NaN marks the gaps
                col_parts[c].append(col.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))
    if not zs:
        return []
    # every step's rows at once, in step order (a writer's row groups are; a stable sort if not)
    steps = np.concatenate(step_parts)
    z = np.vstack(zs) if len(zs) > 1 else zs[0]
    cols = {c: np.concatenate(v) for c, v in col_parts.items()}
    if len(steps) > 1 and (np.diff(steps) < 0).any():
        order = np.argsort(steps, kind="stable")
        steps, z, cols = steps[order], z[order], {c: v[order] for c, v in cols.items()}
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    ends = np.r_[starts[1:], len(steps)]
    n_groups = None
    if "group_id" in cols:  # labels -> codes in order of first appearance, per step
        cols["group_id"], n_groups = segment_codes(starts, len(steps), cols["group_id"])
    # a float column that is null on every row of a step is absent at that step
    absent = {c: np.logical_and.reduceat(np.isnan(v), starts) for c, v in cols.items() if v.dtype.kind == "f"}
    present = [(c, OPTIONAL_COLUMNS[c]) for c in OPTIONAL_COLUMNS if c in cols]
    out = []
    for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        kw = {attr: cols[c][a:b] for c, attr in present if c not in absent or not absent[c][i]}
        out.append(StepSample(int(steps[a]), features.names, z[a:b], n_groups=None if n_groups is None
                              else int(n_groups[i]), **kw))
    return out


FEATURE_THREADS = min(4, os.cpu_count() or 1)


def in_threads(items: Iterator, fn: Callable, workers: int | None = None) -> Iterator[tuple]:
    """``(item, fn(item))`` in the order of ``items``, ``fn`` running on up to ``workers``
    threads (default ``FEATURE_THREADS``) while the next items are read: pyarrow's compute
    functions and numpy's array operations release the GIL, so a row group's features are
    computed while the next is read and coded (1.9x on two cores for the surface basis). At
    most ``workers`` + 1 items are held at once; an error is raised in order, as without threads."""
    workers = FEATURE_THREADS if workers is None else workers
    if workers <= 1:
        for item in items:
            yield item, fn(item)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append((item, pool.submit(fn, item)))
                if len(pending) > workers:
                    item0, fut = pending.popleft()
                    yield item0, fut.result()
            while pending:
                item0, fut = pending.popleft()
                yield item0, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


def _label_ids(col, ids: dict) -> np.ndarray:
    """Integer ids for a column of labels (group ids, prompts), through Arrow's dictionary
    encoding: Python sees each distinct label once, never each row. ``ids`` maps labels to
    integers and is shared across row groups, so equal labels get equal ids; null is -1."""
    enc = pc.dictionary_encode(col)
    enc = enc.combine_chunks() if isinstance(enc, pa.ChunkedArray) else enc
    table = np.array([ids.setdefault(v, len(ids)) for v in enc.dictionary.to_pylist()] + [-1], dtype=np.int64)
    idx = enc.indices.fill_null(len(enc.dictionary)).to_numpy(zero_copy_only=False)
    return table[idx]


def feature_context(run: Run) -> dict[str, object]:
    """What a declared feature may need from the record beyond its rollouts: the model's
    end-of-sequence token and the trainer's completion length cap."""
    cfg = run.manifest.trainer_config or {}
    return {"eos_token_id": run.manifest.model.eos_token_id, "max_completion_length": cfg.get("max_completion_length")}


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
    # each step's moments once (it sits in two pairs), all in one segmented pass
    moments = all_step_moments([s for s in samples if s.n >= 2])

    def moments_of(x: StepSample) -> tuple[np.ndarray, np.ndarray, int]:
        return moments[x.step]

    formed = []
    for t in sorted(by_step):
        if t + 1 not in by_step:
            continue
        pre, post = by_step[t], by_step[t + 1]
        for side in (pre, post):
            if side.n < 2:
                raise ValueError(f"step {side.step} has {side.n} rollout(s); a ledger needs at least 2 per step "
                                 "to estimate the standard error of dz")
        matched = matched_by_prompt(pre, post)
        if matched is not None:
            dz, cov, units = matched
        else:
            m_pre, v_pre, u_pre = moments_of(pre)
            m_post, v_post, u_post = moments_of(post)
            dz, cov, units = m_post - m_pre, v_pre + v_post, u_pre + u_post
        formed.append((t, pre, post, dz, cov, units, matched is not None))
    if not formed:
        return []
    # every pair's standard errors at once: the diagonals of the stacked covariances
    covs = np.stack([cov for _, _, _, _, cov, _, _ in formed])
    ses = np.sqrt(np.clip(np.diagonal(covs, axis1=1, axis2=2), 0, None))
    return [Ledger(step_pair=(t, t + 1), names=names, delta_z=dz, se=se, cov_delta=cov, n_pre=pre.n, n_post=post.n,
                   learning_rate=None if eta_by_step is None else eta_by_step.get(t), units=units, matched=matched)
            for (t, pre, post, dz, cov, units, matched), se in zip(formed, ses)]
