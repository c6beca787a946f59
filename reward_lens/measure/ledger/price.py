"""From a record to per-step feature samples and per-step-pair ledgers.

A ``StepSample`` is what pi_t produced at step t: the n x k feature matrix in the basis
``names``, with rewards and advantages. A ``Ledger`` is one consecutive step pair (t, t+1):
the movement dz of the feature means, its standard error and full sampling covariance, and
the learning rate of step t. Ledgers are the cost book's input.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from functools import cached_property

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
    logp_sampler: np.ndarray | None = None  # (n,) log of the sampling engine's probability (vLLM), where recorded
    drawn_by: np.ndarray | None = None  # (n,) held-out rows: the step whose policy drew the row (record `drawn_by_step`)
    prompts: np.ndarray | None = None  # (n,) prompt of each rollout: any labels (a record's are integer ids)
    # set only when ``groups`` are already codes 0..n_groups-1 in order of first appearance
    # (``steps_from_run`` codes them once for all steps), so nothing has to code them again
    n_groups: int | None = None
    # the stack of every step's rows this sample's arrays are views into (``steps_from_run``),
    # and its place there: ``stacked`` hands consecutive samples back without a copy
    stack: StepStack | None = field(default=None, repr=False)
    index: int = field(default=-1, repr=False)
    # held-out completions of the previous policy for this step's prompts (never in the loss),
    # their groups coded as this sample's: the paired ledger's second side (``steps_from_run``)
    heldout: StepSample | None = field(default=None, repr=False)
    # completions of this step's policy for the previous generation's prompts, drawn beside its
    # generation and never trained on (the tap's side b), their groups coded as ``heldout``'s: where
    # recorded, the paired ledger reads them in place of the rollouts (``paired_samples``)
    fresh: StepSample | None = field(default=None, repr=False)

    @cached_property
    def n(self) -> int:  # read per step by every book: worked out once
        return self.z.shape[0]


@dataclass(frozen=True, eq=False)
class StepStack:
    """The rows of every step ``steps_from_run`` read, stacked in step order (read-only). Sample i
    holds views of rows ``starts[i]:starts[i] + ns[i]``; ``views`` keeps the very array objects
    it was given, so ``stacked`` can tell a sample still holding them from one given others."""

    arrays: dict[str, np.ndarray]  # sample attribute -> its rows for every step, stacked
    starts: np.ndarray  # (P,) first row of each step
    ns: np.ndarray  # (P,) rows of each step
    views: dict[str, list]  # sample attribute -> each sample's array (None where it has none)
    # per-step statistics of a run of its samples, worked out once for every book that asks
    # (``memo(key, samples, make)``); the arrays are read-only, so they cannot go stale
    _memo: dict = field(default_factory=dict, repr=False)
    _memo_locks: dict = field(default_factory=dict, repr=False)  # a lock per key: one thread makes it
    _memo_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def memo(self, key: str, samples: Sequence[StepSample], make: Callable[[], object]):
        """``make()`` for ``samples`` -- computed once per key for the same run of samples of
        this stack (``stack_range``); for any other samples, every time."""
        where = stack_range(samples)
        if where is None or where[0] is not self:
            return make()
        k = (key, where[1], where[2])
        if k in self._memo:
            return self._memo[k]
        with self._memo_lock:  # books on other threads: one makes it, the others wait for it
            lock = self._memo_locks.setdefault(k, threading.Lock())
        with lock:
            if k not in self._memo:
                self._memo[k] = make()
        return self._memo[k]


def stack_range(samples: Sequence[StepSample], attr: str = "z") -> tuple[StepStack, int, int] | None:
    """The stack and the range of its samples [i0, i1) that ``samples`` are, in order, each
    still holding the stack's own ``attr`` array; else None."""
    if not samples:
        return None
    st, i0 = samples[0].stack, samples[0].index
    views = st.views.get(attr) if st is not None else None
    end = i0 + len(samples)
    if views is not None and i0 >= 0 and end <= len(views):
        # each sample of this stack, holding its array of it (a present one): identity tests in
        # C over the run, not a Python generator per sample (books ask this of 10,000 samples often)
        mine = views[i0:end]
        if (all(map(operator.is_, map(_STACK, samples), itertools.repeat(st)))
                and all(map(operator.is_, map(operator.attrgetter(attr), samples), mine))
                and all(map(operator.is_not, mine, itertools.repeat(None)))):
            return st, i0, end
    return None


_STACK = operator.attrgetter("stack")
_BLOCK, _ROW = operator.attrgetter("block"), operator.attrgetter("row")


def stacked(samples: Sequence[StepSample], attr: str = "z") -> np.ndarray:
    """``np.concatenate`` of the samples' ``attr`` arrays (rows in sample order). Consecutive
    samples of one ``StepStack`` that still hold the stack's arrays get a read-only view of
    it, no copy: at 640,000 rollouts a copy of z costs as much as the arithmetic on it."""
    where = stack_range(samples, attr)
    if where is not None:
        st, i0, end = where
        return st.arrays[attr][int(st.starts[i0]):int(st.starts[end - 1] + st.ns[end - 1])]
    return np.concatenate([np.asarray(getattr(s, attr)) for s in samples])


def stack_views(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``np.stack(arrays)``, without a copy where the arrays are already its rows: equal-shaped
    views one after another of one C-contiguous array (the paired ledgers of one batch hold
    their samples so); a read-only view then, else the stacked copy."""
    a0 = arrays[0] if len(arrays) else None
    base = a0.base if a0 is not None else None
    if base is not None and base.flags.c_contiguous and a0.flags.c_contiguous and a0.dtype == base.dtype:
        step = a0.nbytes
        start = a0.__array_interface__["data"][0]
        offset = start - base.__array_interface__["data"][0]
        if step and offset >= 0 and base.nbytes >= offset + step * len(arrays) and all(
                x.base is base and x.shape == a0.shape and x.flags.c_contiguous
                and x.__array_interface__["data"][0] == start + j * step for j, x in enumerate(arrays)):
            flat = base.reshape(-1)[offset // base.itemsize:(offset + step * len(arrays)) // base.itemsize]
            view = flat.reshape(len(arrays), *a0.shape)
            view.flags.writeable = False
            return view
    return np.stack(arrays)


def unit_ids(samples: Sequence[StepSample], groups_from: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Each rollout's independent unit, numbered across ``samples`` (in sample order, each
    sample's units in order): its prompt group where the sample has at least ``groups_from``
    groups, else the rollout itself (and always the rollout in a sample without groups).
    Returns the ids and each sample's number of units. Samples of one ``StepStack`` with coded
    groups take one vectorised pass; others one array operation per sample."""
    ns = np.fromiter((s.n for s in samples), np.int64, len(samples))
    if samples and all(s.n_groups is not None for s in samples):
        codes = stacked(samples, "groups")
        gs = np.fromiter((s.n_groups for s in samples), np.int64, len(samples))
        as_rows = gs < groups_from
        units = np.where(as_rows, ns, gs)
        offsets = np.r_[0, np.cumsum(units)[:-1]]
        if as_rows.any():
            starts = np.r_[0, np.cumsum(ns)[:-1]]
            local = np.arange(len(codes)) - np.repeat(starts, ns)
            codes = np.where(np.repeat(as_rows, ns), local, codes)
        return codes + np.repeat(offsets, ns), units
    ids, units, offset = [], [], 0
    for s in samples:
        codes, g = sample_codes(s) if s.groups is not None else (None, 0)
        if codes is None or g < groups_from:
            codes, g = np.arange(s.n), s.n
        ids.append(codes + offset)
        offset += g
        units.append(g)
    return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), np.array(units, dtype=np.int64)


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


@dataclass(frozen=True, eq=False)
class LedgerArrays:
    """The ledgers of many step pairs as stacked arrays, entry q of each for ledger q: what a
    book pricing 10,000 step pairs reads, instead of 10,000 objects' attributes."""

    names: tuple[str, ...]
    step_pairs: np.ndarray  # (P, 2) int
    delta_z: np.ndarray  # (P, k)
    se: np.ndarray  # (P, k)
    cov_delta: np.ndarray  # (P, k, k)
    n_pre: np.ndarray  # (P,) int
    n_post: np.ndarray  # (P,) int
    units: np.ndarray  # (P,) int: 0 where unstated (then n_pre + n_post)
    matched: np.ndarray  # (P,) bool
    learning_rate: list  # (P,) float or None
    kind: str = "unpaired"


class LedgerSeries(Sequence):
    """Unpaired ledgers held as ``LedgerArrays`` (``ledger_series`` returns one): item q is a
    ``Ledger`` made when it is asked for, while a book reads the arrays (``ledger_arrays``)."""

    def __init__(self, arrays: LedgerArrays):
        self.arrays = arrays
        self._made: dict[int, Ledger] = {}

    def __len__(self) -> int:
        return len(self.arrays.step_pairs)

    def __getitem__(self, q):
        if isinstance(q, slice):
            return [self[i] for i in range(*q.indices(len(self)))]
        n = len(self)
        if not -n <= q < n:
            raise IndexError(f"ledger {q} of a series of {n}")
        q %= n
        if q not in self._made:
            a = self.arrays
            self._made[q] = Ledger(step_pair=(int(a.step_pairs[q, 0]), int(a.step_pairs[q, 1])), names=a.names,
                                   delta_z=a.delta_z[q], se=a.se[q], cov_delta=a.cov_delta[q], n_pre=int(a.n_pre[q]),
                                   n_post=int(a.n_post[q]), learning_rate=a.learning_rate[q], units=int(a.units[q]),
                                   matched=bool(a.matched[q]))
        return self._made[q]

    def __iter__(self) -> Iterator[Ledger]:
        return (self[q] for q in range(len(self)))

    def where(self, keep: np.ndarray) -> LedgerSeries:
        """The ledgers where ``keep`` (a boolean mask over them) holds, as a series."""
        a = self.arrays
        lr = [v for v, k in zip(a.learning_rate, keep.tolist()) if k]
        return LedgerSeries(LedgerArrays(a.names, a.step_pairs[keep], a.delta_z[keep], a.se[keep], a.cov_delta[keep],
                                         a.n_pre[keep], a.n_post[keep], a.units[keep], a.matched[keep], lr, a.kind))


@dataclass(frozen=True, eq=False)
class LedgerBlock:
    """Ledgers made together (the paired ledgers of one group layout), their numbers held as one
    ``LedgerArrays``: the ledger of row i carries ``block`` and ``row`` = i, and its dz, SE and
    covariance are views of row i. ``ledger_arrays`` hands back a run of consecutive rows as
    slices instead of restacking 10,000 ledgers' attributes."""

    arrays: LedgerArrays

    def rows(self, ledgers: Sequence[Ledger]) -> LedgerArrays | None:
        """The arrays of ``ledgers`` when they are rows r0, r0 + 1, ... of this block, else None."""
        r0 = getattr(ledgers[0], "row", -1) if ledgers else -1
        a = self.arrays
        if r0 < 0 or r0 + len(ledgers) > len(a.step_pairs):
            return None
        try:  # every ledger of this block, at its row: tested in C over the run
            if not (all(map(operator.is_, map(_BLOCK, ledgers), itertools.repeat(self)))
                    and list(map(_ROW, ledgers)) == list(range(r0, r0 + len(ledgers)))):
                return None
        except AttributeError:  # a ledger made elsewhere (no block)
            return None
        cut = slice(r0, r0 + len(ledgers))
        return LedgerArrays(a.names, a.step_pairs[cut], a.delta_z[cut], a.se[cut], a.cov_delta[cut], a.n_pre[cut],
                            a.n_post[cut], a.units[cut], a.matched[cut], a.learning_rate[cut], a.kind)


def ledger_arrays(ledgers: Sequence[Ledger]) -> LedgerArrays:
    """The ledgers' numbers as stacked arrays: a ``LedgerSeries``'s own, the rows of the
    ``LedgerBlock`` they were made in, or stacked from the ledgers (paired ones included: their
    per-rollout arrays stay on the ledgers)."""
    if isinstance(ledgers, LedgerSeries):
        return ledgers.arrays
    block = getattr(ledgers[0], "block", None) if ledgers else None
    got = block.rows(ledgers) if block is not None else None
    if got is not None:
        return got
    k = len(ledgers[0].names) if ledgers else 0
    names = ledgers[0].names if ledgers else ()
    kinds = {lg.kind for lg in ledgers}
    return LedgerArrays(
        names=names, step_pairs=np.array([lg.step_pair for lg in ledgers], dtype=np.int64).reshape(len(ledgers), 2),
        delta_z=stack_views([lg.delta_z for lg in ledgers]) if ledgers else np.zeros((0, k)),
        se=stack_views([lg.se for lg in ledgers]) if ledgers else np.zeros((0, k)),
        cov_delta=stack_views([lg.cov_delta for lg in ledgers]) if ledgers else np.zeros((0, k, k)),
        n_pre=np.array([lg.n_pre for lg in ledgers], dtype=np.int64),
        n_post=np.array([lg.n_post for lg in ledgers], dtype=np.int64),
        units=np.array([lg.units for lg in ledgers], dtype=np.int64),
        matched=np.array([lg.matched for lg in ledgers], dtype=bool),
        learning_rate=[lg.learning_rate for lg in ledgers], kind=kinds.pop() if len(kinds) == 1 else "mixed")


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
    fast = _codes_by_offset(starts, seg, labels)
    if fast is not None:
        return fast
    lab = np.unique(labels, return_inverse=True)[1].reshape(-1).astype(np.int64)
    key = seg.astype(np.int64) * (int(lab.max(initial=0)) + 1) + lab
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # rows are in segment order,
    counts = np.bincount(seg[first], minlength=len(starts))         # so ranks run segment by segment
    offsets = np.r_[0, np.cumsum(counts)[:-1]]
    return rank[inverse.reshape(-1)] - offsets[seg], counts


def _codes_by_offset(starts: np.ndarray, seg: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``segment_codes`` where each segment's labels are new integers in order of first
    appearance (a record's group ids: a step's groups are its own, numbered as they appear):
    the codes are the labels less the segment's smallest, which is checked -- every segment's
    codes start at 0 and their running maximum grows by at most 1 -- else None."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu" or not len(labels) or labels.min() < 0 or \
            (np.diff(np.r_[starts, len(labels)]) < 1).any():  # an empty segment has no smallest label
        return None
    codes = labels - np.minimum.reduceat(labels, starts)[seg]
    counts = np.maximum.reduceat(codes, starts) + 1
    # laid end to end (segment i's codes offset by the groups before it), all segments' codes
    # are first-appearance codes exactly when each segment's are
    joined = codes + np.r_[0, np.cumsum(counts)[:-1]][seg]
    if codes[starts].any() or (np.diff(np.maximum.accumulate(joined)) > 1).any():
        return None
    return codes.astype(np.int64, copy=False), counts.astype(np.int64)


def step_moments(s: StepSample) -> tuple[np.ndarray, np.ndarray, int]:
    """A step's feature mean, the sampling covariance of that mean, and its independent units.

    With two or more prompt groups, the groups are the units: Cov(group means) / G, which
    carries the between-prompt variance (two steps see different prompts, and the rollouts of
    one prompt are not independent of each other). With one group (one prompt per step), the
    between-prompt variance cannot be estimated from the step and the rollouts are taken as
    the units, C / n -- an understatement whenever prompts differ in what they elicit.
    """
    return all_step_moments([s])[s.step]


def blocks(uid: np.ndarray, total: int) -> int | None:
    """m when the ids run in equal consecutive blocks, 0 0 .. 0 1 1 .. 1 ..., m of each of
    0..total-1 (every prompt group of m rollouts together, as TRL writes them), else None."""
    m = len(uid) // total if total else 0
    if m and m * total == len(uid) and (uid.reshape(total, m) == np.arange(total)[:, None]).all():
        return m
    return None


def group_sums(values: np.ndarray, uid: np.ndarray, total: int) -> np.ndarray:
    """The sums of ``values`` (N, k) by id (``uid``: N ids in 0..total-1), as one bincount per
    column gives them. Ids in equal consecutive ``blocks`` are summed as a (total, m, k)
    reshape instead: the same additions in the same order, without k passes over the ids."""
    m = blocks(uid, total) if values.ndim == 2 else None
    if m:
        return values.reshape(total, m, values.shape[1]).sum(axis=1)
    if values.ndim == 1:
        return np.bincount(uid, weights=values, minlength=total)
    return np.stack([np.bincount(uid, weights=values[:, j], minlength=total) for j in range(values.shape[1])], axis=1)


def all_step_moments(samples: Sequence[StepSample]) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """``step_moments`` of every sample in one segmented pass (no Python per step): the
    rollouts of all steps stacked, group sums by one bincount per feature over global group
    ids, and each step's scatter of its units (group means, or rollouts for a step with one
    group) summed by segment. Same definitions, same numbers to rounding."""
    if not samples:
        return {}
    means, covs, units = step_moment_arrays(samples)
    return {s.step: (m, c, g) for s, m, c, g in zip(samples, means, covs, units.tolist())}


def step_moment_arrays(samples: Sequence[StepSample], z: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``all_step_moments`` as arrays: means (P, k), covariances (P, k, k), units (P,); of the
    rows ``z`` (the samples' rows stacked, another column than their features) where given."""
    z = stacked(samples) if z is None else z
    ns = np.fromiter((s.n for s in samples), np.int64, len(samples))
    # units: each step's groups where it has two or more, else each rollout
    uid, n_units = unit_ids(samples, groups_from=2)
    offset = int(n_units.sum())
    size = np.bincount(uid, minlength=offset).astype(float)
    um = group_sums(z, uid, offset) / size[:, None]
    step_of_unit = np.repeat(np.arange(len(samples)), n_units)
    ustart = np.concatenate([[0], np.cumsum(n_units)[:-1]])
    rstart = np.concatenate([[0], np.cumsum(ns)[:-1]])
    means = np.add.reduceat(z, rstart, axis=0) / ns[:, None]
    unit_mean = np.add.reduceat(um, ustart, axis=0) / n_units[:, None]
    scatter = segment_scatter(um - unit_mean[step_of_unit], ustart, n_units)
    g = n_units.astype(float)[:, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        covs = np.where(g > 1, scatter / (g - 1) / g, np.nan)
    return means, covs, n_units


def segment_scatter(dev: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """sum_i dev_i dev_i^T over each segment [starts[j], starts[j] + lengths[j]) of the rows of
    ``dev`` (zero for an empty segment): segments of one length stacked, one batched matrix
    product per length (an outer product per row, summed, held rows x k x k floats)."""
    k = dev.shape[1]
    if len(starts) and len(dev) == len(starts) * int(lengths[0]) and (lengths == lengths[0]).all() and \
            (starts == np.arange(len(starts)) * int(lengths[0])).all():  # one length, in order: a reshape
        block = dev.reshape(len(starts), int(lengths[0]), k)
        return block.transpose(0, 2, 1) @ block
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
                    "logp_prev": "logp_prev", "kl_prev": "kl_prev", "logp_prev_step": "logp_prev_step",
                    "logp_sampler": "logp_sampler", "drawn_by_step": "drawn_by"}


class RowCollector(Protocol):
    """Something else a report takes from the rollouts (a browser's rows, curves), fed by the
    same pass that computes the features instead of a pass of its own: ``take`` gets every
    table read, in record order, with its rows' features."""

    columns: tuple[str, ...]  # the columns it reads, where the record has them

    def take(self, table: pa.Table, z: np.ndarray) -> None: ...


def steps_from_run(run: Run, features: FeatureBasis, window: Window | None = None, *,
                   collectors: Sequence[RowCollector] = (), heldout: bool = True) -> list[StepSample]:
    """One StepSample per step in ``window``, reading only the columns the features need
    (plus rewards, advantages, groups and log-probabilities where the record has them, and
    the columns ``collectors`` read, which are handed every rollouts table as it is read).
    Where the record holds held-out completions (and ``heldout``), each step's are read in the
    same pass and hang off its sample as ``sample.heldout``, their groups coded as the sample's."""
    window = window or whole_run(run)
    ho_run = run.heldout() if heldout else None
    available = set(run.rollout_columns())
    extra = [c for c in OPTIONAL_COLUMNS if c in available]
    also = [c for col in collectors for c in col.columns if c in available]
    context = feature_context(run)
    wanted = [c for c in features.columns if c in available or c not in ("completion_ids", "num_tokens")]
    if {"completion_ids", "num_tokens"} & set(features.columns) and not {"completion_ids", "num_tokens"} & set(wanted):
        wanted.append("num_tokens")  # neither is there: the feature names the column it lacks
    nulls: set[str] = set()  # float columns with a null somewhere: only they can be absent at a step
    columns = [*dict.fromkeys([*wanted, *extra, *also])]
    tables = ((t, False) for t in run.iter_rollouts(columns, window) if t.num_rows)
    if ho_run is not None:
        if set(ho_run.rollout_columns()) >= set(wanted) | set(extra):
            ho_cols = [*dict.fromkeys([*wanted, *extra])]
            tables = itertools.chain(tables, ((t, True) for t in ho_run.iter_rollouts(ho_cols, window) if t.num_rows))
        else:
            ho_run = None  # held-out rows without the columns the rollouts have: not a side to combine
    label_columns = [c for c in extra if c in LABEL_COLUMNS]
    col_parts: dict[str, list] = {c: [] for c in label_columns}  # each read's dictionary-encoded labels

    def compute(item: tuple[pa.Table, bool]) -> tuple[np.ndarray, dict]:
        table = item[0]
        z = features.compute(table, source=table_source(table, run.path / "rollouts.parquet"), context=context)
        return z, {c: pc.dictionary_encode(table.column(c).combine_chunks()) for c in label_columns}

    # Every step's rows at once, filled in as the reads come in (the main thread would otherwise
    # wait for the feature threads, and stack 46 MB at the end): as many rows as the window's
    # steps have in the record.
    rs = run.rollout_steps
    bound = int(np.count_nonzero((rs >= window.start) & (rs <= window.stop)))
    if ho_run is not None:
        hs = ho_run.rollout_steps
        bound += int(np.count_nonzero((hs >= window.start) & (hs <= window.stop)))
    z_all, steps_all = None, np.empty(bound, dtype=np.int64)
    side_all = np.zeros(bound, dtype=bool)
    floats = {c: np.empty(bound) for c in extra if c not in label_columns}
    filled = 0
    for (table, is_heldout), (z, encoded) in in_threads(tables, compute):
        if not is_heldout:
            for col in collectors:
                col.take(table, z)
        a, b = filled, filled + table.num_rows
        if z_all is None:
            z_all = np.empty((bound, z.shape[1]))
        z_all[a:b] = z
        steps_all[a:b] = table.column("step").to_numpy()
        side_all[a:b] = is_heldout
        for c in extra:
            col = table.column(c)
            if c in encoded:
                col_parts[c].append(encoded[c])
            elif col.null_count == 0:
                floats[c][a:b] = col.to_numpy(zero_copy_only=False)
            else:  # partly null (e.g. logp_prev of the first step): NaN marks the gaps
                nulls.add(c)
                floats[c][a:b] = col.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
        filled = b
    if not filled or not (~side_all[:filled]).any():
        return []
    steps, z, side = steps_all[:filled], z_all[:filled], side_all[:filled]
    cols = {c: _label_ids(col_parts[c]) if c in label_columns else floats[c][:filled] for c in extra}
    if "group_id" in cols and side.any():
        n_roll = int(np.count_nonzero(~side))
        if side[:n_roll].any() or not (_ascending(steps[:n_roll]) and _ascending(steps[n_roll:])):
            # rollouts, then held-out rows, each side in step order (a stable sort: a step's rows
            # keep their read order); a writer's row groups are so already, and nothing moves
            order = np.lexsort((steps, side))
            steps, z, cols = steps[order], z[order], {c: v[order] for c, v in cols.items()}
        return _two_sides(steps, z, cols, n_roll, nulls, features.names)
    if not _ascending(steps):  # in step order (a writer's row groups are; a stable sort if not)
        order = np.argsort(steps, kind="stable")
        steps, z, cols = steps[order], z[order], {c: v[order] for c, v in cols.items()}
    return _samples(steps, z, cols, nulls, features.names)


def _ascending(steps: np.ndarray) -> bool:
    return len(steps) < 2 or not bool((np.diff(steps) < 0).any())


def _two_sides(steps: np.ndarray, z: np.ndarray, cols: dict[str, np.ndarray], n_roll: int, nulls: set[str],
               names: tuple[str, ...]) -> list[StepSample]:
    """``steps_from_run``'s samples of a read that holds its rollouts (rows < n_roll), then its
    held-out rows, each side in step order: the sides are taken as they lie (views), and the
    groups coded per step over both sides at once, rollouts first (so their codes are the ones a
    read of the rollouts alone gives); only the labels are put in step order for that."""
    order = np.argsort(steps, kind="stable")  # within a step: its rollouts, then its held-out rows
    ordered = steps[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    codes = np.empty(len(steps), dtype=np.int64)
    codes[order] = segment_codes(starts, len(steps), cols["group_id"][order])[0]
    cols = {**cols, "group_id": codes}
    roll, held = slice(0, n_roll), slice(n_roll, len(steps))
    drawn = cols.get("drawn_by_step")
    fresh = drawn[held] == steps[held] if drawn is not None else np.zeros(len(steps) - n_roll, dtype=bool)
    parts = {}
    for name, mask in (("heldout", ~fresh), ("fresh", fresh)):  # drawn by pi_t; by the step's own policy (side b)
        if mask.any():
            rows = slice(n_roll, len(steps)) if mask.all() else np.flatnonzero(mask) + n_roll
            parts[name] = {s.step: s for s in _samples(steps[rows], z[rows], {c: v[rows] for c, v in cols.items()},
                                                        nulls, names, coded=True)}
    return _samples(steps[roll], z[roll], {c: v[roll] for c, v in cols.items()}, nulls, names, coded=True,
                    attach=parts)


def _samples(steps: np.ndarray, z: np.ndarray, cols: dict[str, np.ndarray], nulls: set[str], names: tuple[str, ...],
             coded: bool = False, attach: dict[str, dict[int, StepSample]] | None = None) -> list[StepSample]:
    """StepSamples of rows sorted by step: views of one read-only ``StepStack``. ``coded``: the
    group ids are already codes per step (else they are labels, coded here)."""
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    ends = np.r_[starts[1:], len(steps)]
    n_groups = None
    if "group_id" in cols:  # labels -> codes in order of first appearance, per step
        if coded:
            n_groups = np.maximum.reduceat(cols["group_id"], starts) + 1
        else:
            cols["group_id"], n_groups = segment_codes(starts, len(steps), cols["group_id"])
    # a float column that is null on every row of a step is absent at that step
    absent = {c: np.logical_and.reduceat(np.isnan(v), starts) for c, v in cols.items()
              if v.dtype.kind == "f" and c in nulls}
    arrays = {"z": z, **{OPTIONAL_COLUMNS[c]: v for c, v in cols.items()}}
    for a in arrays.values():
        a.flags.writeable = False  # shared by every sample and by ``stacked``
    ns = ends - starts
    views = {attr: _step_views(v, starts, ns, absent.get(c))
             for attr, c, v in [("z", None, z), *[(OPTIONAL_COLUMNS[c], c, v) for c, v in cols.items()]]}
    stack = StepStack(arrays=arrays, starts=starts, ns=ns, views=views)
    present = [OPTIONAL_COLUMNS[c] for c in OPTIONAL_COLUMNS if c in cols]
    g = [None] * len(starts) if n_groups is None else n_groups.tolist()
    step_of = steps[starts].tolist()
    # every field of each sample, as the dataclass's __init__ sets them, made column by column
    # and put in place without it: at 10,000 steps x 2 sides its frozen __setattr__ per field
    # was a third of a second on the critical path of a tapped report (bench/report_phases.py)
    fields = {f: [None] * len(starts) for f in _SAMPLE_FIELDS}
    fields.update(step=step_of, names=[names] * len(starts), n_groups=g, stack=[stack] * len(starts),
                  index=list(range(len(starts))), **{attr: views[attr] for attr in ("z", *present)})
    for k, v in (attach or {}).items():
        fields[k] = [v.get(s) for s in step_of]
    return _made(list(zip(*fields.values())), tuple(fields))


# StepSample's fields in declaration order, for ``_made``
_SAMPLE_FIELDS = tuple(f.name for f in dataclass_fields(StepSample))


def _made(rows: list[tuple], names: tuple[str, ...]) -> list[StepSample]:
    """StepSamples with the fields ``names`` set to each row's values -- every field, so that
    each is what ``StepSample(**dict(zip(names, row)))`` makes (tests/unit/test_step_samples.py),
    without a frozen dataclass's ``object.__setattr__`` per field."""
    if set(names) != set(_SAMPLE_FIELDS):
        raise ValueError(f"_made needs every field of StepSample, not {names}")
    new = object.__new__
    out = []
    for row in rows:
        s = new(StepSample)
        s.__dict__.update(zip(names, row))
        out.append(s)
    return out


def _step_views(v: np.ndarray, starts: np.ndarray, ns: np.ndarray, absent: np.ndarray | None) -> list:
    """Each step's rows of ``v`` (rows sorted by step, step i's from ``starts[i]``, ``ns[i]`` of
    them) as a view, None where ``absent`` says the column is absent at the step. Steps of equal
    size in a C-contiguous column are the rows of one reshaped view, listed in C (10,000 slices
    in Python are 20 ms a column); the same views as slicing, of the same memory."""
    if len(ns) and v.flags.c_contiguous and (ns == ns[0]).all() and int(ns[0]) * len(ns) == len(v):
        out = list(v.reshape(len(ns), int(ns[0]), *v.shape[1:]))
    else:
        out = [v[a:a + n] for a, n in zip(starts.tolist(), ns.tolist())]
    if absent is not None:
        for i in np.flatnonzero(absent).tolist():
            out[i] = None
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


# Columns of labels, read as integer ids: equal labels get equal ids over the whole read.
LABEL_COLUMNS = ("group_id", "prompt")


def _label_ids(parts: Sequence[pa.DictionaryArray]) -> np.ndarray:
    """Integer ids for a column of labels (group ids, prompts) read in parts, each part
    dictionary-encoded by Arrow: the parts' dictionaries laid end to end and encoded once more
    give every distinct label of the read one id, in order of first appearance (each part's
    dictionary is in its own order of first appearance, and the parts are in row order). Null
    is -1. No Python object per row or per label."""
    dicts = [p.dictionary if p.dictionary.type == parts[0].dictionary.type else p.dictionary.cast(parts[0].dictionary.type)
             for p in parts]
    ids = pc.dictionary_encode(pa.concat_arrays(dicts)).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    out, offset = [], 0
    for p, d in zip(parts, dicts):
        table = np.r_[ids[offset:offset + len(d)], -1]
        out.append(table[p.indices.fill_null(len(d)).to_numpy(zero_copy_only=False)])
        offset += len(d)
    return np.concatenate(out)


def feature_context(run: Run) -> dict[str, object]:
    """What a declared feature may need from the record beyond its rollouts: the model's
    end-of-sequence token and the trainer's completion length cap."""
    cfg = run.manifest.trainer_config or {}
    return {"eos_token_id": run.manifest.model.eos_token_id, "max_completion_length": cfg.get("max_completion_length")}


def learning_rates(run: Run, window: Window | None = None) -> dict[int, float]:
    """``{step: learning rate used}`` for the steps in ``window`` whose telemetry has it."""
    lrs = run.telemetry_column("learning_rate")
    return {s: float(v) for s, v in lrs.items() if window is None or s in window}


def ledger_series(samples: Sequence[StepSample], eta_by_step: Mapping[int, float] | None = None) -> LedgerSeries:
    """One Ledger per consecutive step pair (t, t+1) present in ``samples`` (a sequence of
    Ledgers, held as arrays: ``LedgerSeries``).

    Pairs whose steps are not adjacent (a gap in the record) are not formed: a ledger spans
    exactly one optimizer step. Each side needs at least two rollouts for a standard error.
    """
    names = samples[0].names if samples else ()
    for s in samples:
        if s.names != names:
            raise ValueError(f"step {s.step} is in basis {s.names}, step {samples[0].step} in {names}: "
                             "samples must share one feature basis")
    by_step = {s.step: s for s in samples}
    pairs = [t for t in sorted(by_step) if t + 1 in by_step]
    for t in pairs:
        for side in (by_step[t], by_step[t + 1]):
            if side.n < 2:
                raise ValueError(f"step {side.step} has {side.n} rollout(s); a ledger needs at least 2 per step "
                                 "to estimate the standard error of dz")
    if not pairs:
        k = len(names)
        return LedgerSeries(LedgerArrays(names, np.zeros((0, 2), np.int64), np.zeros((0, k)), np.zeros((0, k)),
                                         np.zeros((0, k, k)), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                         np.zeros(0, np.int64), np.zeros(0, bool), []))
    # each step's moments once (it sits in two pairs), all in one segmented pass; every pair's
    # dz and covariance by stacked arithmetic, then the pairs matched by prompt replace theirs
    two = [s for s in samples if s.n >= 2]
    means, covs, units = step_moment_arrays(two)
    pos = {s.step: i for i, s in enumerate(two)}
    pre = np.array([pos[t] for t in pairs])
    post = np.array([pos[t + 1] for t in pairs])
    dz, cov, n_units = means[post] - means[pre], covs[pre] + covs[post], units[pre] + units[post]
    matched = np.zeros(len(pairs), dtype=bool)
    for q in np.flatnonzero(_may_match(two, pre, post)).tolist():
        m = matched_by_prompt(two[pre[q]], two[post[q]])
        if m is not None:
            dz[q], cov[q], n_units[q] = m
            matched[q] = True
    ses = np.sqrt(np.clip(np.diagonal(cov, axis1=1, axis2=2), 0, None))
    lrs = eta_by_step or {}
    return LedgerSeries(LedgerArrays(
        names=names, step_pairs=np.stack([np.array(pairs), np.array(pairs) + 1], axis=1).astype(np.int64),
        delta_z=dz, se=ses, cov_delta=cov, n_pre=np.array([by_step[t].n for t in pairs], dtype=np.int64),
        n_post=np.array([by_step[t + 1].n for t in pairs], dtype=np.int64), units=n_units.astype(np.int64),
        matched=matched, learning_rate=[None if eta_by_step is None else lrs.get(t) for t in pairs]))


def _may_match(samples: Sequence[StepSample], pre: np.ndarray, post: np.ndarray) -> np.ndarray:
    """Which pairs (samples[pre[q]], samples[post[q]]) share at least ``MATCH_MIN_PROMPTS``
    prompts (the test ``matched_by_prompt`` starts with), for every pair at once where the
    samples' prompts are integer ids (a record's are) and each pair's steps are neighbours in
    ``samples``; else True, and ``matched_by_prompt`` decides."""
    if any(s.prompts is None for s in samples):
        maybe = np.array([samples[a].prompts is not None and samples[b].prompts is not None
                          for a, b in zip(pre.tolist(), post.tolist())], dtype=bool)
        return maybe if not maybe.any() else maybe & _may_match_ids(samples, pre, post, maybe)
    return _may_match_ids(samples, pre, post, np.ones(len(pre), dtype=bool))


def _may_match_ids(samples, pre, post, which) -> np.ndarray:
    if any(s.prompts is None or s.prompts.dtype.kind not in "iu" for s in samples) or not (post == pre + 1).all():
        return which
    ns = np.fromiter((s.n for s in samples), np.int64, len(samples))
    ids = stacked(samples, "prompts").astype(np.int64) + 1  # null prompts (-1) are a label too
    width = int(ids.max(initial=0)) + 1
    keys = np.unique(np.repeat(np.arange(len(samples), dtype=np.int64), ns) * width + ids)  # (sample, prompt), once
    row = keys // width
    also_before = np.isin(keys - width, keys) & (row >= 1)  # the same prompt in the previous sample
    shared = np.bincount(row[also_before] - 1, minlength=len(samples))
    return which & (shared[pre] >= MATCH_MIN_PROMPTS)
