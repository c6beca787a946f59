"""The cost book: KL_min per step pair, its Shapley shares, and efficiency eta = KL_min / D_t.

Seed section "The three numbers": KL_min = 1/2 dz^T G^-1 dz is the smallest policy
divergence consistent with the observed feature movement, so eta_t = KL_min / D_t lies in
[0, 1] whenever its premises hold. The book never hands out an eta outside that interval:
it refuses ENVELOPE_VIOLATED and names the failed premise. It never clips.

The half of the book that needs no denominator (KL_min, its shares, its noise floor) is
``kl_min_series``; ``cost_series`` adds D_t where some input supplies it, resolved through
``specs/books/cost.yaml``, and refuses RECORD_INCOMPLETE where none does.

Noise floor. Under sampling noise the observed dz~ has covariance Sigma_dz, and
E[1/2 dz~^T G^-1 dz~] = KL_min + 1/2 tr(G^-1 Sigma_dz). The second term is what a
quadratic form of pure noise reads; each row reports it. Under dz = 0 the form has standard
deviation sqrt(1/2 tr((G^-1 Sigma_dz)^2)) (Gaussian dz~), and a row *clears* the floor when
KL_min > floor + 2 sd, an approximately 95 % one-sided test.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from reward_lens.measure.efficiency import eta as _eta
from reward_lens.measure.efficiency.metric import MetricG, active_index
from reward_lens.measure.efficiency.shapley import EXACT_MAX_FEATURES, kl_min as quad_kl_min, shapley_shares
from reward_lens.measure.ledger.moderated import moderated_by_pair, t975
from reward_lens.measure.ledger.paired import MIN_ESS_PER_GROUP, SAMPLER_KL_MAX_SHARE, PairedLedger
from reward_lens.measure.ledger.price import Ledger, LedgerSeries, ledger_arrays
from reward_lens.record.reader import Run
from reward_lens_spec import Presence, Refusal, Subject, load_book, make_refusal, resolve

BOOK_ID = "cost"
# A row clears the noise floor when KL_min exceeds floor + NOISE_Z * sd(null): ~95 % one-sided.
NOISE_Z = 2.0
# The Shapley shares sum to KL_min exactly in exact arithmetic; in float64 the sum drifts with
# the conditioning of G (about 1e-12 relative for a well-conditioned G, 1e-4 at condition
# 1e10). A row whose share sum misses KL_min by more than this relative error says so
# (``shares_inexact``) rather than presenting shares that do not add up.
SHARE_SUM_RTOL = 1e-6
# A paired book of single step pairs (window 1) computes its rows as columns over all step pairs
# at once (``_paired_columns``); False makes them row by row, as a windowed or unpaired book's
# are: the same rows (tests/unit/test_cost_columns.py compares the two).
PAIRED_COLUMNS = True


@dataclass(frozen=True)
class KlMinRow:
    """KL_min of one step pair, in nats per sequence, with its shares and noise floor."""

    step_pair: tuple[int, int]
    kl_min: float
    shares: dict[str, float]
    noise_floor: float
    noise_sd: float
    clears_noise_floor: bool
    leading_feature: str | None
    leading_delta: float | None
    leading_se: float | None
    n_pre: int
    n_post: int
    unpriced_movement: dict[str, float] = field(default_factory=dict)  # excluded feature -> dz
    p_value: float = 1.0  # of "dz = 0" (unpaired: Hotelling T^2; paired: F-test of r on z within groups)
    shares_inexact: bool = False  # the share sum misses kl_min by more than SHARE_SUM_RTOL (ill-conditioned G)
    condition: float = 1.0  # condition number of the active correlation matrix of G
    resolved: bool = False  # rejected by Benjamini-Hochberg at FDR_Q across the series' rows
    kind: str = "unpaired"  # the ledger that made the row

    @property
    def nothing_priced(self) -> bool:
        """Every feature was excluded (constant or collinear): no movement could be priced."""
        return not self.shares

    @property
    def leading_t(self) -> float | None:
        if self.leading_delta is None or not self.leading_se:
            return None
        return self.leading_delta / self.leading_se


@dataclass(frozen=True, eq=False)
class KlMinColumns:
    """Every row of a KL_min series as arrays, entry i of each for row i: the rows are made from
    these when asked for (``KlMinSeries.rows``), while a report reads the columns whole."""

    names: tuple[str, ...]
    step_pair: np.ndarray  # (P, 2) int
    kl_min: np.ndarray  # (P,) nats per sequence
    noise_floor: np.ndarray  # (P,) nats per sequence
    noise_sd: np.ndarray  # (P,)
    clears_noise_floor: np.ndarray  # (P,) bool
    p_value: np.ndarray  # (P,)
    resolved: np.ndarray  # (P,) bool
    shares_inexact: np.ndarray  # (P,) bool
    condition: np.ndarray  # (P,)
    leading: np.ndarray  # (P,) index of the leading feature in names, -1 where none
    leading_delta: np.ndarray  # (P,) its dz (NaN where none)
    leading_se: np.ndarray  # (P,) its SE (NaN where none)
    n_pre: np.ndarray  # (P,) int
    n_post: np.ndarray  # (P,) int
    priced: np.ndarray  # (P, k) bool: the feature is in the row's active set
    shares: np.ndarray  # (P, k) nats per sequence, 0 where not priced
    delta_z: np.ndarray  # (P, k) the ledger's dz, feature units
    excluded: np.ndarray  # (P, k) bool: left out by the row's metric (constant or collinear)
    kind: tuple[str, ...]  # (P,) the ledger that made each row

    def __len__(self) -> int:
        return len(self.kl_min)

    def row(self, i: int) -> KlMinRow:
        names, lead = self.names, int(self.leading[i])
        priced, excluded, dz = self.priced[i].tolist(), self.excluded[i].tolist(), self.delta_z[i].tolist()
        return KlMinRow(
            step_pair=(int(self.step_pair[i, 0]), int(self.step_pair[i, 1])), kl_min=float(self.kl_min[i]),
            shares={n: v for n, v, on in zip(names, self.shares[i].tolist(), priced) if on},
            noise_floor=float(self.noise_floor[i]), noise_sd=float(self.noise_sd[i]),
            clears_noise_floor=bool(self.clears_noise_floor[i]),
            leading_feature=names[lead] if lead >= 0 else None,
            leading_delta=float(self.leading_delta[i]) if lead >= 0 else None,
            leading_se=float(self.leading_se[i]) if lead >= 0 else None,
            n_pre=int(self.n_pre[i]), n_post=int(self.n_post[i]),
            unpriced_movement={n: d for n, d, ex in zip(names, dz, excluded) if ex and d != 0},
            p_value=float(self.p_value[i]), shares_inexact=bool(self.shares_inexact[i]),
            condition=float(self.condition[i]), resolved=bool(self.resolved[i]), kind=self.kind[i])


@dataclass(frozen=True, eq=False)
class KlMinSeries(Sequence):
    """The denominator-free half of the book: a sequence of rows, plus any refusals. Its rows
    are held as ``columns`` (None when the series is refused) and made one by one on access."""

    columns: KlMinColumns | None
    refusals: tuple[Refusal, ...]
    metric: MetricG
    # paired ledgers: each priced step pair's estimate (exact KL_min, its jackknife, D_t), and the
    # step pairs whose sample fails a premise of the estimate, with the premise
    estimates: Mapping = field(default_factory=dict, repr=False)
    premises: dict = field(default_factory=dict, repr=False)

    @cached_property
    def rows(self) -> tuple[KlMinRow, ...]:
        return tuple(self.columns.row(i) for i in range(len(self))) if self.columns is not None else ()

    def __len__(self) -> int:
        return len(self.columns) if self.columns is not None else 0

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self.rows[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of a series of {n}")
        return self.columns.row(i % n)

    def __iter__(self) -> Iterator[KlMinRow]:
        return iter(self.rows)


ROW_STATUSES = ("resolved", "unresolved", "refused", "nothing_priced")


@dataclass(frozen=True)
class CostRow:
    """eta of one step pair, or of a window of consecutive step pairs (``steps`` > 1).

    ``efficiency`` is KL_min / D_t, always in [0, 1] (else the row is refused, not made).
    ``efficiency_null`` is what noise alone gives it in expectation and
    ``efficiency_debiased`` = (eta - null) / (1 - null) (may be below 0 when noise dominates);
    ``interval`` is a 95 % interval of the debiased value, None where the jackknife cannot give
    one (``no_interval``: one prompt group varies, ``EtaEstimate.estimable``). ``status`` is "resolved" when the
    book-wide Benjamini-Hochberg decision at FDR_Q rejects "the features explain none of the
    step", else "unresolved"; "nothing_priced" rows (every feature excluded) carry no eta.
    """

    step_pair: tuple[int, int]
    kl_min: float  # nats per sequence (paired: the exact I-projection; unpaired: 1/2 dz^T G^-1 dz)
    kl_spent: float  # D_t, nats per sequence
    efficiency: float | None  # in [0, 1], always; None when nothing was priced
    kl_spent_source: str
    resolved: bool
    shares: dict[str, float]
    status: str = "unresolved"
    efficiency_debiased: float | None = None
    efficiency_null: float | None = None
    interval: tuple[float, float] | None = None
    p_value: float | None = None
    ledger: str = "unpaired"
    steps: int = 1
    d_t_checks: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # source -> (nats, SE)
    d_t_disagrees: bool = False
    no_interval: bool = False  # priced, but one prompt group varies: eta has no interval (``EtaEstimate.estimable``)
    # D_t's standard error and 95 % interval: paired, the sample's own moderated across neighbouring
    # updates (``ledger.moderated``; a window's members' added), the upper end raised by the tail
    # its sample did not hold on a sharpened policy (``ledger.paired.tail_allowance``); unpaired,
    # the record's SE as recorded
    kl_spent_se: float | None = None
    kl_spent_interval: tuple[float, float] | None = None
    # nats the interval's upper end adds for that tail (a window's members' summed; 0 where none was
    # added, as on the unpaired ledger), None where there is no interval
    kl_spent_tail: float | None = None


class EtaEstimates(Mapping):
    """Step pair -> ``EtaEstimate`` of a book's priced rows, held as ``EtaColumns`` (an estimate is
    made when it is asked for; ``objects``, where the book made them one by one, are handed back
    as they are). ``columns`` and ``sorted_columns`` are what a report reads whole."""

    def __init__(self, columns: _eta.EtaColumns, objects: Sequence[_eta.EtaEstimate] | None = None):
        self.columns = columns
        self._objects = list(objects) if objects is not None else None
        # the last estimate of a step pair, as a dict built from them keeps it
        self._index = {pair: i for i, pair in enumerate(map(tuple, columns.step_pair.tolist()))}

    @classmethod
    def of(cls, estimates: Sequence[_eta.EtaEstimate], kind: str = "paired") -> EtaEstimates:
        return cls(_eta.EtaColumns.of(estimates, kind), estimates)

    def __getitem__(self, pair) -> _eta.EtaEstimate:
        i = self._index[tuple(pair)]
        return self._objects[i] if self._objects is not None else self.columns.estimate(i)

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def positions(self, pairs) -> np.ndarray:
        """The columns' entry of each step pair of ``pairs``."""
        return np.array([self._index[tuple(p)] for p in pairs], dtype=np.int64)

    def sorted_columns(self) -> _eta.EtaColumns:
        """One estimate per step pair, in step-pair order: ``sorted(self.values(), key=step_pair)``
        as columns."""
        at = np.fromiter(self._index.values(), dtype=np.int64, count=len(self._index))
        sp = self.columns.step_pair[at]
        return self.columns.take(at[np.lexsort((sp[:, 1], sp[:, 0]))] if len(at) else at)


@dataclass(frozen=True, eq=False)
class CostColumns:
    """Every row of a cost book as arrays, entry i of each for row i (rows in step-pair order):
    the rows are made from these when asked for (``CostBook.rows``), while a report reads the
    columns whole. An optional number of a row is its array's entry where its ``*_on`` mask
    holds, else None."""

    step_pair: np.ndarray  # (R, 2) int
    status: tuple[str, ...]
    kl_min: np.ndarray
    kl_spent: np.ndarray
    kl_spent_on: np.ndarray
    priced: np.ndarray  # efficiency, its null and debiased value and the p-value are stated
    efficiency: np.ndarray
    efficiency_null: np.ndarray
    efficiency_debiased: np.ndarray
    p_value: np.ndarray
    interval_on: np.ndarray
    interval_lo: np.ndarray
    interval_hi: np.ndarray
    source: tuple[str, ...]
    resolved: np.ndarray
    ledger: str
    steps: np.ndarray
    shares: Sequence[dict]
    d_t_checks: Sequence[dict]
    d_t_disagrees: np.ndarray
    no_interval: np.ndarray
    kl_spent_se_on: np.ndarray
    kl_spent_se: np.ndarray
    kl_spent_lo: np.ndarray
    kl_spent_hi: np.ndarray
    kl_spent_tail: np.ndarray  # what kl_spent_hi adds for the tail (stated where kl_spent_se_on)

    def __len__(self) -> int:
        return len(self.kl_min)

    def row(self, i: int) -> CostRow:
        on = bool(self.priced[i])
        return CostRow(
            step_pair=(int(self.step_pair[i, 0]), int(self.step_pair[i, 1])), kl_min=float(self.kl_min[i]),
            kl_spent=float(self.kl_spent[i]) if self.kl_spent_on[i] else None,
            efficiency=float(self.efficiency[i]) if on else None, kl_spent_source=self.source[i],
            resolved=bool(self.resolved[i]), shares=self.shares[i], status=self.status[i],
            efficiency_debiased=float(self.efficiency_debiased[i]) if on else None,
            efficiency_null=float(self.efficiency_null[i]) if on else None,
            interval=(float(self.interval_lo[i]), float(self.interval_hi[i])) if self.interval_on[i] else None,
            p_value=float(self.p_value[i]) if on else None, ledger=self.ledger, steps=int(self.steps[i]),
            d_t_checks=self.d_t_checks[i], d_t_disagrees=bool(self.d_t_disagrees[i]),
            no_interval=bool(self.no_interval[i]),
            kl_spent_se=float(self.kl_spent_se[i]) if self.kl_spent_se_on[i] else None,
            kl_spent_interval=(float(self.kl_spent_lo[i]), float(self.kl_spent_hi[i])) if self.kl_spent_se_on[i]
            else None,
            kl_spent_tail=float(self.kl_spent_tail[i]) if self.kl_spent_se_on[i] else None)

    def lists(self, name: str) -> list:
        """Column ``name`` as the rows hold it (None where a row states none): what a report's
        model takes, made from the arrays in one pass."""
        opt = {"kl_spent": ("kl_spent", self.kl_spent_on), "efficiency": ("efficiency", self.priced),
               "efficiency_null": ("efficiency_null", self.priced),
               "efficiency_debiased": ("efficiency_debiased", self.priced), "p_value": ("p_value", self.priced),
               "kl_spent_se": ("kl_spent_se", self.kl_spent_se_on),
               "kl_spent_tail": ("kl_spent_tail", self.kl_spent_se_on)}
        if name in opt:
            attr, on = opt[name]
            return [v if o else None for v, o in zip(getattr(self, attr).tolist(), on.tolist())]
        if name == "interval":
            return [(a, b) if o else None for a, b, o in zip(self.interval_lo.tolist(), self.interval_hi.tolist(),
                                                             self.interval_on.tolist())]
        if name == "kl_spent_interval":
            return [(a, b) if o else None for a, b, o in zip(self.kl_spent_lo.tolist(), self.kl_spent_hi.tolist(),
                                                             self.kl_spent_se_on.tolist())]
        if name == "step_pair":
            return [tuple(p) for p in self.step_pair.tolist()]
        if name in ("shares", "d_t_checks"):
            got = getattr(self, name)
            return [got[i] for i in range(len(self))]
        got = getattr(self, name)
        return list(got) if isinstance(got, tuple) else got.tolist()

    @classmethod
    def from_rows(cls, rows: Sequence[CostRow], ledger: str) -> CostColumns:
        """The columns of rows made one by one (a windowed or an unpaired book)."""
        n = len(rows)

        def floats(values) -> tuple[np.ndarray, np.ndarray]:
            values = list(values)
            return (np.array([np.nan if v is None else v for v in values], dtype=np.float64).reshape(n),
                    np.array([v is not None for v in values], dtype=bool).reshape(n))

        kl_spent, kl_spent_on = floats(r.kl_spent for r in rows)
        eff, priced = floats(r.efficiency for r in rows)
        se, se_on = floats(r.kl_spent_se for r in rows)
        return cls(
            step_pair=np.array([r.step_pair for r in rows], dtype=np.int64).reshape(n, 2),
            status=tuple(r.status for r in rows), kl_min=floats(r.kl_min for r in rows)[0],
            kl_spent=kl_spent, kl_spent_on=kl_spent_on, priced=priced, efficiency=eff,
            efficiency_null=floats(r.efficiency_null for r in rows)[0],
            efficiency_debiased=floats(r.efficiency_debiased for r in rows)[0],
            p_value=floats(r.p_value for r in rows)[0],
            interval_on=np.array([r.interval is not None for r in rows], dtype=bool).reshape(n),
            interval_lo=floats(r.interval[0] if r.interval else None for r in rows)[0],
            interval_hi=floats(r.interval[1] if r.interval else None for r in rows)[0],
            source=tuple(r.kl_spent_source for r in rows), resolved=np.array([r.resolved for r in rows], dtype=bool),
            ledger=ledger, steps=np.array([r.steps for r in rows], dtype=np.int64),
            shares=tuple(r.shares for r in rows), d_t_checks=tuple(r.d_t_checks for r in rows),
            d_t_disagrees=np.array([r.d_t_disagrees for r in rows], dtype=bool),
            no_interval=np.array([r.no_interval for r in rows], dtype=bool), kl_spent_se_on=se_on, kl_spent_se=se,
            kl_spent_lo=floats(r.kl_spent_interval[0] if r.kl_spent_interval else None for r in rows)[0],
            kl_spent_hi=floats(r.kl_spent_interval[1] if r.kl_spent_interval else None for r in rows)[0],
            kl_spent_tail=floats(r.kl_spent_tail for r in rows)[0])


@dataclass(frozen=True, eq=False)
class CostBook:
    """The book's rows, held as ``columns`` (made one by one on access: ``rows``), its refusals,
    its KL_min half, and the estimate of each priced row (``_estimates``)."""

    columns: CostColumns
    refusals: tuple[Refusal, ...]
    kl_min: KlMinSeries
    run_id: str | None = None
    ledger: str = "unpaired"
    window: int | str = 1
    _estimates: EtaEstimates | None = field(default=None, repr=False, compare=False)

    @cached_property
    def rows(self) -> tuple[CostRow, ...]:
        return tuple(self.columns.row(i) for i in range(len(self.columns)))

    @property
    def estimates(self) -> EtaEstimates:
        """The estimate of each priced row (windows: of each window), by step pair."""
        return self._estimates if self._estimates is not None else EtaEstimates.of([], self.ledger)

    @property
    def resolved_rows(self) -> tuple[CostRow, ...]:
        return tuple(self.columns.row(i) for i in np.flatnonzero(self._status_is("resolved")).tolist())

    def _status_is(self, status: str) -> np.ndarray:
        return np.array([s == status for s in self.columns.status], dtype=bool).reshape(len(self.columns))

    def counts(self) -> dict[str, int]:
        """Rows of each status; refused counts the step pairs the refusals name."""
        out = {k: 0 for k in ROW_STATUSES}
        for s in self.columns.status:
            out[s] += 1
        out["refused"] = sum(len(r.subject.step_pairs) for r in self.refusals)
        return out

    def headline(self) -> tuple[float | None, tuple[float, float] | None]:
        """Median debiased eta over resolved rows with an interval only, with its 95 % interval
        (None when there is none). Selected on significance, so it leans high: ``run_level`` is the
        headline."""
        est = self.estimates
        pairs = self.columns.step_pair[self._status_is("resolved")]
        return _eta.headline(est.columns.take(est.positions(pairs.tolist())))

    def run_level(self) -> _eta.EtaEstimate | None:
        """The run's efficiency: sum KL_min / sum D_t over every priced row, resolved or not
        (``eta.run_level``), or None when no row is priced."""
        return _eta.run_level(self.estimates.sorted_columns())

    @property
    def false_discoveries_expected(self) -> float:
        """Benjamini-Hochberg bounds the expected share of false discoveries by FDR_Q, so of
        the resolved rows at most this many are expected to be noise."""
        return _eta.FDR_Q * int(self._status_is("resolved").sum())

    def render(self, width: int = 90) -> str:
        """Plain text in the seed's layout: one block per refusal, then the computed rows."""
        blocks = [r.text(width) for r in self.refusals]
        if self.rows:
            c = self.counts()
            lines = [f"cost_series  {len(self.rows)} step pair(s) priced ({self.ledger} ledger): "
                     f"{c['resolved']} resolved, {c['unresolved']} unresolved, {c['nothing_priced']} nothing priced"]
            lines.append("    step pair      KL_min (nats)   D_t (nats)   efficiency   status")
            for r in self.rows:
                eff = f"{r.efficiency:>11.4f}" if r.efficiency is not None else f"{'-':>11}"
                lines.append(f"    {r.step_pair[0]:>5d}->{r.step_pair[1]:<6d}  {r.kl_min:>13.4g}  {r.kl_spent:>11.4g}"
                             f"  {eff}   {r.status}")
            blocks.append("\n".join(lines))
        if not blocks:
            blocks.append("cost_series  no step pairs")
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return self.render()


# ---------------------------------------------------------------------------- helpers
def _short(run_id: str | None) -> str:
    return (run_id[:12] + "...") if run_id else "(no run)"


def _subject(run_id: str | None, pairs: Sequence[tuple[int, int]]) -> Subject:
    return Subject(run_id=run_id, step_pairs=tuple(tuple(p) for p in pairs))


def _basis_refusal(ledgers: Sequence[Ledger], g: MetricG, run_id: str | None) -> Refusal | None:
    if isinstance(ledgers, LedgerSeries):  # one basis for all its ledgers
        bad = ledgers if ledgers.arrays.names != g.names and len(ledgers) else []
    else:
        bad = [lg for lg in ledgers if lg.names != g.names]
    if not bad:
        return None
    a, b = bad[0].names, g.names
    pos = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    return make_refusal("UNIT_MISMATCH", load_book(BOOK_ID), _subject(run_id, [lg.step_pair for lg in bad]), {
        "kind": "basis", "n_pairs": len(bad), "run": _short(run_id),
        "ledger_names": list(a), "metric_names": list(b), "position": pos,
        "ledger_basis": getattr(a, "basis_id", None), "metric_basis": getattr(b, "basis_id", None),
        "same_set": sorted(a) == sorted(b),
    })


def _columns(ledgers: Sequence[Ledger], g: MetricG, paired_p: dict | None = None) -> KlMinColumns:
    """Rows for every ledger, each priced by the metric of its step (``g.for_step``), as
    columns; pairs that share an active set are computed together (one vectorised Shapley
    sweep, and the noise floors and Hotelling tests as batched matrix operations). ``paired_p``:
    the p-value of each paired row that was estimated (the jackknife test of its exact KL_min);
    a paired row without one is left out of the decision (its premise failed)."""
    names, n_pairs, k = g.names, len(ledgers), len(g.names)
    arrays = ledger_arrays(ledgers)
    ts = arrays.step_pairs[:, 0].tolist()
    dz_all, se_all, cov_all = arrays.delta_z, arrays.se, arrays.cov_delta
    g_all = g.matrices_of(ts) if ledgers else np.zeros((0, k, k))
    units_all = np.where(arrays.units > 0, arrays.units, arrays.n_pre + arrays.n_post)
    paired = (np.zeros(n_pairs, dtype=bool) if arrays.kind == "unpaired" else
              np.array([isinstance(lg, PairedLedger) for lg in ledgers], dtype=bool))
    groups: dict[tuple[str, ...], list[int]] = {}  # rows by the active set of their step
    for p, t in enumerate(ts):
        groups.setdefault(g.active_of(t), []).append(p)
    col = {"kl_min": np.zeros(n_pairs), "noise_floor": np.zeros(n_pairs), "noise_sd": np.zeros(n_pairs),
           "clears_noise_floor": np.zeros(n_pairs, bool), "shares_inexact": np.zeros(n_pairs, bool),
           "condition": np.ones(n_pairs), "leading": np.full(n_pairs, -1), "leading_delta": np.full(n_pairs, np.nan),
           "leading_se": np.full(n_pairs, np.nan), "priced": np.zeros((n_pairs, k), bool),
           "shares": np.zeros((n_pairs, k)), "excluded": np.zeros((n_pairs, k), bool)}
    by_excluded: dict[tuple[str, ...], list[int]] = {}  # rows by the features their step excludes
    for p, t in enumerate(ts):
        by_excluded.setdefault(tuple(g.excluded_of(t)), []).append(p)
    for key, rows in by_excluded.items():
        col["excluded"][np.ix_(rows, [names.index(n) for n in key])] = True
    pvals = np.ones(n_pairs)
    for active, members in groups.items():
        idx = active_index(names, active)
        rows = np.array(members)
        if not len(idx):  # nothing varies at this step: no movement can be priced
            pvals[rows] = np.nan  # not a test: left out of Benjamini-Hochberg
            continue
        dz = dz_all[rows][:, idx]
        se = se_all[rows][:, idx]
        gaa = g_all[rows][:, idx][:, :, idx]
        cov = cov_all[rows][:, idx][:, :, idx]
        units = units_all[rows]
        kl = np.atleast_1d(quad_kl_min(dz, gaa))
        shares = np.atleast_2d(shapley_shares(dz, gaa))
        m = np.linalg.inv(gaa) @ cov
        floor = 0.5 * np.trace(m, axis1=1, axis2=2)
        noise_sd = np.sqrt(np.clip(0.5 * np.einsum("pij,pji->p", m, m), 0.0, None))  # 0.5 tr(M M)
        sd = np.sqrt(np.einsum("pii->pi", gaa))
        ev = np.linalg.eigvalsh(gaa / (sd[:, :, None] * sd[:, None, :]))  # a correlation matrix: symmetric
        conds = np.abs(ev).max(axis=1) / np.abs(ev).min(axis=1)  # the 2-norm condition number, as cond()
        lead = np.argmax(shares, axis=1)
        unpaired = np.flatnonzero(~paired[rows])
        p_of = np.ones(len(rows))
        p_of[unpaired] = _eta.hotelling_p_many(dz[unpaired], cov[unpaired], units[unpaired],
                                               arrays.matched[rows][unpaired])
        for q in np.flatnonzero(paired[rows]).tolist():
            p_of[q] = (paired_p or {}).get(tuple(ledgers[members[q]].step_pair), np.nan)
        pvals[rows] = p_of
        has_lead = kl > 0
        q_lead = np.arange(len(rows))
        col["kl_min"][rows] = kl
        col["noise_floor"][rows] = floor
        col["noise_sd"][rows] = noise_sd
        col["clears_noise_floor"][rows] = kl > floor + NOISE_Z * noise_sd
        col["shares_inexact"][rows] = np.abs(shares.sum(axis=1) - kl) > SHARE_SUM_RTOL * np.maximum(kl, 1e-300)
        col["condition"][rows] = conds
        col["leading"][rows] = np.where(has_lead, idx[lead], -1)
        col["leading_delta"][rows] = np.where(has_lead, dz[q_lead, lead], np.nan)
        col["leading_se"][rows] = np.where(has_lead, se[q_lead, lead], np.nan)
        col["priced"][np.ix_(rows, idx)] = True
        col["shares"][np.ix_(rows, idx)] = shares
    priced = np.flatnonzero(~np.isnan(pvals))
    resolved = np.zeros(n_pairs, dtype=bool)
    resolved[priced] = _eta.benjamini_hochberg(pvals[priced])
    return KlMinColumns(
        names=names, step_pair=arrays.step_pairs, p_value=np.where(np.isnan(pvals), 1.0, pvals), resolved=resolved,
        n_pre=arrays.n_pre, n_post=arrays.n_post, delta_z=dz_all,
        kind=(arrays.kind,) * n_pairs if arrays.kind != "mixed" else tuple(lg.kind for lg in ledgers), **col)


def kl_min_series(ledgers: Sequence[Ledger], g: MetricG, *, run_id: str | None = None) -> KlMinSeries:
    """KL_min and its exact Shapley shares for every step pair. Needs no D_t."""
    refusal = _basis_refusal(ledgers, g, run_id)
    if refusal is not None:
        return KlMinSeries(None, (refusal,), g)
    if g.method == "fisher_kernel" and g.diagnostics.get("at_boundary"):
        from reward_lens.measure.efficiency.metric import RHO_MAX, RHO_MIN

        pairs = [lg.step_pair for lg in ledgers]
        ref = make_refusal("ENVELOPE_VIOLATED", load_book(BOOK_ID), _subject(run_id, pairs), {
            "premise": "damping_unidentified", "step_pair": list(pairs[0]) if pairs else [0, 0], "n_pairs": len(pairs),
            "run": _short(run_id), "rho": g.diagnostics["rho"], "rho_min": RHO_MIN, "rho_max": RHO_MAX, "n": g.n})
        return KlMinSeries(None, (ref,), g)
    widest = max([len(g.active)] + [len(g.active_of(t)) for t in g.by_step])
    if widest > EXACT_MAX_FEATURES:
        ref = make_refusal("LIMIT_EXCEEDED", load_book(BOOK_ID), _subject(run_id, [lg.step_pair for lg in ledgers]),
                           {"what": "exact Shapley shares", "limit": EXACT_MAX_FEATURES, "k": widest,
                            "run": _short(run_id)})
        return KlMinSeries(None, (ref,), g)
    missing = [tuple(p) for p in ledger_arrays(ledgers).step_pairs.tolist()
               if g.scope == "per_step" and p[0] not in g.by_step] if ledgers else []
    if missing:
        raise ValueError(f"the per-step metric has no estimate for the steps of pairs {missing[:5]}: build the "
                         "metric from the same StepSample list as the ledgers")
    estimates, premises, p_values = paired_row_estimates(ledgers, g)
    return KlMinSeries(_columns(ledgers, g, p_values), (), g, estimates=estimates, premises=premises)


def paired_row_estimates(ledgers: Sequence[Ledger], g: MetricG
                         ) -> tuple[EtaEstimates, dict[tuple[int, int], str],
                                    dict[tuple[int, int], float]]:
    """For the paired ledgers: the step pairs whose sample fails a premise, with the premise
    ("heavy_tails", "low_ess"); the p-value of every other step pair that prices a feature
    (``eta.rollout_test``); and, where the sample also has the token-level KL for a
    denominator, its estimate (``eta.paired_estimates``; "no_token_kl" is listed with the
    premises, though dz and its test stand)."""
    todo, untested, failed, p_values = [], [], {}, {}
    for lg in ledgers:
        if not isinstance(lg, PairedLedger):
            continue
        pair = tuple(lg.step_pair)
        premise = lg.premise()
        if premise:
            failed[pair] = premise
            continue
        idx = active_index(g.names, g.active_of(pair[0]))
        if not len(idx):
            continue
        if lg.kl is None:
            failed[pair] = "no_token_kl"
            untested.append((lg, idx))
            continue
        todo.append((lg, idx))
    p_values.update({tuple(lg.step_pair): p for (lg, _), p in zip(untested, _eta.rollout_tests(untested))})
    estimates = EtaEstimates(_eta.paired_estimate_columns(todo))
    p_values.update(zip(map(tuple, estimates.columns.step_pair.tolist()), estimates.columns.p_value.tolist()))
    return estimates, failed, p_values


def _supplied(run: Run | None, kl_spent: Mapping[int, float] | None, n_steps: int) -> dict[str, Presence]:
    sup = dict(run.fields()) if run is not None else {}
    if kl_spent:
        sup["kl_spent"] = Presence(len(kl_spent), max(n_steps, len(kl_spent)))
    return sup


def denominator_context(resolution, *, run_label: str, n_missing: int | None, n_total: int | None,
                        optimizer: str | None, betas: list[float], framework: str | None,
                        kl_spent_given: bool = False, audit: bool = False) -> dict[str, Any]:
    """The RECORD_INCOMPLETE context for the denominator, from a resolution: shared by the
    book (on a record) and the audit (on a logging config, before any run exists)."""
    status = resolution.status("denominator")
    return {
        "requirement": "denominator", "audit": audit, "run": run_label, "in_sample": 0,
        "n_missing": n_missing, "n_total": n_total, "framework": framework, "optimizer": optimizer,
        "betas": betas, "kl_spent_given": kl_spent_given,
        "alternatives": [{"id": a.id, "describe": a.describe, "missing": list(a.missing), "partial": list(a.partial)}
                         for a in status.alternatives],
        "near_misses": [{"field": nm.spec.field, "present": nm.present, "why": nm.spec.why,
                         "count": nm.presence.count if nm.presence else 0,
                         "of": nm.presence.of if nm.presence else 0,
                         "applies": nm.applies, "only_for": nm.spec.only_for_optimizers}
                        for nm in status.near_misses],
    }


def rollouts_context(*, run_label: str, steps_with_rollouts: int | None, steps: int | None,
                     logging_steps: int | None, framework: str | None, audit: bool = False) -> dict[str, Any]:
    return {"requirement": "rollouts", "audit": audit, "run": run_label, "steps_with_rollouts": steps_with_rollouts,
            "steps": steps, "logging_steps": logging_steps, "framework": framework}


def rollouts_refusal(run: Run, samples: Sequence[Any]) -> Refusal:
    """RECORD_INCOMPLETE when no two consecutive steps both have rollouts (no ledger at all)."""
    ctx = rollouts_context(run_label=_short(run.run_id), steps_with_rollouts=len(samples),
                           steps=int(len(np.union1d(run.steps, run.rollout_step_values))),
                           logging_steps=run.manifest.logging_steps, framework=run.manifest.framework.name)
    return make_refusal("RECORD_INCOMPLETE", load_book(BOOK_ID), _subject(run.run_id, []), ctx)


def run_denominator_context(run: Run | None, n_missing: int, total: int, resolution,
                            kl_spent_given: bool = False) -> dict[str, Any]:
    """The RECORD_INCOMPLETE context for a run's missing D_t (every book that needs D_t)."""
    ctx = denominator_context(
        resolution, run_label=_short(run.run_id if run is not None else None), n_missing=n_missing,
        n_total=total, optimizer=run.manifest.optimizer if run is not None else None,
        betas=sorted(set(run.telemetry_column("beta").values())) if run is not None else [],
        framework=run.manifest.framework.name if run is not None else None, kl_spent_given=kl_spent_given)
    ctx["in_sample"] = len(run.in_sample_d_t_steps) if run is not None else 0
    return ctx


def _denominators(ledgers: Sequence[Ledger], run: Run | None, kl_spent: Mapping[int, float] | None,
                  kl_spent_unit: str) -> tuple[dict[int, tuple[float, str]], Refusal | None]:
    """D_t per step from the caller or the record, in nats per sequence."""
    out: dict[int, tuple[float, str]] = {}
    # Window-mean telemetry (telemetry_per_step: false) carries no per-step D_t: a mean over a
    # logging window is not the divergence of the step it is filed under.
    if run is not None and run.manifest.telemetry_per_step:
        est = run.telemetry_column("kl_to_previous_estimator")
        for s, v in run.telemetry_column("kl_to_previous").items():
            out[s] = (float(v), f"record kl_to_previous ({est.get(s, 'estimator not recorded')})")
    if kl_spent:
        if kl_spent_unit == "nats_per_sequence":
            for s, v in kl_spent.items():
                # A KlEstimate (whitebox) carries its estimator; a bare number is the caller's.
                est = getattr(v, "estimator", None)
                out[int(s)] = (float(v), f"kl_spent ({est})" if est else "caller kl_spent")
        elif kl_spent_unit == "nats_per_token":
            # Exact only as total-nats / total-tokens over the same sequences: per sequence it
            # is that mean times the mean completion length. Without token counts, refuse.
            fields = run.fields() if run is not None else {}
            if "rollout.num_tokens" not in fields:
                return out, make_refusal("UNIT_MISMATCH", load_book(BOOK_ID),
                                         _subject(run.run_id if run else None, [lg.step_pair for lg in ledgers]),
                                         {"kind": "per_token", "run": _short(run.run_id if run else None),
                                          "n_pairs": len(ledgers)})
            tokens = run.read_rollouts(["num_tokens"])
            steps = tokens.column("step").to_numpy()
            counts = tokens.column("num_tokens").to_numpy(zero_copy_only=False).astype(float)
            uniq, inverse = np.unique(steps, return_inverse=True)
            means = np.bincount(inverse, weights=counts) / np.bincount(inverse)
            mean_tokens = dict(zip(uniq.tolist(), means.tolist()))
            for s, v in kl_spent.items():
                if int(s) + 1 in mean_tokens:
                    out[int(s)] = (float(v) * mean_tokens[int(s) + 1],
                                   "caller kl_spent (per token x mean completion tokens of step t+1)")
        else:
            raise ValueError(f"kl_spent_unit must be 'nats_per_sequence' or 'nats_per_token', not {kl_spent_unit!r}")
    return out, None


def cost_series(
    ledgers: Sequence[Ledger],
    g: MetricG,
    run_: Run | None = None,
    kl_spent: Mapping[int, float] | None = None,
    *,
    kl_spent_unit: str = "nats_per_sequence",
    window: int | str = 1,
) -> CostBook:
    """The cost book: eta_t = KL_min / D_t per step pair, or the refusals that replace it.

    Unpaired ledgers: D_t for the pair (t, t+1) is ``kl_spent[t]`` if given, else the record's
    ``kl_to_previous`` at step t (both nats per sequence; ``kl_spent_unit='nats_per_token'``
    converts exactly only with the record's token counts, and refuses UNIT_MISMATCH without
    them). Paired ledgers (``paired_ledger_series``) carry their own D_t, estimated on the
    same sample as the exact KL_min, so eta <= 1 by construction; the record's value and the
    token-level estimate are kept beside it as checks.

    ``window``: price W consecutive step pairs together as a ratio of sums, or "adaptive".
    Every row gets a status; "resolved" is decided across the book by Benjamini-Hochberg.
    """
    run_id = run_.run_id if run_ is not None else None
    book = load_book(BOOK_ID)
    kinds = {"unpaired"} if isinstance(ledgers, LedgerSeries) and len(ledgers) else {lg.kind for lg in ledgers}
    if len(kinds) > 1:
        raise ValueError("cost_series takes the ledgers of one ledger kind, not a mix of paired and unpaired")
    kind = kinds.pop() if kinds else "unpaired"
    series = kl_min_series(ledgers, g, run_id=run_id)
    if series.refusals:
        return CostBook(CostColumns.from_rows((), kind), series.refusals, series, run_id, ledger=kind, window=window)
    denoms, unit_refusal = _denominators(ledgers, run_, kl_spent, kl_spent_unit)
    if unit_refusal is not None:
        return CostBook(CostColumns.from_rows((), kind), (unit_refusal,), series, run_id, ledger=kind, window=window)
    pairs = [tuple(p) for p in ledger_arrays(ledgers).step_pairs.tolist()]
    place = {pair: q for q, pair in enumerate(pairs)}
    refusals: list[Refusal] = []
    missing = [pair for pair in pairs if kind == "unpaired" and pair[0] not in denoms]
    if missing:
        n_steps = len(run_.steps) if run_ is not None else len(ledgers)
        resolution = resolve(book, _supplied(run_, kl_spent, n_steps),
                             optimizer=run_.manifest.optimizer if run_ is not None else None)
        refusals.append(make_refusal("RECORD_INCOMPLETE", book, _subject(run_id, missing),
                                     run_denominator_context(run_, len(missing), len(ledgers), resolution, bool(kl_spent))))
    if kind == "paired" and window == 1 and PAIRED_COLUMNS:  # every row's numbers as arrays over all pairs at once
        columns, kept = _paired_columns(ledgers, series, run_, book, run_id, refusals)
        return CostBook(columns, tuple(refusals), series, run_id, ledger=kind, window=window, _estimates=kept)
    estimates: list[_eta.EtaEstimate] = []
    failed: dict[str, list[dict[str, Any]]] = {}  # paired step pairs whose sample fails a premise, by premise
    meta: dict[tuple[int, int], tuple[int, str, dict]] = {}  # row, D_t's source, D_t checks
    nothing: list[CostRow] = []
    # rows only where a denominator can price them (paired ledgers carry their own); a row is
    # made (series[i]) only to name a violation, the rest is read from the columns
    cols = series.columns
    kl_of, floor_of, p_of = cols.kl_min.tolist(), cols.noise_floor.tolist(), cols.p_value.tolist()
    priced_any = cols.priced.any(axis=1).tolist()
    # in step-pair order whatever the ledgers' order: windows are consecutive pairs, and each row
    # below finds the pairs its window covers by walking them in order
    wanted = sorted((i for i, pair in enumerate(pairs) if kind == "paired" or pair[0] in denoms), key=pairs.__getitem__)
    d_t_se = run_.telemetry_column("kl_to_previous_se") if run_ is not None and kind == "unpaired" else {}
    # each row's D_t SE: paired, the sample's own moderated across neighbouring updates; unpaired,
    # the record's as recorded where D_t is the record's (a caller's kl_spent has none here)
    spread = moderated_by_pair(ledgers) if kind == "paired" else {
        pair: (se, float("inf")) for pair in pairs if pair[0] in denoms and denoms[pair[0]][1].startswith("record")
        and (se := d_t_se.get(pair[0])) is not None and math.isfinite(se)}
    for i in wanted:
        pair = pairs[i]
        lg = ledgers[place[pair]]
        if kind == "paired":
            source = _paired_source(lg)
            premise = series.premises.get(pair)
            if premise is not None:
                failed.setdefault(premise, []).append(_premise_numbers(lg))
                continue
            d_t = lg.d_t
        else:
            d_t, source = denoms[pair[0]]
        if not priced_any[i]:
            d_se, d_iv, d_tail = _window_spread(d_t, [spread.get(pair)], [getattr(lg, "d_t_tail", None)])
            nothing.append(CostRow(pair, 0.0, d_t, None, source, False, {}, status="nothing_priced", ledger=kind,
                                   kl_spent_se=d_se, kl_spent_interval=d_iv, kl_spent_tail=d_tail))
            continue
        idx = active_index(g.names, g.active_of(pair[0]))
        if kind == "paired":
            # (a sample in which no priced feature varies within any prompt group has KL_min 0
            # whatever the step did: the within-group metric leaves such a feature out of the
            # step's active set, so that pair is ``nothing_priced`` above, as every decision reads it)
            est = series.estimates[pair]
            violation = _paired_envelope(series, i, lg, est)
        else:
            violation = _envelope(series[i], lg, d_t) if _outside(kl_of[i], d_t) else None
            est = None if violation else _eta.unpaired_estimate(
                lg, g.matrix_of(pair[0])[np.ix_(idx, idx)], idx, kl_of[i], floor_of[i], d_t, p_of[i],
                d_t_se.get(pair[0]) if source.startswith("record") else None)
        if violation is not None:
            refusals.append(make_refusal("ENVELOPE_VIOLATED", book, _subject(run_id, [pair]),
                                         {**violation, "run": _short(run_id), "source": source}))
            continue
        estimates.append(est)
        meta[pair] = (i, source, _d_t_checks(lg, est, run_, pair))
    refusals.extend(_failed_premises(book, run_id, failed))
    priced = _eta.windows(estimates, window)
    if kind == "paired" and window == 1:  # each row's SE pooled with its neighbouring updates' (``eta.moderate``)
        priced = _eta.moderate(_eta.EtaColumns.of(priced, kind)).estimates()
    decided = _eta.benjamini_hochberg([e.p_value for e in priced])
    rows: list[CostRow] = list(nothing)
    ordered = list(meta.values())  # in the order of ``estimates``, which ``windows`` keeps
    names = cols.names
    share_rows = cols.shares.tolist()
    priced_rows = cols.priced.tolist()
    i = 0
    for est, rej in zip(priced, decided):
        members = []  # the step pairs this window covers: the next ones, in order (linear, not a scan)
        while i < len(ordered) and pairs[ordered[i][0]][1] <= est.step_pair[1]:
            members.append(ordered[i])
            i += 1
        shares: dict[str, float] = {}
        for m in members:  # each row's shares of the features it priced, as the row holds them
            for f, v, on in zip(names, share_rows[m[0]], priced_rows[m[0]]):
                if on:
                    shares[f] = shares.get(f, 0.0) + v
        checks = members[0][2] if len(members) == 1 else {}
        d_se, d_iv, d_tail = _window_spread(est.d_t, [spread.get(pairs[m[0]]) for m in members],
                                            [getattr(ledgers[place[pairs[m[0]]]], "d_t_tail", None) for m in members])
        rows.append(CostRow(
            step_pair=est.step_pair, kl_min=est.kl_min, kl_spent=est.d_t, efficiency=est.eta,
            kl_spent_source=members[0][1], resolved=bool(rej), shares=shares,
            status="resolved" if rej else "unresolved", efficiency_debiased=est.eta_debiased,
            efficiency_null=est.eta_null, interval=est.interval() if est.estimable else None, p_value=est.p_value,
            ledger=kind, steps=est.steps, d_t_checks=checks, d_t_disagrees=_disagree(checks),
            no_interval=not est.estimable, kl_spent_se=d_se, kl_spent_interval=d_iv, kl_spent_tail=d_tail))
    rows.sort(key=lambda r: r.step_pair)
    return CostBook(CostColumns.from_rows(rows, kind), tuple(refusals), series, run_id, ledger=kind, window=window,
                    _estimates=EtaEstimates.of(priced, kind))


def _paired_columns(ledgers: Sequence[PairedLedger], series: KlMinSeries, run_: Run | None, book, run_id: str | None,
                    refusals: list[Refusal]) -> tuple[CostColumns, EtaEstimates]:
    """The rows of a paired book of single step pairs (window 1) as columns, computed over all step
    pairs at once: ``cost_series``'s rows, refusals (appended to ``refusals``, in its order: each
    envelope violation by step pair, then one per failed premise) and estimates, the same numbers
    (tests/unit/test_cost_columns.py holds it to the row-by-row definition)."""
    cols = series.columns
    pairs = [tuple(p) for p in cols.step_pair.tolist()]
    place = {pair: q for q, pair in enumerate(pairs)}
    lgs = [ledgers[place[pair]] for pair in pairs]
    n = len(pairs)
    premise = [series.premises.get(pair) for pair in pairs]
    failed: dict[str, list[dict[str, Any]]] = {}
    for i in [i for i, why in enumerate(premise) if why is not None]:
        failed.setdefault(premise[i], []).append(_premise_numbers(lgs[i]))
    ok = np.array([why is None for why in premise], dtype=bool).reshape(n)
    on = cols.priced.any(axis=1)
    # where each stated row's D_t comes from, in words (a row refused for its premise states none)
    source = dict(zip(np.flatnonzero(ok).tolist(), _paired_sources([lgs[i] for i in np.flatnonzero(ok).tolist()])))
    # D_t's SE: the sample's own moderated across neighbouring updates (``ledger.moderated``)
    spread = moderated_by_pair(ledgers)
    parts = [spread.get(pair) for pair in pairs]
    spread_on = np.array([x is not None for x in parts], dtype=bool).reshape(n)
    spread_se = np.array([x[0] if x is not None else np.nan for x in parts], dtype=np.float64).reshape(n)
    spread_dof = np.array([x[1] if x is not None else np.nan for x in parts], dtype=np.float64).reshape(n)
    # rows that price nothing: D_t as the ledger has it (None without the token KL)
    nothing = np.flatnonzero(ok & ~on)
    d_nothing = [lgs[i].d_t for i in nothing.tolist()]
    # rows that price something: the estimate, unless the envelope is violated
    todo = np.flatnonzero(ok & on)
    est = series.estimates.columns.take(series.estimates.positions([pairs[i] for i in todo.tolist()]))
    bad = est.outside_envelope
    for q in np.flatnonzero(bad).tolist():
        i = int(todo[q])
        violation = _paired_envelope(series, i, lgs[i], est.estimate(q))
        refusals.append(make_refusal("ENVELOPE_VIOLATED", book, _subject(run_id, [pairs[i]]),
                                     {**violation, "run": _short(run_id), "source": source[i]}))
    refusals.extend(_failed_premises(book, run_id, failed))
    kept, est = todo[~bad], est.take(~bad)
    est = _eta.moderate(est)  # each row's SE pooled with its neighbouring updates' (the intervals read it)
    decided = _eta.benjamini_hochberg(est.p_value)
    # the rows: those that price nothing, then the priced, put in step-pair order (as a stable sort)
    m, k = len(nothing), len(kept)
    at = np.concatenate([nothing, kept])
    order = np.lexsort((cols.step_pair[at, 1], cols.step_pair[at, 0])) if len(at) else np.zeros(0, dtype=np.int64)
    rows = at[order]
    d_spent = np.concatenate([np.array([np.nan if d is None else d for d in d_nothing], dtype=np.float64), est.d_t])
    d_spent_on = np.concatenate([np.array([d is not None for d in d_nothing], dtype=bool), np.ones(k, dtype=bool)])
    estimable = est.estimable
    lo, hi = est.interval()
    tails = np.array([np.nan if lgs[i].d_t_tail is None else lgs[i].d_t_tail for i in at.tolist()], dtype=np.float64)
    se, se_on, se_lo, se_hi, se_tail = _window_spreads(d_spent, spread_se[at], spread_dof[at], spread_on[at], tails)
    checks = _DtChecks.of(lgs, kept, est, run_)

    def cat(nothing_value, priced_values, dtype=np.float64) -> np.ndarray:
        return np.concatenate([np.full(m, nothing_value, dtype=dtype), np.asarray(priced_values, dtype=dtype)])[order]

    status = np.array(["nothing_priced"] * m + np.where(decided, "resolved", "unresolved").tolist(), dtype=object)
    columns = CostColumns(
        step_pair=cols.step_pair[rows], status=tuple(status[order].tolist()), kl_min=cat(0.0, est.kl_min),
        kl_spent=d_spent[order], kl_spent_on=d_spent_on[order], priced=cat(False, np.ones(k, dtype=bool), bool),
        efficiency=cat(np.nan, est.eta), efficiency_null=cat(np.nan, est.eta_null),
        efficiency_debiased=cat(np.nan, est.eta_debiased), p_value=cat(np.nan, est.p_value),
        interval_on=cat(False, estimable, bool), interval_lo=cat(np.nan, np.where(estimable, lo, np.nan)),
        interval_hi=cat(np.nan, np.where(estimable, hi, np.nan)), source=tuple(source[i] for i in rows.tolist()),
        resolved=cat(False, decided, bool), ledger="paired", steps=cat(1, est.steps, np.int64),
        shares=_RowShares(cols, np.where(order >= m, rows, -1)),
        d_t_checks=_RowsOf(checks, np.where(order >= m, order - m, -1)),
        d_t_disagrees=cat(False, checks.disagrees(), bool), no_interval=cat(False, ~estimable, bool),
        kl_spent_se_on=se_on[order], kl_spent_se=se[order], kl_spent_lo=se_lo[order], kl_spent_hi=se_hi[order],
        kl_spent_tail=se_tail[order])
    return columns, EtaEstimates(est)


def _failed_premises(book, run_id: str | None, failed: dict[str, list[dict[str, Any]]]) -> list[Refusal]:
    """One refusal per failed premise, in the order ``failed`` holds them: a sample without the
    token KL is RECORD_INCOMPLETE (``token_kl``), any other premise PREMISE_FAILED
    (``premise_refusal``)."""
    out = []
    for why, items in failed.items():
        subject = _subject(run_id, [tuple(h["step_pair"]) for h in items])
        if why == "no_token_kl":
            out.append(make_refusal("RECORD_INCOMPLETE", book, subject, {
                "requirement": "token_kl", "run": _short(run_id), "n_pairs": len(items), "pairs": items}))
        else:
            out.append(premise_refusal(book, run_id, why, items))
    return out


def _paired_sources(lgs: Sequence[PairedLedger]) -> list[str]:
    """``_paired_source`` of each ledger."""
    return [_paired_source(lg) for lg in lgs]


def _window_spreads(d_t: np.ndarray, se: np.ndarray, dof: np.ndarray, on: np.ndarray, tail: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_window_spread`` of rows of one member each (``on``: the member has an SE and degrees of
    freedom; ``tail`` its tail allowance, NaN adding nothing): the SE (sqrt of its square, as the
    window's sum of one), whether there is one, the interval's ends, and what the upper end adds."""
    with np.errstate(invalid="ignore"):
        has = on & np.isfinite(se) & (se > 0)
        out = np.sqrt(np.where(has, se * se, np.nan))
        f = np.where(has & (dof == dof) & (dof > 0), dof, np.nan)
        half = _t975s_moderated(f) * out
    add = np.zeros(len(d_t)) if tail is None else np.where(np.isfinite(tail), tail, 0.0)
    # a KL is never negative: the interval's lower end stops at 0; the upper adds the tail (``_window_spread``)
    return (out, has, np.where(has, np.maximum(d_t - half, 0.0), np.nan), np.where(has, d_t + half + add, np.nan),
            np.where(has, add, np.nan))


def _t975s_moderated(dof: np.ndarray) -> np.ndarray:
    """``ledger.moderated.t975`` of each entry: the normal's quantile where the degrees of freedom
    are NaN or infinite, else Student's t on at least one, the same ufunc on all of them at once
    (tests/unit/test_cost_columns.py holds it to ``t975`` of each): ``eta.t975s`` of each finite
    entry floored at one."""
    dof = np.asarray(dof, dtype=np.float64)
    return _eta.t975s(np.where(np.isfinite(dof), np.maximum(dof, 1.0), dof))


class _RowShares(Sequence):
    """Each cost row's shares, from the KL_min columns' row ``src[i]`` ({} where -1): the dict the
    row holds, made on access (a window of one adds each share to 0.0)."""

    def __init__(self, cols: KlMinColumns, src: np.ndarray):
        self.cols, self.src = cols, src.tolist()

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i):  # type: ignore[override]
        j = self.src[i]
        if j < 0:
            return {}
        c = self.cols
        return {f: 0.0 + v for f, v, on in zip(c.names, c.shares[j].tolist(), c.priced[j].tolist()) if on}


class _RowsOf(Sequence):
    """``items[src[i]]`` for each row i, {} where src is -1."""

    def __init__(self, items, src: np.ndarray):
        self.items, self.src = items, src.tolist()

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i):  # type: ignore[override]
        j = self.src[i]
        return {} if j < 0 else self.items[j]


@dataclass(frozen=True, eq=False)
class _DtChecks(Sequence):
    """``_d_t_checks`` of each priced paired row, as columns: the dicts are made on access."""

    token: list  # D_t the estimate divides by
    token_se: list  # sqrt of its jackknife variance
    plugin: list  # the same sample's plug-in
    record: list  # the record's kl_to_previous (None where it has none for the step pair)
    record_se: list

    @classmethod
    def of(cls, lgs: Sequence[PairedLedger], kept: np.ndarray, est: _eta.EtaColumns, run: Run | None) -> _DtChecks:
        k = len(kept)
        record, record_se = [None] * k, [None] * k
        if run is not None and run.manifest.telemetry_per_step:
            d_col, se_col = run.telemetry_column("kl_to_previous"), None
            for q, i in enumerate(kept.tolist()):
                pair = lgs[i].step_pair
                if pair[1] - pair[0] == 1:
                    rec = d_col.get(pair[0])
                    if rec is not None:
                        se_col = run.telemetry_column("kl_to_previous_se") if se_col is None else se_col
                        record[q], record_se[q] = float(rec), se_col.get(pair[0])
        with np.errstate(invalid="ignore"):
            token_se = np.sqrt(est.cov[:, 1, 1])
        return cls(est.d_t.tolist(), token_se.tolist(), [lgs[i].d_hat for i in kept.tolist()], record, record_se)

    def __len__(self) -> int:
        return len(self.token)

    def __getitem__(self, q):  # type: ignore[override]
        out = {"token_kl": (self.token[q], self.token_se[q]), "same_sample_plugin": (self.plugin[q], None)}
        if self.record[q] is not None:
            out["record"] = (self.record[q], self.record_se[q])
        return out

    def disagrees(self) -> np.ndarray:
        """``_disagree`` of each row's checks: vectorised, and worked out again row by row where
        the two sides of its inequality are too close for the order of its rounding to be moot."""
        k = len(self.token)
        has = np.array([r is not None and s is not None for r, s in zip(self.record, self.record_se)], dtype=bool)
        out = np.zeros(k, dtype=bool)
        if not has.any():
            return out
        v0, s0 = np.array(self.token)[has], np.array(self.token_se, dtype=np.float64)[has]
        v1 = np.array([r for r, h in zip(self.record, has.tolist()) if h], dtype=np.float64)
        s1 = np.array([s for s, h in zip(self.record_se, has.tolist()) if h], dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            lhs, rhs = np.abs(v1 - v0), D_T_DISAGREE_Z * np.sqrt(s0 * s0 + s1 * s1)
            sure = np.isfinite(lhs) & np.isfinite(rhs) & (np.abs(lhs - rhs) > 1e-9 * np.maximum(lhs, rhs))
        got = lhs > rhs
        idx = np.flatnonzero(has)
        for q in np.flatnonzero(~sure).tolist():  # the row's own arithmetic, exactly
            got[q] = _disagree(self[int(idx[q])])
        out[idx] = got
        return out


def _window_spread(d_t: float, parts: list[tuple[float, float] | None], tails: Sequence[float | None] = ()
                   ) -> tuple[float | None, tuple[float, float] | None, float | None]:
    """A row's D_t SE and 95 % interval from its members' (SE, dof) -- a window's members are
    separate samples, so their variances add; their moderated SEs share most of their pooled
    terms, so the window's degrees of freedom are its members' fewest, not Welch-Satterthwaite's
    sum over them. (None, None) where a member has none, and where the SE is 0: every pooled
    sample constant in its token KL says nothing of the spread, and states no interval rather
    than an exact one. The lower end stops at 0: D_t is a KL, never negative, so a t interval's
    reach below 0 says nothing (and cutting it there changes no coverage). The upper end adds the
    members' ``tails`` (``ledger.paired.tail_allowance``: what a sharpened policy's sample did not
    hold; a window's D_t is its members' sum, and so is their allowance; None adds nothing), and
    the third value says how much that added (None with the interval)."""
    if not parts or any(x is None or not (math.isfinite(x[0]) and x[0] > 0) for x in parts):
        return None, None, None
    se = math.sqrt(sum(s * s for s, _ in parts))
    dofs = [f for _, f in parts if f == f and f > 0]
    half = t975(min(dofs) if dofs else float("nan")) * se
    tail = float(sum(a for a in tails if a is not None and math.isfinite(a)))
    return se, (max(d_t - half, 0.0), d_t + half + tail), tail


def premise_refusal(book, run_id: str | None, premise: str, items: list[dict[str, Any]]) -> Refusal:
    """PREMISE_FAILED for the step pairs whose sample fails ``premise`` (``_premise_numbers`` of
    each): one refusal per premise, in every book that reads their dz."""
    return make_refusal("PREMISE_FAILED", book, _subject(run_id, [tuple(h["step_pair"]) for h in items]), {
        "premise": premise, "pairs": items, "run": _short(run_id), "step_pair": items[0]["step_pair"],
        "min_ess": MIN_ESS_PER_GROUP, "sampler_share": SAMPLER_KL_MAX_SHARE})


def _paired_source(lg: PairedLedger) -> str:
    """Where a paired row's D_t comes from, in words."""
    span = lg.step_pair[1] - lg.step_pair[0]
    what = (f"step {lg.step_pair[1]}'s rollouts" + (f" and {lg.n_heldout} held-out completions of pi_t"
                                                       if lg.n_heldout else ""))
    window = "" if span == 1 else f" (the {span} steps between generations: rollouts reused across steps)"
    # under a cost budget: the prompt groups the tap scored, a uniformly random subset
    subset = (f", on the {lg.n_groups} of {lg.groups_in_step} prompt groups the tap scored"
              if lg.groups_unscored else "")
    return f"token-level KL(pi_{{t+1}} || pi_t) along {what}{window}{subset}, independent of the step"


def _premise_numbers(lg: PairedLedger) -> dict[str, Any]:
    """What a premise refusal of a paired row shows: its k-hat and effective sample sizes."""
    return {"step_pair": list(lg.step_pair), "pareto_k": lg.pareto_k, "pareto_k_max": lg.pareto_k_max,
            "n": int(len(lg.codes)), "groups": lg.n_groups, "ess_pi_t": lg.ess[0], "ess_pi_t1": lg.ess[1],
            "sides": lg.sides, "sampler_kl": lg.sampler_kl, "sampler_kl_se": lg.sampler_kl_se,
            "d_t": lg.d_t if lg.d_t is not None else lg.d_hat}


def _paired_envelope(series: KlMinSeries, i: int, lg: PairedLedger, est: _eta.EtaEstimate) -> dict[str, Any] | None:
    """None unless the paired row ``series[i]``'s KL_min exceeds its D_t beyond noise
    (``eta.ENVELOPE_Z`` standard errors of the difference), or its D_t is not a positive number.
    The row is made only to name a violation."""
    d_t = est.d_t
    if not math.isfinite(d_t):
        why = {"premise": "nonfinite_denominator", "ratio": None}
    elif d_t <= 0:
        why = {"premise": "nonpositive_denominator", "ratio": None}
    elif est.excess_z > _eta.ENVELOPE_Z:
        why = {"premise": "kl_min_above_d_t", "ratio": est.eta_debiased, "excess_z": est.excess_z,
               "envelope_z": _eta.ENVELOPE_Z}
    else:
        return None
    row = series[i]
    return {"step_pair": list(row.step_pair), "kl_min": est.kl_min_debiased, "d_t": d_t, "noise_floor": est.null_kl,
            "clears_noise_floor": row.clears_noise_floor, "leading_feature": row.leading_feature,
            "leading_delta": row.leading_delta, "leading_se": row.leading_se, "leading_t": row.leading_t,
            "n_pre": lg.n_pre, "n_post": lg.n_post, "max_abs_t": float(np.max(np.abs(lg.t))) if len(lg.t) else 0.0,
            **why}


# Two estimates of D_t disagree when they differ by more than this many combined SEs.
D_T_DISAGREE_Z = 3.0


def _d_t_checks(lg: Ledger, est: _eta.EtaEstimate, run: Run | None, pair: tuple[int, int]
                ) -> dict[str, tuple[float, float | None]]:
    """D_t from each source beside the one eta uses: (nats per sequence, SE or None)."""
    if not isinstance(lg, PairedLedger):
        return {}
    out = {"token_kl": (est.d_t, float(math.sqrt(est.cov[1, 1]))), "same_sample_plugin": (lg.d_hat, None)}
    if run is not None and run.manifest.telemetry_per_step and pair[1] - pair[0] == 1:
        rec = run.telemetry_column("kl_to_previous").get(pair[0])
        if rec is not None:
            out["record"] = (float(rec), run.telemetry_column("kl_to_previous_se").get(pair[0]))
    return out


def _disagree(checks: dict[str, tuple[float, float | None]]) -> bool:
    """The record's D_t and the token-level KL along the independent sample are both unbiased
    for D_t when the record's is independent of the step too (a tap since schema 6); they
    disagree beyond D_T_DISAGREE_Z combined SEs. (The same-sample plug-in is left out: it
    misses the tail of r that the sample does not hold, and reads low.)"""
    if "token_kl" not in checks or "record" not in checks:
        return False
    (v0, s0), (v1, s1) = checks["token_kl"], checks["record"]
    if s0 is None or s1 is None:
        return False
    return abs(v1 - v0) > D_T_DISAGREE_Z * math.sqrt(s0 ** 2 + s1 ** 2)


def _outside(kl_min: float, d_t: float) -> bool:
    """Whether eta = KL_min / D_t would leave [0, 1] (or not be a number): ``_envelope`` then
    names the premise that failed."""
    return not math.isfinite(d_t) or d_t <= 0 or not (0.0 <= kl_min / d_t <= 1.0)


def _envelope(row: KlMinRow, lg: Ledger, d_t: float, kl_min: float | None = None) -> dict[str, Any] | None:
    """None when eta = KL_min / D_t is inside [0, 1]; else the failed premise, with numbers.
    ``kl_min`` replaces the row's quadratic form (the paired ledger's exact value)."""
    if not _outside(row.kl_min if kl_min is None else kl_min, d_t):
        return None
    base = {"step_pair": list(row.step_pair), "kl_min": row.kl_min if kl_min is None else kl_min, "d_t": d_t,
            "noise_floor": row.noise_floor, "clears_noise_floor": row.clears_noise_floor,
            "leading_feature": row.leading_feature, "leading_delta": row.leading_delta,
            "leading_se": row.leading_se, "leading_t": row.leading_t, "n_pre": lg.n_pre, "n_post": lg.n_post,
            "max_abs_t": float(np.max(np.abs(lg.t))) if len(lg.t) else 0.0}
    if not math.isfinite(d_t):
        return {**base, "premise": "nonfinite_denominator", "ratio": None}
    if d_t <= 0:
        return {**base, "premise": "nonpositive_denominator", "ratio": None}
    ratio = base["kl_min"] / d_t
    if not (0.0 <= ratio <= 1.0):
        return {**base, "premise": "ratio_above_one", "ratio": ratio}
    return None


__all__ = ["CostBook", "CostRow", "KlMinRow", "KlMinSeries", "cost_series", "kl_min_series", "rollouts_refusal"]
