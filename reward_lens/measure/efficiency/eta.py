"""Efficiency as a measurement: a point, a null expectation, an interval, a p-value, and a
decision across the book's rows.

For a **paired** ledger (one sample of pi_{t+1} scored under both policies) the number is
exact on the sample: eta = KL_min / D_hat with KL_min the I-projection (``iproj``) and D_hat
the same sample's KL(pi_{t+1} || pi_t), so 0 <= eta <= 1 by construction. To second order
eta is the within-group R^2 of the per-sequence log-ratio r on the features, which fixes two
things:

* its bias under the null: with d = n - G within-group degrees of freedom and k features,
  E[R^2] = k / d when the features explain nothing (R^2 ~ Beta(k/2, (d-k)/2) for Gaussian r),
  so every row carries ``null = k/d`` and ``eta_debiased = (eta - null) / (1 - null)``;
* its test: the F-test of the within-group regression of r on z, whose p-value feeds the
  book-wide Benjamini-Hochberg decision.

For an **unpaired** ledger (two samples) eta = KL_min / D_t with D_t from the record; the
noise floor 1/2 tr(G^-1 Sigma_dz) is the null expectation of KL_min, ``eta_debiased`` subtracts
it, and the p-value is the Wald test of dz = 0 (dz^T Sigma^-1 dz ~ chi^2_k).

Intervals: 95 % intervals of ``eta_debiased`` from a delta-method standard error of the
ratio, with the covariance of (KL_min, D_t, null) by the delete-one-group jackknife (paired:
prompt groups are the independent units; t quantile with G - 1 degrees of freedom) or from
draws of dz from its sampling law (unpaired). (A group bootstrap is not used: resampling
with replacement repeats groups, which inflates an R^2-like statistic by more than its
null correction removes.) Windows of W step pairs are priced as a ratio of sums, with the
rows' covariances added. Seeded by the step pair, so a report is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import special  # the distribution functions scipy.stats wraps, without its import cost

from reward_lens.measure.efficiency.iproj import i_projections
from reward_lens.measure.ledger.paired import PairedLedger
from reward_lens.measure.ledger.price import Ledger

# Monte Carlo draws (unpaired KL_min variance; the headline median's interval): the 2.5 %
# and 97.5 % percentiles of 400 draws are each set by ~10 draws, enough for an interval
# reported to two significant figures.
N_DRAWS = 400
# False discovery rate of the book-wide decision "resolved" (Benjamini & Hochberg 1995).
FDR_Q = 0.05


@dataclass(frozen=True, eq=False)
class EtaEstimate:
    """eta of one step pair (or window), before the book-wide decision.

    ``cov`` is the sampling covariance of (KL_min, D_t, null) -- by the jackknife over prompt
    groups (paired) or from draws of dz (unpaired) -- so a window's ratio of sums gets its
    standard error by the delta method."""

    step_pair: tuple[int, int]
    kind: str  # "paired" | "unpaired"
    kl_min: float  # nats per sequence: exact (paired) or quadratic (unpaired)
    d_t: float  # nats per sequence: the denominator this eta uses
    null_kl: float  # nats per sequence: what KL_min reads from noise alone, in expectation
    p_value: float
    cov: np.ndarray  # (3, 3) covariance of (kl_min, d_t, null_kl)
    dof: float = float("inf")  # degrees of freedom of the SE (jackknife: G - 1)
    converged: bool = True
    steps: int = 1  # step pairs in the window

    @property
    def eta(self) -> float:
        return self.kl_min / self.d_t

    @property
    def eta_null(self) -> float:
        return self.null_kl / self.d_t

    @property
    def eta_debiased(self) -> float:
        return _debias(self.kl_min, self.d_t, self.null_kl)

    @property
    def se(self) -> float:
        """Delta-method SE of eta_debiased = (K - N) / (D - N)."""
        k, d, n = (np.float64(v) for v in (self.kl_min, self.d_t, self.null_kl))
        den = d - n
        if not den > 0:
            return float("inf")
        with np.errstate(all="ignore"):  # overflow at absurd scales reads as an infinite SE
            grad = np.array([1.0 / den, -(k - n) / den / den, (k - d) / den / den])
            var = float(grad @ self.cov @ grad)
        return math.sqrt(var) if var >= 0 else (float("inf") if not np.isfinite(var) else 0.0)

    def interval(self) -> tuple[float, float]:
        """95 % interval of eta_debiased: t quantile with the SE's degrees of freedom."""
        q = _t975(self.dof)
        e, se = self.eta_debiased, self.se
        return (e - q * se, e + q * se)


@lru_cache(maxsize=256)
def _t975(dof: float) -> float:
    """The 97.5 % quantile of Student's t with ``dof`` degrees of freedom (normal for infinite):
    a book's rows share a few dof values, so each is worked out once."""
    return float(special.stdtrit(dof, 0.975)) if np.isfinite(dof) else 1.959963984540054


def _debias(kl, d, null):
    """(KL_min - null) / (D - null): eta with the null expectation taken out, in eta units
    ((eta - nu) / (1 - nu), nu = null / D)."""
    if kl.__class__ is float and d.__class__ is float and null.__class__ is float and d - null != 0:
        return (kl - null) / (d - null)  # one row's numbers: the same division, without numpy's machinery
    kl, d, null = np.asarray(kl, float), np.asarray(d, float), np.asarray(null, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (kl - null) / (d - null)
    return float(out) if out.ndim == 0 else out


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


def paired_estimate(lg: PairedLedger, active_idx: np.ndarray, p_value: float | None = None) -> EtaEstimate:
    """eta on the paired sample; its covariance by the delete-one-group jackknife (groups are
    the independent units; each replicate's null uses its own degrees of freedom).
    ``p_value``: the row's F-test, where the caller has it already (else computed here)."""
    return paired_estimates([(lg, active_idx, p_value)])[0]


def paired_estimates(items: Sequence[tuple[PairedLedger, np.ndarray, float | None]]) -> list[EtaEstimate]:
    """``paired_estimate`` of many step pairs: those whose samples share a group layout and an
    active set are projected in one batch (``i_projections``), the same numbers to rounding."""
    out: list[EtaEstimate | None] = [None] * len(items)
    batches: dict[tuple, list[int]] = {}
    orders = []
    for q, (lg, idx, _) in enumerate(items):
        order = np.argsort(lg.codes, kind="stable")  # groups contiguous, as i_projections needs
        orders.append(order)
        key = (lg.n_groups, np.asarray(lg.codes)[order].tobytes(), tuple(np.asarray(idx).tolist()))
        batches.setdefault(key, []).append(q)
    for (g, _, idx), members in batches.items():
        idx = np.array(idx, dtype=int)
        lg0 = items[members[0]][0]
        codes = np.asarray(lg0.codes)[orders[members[0]]]
        weights = np.vstack([np.ones((1, g)), 1.0 - np.eye(g)])
        z = np.stack([items[q][0].z[orders[q]][:, idx] for q in members])
        r = np.stack([np.asarray(items[q][0].log_ratio, dtype=np.float64)[orders[q]] for q in members])
        projs = i_projections(z, r, codes, g, weights)
        k = len(idx)
        d = len(codes) - g
        sizes = np.bincount(codes, minlength=g)
        dofs = np.concatenate([[d], d - (sizes - 1)])  # deleting group j removes m_j rollouts and 1 group mean
        nu = np.where(dofs > 0, k / np.maximum(dofs, 1), 1.0)
        for q, proj in zip(members, projs):
            lg, _, p_value = items[q]
            p = p_value if p_value is not None else within_group_r2_test(lg.z[:, idx], lg.log_ratio, lg.codes, g)[1]
            theta = np.stack([proj.kl_min, proj.d_hat, nu * proj.d_hat], axis=1)  # (1 + G, 3)
            jk = theta[1:]
            cov = (g - 1) / g * (jk - jk.mean(axis=0)).T @ (jk - jk.mean(axis=0))
            out[q] = EtaEstimate(step_pair=lg.step_pair, kind="paired", kl_min=float(theta[0, 0]),
                                 d_t=float(theta[0, 1]), null_kl=float(theta[0, 2]), p_value=p, cov=cov, dof=g - 1,
                                 converged=bool(proj.converged.all()), steps=lg.step_pair[1] - lg.step_pair[0])
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
                      d_t: float, p: float) -> EtaEstimate:
    """eta = KL_min / D_t on a two-sample ledger; the variance of KL_min from draws of dz from
    its sampling law (D_t and the floor taken as known)."""
    dz = lg.delta_z[active_idx]
    sigma = lg.cov_delta[np.ix_(active_idx, active_idx)]
    rng = np.random.default_rng(_seed(lg.step_pair))
    draws = rng.multivariate_normal(dz, sigma, size=N_DRAWS, method="eigh")
    kl_b = 0.5 * np.einsum("bi,ij,bj->b", draws, np.linalg.inv(g_active), draws)
    cov = np.zeros((3, 3))
    cov[0, 0] = float(np.var(kl_b, ddof=1))
    return EtaEstimate(step_pair=lg.step_pair, kind="unpaired", kl_min=kl_min, d_t=d_t, null_kl=noise_floor,
                       p_value=p, cov=cov)


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


def window(estimates: Sequence[EtaEstimate]) -> EtaEstimate:
    """A window of consecutive step pairs priced as a ratio of sums; the rows are independent
    samples, so their covariances add."""
    first, last = estimates[0], estimates[-1]
    return EtaEstimate(
        step_pair=(first.step_pair[0], last.step_pair[1]), kind=first.kind,
        kl_min=sum(e.kl_min for e in estimates), d_t=sum(e.d_t for e in estimates),
        null_kl=sum(e.null_kl for e in estimates), p_value=fisher_combined([e.p_value for e in estimates]),
        cov=np.sum([e.cov for e in estimates], axis=0),
        dof=sum(e.dof for e in estimates), converged=all(e.converged for e in estimates),
        steps=sum(e.steps for e in estimates))


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


def headline(resolved: Sequence[EtaEstimate], seed: int = 0) -> tuple[float | None, tuple[float, float] | None]:
    """Median debiased eta over the resolved rows, and a 95 % interval for that median: each
    row drawn from N(eta_debiased, se^2) (rows are independent samples), the median taken per
    draw, and the 2.5 / 97.5 % percentiles of those medians."""
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
