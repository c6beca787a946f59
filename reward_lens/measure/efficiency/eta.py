"""Efficiency as a measurement: a point, a bias correction, an interval, a p-value, and a
decision across the book's rows; and the run's efficiency as one ratio of sums.

The denominator is always D_t measured on samples independent of the step: for a **paired**
ledger the token-level KL(pi_{t+1} || pi_t) along its own samples (``PairedLedger.d_t``; the
record's ``kl_to_previous`` is the same number), for an **unpaired** one the record's
``kl_to_previous`` (or the caller's ``kl_spent``). Never the same-sample plug-in
mean_g KL(q_g || p_g): it misses the tail of r that a sample of 8 rollouts per prompt never
holds and reads low (0.59x the truth on a collapsing run, measured by ``tools/truth.py``),
which made eta read high.

Paired: KL_min is the exact I-projection of the sample (``iproj``). On a finite sample it also
fits the noise of the target means, so it reads high (measured: 1.3-15x the truth where the
features explain little). The book removes that bias with the delete-one-group jackknife
(Quenouille's correction, KL_jk = G KL - (G-1) mean_g KL_(-g)): the noise term scales as 1/G,
so deleting a group scales it by G/(G-1) and the combination cancels it to first order. Each
KL_(-g) is reached by two Newton steps from the whole sample's tilt, at about the cost of one
more solve for all G of them, and solved from scratch where those steps may be off
(``iproj.group_jackknife``: the same jackknife to a few hundredths of its SE). Each group's
own term of the dual is biased too, at O(1/n) in its few rows, which no deletion of whole
groups sees: on two-sided samples its stratified jackknife at the fitted tilt
(``iproj.fixed_tilt_bias``) is taken out of KL_jk and of every replicate. The covariance of
(KL_jk, D_t) is the jackknife's over the same replicates; eta = KL_jk / D_t with a
delta-method standard error on the degrees of freedom of the groups in which a priced feature
varies, less one (``jackknife_dof``; ``own_se``); a sample in which none varies prices nothing.
A paired book of single step pairs then pools each row's variance with those of the three rows
that state an interval on either side (``moderate``, ``ledger.moderated``), and its t interval
reads the pooled SE on Welch-Satterthwaite degrees of freedom, widened to cover a bias up to the
row's own correction |KL_min - KL_jk| / D_t either way (``bias_aware_halves``: on a sharpened
policy the correction leaves a bias of its own order); a window of several pairs keeps its own SE,
and its interval, like the run's, covers a bias up to its sums' correction (``window``). The
p-value of "the features bought nothing" (KL_min = 0) is the F-test of the within-group regression
of r on the features over the rollouts (``rollout_test``: n - G degrees of freedom, not G - 1).
How often the intervals cover the truth, in three regimes: docs/science.md quotes the truth
harness.

Because D_t is independent of KL_min, eta is no longer <= 1 by construction: a point estimate
may exceed 1 by noise, and is shown with its interval. Only a row whose KL_jk exceeds D_t by
more than ``ENVELOPE_Z`` standard errors is refused ENVELOPE_VIOLATED (a premise failed).

Unpaired: eta = KL_min / D_t with KL_min = 1/2 dz^T G^-1 dz; its noise floor 1/2 tr(G^-1
Sigma_dz) is the expectation of the form under dz = 0 and is subtracted; the variance of
KL_min from draws of dz from its sampling law, D_t's from the record's standard error; the
p-value is Hotelling's test of dz = 0. The seed's envelope applies unchanged: a raw ratio
above 1 is refused.

The run's efficiency (``run_level``) is sum KL_jk / sum D_t over every priced step pair (each a
separate sample, so their covariances add): a ratio of sums, not a median over rows selected
on significance -- such a median leans high (0.45 against a true 0.26 on the oracle's check).
Windows of W step pairs are priced the same way. Seeded by the step pair, so a report is
reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import special  # the distribution functions scipy.stats wraps, without its import cost

from reward_lens.measure.efficiency.iproj import VALUE_RTOL, fixed_tilt_bias, group_jackknife
from reward_lens.measure.ledger.moderated import moderated_eta_se
from reward_lens.measure.ledger.paired import PairedLedger, mis_log_weights
from reward_lens.measure.ledger.price import Ledger, blocks, in_threads, stack_views

# Monte Carlo draws (unpaired KL_min variance; the headline median's interval): the 2.5 %
# and 97.5 % percentiles of 400 draws are each set by ~10 draws, enough for an interval
# reported to two significant figures.
N_DRAWS = 400
# False discovery rate of the book-wide decision "resolved" (Benjamini & Hochberg 1995).
FDR_Q = 0.05


# How the jackknife gets KL_min with each prompt group deleted (``iproj.group_jackknife``):
# "checked", two Newton steps from the whole sample's tilt, solved from scratch where the steps
# may be off; "exact", a solve from scratch per deletion (G more solves per step pair).
DELETIONS = "checked"

# A paired row is refused ENVELOPE_VIOLATED when its KL_min exceeds D_t by more than this many
# standard errors of the difference: beyond sampling noise, a premise failed.
ENVELOPE_Z = 3.0


@dataclass(frozen=True, eq=False)
class EtaEstimate:
    """eta of one step pair (or window), before the book-wide decision.

    ``cov`` is the sampling covariance of (kl_min_debiased, d_t) -- by the jackknife over prompt
    groups (paired) or from draws of dz and the record's SE of D_t (unpaired) -- so a window's
    ratio of sums gets its standard error by the delta method."""

    step_pair: tuple[int, int]
    kind: str  # "paired" | "unpaired"
    kl_min: float  # nats per sequence: exact (paired) or quadratic (unpaired), as the sample gives it
    kl_min_debiased: float  # nats per sequence: with the noise's expected contribution taken out
    d_t: float  # nats per sequence: the independent D_t this eta divides by
    p_value: float
    cov: np.ndarray  # (2, 2) covariance of (kl_min_debiased, d_t)
    dof: float = float("inf")  # degrees of freedom of the SE (jackknife: the groups that vary, less one)
    converged: bool = True
    steps: int = 1  # step pairs in the window
    # paired: the prompt groups in which some priced feature varies (``groups_varying``); the
    # rest add nothing to KL_min, and with none of them the tilt is not identified
    groups_varying: int | None = None
    # a paired book's row: its SE pooled with the neighbouring updates' and that SE's degrees of
    # freedom (``moderate``); the interval and the headline read them where they are set, the
    # envelope test and a window's sums the jackknife's own ``cov``
    se_pooled: float | None = None
    dof_pooled: float | None = None
    # D_t's tail allowance (``ledger.paired.tail_allowance``; a window's members' summed): where the
    # sample of a sharpened policy may have missed the tail of the token KL, D_t may be that much
    # larger, and eta that much smaller: the interval's lower end allows for it (``tail_low``)
    d_t_tail: float = 0.0
    # paired: what the bias correction may have left, in eta -- the correction's own size,
    # |KL_min - KL_jk| / D_t, a row's (``moderate``) or a window's and the run's of their sums
    # (``window``); the interval covers any bias up to it (``bias_aware_halves``). None: no
    # allowance (unpaired rows and unpaired windows)
    bias_bound: float | None = None

    @property
    def null_kl(self) -> float:
        """What sampling noise added to KL_min in expectation (nats per sequence)."""
        return self.kl_min - self.kl_min_debiased

    @property
    def eta(self) -> float:
        return self.kl_min / self.d_t

    @property
    def eta_null(self) -> float:
        return self.null_kl / self.d_t

    @property
    def eta_debiased(self) -> float:
        return _ratio(self.kl_min_debiased, self.d_t)

    @property
    def estimable(self) -> bool:
        """Whether the jackknife over prompt groups gives this eta an interval: a paired estimate
        needs two prompt groups in which a priced behaviour varies. With one, deleting it leaves
        KL_min = 0 and deleting any other scales KL_min by G / (G - 1), so the replicates' spread
        is the estimate itself (the SE of KL_min is KL_min, exactly): an "interval" proportional
        to the estimate, which says nothing of its error. On the truth harness's collapsing run
        such a row read 0.000 +- 0.004 where the truth was 0.86. The row keeps its estimate and
        its test (the rollouts' regression, which does not rest on the jackknife); it states no
        interval, and the median over resolved rows leaves it out. Windows and unpaired rows:
        always."""
        return self.kind != "paired" or self.groups_varying is None or self.groups_varying >= 2

    @property
    def se(self) -> float:
        """SE of eta_debiased = K / D: pooled with the neighbouring updates' where the book pooled
        it (``se_pooled``), else the delta method's from the jackknife's ``cov`` (``own_se``)."""
        return self.se_pooled if self.se_pooled is not None else self.own_se

    @property
    def own_se(self) -> float:
        """Delta-method SE of eta_debiased = K / D from the jackknife's covariance."""
        return _ratio_se(self.kl_min_debiased, self.d_t, self.cov)

    def interval(self) -> tuple[float, float]:
        """95 % interval of eta_debiased: t quantile with the SE's degrees of freedom, widened to
        cover a bias up to ``bias_bound`` (``bias_aware_halves``), the lower end allowing for D_t's
        tail (``tail_low``)."""
        dof = self.dof_pooled if self.se_pooled is not None else self.dof
        e, se = self.eta_debiased, self.se
        if self.bias_bound:  # the same function as the columns', on one entry
            half = float(bias_aware_halves(np.array([dof], dtype=np.float64), np.array([se], dtype=np.float64),
                                           np.array([self.bias_bound], dtype=np.float64))[0])
        else:
            half = _t975(dof) * se
        lo = e - half
        return (float(tail_low(lo, self.d_t, self.d_t_tail)) if self.d_t_tail else lo, e + half)

    @property
    def excess_z(self) -> float:
        """(KL_min - D_t) in standard errors of the difference: above ``ENVELOPE_Z`` KL_min
        exceeds what the step spent beyond noise."""
        diff = self.kl_min_debiased - self.d_t
        var = float(self.cov[0, 0] + self.cov[1, 1] - 2 * self.cov[0, 1])
        if var > 0:
            return diff / math.sqrt(var)
        return math.inf if diff > 0 else -math.inf


@dataclass(frozen=True, eq=False)
class EtaColumns:
    """Many ``EtaEstimate`` of one kind as arrays, entry i of each for estimate i: what a book of
    10,000 step pairs computes its rows' intervals, checks and sums from, whole, instead of
    10,000 objects. ``estimate(i)`` makes the one object; every derived quantity here is the
    estimate's own property computed on all entries at once, the same numbers to the last bit
    (tests/unit/test_cost_columns.py)."""

    step_pair: np.ndarray  # (P, 2) int
    kind: str  # "paired" | "unpaired"
    kl_min: np.ndarray  # (P,)
    kl_min_debiased: np.ndarray  # (P,)
    d_t: np.ndarray  # (P,)
    p_value: np.ndarray  # (P,)
    cov: np.ndarray  # (P, 2, 2)
    dof: np.ndarray  # (P,)
    converged: np.ndarray  # (P,) bool
    steps: np.ndarray  # (P,) int
    groups_varying: np.ndarray  # (P,) int, -1 where None
    # ``EtaEstimate.se_pooled`` and ``dof_pooled`` of each, NaN where None (None: not pooled at all)
    se_pooled: np.ndarray | None = None
    dof_pooled: np.ndarray | None = None
    d_t_tail: np.ndarray | None = None  # (P,) ``EtaEstimate.d_t_tail`` of each; None: 0 for all
    bias_bound: np.ndarray | None = None  # (P,) ``EtaEstimate.bias_bound`` of each, NaN where None; None: none

    def __len__(self) -> int:
        return len(self.kl_min)

    @property
    def pooled(self) -> np.ndarray:
        """Which entries' SE was pooled with the neighbouring updates' (``moderate``)."""
        if self.se_pooled is None:
            return np.zeros(len(self), dtype=bool)
        return ~np.isnan(self.se_pooled)

    @classmethod
    def of(cls, estimates: Sequence[EtaEstimate], kind: str | None = None) -> EtaColumns:
        """The columns of ``estimates`` (of one kind: the first's, or ``kind`` where there are none)."""
        es = list(estimates)
        pooled = any(e.se_pooled is not None for e in es)

        def opt(name: str) -> np.ndarray | None:
            if not pooled:
                return None
            return np.array([np.nan if getattr(e, name) is None else getattr(e, name) for e in es], dtype=np.float64)

        return cls(
            step_pair=np.array([e.step_pair for e in es], dtype=np.int64).reshape(len(es), 2),
            kind=es[0].kind if es else (kind or "paired"),
            kl_min=np.array([e.kl_min for e in es], dtype=np.float64),
            kl_min_debiased=np.array([e.kl_min_debiased for e in es], dtype=np.float64),
            d_t=np.array([e.d_t for e in es], dtype=np.float64),
            p_value=np.array([e.p_value for e in es], dtype=np.float64),
            cov=np.array([e.cov for e in es], dtype=np.float64).reshape(len(es), 2, 2),
            dof=np.array([e.dof for e in es], dtype=np.float64),
            converged=np.array([e.converged for e in es], dtype=bool),
            steps=np.array([e.steps for e in es], dtype=np.int64),
            groups_varying=np.array([-1 if e.groups_varying is None else e.groups_varying for e in es],
                                    dtype=np.int64), se_pooled=opt("se_pooled"), dof_pooled=opt("dof_pooled"),
            bias_bound=(np.array([np.nan if e.bias_bound is None else e.bias_bound for e in es], dtype=np.float64)
                        if any(e.bias_bound is not None for e in es) else None),
            d_t_tail=np.array([e.d_t_tail for e in es], dtype=np.float64) if any(e.d_t_tail for e in es) else None)

    def estimate(self, i: int) -> EtaEstimate:
        gv = int(self.groups_varying[i])
        pooled = self.se_pooled is not None and not math.isnan(self.se_pooled[i])
        return EtaEstimate(step_pair=(int(self.step_pair[i, 0]), int(self.step_pair[i, 1])), kind=self.kind,
                           kl_min=float(self.kl_min[i]), kl_min_debiased=float(self.kl_min_debiased[i]),
                           d_t=float(self.d_t[i]), p_value=float(self.p_value[i]), cov=self.cov[i],
                           dof=float(self.dof[i]), converged=bool(self.converged[i]), steps=int(self.steps[i]),
                           groups_varying=None if gv < 0 else gv,
                           se_pooled=float(self.se_pooled[i]) if pooled else None,
                           dof_pooled=float(self.dof_pooled[i]) if pooled else None,
                           d_t_tail=0.0 if self.d_t_tail is None else float(self.d_t_tail[i]),
                           bias_bound=(None if self.bias_bound is None or math.isnan(self.bias_bound[i])
                                       else float(self.bias_bound[i])))

    def estimates(self) -> list[EtaEstimate]:
        return [self.estimate(i) for i in range(len(self))]

    def take(self, idx) -> EtaColumns:
        """The estimates at ``idx`` (an index array or a mask), in that order."""
        return EtaColumns(step_pair=self.step_pair[idx], kind=self.kind, kl_min=self.kl_min[idx],
                          kl_min_debiased=self.kl_min_debiased[idx], d_t=self.d_t[idx], p_value=self.p_value[idx],
                          cov=self.cov[idx], dof=self.dof[idx], converged=self.converged[idx], steps=self.steps[idx],
                          groups_varying=self.groups_varying[idx],
                          se_pooled=None if self.se_pooled is None else self.se_pooled[idx],
                          dof_pooled=None if self.dof_pooled is None else self.dof_pooled[idx],
                          d_t_tail=None if self.d_t_tail is None else self.d_t_tail[idx],
                          bias_bound=None if self.bias_bound is None else self.bias_bound[idx])

    @property
    def null_kl(self) -> np.ndarray:
        return self.kl_min - self.kl_min_debiased

    @property
    def eta(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.kl_min / self.d_t

    @property
    def eta_null(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.null_kl / self.d_t

    @property
    def eta_debiased(self) -> np.ndarray:
        """``_ratio`` of each: K / D where D > 0, else NaN."""
        pos = self.d_t > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(pos, self.kl_min_debiased / np.where(pos, self.d_t, 1.0), np.nan)

    @property
    def estimable(self) -> np.ndarray:
        if self.kind != "paired":
            return np.ones(len(self), dtype=bool)
        return (self.groups_varying < 0) | (self.groups_varying >= 2)

    @property
    def se(self) -> np.ndarray:
        """``EtaEstimate.se`` of each: the pooled SE where it was pooled, else ``own_se``."""
        own = self.own_se
        return own if self.se_pooled is None else np.where(self.pooled, self.se_pooled, own)

    @property
    def own_se(self) -> np.ndarray:
        """``_ratio_se`` of each: grad^T cov grad written out in the order ``grad @ cov @ grad``
        adds its terms in."""
        return ratio_ses(self.kl_min_debiased, self.d_t, self.cov)

    @property
    def outside_envelope(self) -> np.ndarray:
        """Which entries the book refuses ENVELOPE_VIOLATED: D_t not a positive number, or KL_min
        above it by more than ``ENVELOPE_Z`` standard errors of the difference."""
        with np.errstate(invalid="ignore"):
            return ~np.isfinite(self.d_t) | (self.d_t <= 0) | (self.excess_z > ENVELOPE_Z)

    def interval(self) -> tuple[np.ndarray, np.ndarray]:
        """``EtaEstimate.interval`` of each: (lo, hi)."""
        dof = self.dof if self.se_pooled is None else np.where(self.pooled, self.dof_pooled, self.dof)
        e, se = self.eta_debiased, self.se
        with np.errstate(invalid="ignore"):
            half = t975s(dof) * se if self.bias_bound is None else bias_aware_halves(dof, se, self.bias_bound)
            lo = e - half
            return (lo if self.d_t_tail is None else tail_low(lo, self.d_t, self.d_t_tail)), e + half

    @property
    def excess_z(self) -> np.ndarray:
        diff = self.kl_min_debiased - self.d_t
        c = self.cov
        var = c[:, 0, 0] + c[:, 1, 1] - 2 * c[:, 0, 1]
        pos = var > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            z = diff / np.sqrt(np.where(pos, var, 1.0))
        return np.where(pos, z, np.where(diff > 0, np.inf, -np.inf))


def tail_low(lo, d_t, tail):
    """An interval's lower end of eta = K / D allowing for D_t's tail allowance ``tail``
    (``ledger.paired.tail_allowance``): D_t may be up to ``tail`` larger than measured (its own
    interval's upper end carries it), so eta down to ``lo * D / (D + tail)``. Only a positive
    lower end moves (a lower end at or below 0 already allows an eta of 0), and only where D_t
    and the allowance are positive and finite; elementwise on arrays."""
    lo, d, a = (np.asarray(x, dtype=np.float64) for x in (lo, d_t, tail))
    with np.errstate(invalid="ignore", divide="ignore"):
        move = (lo > 0) & (d > 0) & np.isfinite(d) & (a > 0) & np.isfinite(a)
        return np.where(move, lo * d / np.where(move, d + a, 1.0), lo)


def moderate(est: EtaColumns) -> EtaColumns:
    """A paired book's rows (one step pair each) made ready for their intervals: each row's SE
    pooled with its neighbouring updates' (``ledger.moderated.moderated_eta_se``: the rows that
    state an interval -- estimable, with a finite SE -- in step-pair order, each window counting
    such rows), and each such row's bias bound, the size of its own bias correction in eta,
    |KL_min - KL_jk| / D_t (``EtaEstimate.bias_bound``). The estimate, its test and the decision
    are unchanged; the interval and the headline read the pooled SE, the interval the bound.
    Other kinds are handed back as they are."""
    if est.kind != "paired" or not len(est):
        return est
    own = est.own_se
    on = est.estimable & np.isfinite(own)
    at = np.flatnonzero(on)
    at = at[np.lexsort((est.step_pair[at, 1], est.step_pair[at, 0]))]
    se_p, dof_p, bound = np.full(len(est), np.nan), np.full(len(est), np.nan), np.full(len(est), np.nan)
    if len(at):
        se_p[at], dof_p[at] = moderated_eta_se(own[at], est.dof[at])
        bound[at] = np.abs(est.kl_min[at] - est.kl_min_debiased[at]) / est.d_t[at]
    return dataclasses.replace(est, se_pooled=se_p, dof_pooled=dof_p, bias_bound=bound)


# The jackknife's bias correction takes out the part of KL_min's noise bias that shrinks as 1/G
# (and each group's own); on a sharpened policy the tilt also fits the few distinct completions
# of a 4 + 4 sample, a bias of another order that no deletion removes, and the correction then
# leaves some of its own size (the truth harness: eta reads high on the collapsing run, low on the
# sharpened one, at the median over every row). So a paired row's interval covers any bias up to
# the correction's own size, either way: the bias-aware critical value of Armstrong & Kolesar
# ("Simple and honest confidence intervals in nonparametric regression", Quantitative Economics
# 2020), c with P(|T + b / SE| <= c) = 95 %, at least t975 (no bias) and b / SE + t95, at most
# b / SE + t975. Newton's method from below that root, where the coverage is concave in c (past
# b / SE), climbs to it without overshooting; a few steps reach it to 1e-12 (up to seven at one
# to three degrees of freedom).
_BIAS_NEWTON_STEPS = 30
_BIAS_NEWTON_RTOL = 1e-12
# Above this many degrees of freedom t is the normal to 1e-10, and t's density constant (a
# difference of two log-gammas near 0.5 log(dof)) loses its digits: the normal's functions instead.
NORMAL_DOF = 1e10


def bias_aware_halves(dof: np.ndarray, se: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Half-widths of 95 % intervals that cover the truth whatever the estimate's bias, up to
    ``bound`` either way: ``se`` times c with P(|T + bound / se| <= c) = 0.95, T Student's t on
    ``dof`` (the normal where infinite or above ``NORMAL_DOF``). Elementwise on 1-d arrays of one
    length. A bound of 0 (or NaN) gives t975 * se; an infinite bound, or an infinite se, an
    infinite half; se 0, the bound itself; a bound so many SEs out that their ratio overflows,
    the range's upper end, bound + t975 * se."""
    dof, se, bound = (np.asarray(x, dtype=np.float64) for x in (dof, se, bound))
    q975 = t975s(dof)
    with np.errstate(all="ignore"):
        half = q975 * se
        some = bound > 0  # NaN reads False: no allowance
        half[some & np.isinf(bound)] = np.inf
        at_zero = some & np.isfinite(bound) & (se == 0)
        half[at_zero] = bound[at_zero]
        shift = np.where(some & (se > 0), bound / np.where(se > 0, se, 1.0), 0.0)
        on = some & np.isfinite(bound) & (se > 0) & np.isfinite(se)
        far = on & ~np.isfinite(shift)
        half[far] = bound[far] + q975[far] * se[far]
        on &= np.isfinite(shift)
        if not on.any():
            return half
        shift, nu = shift[on], dof[on]
        fin = np.isfinite(nu) & (nu <= NORMAL_DOF)
        nu = np.where(fin, nu, 1.0)
        log_k = special.gammaln((nu + 1.0) / 2.0) - special.gammaln(nu / 2.0) - 0.5 * np.log(nu * np.pi)

        def coverage(c: np.ndarray, i: np.ndarray) -> np.ndarray:  # P(|T + shift| <= c) of entries i
            x, f, n = shift[i], fin[i], nu[i]
            return np.where(f, special.stdtr(n, c - x) - special.stdtr(n, -c - x),
                            special.ndtr(c - x) - special.ndtr(-c - x))

        def density(x: np.ndarray, i: np.ndarray) -> np.ndarray:
            return np.where(fin[i], np.exp(log_k[i] - (nu[i] + 1.0) / 2.0 * np.log1p(x * x / nu[i])),
                            np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))

        # t's 95 % quantile is at least the normal's: a start below the root without another inversion
        c = np.maximum(q975[on], shift + 1.6448536269514722)
        live = np.arange(len(c))
        for _ in range(_BIAS_NEWTON_STEPS):  # each entry steps until its own step is small: its bits are its own
            if not len(live):
                break
            cl, x = c[live], shift[live]
            step = (0.95 - coverage(cl, live)) / (density(cl - x, live) + density(cl + x, live))
            c[live] = cl + step
            live = live[np.abs(step) > _BIAS_NEWTON_RTOL * cl]
        half[on] = c * se[on]
    return half


def ratio_ses(k: np.ndarray, d: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """``_ratio_se`` of many (K, D) with their covariances (P, 2, 2), elementwise: the same
    products and sums, in the same order, as ``grad @ cov @ grad`` on each."""
    k, d = np.asarray(k, dtype=np.float64), np.asarray(d, dtype=np.float64)
    pos = d > 0
    with np.errstate(all="ignore"):
        g0 = 1.0 / d
        g1 = -k / d / d
        v0 = g0 * cov[:, 0, 0] + g1 * cov[:, 1, 0]
        v1 = g0 * cov[:, 0, 1] + g1 * cov[:, 1, 1]
        var = v0 * g0 + v1 * g1
        se = np.where(var >= 0, np.sqrt(np.where(var >= 0, var, 0.0)), np.where(np.isfinite(var), 0.0, np.inf))
    return np.where(pos, se, np.inf)


def t975s(dof: np.ndarray) -> np.ndarray:
    """``_t975`` of each entry: the ufunc it calls on every finite entry at once, the normal's
    quantile elsewhere."""
    dof = np.asarray(dof, dtype=np.float64)
    out = np.full(dof.shape, 1.959963984540054)
    fin = np.isfinite(dof)
    if fin.any():
        out[fin] = special.stdtrit(dof[fin], 0.975)
    return out


def _ratio(k: float, d: float) -> float:
    return k / d if d > 0 else float("nan")


def _ratio_se(k: float, d: float, cov: np.ndarray) -> float:
    """Delta-method SE of K / D from the covariance of (K, D)."""
    if not d > 0:
        return float("inf")
    # grad^T cov grad written out, each product and sum on its own, in the order ``ratio_ses``
    # takes them: a BLAS dot (``grad @ cov @ grad``) fuses multiply and add where the CPU has FMA
    # (AVX512 kernels), so its last bit differed from the columns' by host. Python floats overflow
    # to inf without a warning: at absurd scales the SE reads infinite
    k, d = float(k), float(d)
    c00, c01, c10, c11 = (float(x) for x in np.asarray(cov, dtype=np.float64).reshape(4))
    g0, g1 = 1.0 / d, -k / d / d
    v0 = g0 * c00 + g1 * c10
    v1 = g0 * c01 + g1 * c11
    var = v0 * g0 + v1 * g1
    return math.sqrt(var) if var >= 0 else (float("inf") if not math.isfinite(var) else 0.0)


@lru_cache(maxsize=256)
def _t975(dof: float) -> float:
    """The 97.5 % quantile of Student's t with ``dof`` degrees of freedom (normal for infinite):
    a book's rows share a few dof values, so each is worked out once. None reads as infinite."""
    return float(special.stdtrit(dof, 0.975)) if dof is not None and np.isfinite(dof) else 1.959963984540054


def _seed(step_pair: tuple[int, int]) -> int:
    return 1_000_003 * int(step_pair[0]) + int(step_pair[1]) + 17


def within_group_r2_test(z: np.ndarray, r: np.ndarray, codes: np.ndarray, n_groups: int) -> tuple[float, float, int]:
    """R^2 of r on z within groups, its F-test p-value, and the degrees of freedom d = n - G."""
    r2, p, d = within_group_r2_tests(np.asarray(z)[None], np.asarray(r)[None], codes, n_groups)
    return float(r2[0]), float(p[0]), d


def within_group_r2_tests(z: np.ndarray, r: np.ndarray, codes: np.ndarray, n_groups: int
                          ) -> tuple[np.ndarray, np.ndarray, int]:
    """``within_group_r2_test`` of P samples that share one group layout: z (P, n, k), r (P, n),
    codes (n,). The least-squares fit by one batched SVD, with ``numpy.linalg.lstsq``'s rank
    rule (singular values at most eps * max(n, k) * the largest count as zero)."""
    z = np.asarray(z, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    n_pairs, n, k = z.shape
    m = blocks(np.asarray(codes), n_groups)
    if m:  # groups of m rows one after another (TRL's layout): centred by reshape and broadcasting
        zb, rb = z.reshape(n_pairs, n_groups, m, k), r.reshape(n_pairs, n_groups, m)
        zc = (zb - zb.mean(axis=2, keepdims=True)).reshape(z.shape)
        rc = (rb - rb.mean(axis=2, keepdims=True)).reshape(r.shape)
    else:
        onehot = np.zeros((n, n_groups))
        onehot[np.arange(n), codes] = 1.0
        size = onehot.sum(axis=0)
        zc = z - onehot @ ((onehot.T @ z) / size[:, None])
        rc = r - ((r @ onehot) / size) @ onehot.T
    d = n - n_groups
    tss = np.einsum("pn,pn->p", rc, rc)
    r2, p = np.zeros(n_pairs), np.ones(n_pairs)
    ok = tss > 0
    if d - k < 1 or not ok.any():
        return r2, p, d
    u, sv, _ = np.linalg.svd(zc[ok], full_matrices=False)
    kept = sv > np.finfo(np.float64).eps * max(n, k) * sv[:, :1]
    coef = np.einsum("pnk,pn->pk", u, rc[ok]) * kept
    resid = rc[ok] - np.einsum("pnk,pk->pn", u, coef)
    r2[ok] = np.maximum(0.0, 1.0 - np.einsum("pn,pn->p", resid, resid) / tss[ok])
    f = (r2[ok] / k) / np.maximum((1.0 - r2[ok]) / (d - k), 1e-300)
    p[ok] = special.fdtrc(k, d - k, f)
    return r2, p, d


def paired_estimate(lg: PairedLedger, active_idx: np.ndarray) -> EtaEstimate:
    """eta on the paired sample, its bias corrected and its covariance estimated by the
    delete-one-group jackknife (groups are the independent units). Needs the token-level KL
    along the sample (``lg.kl``) for its denominator."""
    return paired_estimates([(lg, active_idx)])[0]


def paired_estimates(items: Sequence[tuple[PairedLedger, np.ndarray]], deletions: str | None = None
                     ) -> list[EtaEstimate]:
    """``paired_estimate`` of many step pairs: those whose samples share a group layout, a
    split into sides and an active set are projected in one batch (``iproj.group_jackknife``;
    ``deletions`` says how it gets each deleted group's KL_min, default ``DELETIONS``), the
    same numbers to rounding. The ledgers of one ``paired_ledger_series`` batch hold the same
    codes and sides (the very arrays): their order and key are worked out once, their rows
    gathered in one operation, and their jackknife done as array arithmetic. One object per
    step pair: a book reads ``paired_estimate_columns`` instead."""
    return paired_estimate_columns(items, deletions).estimates()


# Step pairs a thread of ``paired_estimate_columns`` takes at once: 512 pairs of 96 rows x 9
# features are 3.4 MiB of gathered features, and 10,000 pairs are 20 chunks for the threads.
ESTIMATE_CHUNK = 512


def paired_estimate_columns(items: Sequence[tuple[PairedLedger, np.ndarray]], deletions: str | None = None
                            ) -> EtaColumns:
    """``paired_estimates`` as columns, entry q for ``items[q]``."""
    deletions = deletions or DELETIONS
    n_items = len(items)
    col = {"kl_min": np.zeros(n_items), "kl_min_debiased": np.zeros(n_items), "d_t": np.zeros(n_items),
           "cov": np.zeros((n_items, 2, 2)), "dof": np.zeros(n_items), "converged": np.zeros(n_items, dtype=bool),
           "groups_varying": np.zeros(n_items, dtype=np.int64)}
    step_pairs = np.array([lg.step_pair for lg, _ in items], dtype=np.int64).reshape(n_items, 2)
    p_values = np.array(rollout_tests(items), dtype=np.float64)
    batches: dict[tuple, list[int]] = {}
    layouts: dict[tuple, tuple] = {}  # (id of codes, of sides, of idx) -> (batch key, order)
    codes_of: dict[tuple, np.ndarray] = {}  # batch key -> its rows' group codes, in group order
    order_of = []
    for q, (lg, idx) in enumerate(items):
        if lg.kl is None:
            raise ValueError(f"step pair {lg.step_pair}: the paired estimate needs the token-level KL along the "
                             "sample (the record's kl_prev) for its denominator")
        # the arrays are alive for the whole call (``items`` holds them), so their ids are theirs
        mk = (id(lg.codes), id(lg.heldout), id(idx), lg.n_groups)
        got = layouts.get(mk)
        if got is None:
            order = np.argsort(lg.codes, kind="stable")  # groups contiguous, as i_projections needs
            side = None if lg.heldout is None else np.asarray(lg.heldout)[order]
            codes = np.asarray(lg.codes)[order]
            key = (lg.n_groups, codes.tobytes(), None if side is None else side.tobytes(), tuple(np.asarray(idx).tolist()))
            got = layouts[mk] = (key, order)
            codes_of.setdefault(key, codes)
        order_of.append(got[1])
        batches.setdefault(got[0], []).append(q)
    tasks = []
    for key, members in batches.items():
        # a layout whose groups lie in equal consecutive blocks (the tap's) in chunks; any other
        # whole, as before: its group sums are matrix products, whose last bit depends on how many
        # pairs they are handed together
        chunk = ESTIMATE_CHUNK if blocks(codes_of[key], key[0]) else max(len(members), 1)
        tasks += [(key, members[lo:lo + chunk]) for lo in range(0, len(members), chunk)]

    def estimate(task: tuple) -> tuple:
        """One chunk of step pairs of one layout, from the gather of their rows to their columns:
        on a thread, in cache (in equal group blocks every pair's arithmetic is its own, so the
        same numbers as for all the layout's pairs at once)."""
        key, members = task
        g, _, side_key, idx = key
        idx = np.array(idx, dtype=int)
        lg0 = items[members[0]][0]
        order = order_of[members[0]]
        codes = codes_of[key]
        side = None if side_key is None else np.asarray(lg0.heldout)[order]
        lgs = [items[q][0] for q in members]
        if all(order_of[q] is order for q in members):  # one gather for the chunk
            z = _gathered(stack_views([lg.z for lg in lgs]), order, idx)
            r = np.take(np.asarray(stack_views([lg.log_ratio for lg in lgs]), dtype=np.float64), order, axis=1)
            kl = np.take(np.asarray(stack_views([lg.kl for lg in lgs]), dtype=np.float64), order, axis=1)
        else:
            z = np.stack([lg.z[order_of[q]][:, idx] for q, lg in zip(members, lgs)])
            r = np.stack([np.asarray(lg.log_ratio, dtype=np.float64)[order_of[q]] for q, lg in zip(members, lgs)])
            kl = np.stack([np.asarray(lg.kl, dtype=np.float64)[order_of[q]] for q, lg in zip(members, lgs)])
        jk = group_jackknife(z, r, codes, g, side, deletions, workers=1)
        log_q = mis_log_weights(r, side, codes, g)[0]
        varying = groups_varying(z, codes, g)  # (P,)
        k_full, k_del = jk.full, jk.deleted  # (P,) the full sample, (P, G) each group deleted
        k_jk = g * k_full - (g - 1) * k_del.mean(axis=1)
        # each of the g + 1 values is good to VALUE_RTOL (1 + |K|) at best: a correction below what
        # their combination can cancel to is zero, not -1e-14 nats
        k_jk = np.where(np.abs(k_jk - k_full) <= 4 * g * VALUE_RTOL * (1.0 + np.abs(k_full)), k_full, k_jk)
        # each group's term of the dual is biased at O(1/n) in its own few rows, which no deletion
        # of whole groups sees: its stratified jackknife at the whole sample's tilt, taken out of
        # KL_jk and of each replicate (the mean over the groups a replicate keeps)
        bias_g = jk.bias if jk.bias is not None else fixed_tilt_bias(z, r, codes, g, side, jk.lam)  # (P, G)
        k_jk = k_jk - bias_g.mean(axis=1)
        k_del = k_del - (bias_g.sum(axis=1, keepdims=True) - bias_g) / (g - 1)
        # each row's token KL at its weight, summed by group below over the layout's every pair at
        # once: a matrix product's last bit depends on how many rows it is handed
        return k_full, k_jk, k_del, np.exp(log_q) * kl, jk.converged, varying, jackknife_dofs(varying, g)

    # the chunks on threads, a whole chunk's work each (the jackknife's batches then on the
    # chunk's thread): the gathers and weights were a third of a second on one core in between
    done: dict[tuple, list] = {}
    for (key, members), got in in_threads(iter(tasks), estimate):
        done.setdefault(key, []).append((members, got))
    for key, parts in done.items():
        g, codes = key[0], codes_of[key]
        rows = np.array([q for members, _ in parts for q in members], dtype=np.int64)
        k_full, k_jk, k_del, w_kl, converged, varying, dofs = (np.concatenate(x) for x in zip(*(got for _, got in parts)))
        onehot = np.zeros((len(codes), g))
        onehot[np.arange(len(codes)), codes] = 1.0
        d_g = w_kl @ onehot  # (P, G) token-level D per group
        d_jk = (d_g.sum(axis=1, keepdims=True) - d_g) / (g - 1)  # (P, G) D with group j deleted
        theta = np.stack([k_del, d_jk], axis=2)  # (P, G, 2) the replicates
        dev = theta - theta.mean(axis=1, keepdims=True)
        covs = np.matmul((g - 1) / g * dev.transpose(0, 2, 1), dev)  # (P, 2, 2)
        col["kl_min"][rows], col["kl_min_debiased"][rows], col["d_t"][rows] = k_full, k_jk, d_g.mean(axis=1)
        col["cov"][rows], col["converged"][rows], col["groups_varying"][rows] = covs, converged, varying
        col["dof"][rows] = dofs
    tails = np.array([lg.d_t_tail if lg.d_t_tail is not None and math.isfinite(lg.d_t_tail) else 0.0
                      for lg, _ in items], dtype=np.float64)
    return EtaColumns(step_pair=step_pairs, kind="paired", p_value=p_values,
                      steps=step_pairs[:, 1] - step_pairs[:, 0], d_t_tail=tails if (tails > 0).any() else None, **col)


def groups_varying(z: np.ndarray, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """For samples z (P, n, k) whose rows are ordered by group (``codes`` non-decreasing): how
    many prompt groups hold two rows that differ in some feature (P,). A group where every
    feature is constant adds nothing to KL_min (its log-partition is lambda . z at any tilt)."""
    z = np.asarray(z)
    if not len(codes) or not z.shape[2]:
        return np.zeros(len(z), dtype=int)
    size = np.bincount(codes, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(size)[:-1]])[size > 0]
    spread = np.maximum.reduceat(z, starts, axis=1) - np.minimum.reduceat(z, starts, axis=1)  # (P, G', k)
    return (spread > 0).any(axis=2).sum(axis=1)


def jackknife_dof(varying: int, n_groups: int) -> float:
    """Degrees of freedom of the delete-one-group jackknife's SE of a paired eta: the groups in
    which a priced feature varies, less one (at least one). Deleting any other group moves
    KL_min by the same amount (the mean's 1/G), so the spread of the replicates that sets the
    SE comes from those groups alone; on a sharpened policy they are often two or three of
    eight, and t on G - 1 made the intervals far too short (tools/truth.py, the collapsing run's
    redraws: 68 % coverage; 88.5 % with these and the samples that vary in no group priced as
    nothing, as the book prices them -- the within-group metric leaves a feature that varies in
    no group out of the step's active set; the moderate run's, where every group varies,
    unchanged). For KL_min this count is what its replicates' spread rests on; D_t's
    replicates vary with every group, so for the delta method's SE of KL / D it is a
    conservative count, not an exact one."""
    return float(max(min(varying, n_groups) - 1, 1))


def jackknife_dofs(varying: np.ndarray, n_groups: int) -> np.ndarray:
    """``jackknife_dof`` of each entry of ``varying``."""
    return np.maximum(np.minimum(np.asarray(varying, dtype=np.int64), n_groups) - 1, 1).astype(np.float64)


def _gathered(rows: np.ndarray, order: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``_laid_out_as(rows[0][order][:, idx], rows[:, order][:, :, idx])`` for samples ``rows``
    (P, n, k): each sample's rows ``order`` (indices or a mask) and columns ``idx``, laid out as
    ``np.stack`` lays out the gathers of each. Where that is each sample in Fortran order (a
    column gather of two or more columns), one gather of the transposed samples makes it: the
    same values in the same layout, without the three copies of every row in between."""
    one = rows[0][order][:, idx]
    if one.ndim == 2 and one.flags.f_contiguous and not one.flags.c_contiguous:
        order = _positions(order, rows.shape[1])
        t = rows.transpose(0, 2, 1)  # (P, k, n)
        if not np.array_equal(idx, np.arange(rows.shape[2])):
            t = np.take(t, idx, axis=1)
        return np.take(t, order, axis=2).transpose(0, 2, 1)
    return _laid_out_as(one, rows[:, order][:, :, idx])


def _positions(rows, n: int) -> np.ndarray:
    """The row positions that ``rows`` (a slice, a mask or positions) picks of n."""
    if isinstance(rows, slice):
        return np.arange(n)[rows]
    rows = np.asarray(rows)
    return np.flatnonzero(rows) if rows.dtype == bool else rows


def _laid_out_as(one: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``rows`` (P, ...) in the memory layout ``np.stack`` gives P arrays laid out as ``one``
    (a column gather is Fortran-ordered): the projections' matrix products then take the same
    paths, and give the same numbers to the last bit, as on the stacked arrays."""
    if one.ndim == 2 and one.flags.f_contiguous and not one.flags.c_contiguous:
        out = np.empty((len(rows), *one.shape[::-1])).transpose(0, 2, 1)
    else:
        out = np.empty(rows.shape)
    out[...] = rows
    return out


def rollout_test(lg: PairedLedger, idx: np.ndarray) -> float:
    """p-value of "the features bought nothing of the step" (KL_min = 0): the F-test of the
    within-group regression of r on the active features over step t+1's rollouts, the side drawn
    from pi_{t+1} (to first order dz = Cov_{pi_{t+1}}(z, r) within groups, so no association is
    no movement). Exact for Gaussian r whatever the step; the held-out rows, drawn from the other
    policy, are not mixed into it."""
    return rollout_tests([(lg, idx)])[0]


# Step pairs tested in one batched SVD at most (z of 1,024 pairs x 64 rollouts x 9 features is 4.5 MiB),
# the batches on threads (``in_threads``).
ROLLOUT_TEST_BATCH = 1024


def rollout_tests(items: Sequence[tuple[PairedLedger, np.ndarray]]) -> list[float]:
    """``rollout_test`` of many step pairs: those whose rollout sides share a group layout and an
    active set are fitted in one batched SVD (``within_group_r2_tests``), the same numbers. The
    ledgers of one ``paired_ledger_series`` batch hold the same codes and sides (the very
    arrays): their layout is worked out once and their rows gathered in one operation."""
    out = [1.0] * len(items)
    batches: dict[tuple, list[int]] = {}
    layouts: dict[tuple, tuple] = {}  # (id of codes, of sides, of idx) -> (key, rows, g, n_groups, every)
    for q, (lg, idx) in enumerate(items):
        mk = (id(lg.codes), id(lg.heldout), id(idx), lg.n_groups, lg.z.shape[1])  # alive for the call: ids are theirs
        got = layouts.get(mk)
        if got is None:
            rows = slice(None) if lg.heldout is None else ~np.asarray(lg.heldout)
            codes = np.asarray(lg.codes)[rows]
            present = np.bincount(codes, minlength=lg.n_groups) > 0 if len(codes) else np.zeros(0, dtype=bool)
            if present.all() and len(present) == lg.n_groups:
                g, n_groups = codes, lg.n_groups  # already 0..G-1, every group present
            else:
                kept, g = np.unique(codes, return_inverse=True)
                n_groups = len(kept)
            # a sample of rollouts alone, every feature active: its own arrays (views of the
            # ledgers' batch, which ``stack_views`` hands back without a copy)
            every = lg.heldout is None and len(idx) == lg.z.shape[1] and bool((np.diff(idx) == 1).all())
            got = layouts[mk] = ((n_groups, g.tobytes(), tuple(np.asarray(idx).tolist())), rows, g, n_groups, every)
        batches.setdefault(mk, []).append(q)
    tasks = [(mk, members[a:a + ROLLOUT_TEST_BATCH]) for mk, members in batches.items()
             for a in range(0, len(members), ROLLOUT_TEST_BATCH)]

    def fit(task: tuple) -> np.ndarray:
        mk, qs = task
        _, rows, g, n_groups, every = layouts[mk]
        idx = items[qs[0]][1]
        part = [items[q][0] for q in qs]
        z = stack_views([lg.z for lg in part])
        r = stack_views([np.asarray(lg.log_ratio, dtype=np.float64) for lg in part])
        if not every:  # laid out as the stack of each one's gather, so the fit's sums run alike
            z = _gathered(z, rows, idx)
            r = np.take(r, _positions(rows, r.shape[1]), axis=1)
        return within_group_r2_tests(z, r, g, n_groups)[1]

    # each pair's fit is its own (one SVD per matrix): batches on threads give the same numbers
    for (_, qs), p in in_threads(iter(tasks), fit):
        for q, pv in zip(qs, p.tolist()):
            out[q] = pv
    return out


# Hotelling's test is not formed on a Sigma whose correlation matrix is worse conditioned
# than this (as on a singular one): there T^2 is dominated by directions in which Sigma is
# zero up to rounding, and a change of 1e-15 in Sigma moved such a p-value from 0.986 to
# 0.906 (`long`). The same bound the metric uses to call a feature collinear (COLLINEAR_TOL).
HOTELLING_MAX_CONDITION = 1e10


def _testable(sigma: np.ndarray) -> np.ndarray:
    """For a stack of covariances (P, k, k): finite, every variance positive, and a
    correlation matrix with condition number at most HOTELLING_MAX_CONDITION."""
    ok = np.isfinite(sigma).all(axis=(1, 2))
    var = np.einsum("pii->pi", sigma)
    ok &= (var > 0).all(axis=1)
    out = np.zeros(len(sigma), dtype=bool)
    if ok.any():
        sd = np.sqrt(var[ok])
        ev = np.linalg.eigvalsh(sigma[ok] / (sd[:, :, None] * sd[:, None, :]))
        out[ok] = ev[:, 0] * HOTELLING_MAX_CONDITION >= ev[:, -1]
    return out


def hotelling_p(dz: np.ndarray, sigma: np.ndarray, units: int, one_sample: bool = False) -> float:
    """p-value of dz = 0 on a two-sample ledger: Hotelling's T^2 = dz^T Sigma^-1 dz with
    F = T^2 (N - k - 1) / (k (N - 2)) ~ F(k, N - k - 1), N the independent units of both steps
    (prompt groups, or rollouts where a step has one prompt); exact for Gaussian features with
    a common covariance and equal sizes. Sigma estimated from few units makes a chi^2 reading
    of T^2 far too optimistic. ``one_sample``: dz is a mean of P matched differences, and
    F = T^2 (P - k) / (k (P - 1)) ~ F(k, P - k). 1 where it cannot be tested: too few units,
    or Sigma singular or nearly so (``HOTELLING_MAX_CONDITION``)."""
    return float(hotelling_p_many(dz[None], sigma[None], np.array([units]), np.array([one_sample]))[0])


def hotelling_p_many(dz: np.ndarray, sigma: np.ndarray, units: np.ndarray, one_sample: np.ndarray) -> np.ndarray:
    """``hotelling_p`` of many ledgers of one dimension k at once: dz (P, k), sigma (P, k, k),
    units and one_sample (P,); one batched solve over the testable ones."""
    n_rows, k = dz.shape
    out = np.ones(n_rows)
    n = np.asarray(units, dtype=float)
    one_sample = np.asarray(one_sample, dtype=bool)
    dof = np.where(one_sample, n - k, n - k - 1)
    ok = (dof >= 1) & _testable(sigma) if n_rows else np.zeros(0, dtype=bool)
    if not ok.any():
        return out
    t2 = np.einsum("pi,pi->p", dz[ok], np.linalg.solve(sigma[ok], dz[ok][:, :, None])[:, :, 0])
    scale = np.where(one_sample, (n - k) / (k * (n - 1)), (n - k - 1) / (k * np.maximum(n - 2, 1)))[ok]
    good = np.isfinite(t2) & (t2 >= 0)
    p = np.ones(len(t2))
    p[good] = special.fdtrc(k, dof[ok][good], t2[good] * scale[good])
    out[ok] = p
    return out


def unpaired_estimate(lg: Ledger, g_active: np.ndarray, active_idx: np.ndarray, kl_min: float, noise_floor: float,
                      d_t: float, p: float, d_t_se: float | None = None) -> EtaEstimate:
    """eta = (KL_min - floor) / D_t on a two-sample ledger; the variance of KL_min from draws of
    dz from its sampling law, D_t's from its recorded standard error (0 where none)."""
    dz = lg.delta_z[active_idx]
    sigma = lg.cov_delta[np.ix_(active_idx, active_idx)]
    rng = np.random.default_rng(_seed(lg.step_pair))
    draws = rng.multivariate_normal(dz, sigma, size=N_DRAWS, method="eigh")
    kl_b = 0.5 * np.einsum("bi,ij,bj->b", draws, np.linalg.inv(g_active), draws)
    cov = np.zeros((2, 2))
    cov[0, 0] = float(np.var(kl_b, ddof=1))
    cov[1, 1] = float(d_t_se) ** 2 if d_t_se is not None and math.isfinite(d_t_se) else 0.0
    return EtaEstimate(step_pair=lg.step_pair, kind="unpaired", kl_min=kl_min, kl_min_debiased=kl_min - noise_floor,
                       d_t=d_t, p_value=p, cov=cov)


def benjamini_hochberg(p: Sequence[float], q: float = FDR_Q) -> np.ndarray:
    """Which hypotheses BH rejects at false discovery rate q (Benjamini & Hochberg 1995)."""
    p = np.asarray(p, dtype=float)
    m = len(p)
    if not m:
        return np.zeros(0, dtype=bool)
    order = np.argsort(p)
    passed = p[order] <= q * np.arange(1, m + 1) / m
    out = np.zeros(m, dtype=bool)
    if passed.any():
        out[order[: np.nonzero(passed)[0].max() + 1]] = True
    return out


def fisher_combined(p: Sequence[float]) -> float:
    """Fisher's method: -2 sum log p ~ chi^2_{2W} for W independent p-values."""
    p = np.clip(np.asarray(p, dtype=float), 1e-300, 1.0)
    return float(special.chdtrc(2 * len(p), -2.0 * np.log(p).sum()))


def window(estimates: Sequence[EtaEstimate] | EtaColumns) -> EtaEstimate:
    """A window of consecutive step pairs priced as a ratio of sums; the rows are independent
    samples, so their covariances add."""
    if isinstance(estimates, EtaColumns):
        return _window_of_columns(estimates)
    first, last = estimates[0], estimates[-1]
    return _with_bias_bound(EtaEstimate(
        step_pair=(first.step_pair[0], last.step_pair[1]), kind=first.kind,
        kl_min=sum(e.kl_min for e in estimates), kl_min_debiased=sum(e.kl_min_debiased for e in estimates),
        d_t=sum(e.d_t for e in estimates), p_value=fisher_combined([e.p_value for e in estimates]),
        cov=np.sum([e.cov for e in estimates], axis=0),
        dof=sum(e.dof for e in estimates), converged=all(e.converged for e in estimates),
        steps=sum(e.steps for e in estimates), d_t_tail=sum(e.d_t_tail for e in estimates)))


def _with_bias_bound(e: EtaEstimate) -> EtaEstimate:
    """A paired window (the run's eta is one) with its bias bound, as a row has its own
    (``moderate``): the size of its sums' bias correction, |sum KL_min - sum KL_jk| / sum D_t. Its
    interval then covers a bias up to what the correction took out, as each row's does. Without it,
    the run's interval on the truth harness's collapsing record (AVX512 kernels), 0.358 [0.210,
    0.459], missed the truth 0.206: the jackknife had taken 0.114 out of a plug-in 0.472, more than
    twice the interval's SE, and the interval said nothing of what that correction might have left.
    Unpaired windows, whose rows have no bound, are handed back as they are; so is a window whose
    D_t is not a positive number (its interval is not stated on it)."""
    if e.kind != "paired" or not (e.d_t > 0 and math.isfinite(e.d_t)):
        return e
    bound = abs(e.kl_min - e.kl_min_debiased) / e.d_t
    # an infinite bound is kept, as a row's is (``moderate``): its interval is then unbounded
    return e if math.isnan(bound) else dataclasses.replace(e, bias_bound=bound)


def _window_of_columns(c: EtaColumns) -> EtaEstimate:
    """``window`` of the estimates in ``c``, in their order, from the columns: the same sums of
    the same floats in the same order (Python's ``sum`` of each column's values)."""
    return _with_bias_bound(EtaEstimate(
        step_pair=(int(c.step_pair[0, 0]), int(c.step_pair[-1, 1])), kind=c.kind,
        kl_min=sum(c.kl_min.tolist()), kl_min_debiased=sum(c.kl_min_debiased.tolist()), d_t=sum(c.d_t.tolist()),
        p_value=fisher_combined(c.p_value), cov=np.sum(np.ascontiguousarray(c.cov), axis=0),
        dof=sum(c.dof.tolist()), converged=bool(c.converged.all()), steps=sum(c.steps.tolist()),
        d_t_tail=0.0 if c.d_t_tail is None else sum(c.d_t_tail.tolist())))


def windows(estimates: Sequence[EtaEstimate], w: int | str) -> list[EtaEstimate]:
    """Consecutive step pairs grouped into windows of ``w`` (a gap in the steps starts a new
    window), or ``"adaptive"``: merged until the window's combined p-value is below FDR_Q.
    Adaptive windows are chosen by looking at the p-values, so the book-wide decision over
    them is exploratory; the report says so."""
    if w == 1:
        return list(estimates)
    out: list[EtaEstimate] = []
    cur: list[EtaEstimate] = []
    for e in estimates:
        if cur and e.step_pair[0] != cur[-1].step_pair[1]:
            out.append(window(cur))
            cur = []
        cur.append(e)
        full = len(cur) == w if w != "adaptive" else fisher_combined([c.p_value for c in cur]) <= FDR_Q
        if full:
            out.append(window(cur))
            cur = []
    if cur:
        out.append(window(cur))
    return out


def run_level(estimates: Sequence[EtaEstimate] | EtaColumns) -> EtaEstimate | None:
    """The run's efficiency: sum KL_jk / sum D_t over every priced step pair (``window`` of all
    of them: the rows are separate samples, so their covariances add), or None when none is
    priced. Not selected on significance."""
    if isinstance(estimates, EtaColumns):
        return window(estimates) if len(estimates) else None
    return window(list(estimates)) if estimates else None


def headline(resolved: Sequence[EtaEstimate] | EtaColumns, seed: int = 0) -> tuple[float | None, tuple[float, float] | None]:
    """The median debiased eta over the resolved rows that have an interval (``estimable``), and a
    95 % interval for that median (each row drawn from N(eta_debiased, se^2), the median taken per
    draw). Selected on significance, so it leans high: reported beside ``run_level``, never
    instead of it."""
    if isinstance(resolved, EtaColumns):  # the same values, from the columns
        resolved = resolved.take(resolved.estimable)
        if not len(resolved):
            return None, None
        pts, ses = resolved.eta_debiased, resolved.se
    else:
        resolved = [e for e in resolved if e.estimable]
        if not resolved:
            return None, None
        pts = np.array([e.eta_debiased for e in resolved])
        ses = np.array([e.se for e in resolved])
    med = float(np.median(pts))
    if not np.isfinite(ses).all():
        return med, None
    draws = np.random.default_rng(seed).normal(pts, ses, size=(N_DRAWS, len(pts)))
    lo, hi = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return med, (float(lo), float(hi))
