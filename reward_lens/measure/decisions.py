"""One set of decisions per run, made once and read by every book, the card, the findings and
the diff: which step pairs are refused and why, which are usable, which are priced, whose
movement is resolved from noise, and which features moved at each.

A step pair (t, t+1) is one optimizer update, read on samples independent of it.

* **refused** -- no ledger could be formed for it (``NotFormed``: one rollout, too few prompt
  groups, no scores under the previous policy, ...) or its sample fails a premise of the
  estimate (``PairedLedger.premise``: heavy-tailed weights, too few effective samples). No book
  states a number or a direction for it.
* **usable** -- every other step pair: its dz can be read.
* **priced** -- usable, and at least one feature varies in its sample, so KL_min is computed.
* **resolved** -- priced, and Benjamini-Hochberg at q = 0.05 over the priced step pairs rejects
  "the features bought nothing of this update" (the cost book's per-row test: the F-test of the
  within-group regression of the log-ratio on the features, paired; Hotelling's T^2, unpaired).
* **identified** (a cell: a feature at a usable step pair) -- the feature varies within some
  prompt group of the sample (its standard error is positive); a feature constant in every
  group has a movement the sample cannot see, and is shown as not identified, never as 0.
* **moved** (a cell) -- identified, and BH at q = 0.05 over every identified cell rejects
  dz = 0 (t on G - 1 degrees of freedom where prompt groups are the units).

Shares of KL_min are summed over the resolved step pairs only: a share of an unresolved row is
noise and is never stated as a finding.

**What leads η on the first screen** (``headline_of``: single updates, or windows of consecutive
updates) is decided here too, once, and read by the card, the cost book and report.json.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from scipy import special

from reward_lens.measure.efficiency import eta as _eta
from reward_lens.measure.efficiency.eta import FDR_Q, benjamini_hochberg
from reward_lens.measure.ledger.price import ledger_arrays

# Words for the reasons a step pair is refused (``NotFormed.reason`` and the premises).
REASONS = {
    "no_logp_prev": "no scores under the previous policy",
    "prev_step": "scored under more than one earlier policy",
    "few_groups": "fewer than 2 prompt groups of 2 or more rollouts",
    "one_rollout": "a step with one rollout",
    "heldout_unscored": "held-out completions not scored under both policies",
    "partly_scored_group": "a prompt group scored under the previous policy on some rollouts only",
    "not_measured": "not measured by the tap under its cost budget",
    "heavy_tails": "importance weights too heavy-tailed",
    "low_ess": "too few effective samples",
    "sampler_mismatch": "rollouts sampled by an engine (vLLM) that departs from the policy",
    "no_token_kl": "no token-level KL along the samples",
}


@dataclass(frozen=True)
class Decisions:
    names: tuple[str, ...]
    ledger: str  # "paired" | "unpaired" | "none"
    refused: Mapping[tuple[int, int], str]  # step pair -> reason (a key of REASONS)
    usable: tuple[tuple[int, int], ...]  # in step order
    delta_z: np.ndarray  # (U, k) dz of each usable step pair, feature units
    se: np.ndarray  # (U, k)
    t: np.ndarray  # (U, k) dz / SE, NaN where not identified
    p: np.ndarray  # (U, k) two-sided p of dz = 0, NaN where not identified
    identified: np.ndarray  # (U, k) bool
    moved: np.ndarray  # (U, k) bool: BH over the identified cells
    priced: tuple[tuple[int, int], ...]
    resolved: tuple[tuple[int, int], ...]
    kl_min: Mapping[tuple[int, int], float] = field(default_factory=dict)  # priced pair -> KL_min (the quadratic form)
    shares: Mapping[tuple[int, int], Mapping[str, float]] = field(default_factory=dict)  # priced pair -> shares (nats)
    # --ledger auto fell back to the unpaired ledger: why the paired one could not form, in words
    fallback: str | None = None
    # usable step pair -> D_t (nats per sequence), where one was measured: read on no feature, so
    # the same in every basis; every total of D_t on every page is ``d_t_total`` over ``spent``
    spent: Mapping[tuple[int, int], float] = field(default_factory=dict)
    # what leads eta on the first screen and in the cost book (``headline_of``); None where no cost
    # book was priced (``decide_from`` alone)
    headline: Headline | None = None

    # ---------------------------------------------------------------- counts, made here only
    @property
    def n_pairs(self) -> int:
        """Every step pair the record has a ledger for, or a refusal of one."""
        return len(self.usable) + len(self.refused)

    @cached_property
    def pairs_moved(self) -> tuple[tuple[int, int], ...]:
        """Usable step pairs at which at least one feature moved (per-feature tests)."""
        return tuple(p for p, row in zip(self.usable, self.moved) if row.any())

    def refused_by_reason(self) -> dict[str, list[tuple[int, int]]]:
        out: dict[str, list[tuple[int, int]]] = {}
        for pair, why in sorted(self.refused.items()):
            out.setdefault(why, []).append(pair)
        return out

    def cells_moved(self, feature: str) -> int:
        return int(self.moved[:, self.names.index(feature)].sum()) if len(self.usable) else 0

    def cells_not_identified(self) -> int:
        return int((~self.identified).sum())

    @cached_property
    def d_t_total(self) -> float | None:
        """D_t summed over every usable step pair that has one (nats per sequence), in step order;
        None where none has: the run's spend, the one total the card and every book quote."""
        return float(sum(self.spent.values())) if self.spent else None

    @property
    def d_t_updates(self) -> int:
        """The updates ``d_t_total`` is over."""
        return len(self.spent)

    @cached_property
    def d_t_median(self) -> float | None:
        return float(np.median(list(self.spent.values()))) if self.spent else None

    @cached_property
    def resolved_kl_min(self) -> float:
        """KL_min summed over the resolved step pairs (nats per sequence), in step order."""
        return float(sum(self.kl_min[p] for p in self.resolved))

    @cached_property
    def resolved_shares(self) -> dict[str, float] | None:
        """Each feature's share of KL_min over the resolved step pairs (fractions summing to 1),
        or None when no step pair is resolved: the one place a share is computed."""
        total = self.resolved_kl_min
        if not self.resolved or not total > 0:
            return None
        sums = {n: sum(self.shares[p].get(n, 0.0) for p in self.resolved) for n in self.names}
        return {n: v / total for n, v in sums.items()}

    def leads(self, feature: str) -> int:
        """Resolved step pairs whose largest share is ``feature``'s."""
        return sum(max(self.shares[p], key=self.shares[p].get) == feature for p in self.resolved if self.shares[p])

    def summary(self) -> dict[str, int | str]:
        """The counts every sentence on the page takes its numbers from."""
        return {"ledger": self.ledger, "fallback": self.fallback, "step_pairs": self.n_pairs,
                "usable": len(self.usable), "d_t_updates": self.d_t_updates,
                "refused": len(self.refused), "priced": len(self.priced), "resolved": len(self.resolved),
                "moved": len(self.pairs_moved), "cells": int(self.identified.size),
                "cells_identified": int(self.identified.sum()), "cells_moved": int(self.moved.sum())}


def t_dof(lg, k: int) -> np.ndarray:
    """The degrees of freedom of each feature's t test of a ledger's dz: the paired ledger's own
    (Welch-Satterthwaite over its (group, side) strata, where its SE has them), else its prompt
    groups less one; 0 (a normal test) with one group or none."""
    dof = getattr(lg, "dof", None)
    groups = float(getattr(lg, "n_groups", 0))
    fallback = groups - 1 if groups > 1 else 0.0
    if dof is None:
        return np.full(k, fallback)
    dof = np.asarray(dof, dtype=np.float64)
    return np.where(np.isfinite(dof) & (dof > 0), dof, fallback)


def t_dofs(ledgers: Sequence, k: int) -> np.ndarray:
    """``t_dof`` of each ledger (L, k): where every ledger has its own degrees of freedom, one
    ``where`` over them all (the same choice of each entry); else ledger by ledger."""
    dof = [getattr(lg, "dof", None) for lg in ledgers]
    if not ledgers or any(d is None for d in dof):
        return np.array([t_dof(lg, k) for lg in ledgers])
    dof = np.array(dof, dtype=np.float64)
    if dof.shape != (len(ledgers), k):
        return np.array([t_dof(lg, k) for lg in ledgers])
    groups = np.array([float(getattr(lg, "n_groups", 0)) for lg in ledgers], dtype=np.float64)
    fallback = np.where(groups > 1, groups - 1, 0.0)[:, None]
    return np.where(np.isfinite(dof) & (dof > 0), dof, fallback)


def decide(priced_run, names: Sequence[str]) -> Decisions:
    """The decisions of a priced run (``efficiency.of_run.PricedRun``): its ledgers, the cost
    book's KL_min rows (their BH decision) and the step pairs that could not be formed."""
    if priced_run is None:
        return decide_from([], names, ledger="none")
    d = decide_from(priced_run.ledgers, names, ledger=priced_run.ledger, not_formed=priced_run.not_formed,
                    series=priced_run.book.kl_min if priced_run.book is not None else None,
                    spent=priced_run.spent)
    if priced_run.book is not None:
        d = dataclasses.replace(d, headline=headline_of(priced_run.book, d))
    fb = priced_run.fallback
    if fb is None:
        return d
    words = f"{REASONS.get(fb.reason, fb.reason)} at every step (step {fb.step} has {fb.count})"
    return dataclasses.replace(d, fallback=words)


def decide_from(ledgers: Sequence, names: Sequence[str], *, ledger: str = "unpaired",
                not_formed: Mapping | None = None, series=None, spent: Mapping | None = None) -> Decisions:
    """The decisions of ``ledgers`` (with the step pairs that could not be formed, the cost
    book's KL_min series where there is one: its premises and its BH decision, and each step
    pair's D_t, ``PricedRun.spent``, kept for the usable step pairs)."""
    names = tuple(names)
    k = len(names)
    refused: dict[tuple[int, int], str] = {}
    for pair, why in (not_formed or {}).items():
        refused[tuple(pair)] = why.reason
    if series is not None:
        refused.update({tuple(p): why for p, why in series.premises.items() if why != "no_token_kl"})
    ledgers = list(ledgers) if ledgers is not None else []
    arrays = ledger_arrays(ledgers) if ledgers else None
    pairs = [tuple(p) for p in arrays.step_pairs.tolist()] if arrays is not None else []
    keep = np.array([p not in refused for p in pairs], dtype=bool)
    usable = tuple(p for p, ok in zip(pairs, keep) if ok)
    if arrays is not None and len(usable):
        dz, se = arrays.delta_z[keep], arrays.se[keep]
        dofs = t_dofs([lg for lg, ok in zip(ledgers, keep.tolist()) if ok], k)
    else:
        dz = se = np.zeros((0, k))
        dofs = np.zeros((0, k))
    identified = se > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(identified, dz / np.where(identified, se, 1.0), np.nan)
        p = 2 * np.where(dofs > 0, special.stdtr(np.maximum(dofs, 1), -np.abs(t)), special.ndtr(-np.abs(t)))
    p = np.where(identified, p, np.nan)
    moved = np.zeros(identified.shape, dtype=bool)
    moved[identified] = benjamini_hochberg(p[identified], FDR_Q)
    priced, resolved, kl, shares = [], [], {}, {}
    cols = series.columns if series is not None else None
    if cols is not None:  # the columns as lists once: 10,000 rows read element by element otherwise
        on_rows, share_rows = cols.priced.tolist(), cols.shares.tolist()
        for pair, on_row, share_row, kl_i, res in zip((tuple(q) for q in cols.step_pair.tolist()), on_rows,
                                                      share_rows, cols.kl_min.tolist(), cols.resolved.tolist()):
            if pair in refused or not any(on_row):
                continue
            priced.append(pair)
            kl[pair] = kl_i
            shares[pair] = {n: v for n, v, on in zip(cols.names, share_row, on_row) if on}
            if res:
                resolved.append(pair)
    ledger = ledger if ledgers or not_formed else "none"
    kept = set(usable)
    spent = {tuple(q): float(v) for q, v in (spent or {}).items() if tuple(q) in kept}
    return Decisions(names, ledger, refused, usable, dz, se, t, p, identified, moved, tuple(priced), tuple(resolved),
                     kl, shares, spent=dict(sorted(spent.items())))


# ------------------------------------------------------------------------ what leads eta
# Windows are pooled until their eta's 95 % interval is at most this fraction of the run's eta either
# way (half its width): a window whose eta is the run's then reads it with a lower end at half of
# it, resolved from 0. The target is set by the run's eta, once, and a window is closed on its
# interval's width alone, not on whether its eta clears 0: windows closed where their own eta first
# clears 0 are selected on their own size and lean high, as the resolved rows do (issue 62, item 5).
# The width still reads the estimate a little (the delta method's SE grows with eta, the bias bound
# with the jackknife's correction): a far weaker selection than on the lower end itself.
# Why not ``--window adaptive`` (windows closed where Fisher's combination of the updates' p-values
# falls below FDR_Q): at the tap's default budget an update is read on ~3 prompt groups of 2, its
# F-test has fewer residual degrees of freedom than features and reads p = 1, and no window closes
# (tests/fixtures/grpo_run/windowed: p = 1 at 20 of its 22 updates).
WINDOW_PRECISION = 0.5
# Single updates lead while at least this share of the priced ones is resolved from noise (the
# book's per-update decision, BH at FDR_Q): most of the run is then read update by update. Below it
# (0 of 22 on tests/fixtures/grpo_run/windowed, at the tap's default budget, where the per-update
# test has 3 prompt groups of 2 to read), the first screen reads eta over windows.
ROWS_RESOLVED_SHARE = 0.5


@dataclass(frozen=True)
class EtaWindow:
    """eta over consecutive updates pooled as one ratio of sums (``eta.window``: sum KL_jk / sum D_t,
    the members' jackknife covariances added -- a paired ledger reads each update on samples of its
    own, so no sample is counted twice), with its 95 % interval.

    ``first``..``last``: the steps it spans (its first update's t, its last one's t+1); ``updates``:
    the priced updates pooled in it. An update the window spans but does not pool -- not measured by
    the tap under its budget, refused, or with nothing priced -- adds nothing to either sum, as it
    adds nothing to the run's eta: where ``updates`` < ``span`` the window's eta is that of the
    updates eta is read on in its span (the tap chooses which it measures by step index and timing,
    never by a value; a refused or unpriced update is left out as the run's eta leaves it out)."""

    first: int
    last: int
    updates: int
    eta: float  # debiased, dimensionless
    interval: tuple[float, float] | None  # 95 %; None where not finite
    kl_min: float  # debiased sum, nats per sequence
    d_t: float  # sum of D_t, nats per sequence
    short: bool = False  # the run's last updates, which never reached the target half-width

    @property
    def span(self) -> int:
        """The updates between ``first`` and ``last``, pooled or not."""
        return self.last - self.first

    @property
    def resolved(self) -> bool:
        """eta resolved from 0: its interval's lower end is above 0."""
        return self.interval is not None and self.interval[0] > 0


@dataclass(frozen=True)
class Headline:
    """What leads eta on the first screen and in the cost book: ``lead`` "rows" (the book's own rows:
    single updates by default) or "windows" (``windows``, the priced updates in step order cut into
    consecutive windows, each pooled until its interval's half-width is at most ``target``; cut only
    where they lead). ``why`` says which rule decided it (a key; its words are the templates'):

    * ``rows_resolve`` -- at least ``ROWS_RESOLVED_SHARE`` of the priced updates are resolved from
      noise (``Decisions.resolved``): single updates lead;
    * ``rows_precise`` -- the single updates' intervals are already that narrow (median half-width
      ``row_half_width`` at most ``target``): they lead;
    * ``windows`` -- neither, and windows lead;
    * ``never_precise`` -- no window short of the whole run reaches the target: the run's eta is the
      only pooled number (it stays on the page in every case);
    * ``run_not_positive`` -- the run's eta (its point) is not above 0: there is no eta to size
      the windows by, and no window is read. A run whose eta is positive but not resolved over the
      whole run is windowed still: eta may be resolved in a phase of it (the target is then a
      precision no window may reach, and ``never_precise`` says so);
    * ``unpaired`` -- the unpaired ledger reads update (t, t+1) from step t's and step t+1's
      rollouts, so consecutive updates share a step's rollouts: pooled as independent they would
      count those rollouts twice, and no window is formed;
    * ``windowed_book`` -- the book's rows are already windows (``--window``);
    * ``few`` -- fewer than two updates are priced."""

    lead: str  # "rows" | "windows"
    why: str
    target: float | None = None  # half-width the windows are pooled to (dimensionless, eta's units)
    row_half_width: float | None = None  # median half-width of the single updates' intervals
    windows: tuple[EtaWindow, ...] = ()

    @property
    def resolved(self) -> int:
        """Windows whose eta is resolved from 0."""
        return sum(w.resolved for w in self.windows)


def headline_of(book, d: Decisions | None = None) -> Headline:
    """What leads eta: single updates, where most of them resolve (``d``: the run's decisions, whose
    per-update resolution is counted) or their intervals are precise enough; else windows of
    consecutive updates pooled until their interval is precise enough to resolve the run's eta
    (``WINDOW_PRECISION``). ``book``: the cost book
    (``CostBook``), whose priced rows are the updates eta is read on and whose run-level eta sets the
    target. Windows are cut greedily in step order: members are added until the window's
    half-width is at most the target, then a new window starts; the last members, if they never
    reach it, are a window of their own that falls short (``EtaWindow.short``), stated as such. A
    window of one update is that update's own row (its interval as the book states it)."""
    if book.window != 1:
        return Headline("rows", "windowed_book")
    if book.ledger != "paired":
        return Headline("rows", "unpaired")
    est = book.estimates.sorted_columns()
    if len(est) < 2:
        return Headline("rows", "few")
    run = _eta.run_level(est)
    if not (run.eta_debiased > 0 and math.isfinite(run.eta_debiased)):
        return Headline("rows", "run_not_positive")
    target = WINDOW_PRECISION * run.eta_debiased
    lo, hi = est.interval()  # every row's, as its row states it (the columns' own: one call for all)
    halves = ((hi - lo) / 2)[est.estimable]
    row_half = float(np.median(halves)) if len(halves) else math.inf
    if d is not None and d.priced and len(d.resolved) >= ROWS_RESOLVED_SHARE * len(d.priced):
        return Headline("rows", "rows_resolve", target, row_half)
    if row_half <= target:
        return Headline("rows", "rows_precise", target, row_half)
    cuts = _cuts(est, target)
    if not any(met for _, _, met in cuts) or len(cuts) < 2:
        return Headline("rows", "never_precise", target, row_half)
    return Headline("windows", "windows", target, row_half, _windows_of(est, cuts))


# Every start's candidate windows up to this many updates long are sized at once (``_first_ends``: one
# call of the intervals for all of them); a window that needs more is searched from its start twice
# as far, and so on (``_candidates``). Windows are rarely long, so the search is near linear in the
# updates: 10,000 of them in a fraction of a second.
LOOK_AHEAD = 32


def _cuts(est, target: float) -> list[tuple[int, int, bool]]:
    """[a, b) of each window of the rows ``est`` (``EtaColumns``, in step order) and whether it met
    ``target``: the first end, from each start in turn, at which the pooled half-width is at most
    ``target`` (a window of one: its row's own interval, which states none where the row has none);
    the last rows, where they never reach it, a window of their own that did not."""
    n = len(est)
    lo, hi = est.interval()
    own = np.where(est.estimable, (hi - lo) / 2, np.inf)
    first = _first_ends(est, own, target)
    cuts: list[tuple[int, int, bool]] = []
    start = 0
    while start < n:
        end = start + int(first[start]) + 1 if first[start] >= 0 else None
        ahead = 2 * LOOK_AHEAD
        while end is None and start + ahead // 2 < n:  # past the first look: further, twice as far each time
            stop = min(n, start + ahead)
            ok = _candidates(est, start, stop, target)
            ok[0] = own[start] <= target
            met = np.flatnonzero(ok)
            if len(met):
                end = start + int(met[0]) + 1
            ahead *= 2
        cuts.append((start, n if end is None else end, end is not None))
        start = n if end is None else end
    return cuts


def _sums(x: np.ndarray, width: int) -> np.ndarray:
    """Running sums of ``x`` from every start, ``width`` long: entry [s, ..., j] = x[s] + ... +
    x[s + j] added in order (``np.cumsum`` along each start's row, as ``window``'s sums run), with
    zeros past the end."""
    padded = np.concatenate([x, np.zeros((width - 1, *x.shape[1:]), dtype=np.float64)])
    return np.cumsum(np.lib.stride_tricks.sliding_window_view(padded, width, axis=0), axis=-1)


def _met(est, target: float, k, kd, d, cov, dof, tail, shape: tuple[int, int] | None = None) -> np.ndarray:
    """Whether each window, given its sums (flat arrays; ``cov`` (m, 2, 2)), has a half-width at most
    ``target``: ``eta.window``'s estimate of each -- its own SE and degrees of freedom, its bias bound
    |sum KL - sum KL_jk| / sum D_t where paired, its tail -- and its interval as ``EtaColumns.interval``
    states it. The bias-aware half-width lies between t975 SE and bound + t975 SE (``bias_aware_halves``)
    and the width grows with it (``tail_low`` is monotone), so only the windows between those two are
    solved for it exactly (with ``shape`` (starts, ends): only those before each start's first window
    surely within the target; the later ones are of no use)."""
    m = len(k)
    bound = None
    if est.kind == "paired":
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = np.where((d > 0) & np.isfinite(d), np.abs(k - kd) / d, np.nan)
    cand = _eta.EtaColumns(
        step_pair=np.zeros((m, 2), dtype=np.int64), kind=est.kind, kl_min=k, kl_min_debiased=kd, d_t=d,
        p_value=np.full(m, np.nan), cov=cov, dof=dof, converged=np.ones(m, dtype=bool),
        steps=np.ones(m, dtype=np.int64), groups_varying=np.full(m, -1, dtype=np.int64), bias_bound=bound,
        d_t_tail=tail)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q975, q95 = _quantiles(dof)
        e, se = cand.eta_debiased, cand.se
        b = np.zeros(m) if bound is None else np.where(np.isnan(bound), 0.0, bound)
        # the bias-aware half's critical value c is at least t975 and b / SE + t95, at most b / SE + t975
        low, high = np.where(b > 0, np.maximum(q975 * se, b + q95 * se), q975 * se), b + q975 * se

        def width(half):
            lo = e - half
            return ((e + half) - (lo if tail is None else _eta.tail_low(lo, d, tail))) / 2

        surely = width(high) <= target
        maybe = (width(low) <= target) & ~surely
    if shape is not None:
        sure = surely.reshape(shape)
        last = np.where(sure.any(axis=1), sure.argmax(axis=1), shape[1])
        maybe = (maybe.reshape(shape) & (np.arange(shape[1])[None, :] < last[:, None])).reshape(-1)
    at = np.flatnonzero(maybe)
    if len(at):
        lo, hi = cand.take(at).interval()
        with np.errstate(invalid="ignore"):
            surely[at] = (hi - lo) / 2 <= target
    return surely


def _quantiles(dof: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """t's 97.5 % (``eta.t975s``, as the intervals read it) and 95 % quantiles on ``dof`` (the
    normal's where infinite or above ``eta.NORMAL_DOF``: t's is larger, so a lower bound still),
    each computed once per distinct value."""
    u, inv = np.unique(dof, return_inverse=True)
    normal = ~np.isfinite(u) | (u > _eta.NORMAL_DOF)
    q95 = np.where(normal, special.ndtri(0.95), special.stdtrit(np.where(normal, 1.0, u), 0.95))
    return _eta.t975s(u)[inv.reshape(-1)], q95[inv.reshape(-1)]


def _first_ends(est, own: np.ndarray, target: float) -> np.ndarray:
    """For every start s, the offset j of the first window [s, s + j] (at most ``LOOK_AHEAD`` long)
    whose half-width is at most ``target`` (j = 0: the row's own, ``own``); -1 where none is."""
    n = len(est)
    w = min(LOOK_AHEAD, n)
    with np.errstate(invalid="ignore"):
        first = own <= target
    if w < 2:
        return np.where(first, 0, -1)
    # windows of two members or more: offsets 1 .. w-1 of every start
    k, kd, d, dof = (_sums(x, w)[:, 1:].reshape(-1) for x in (est.kl_min, est.kl_min_debiased, est.d_t, est.dof))
    cov = np.moveaxis(_sums(est.cov, w), -1, 1)[:, 1:].reshape(n * (w - 1), 2, 2)
    tail = None if est.d_t_tail is None else _sums(est.d_t_tail, w)[:, 1:].reshape(-1)
    more = _met(est, target, k, kd, d, cov, dof, tail, shape=(n, w - 1)).reshape(n, w - 1)
    met = np.concatenate([first[:, None], more], axis=1)
    met[np.arange(n)[:, None] + np.arange(w)[None, :] >= n] = False  # past the last update
    return np.where(met.any(axis=1), met.argmax(axis=1), -1)


def _candidates(est, start: int, stop: int, target: float) -> np.ndarray:
    """Whether each window [start, j], j in [start, stop), is within ``target``, its sums run in order."""
    part = slice(start, stop)
    sums = (np.cumsum(x[part], axis=0) for x in (est.kl_min, est.kl_min_debiased, est.d_t, est.cov, est.dof))
    return _met(est, target, *sums, None if est.d_t_tail is None else np.cumsum(est.d_t_tail[part]))


def _windows_of(est, cuts: list[tuple[int, int, bool]]) -> tuple[EtaWindow, ...]:
    """The windows' numbers, as every page states them: a single update's own row, else
    ``eta.window`` of its members; their intervals in one call (``EtaColumns.interval``, each
    estimate's own)."""
    es = [est.estimate(a) if b - a == 1 else _eta.window(est.take(np.arange(a, b))) for a, b, _ in cuts]
    cols = _eta.EtaColumns.of(es, est.kind)
    lo, hi = cols.interval()
    ok = np.isfinite(lo) & np.isfinite(hi) & cols.estimable
    return tuple(EtaWindow(first=int(e.step_pair[0]), last=int(e.step_pair[1]), updates=b - a,
                           eta=float(e.eta_debiased), interval=(float(l), float(h)) if on else None,
                           kl_min=float(e.kl_min_debiased), d_t=float(e.d_t), short=not met)
                 for e, (a, b, met), l, h, on in zip(es, cuts, lo.tolist(), hi.tolist(), ok.tolist()))


# ------------------------------------------------------------------------ verdicts, one per behaviour
# What the reward asked for of one behaviour (the cause book's selection gradient, decided by BH):
# ``directly`` -- its own gradient; ``jointly`` -- the joint test of a cluster of behaviours too
# collinear within prompt groups to tell apart (``COLLINEAR_R``): the reward asked for the cluster,
# and which member it asked for cannot be read; ``no``.
ASKED_DIRECTLY, ASKED_JOINTLY, NOT_ASKED = "directly", "jointly", "no"

# The verdict of one behaviour, by key. Its words are ``templates/report/verdict.j2``'s.
BOUGHT = "bought"  # asked for, moved as asked
NOT_BOUGHT = "not_bought"  # asked for, no net movement resolved
OTHER_WAY = "other_way"  # asked for, moved against what was asked
CARRIED = "carried"  # not asked for; selected through a correlated behaviour, and moved with that selection
AGAINST = "against"  # not asked for; selected through a correlated behaviour, and moved against that selection
COLLATERAL = "collateral"  # moved with no selection on it, direct or indirect
NEITHER = "neither"  # neither moved nor asked for
VERDICTS = (BOUGHT, NOT_BOUGHT, OTHER_WAY, CARRIED, AGAINST, COLLATERAL, NEITHER)
ASKED_VERDICTS = (BOUGHT, NOT_BOUGHT, OTHER_WAY)
# A declared target's own verdict (what the user wants of it, ``target: higher|lower``, not what the
# reward asks): it replaces the verdicts above for that behaviour on every page, so a target the
# reward selects against is never "asked for and bought" (issue 57).
TARGET_FELL_SELECTED_AGAINST = "target_against_selected"  # moved against what the user wants; the reward selected that way
TARGET_FELL = "target_against"  # moved against what the user wants
TARGET_SELECTED_AGAINST = "target_selected_against"  # no net change; the reward selects against what the user wants
TARGET_MET = "target_met"  # moved the way the user wants
TARGET_STILL = "target_still"  # no net change, and no selection against it
TARGET_VERDICTS = (TARGET_FELL_SELECTED_AGAINST, TARGET_FELL, TARGET_SELECTED_AGAINST, TARGET_MET, TARGET_STILL)
# The target verdicts that lead the first screen as a warning: the target moved or is pushed the wrong way.
TARGET_WRONG = (TARGET_FELL_SELECTED_AGAINST, TARGET_FELL, TARGET_SELECTED_AGAINST)
# A disagreement between what the reward selects and what moved: the agreement book's headline.
DISAGREEMENTS = (NOT_BOUGHT, OTHER_WAY, AGAINST, COLLATERAL, *TARGET_WRONG)


@dataclass(frozen=True)
class Selection:
    """What the reward selected of one behaviour, from the cause book: ``asked`` (directly,
    jointly, no) and the direction asked for (+1 more, -1 less; 0 when not asked); ``selected``:
    the selection differential (direct and indirect together) is resolved, in the direction of
    the sign of ``differential``."""

    asked: str
    direction: int
    jointly_with: tuple[str, ...]
    selected: bool
    differential: float | None


@dataclass(frozen=True)
class Verdict:
    """One behaviour's verdict, the same on every page: ``key`` (one of ``VERDICTS``), what the reward
    asked for of it (``asked``, ``direction``, ``jointly_with``) and its words."""

    key: str
    asked: str
    direction: int
    jointly_with: tuple[str, ...]
    words: str

    @property
    def asked_words(self) -> str:
        """What the cause book says of it: "yes (more)", "jointly with `b` (more)", "no"."""
        return _words("asked", self)


def _words(macro: str, v: Verdict | Selection) -> str:
    from reward_lens_spec.render import render_macro

    return render_macro("report/verdict.j2", macro, key=getattr(v, "key", None), asked=v.asked,
                        direction=v.direction, jointly_with=list(v.jointly_with))


def asked_words(sel: Selection) -> str:
    """What the reward asked for of a behaviour, in the words of every page: "yes (more)",
    "jointly with `b` (more)", "no" (the cause book's column, the verdict's first half)."""
    return _words("asked", sel)


def verdict_of(moved: bool, drift: float, sel: Selection) -> Verdict:
    """The verdict of one behaviour, sign-aware: a behaviour is judged against the direction the
    reward selects it in -- what it asked for of it (directly or jointly) where it asked, else its
    selection differential -- and one that moved against that direction is never carried along.

    - asked for: moved that way *bought*; not moved *not bought*; moved the other way *other way*;
    - not asked for, selected through a correlated behaviour: moved with the differential
      *carried along*; against it *moved against what the reward selects*;
    - moved with no resolved selection at all: *collateral*; else *neither*."""
    up = drift > 0
    if sel.asked != NOT_ASKED:
        key = NOT_BOUGHT if not moved else BOUGHT if up == (sel.direction > 0) else OTHER_WAY
    elif not moved:
        key = NEITHER
    elif not sel.selected or sel.differential is None or sel.differential == 0:
        key = COLLATERAL
    else:
        key = CARRIED if up == (sel.differential > 0) else AGAINST
    shell = Verdict(key, sel.asked, sel.direction if sel.asked != NOT_ASKED else 0, sel.jointly_with, "")
    return dataclasses.replace(shell, words=_words("verdict", shell))


def selection_direction(sel: Selection) -> int:
    """The direction the reward selects a behaviour in: what it asked for of it where it asked
    (directly or jointly), else the sign of its resolved selection differential; 0 for none."""
    if sel.asked != NOT_ASKED:
        return sel.direction
    if sel.selected and sel.differential:
        return 1 if sel.differential > 0 else -1
    return 0


def target_verdict_of(name: str, want: str, moved: bool, drift: float, sel: Selection) -> Verdict:
    """The verdict of a declared target (``want``: higher or lower), judged against what the user
    wants, not against what the reward asks: moved the wrong way (*fell*, or *rose* for a target
    wanted lower) -- with the reward selecting that way too, or not; no net change while the reward
    selects against it; moved as wanted; no net change. Words: ``templates/report/verdict.j2``'s
    ``target`` macro, naming the target."""
    sign = 1 if want == "higher" else -1
    against = selection_direction(sel) == -sign
    if moved and (drift > 0) == (sign > 0):
        key = TARGET_MET
    elif moved:
        key = TARGET_FELL_SELECTED_AGAINST if against else TARGET_FELL
    else:
        key = TARGET_SELECTED_AGAINST if against else TARGET_STILL
    from reward_lens_spec.render import render_macro

    words = render_macro("report/verdict.j2", "target", key=key, target=name, want=want, up=drift > 0)
    return Verdict(key, sel.asked, sel.direction if sel.asked != NOT_ASKED else 0, sel.jointly_with,
                   " ".join(words.split()))


def selection_of(direct: bool, jointly: bool, gradient: float | None, joint_direction: int,
                 collinear_with: Sequence[str], selected: bool, differential: float | None) -> Selection:
    """The cause book's decisions about one behaviour (its gradient's own test, its cluster's joint
    test, its differential's test) as a ``Selection``. A behaviour asked for directly is asked in
    the sign of its own gradient; one asked for jointly, in the sign its cluster's fitted reward
    covaries with it (``joint_direction``)."""
    if direct:
        return Selection(ASKED_DIRECTLY, 1 if (gradient or 0.0) > 0 else -1, (), selected, differential)
    if jointly:
        return Selection(ASKED_JOINTLY, joint_direction or 1, tuple(collinear_with), selected, differential)
    return Selection(NOT_ASKED, 0, (), selected, differential)
