"""The paired ledger: step t priced on samples independent of its update, from both sides.

The unpaired (two-sample) ledger compares step t's rollouts with step t+1's: different
samples of different prompts, so its dz carries sampling noise of order 1/sqrt(n) whatever
the step size, while D_t shrinks with the step squared. The paired ledger prices the step
(t, t+1) on samples no gradient of that step touched, each scored under *both* policies
(r_i = log pi_{t+1}(y_i) - log pi_t(y_i), the record's ``logp_pre - logp_prev``), grouped by
the prompts of step t+1:

* side b, always: step t+1's rollouts, y ~ pi_{t+1} (drawn before any gradient touched them);
* side a, where the tap drew them (``heldout``): h held-out completions per prompt from pi_t,
  never in the loss, scored under pi_{t+1} after the step.

The two sides are combined by multiple importance sampling with the balance heuristic (Veach &
Guibas 1995): within a prompt group with n_a held-out and n_b rollouts, every sample y is a
draw from the mixture n_a pi_t + n_b pi_{t+1}, and its self-normalised weights towards the two
policies are

    q(y) prop. to pi_{t+1}(y) / (n_a pi_t(y) + n_b pi_{t+1}(y)) = 1 / (n_a e^{-r} + n_b),
    p(y) prop. to pi_t(y)     / (n_a pi_t(y) + n_b pi_{t+1}(y)) = 1 / (n_a + n_b e^{r}),

each at most 1/n of its own side: no sample dominates either expectation. Then
dz_g = E_q[z] - E_p[z], dz = mean over groups, Sigma_dz = Cov_g(dz_g) / G (groups are the
independent units), and D_t is the token-level KL(pi_{t+1} || pi_t) summed along each sample's
prefixes, weighted by q (chain rule: unbiased for D_t, the Rao-Blackwellised form of E_q[r]).
Without held-out samples (n_a = 0) q is uniform and p prop. to e^{-r}: the one-sided paired
ledger, Price's covariance form dz_g = -(m_g) Cov_g(p_g, z).

Why both sides. Reweighting pi_{t+1}'s samples towards pi_t is the heavy-tailed direction
when a step sharpens the policy (pi_{t+1} narrower than pi_t, RL's usual dynamic): what pi_t
did and pi_{t+1} stopped doing is rarely in pi_{t+1}'s sample at all. Measured by
``tools/truth.py`` against 512 fresh samples per prompt from both policies, on a run whose
correctness collapses (the task recipe at lr 3e-3, 59 step pairs x 6 features, 8 rollouts per
prompt): the one-sided ledger's dz is biased beyond 3 standard errors in 92 of 331 cells; with
h = 2 held-out completions per prompt in 1, with h = 4 in none.

Under a cost budget the tap scores only a uniformly random subset of a step's prompt groups
(``logp_prev``, ``kl_prev``, ``logp_prev_step`` null on every rollout of the others, held-out
rows only for scored groups). The ledger then prices the step pair on the scored groups alone,
each unscored group dropped whole: the subset was drawn independently of every sampled value,
so the mean over scored groups is unbiased for the batch's. Its SE must then hold the sampling of
those n groups from the step's N as well as the sampling of completions within them (two-stage
sampling, Cochran 1977, sec. 10.2 and 11.2, the second stage from an unbounded population):

    Var = (1 - n/N) s_b^2 / n + (n/N) Var_within,

s_b^2 the spread across the measured groups of their estimates (which holds their within-group
noise too: hence the second term carries only n/N of the conditional variance ``Var_within``,
the stratified jackknife's below), for dz and D_t alike (``group_sampling``). Its degrees of
freedom are Welch-Satterthwaite's over the two terms: the between-group term's n - 1 wherever it
dominates. At n = N the first term vanishes and the SE is the conditional one unchanged (a run
at ``budget=None``). With one scored group the spread across groups is not identified, and the
pair is refused by name (``few_groups``). KL_min and eta are not touched here: their SEs are the
delete-one-group jackknife's (``efficiency.eta``), which already count the sampling of the groups
(as from an unbounded population: without the (1 - n/N) factor, the wider side).
``PairedLedger.n_groups`` of ``groups_in_step`` says how many were used. A group scored on some
rows and not others breaks that contract, and the step pair is refused by name
(``partly_scored_group``) rather than priced on a guess.

Never on the rollouts the step trained on: there log pi_{t+1}/pi_t is inflated by the update
itself (GRPO raises the log-probability of positive-advantage rollouts), which is why the
record's ``logp_post`` is never read here.

Premise checks, in each direction used. One-sided, the weights pi_t / pi_{t+1} are unbounded
and must not be too heavy-tailed for self-normalised importance sampling: ``pareto_khat`` fits
a generalised Pareto distribution to their upper tail (Vehtari et al. 2024, "Pareto smoothed
importance sampling", JMLR 25(72)); above min(1 - 1/log10 S, 0.7) the estimate is unreliable.
Two-sided, every weight is bounded (at most 1/n of its side), so k-hat does not apply. Either
way each direction's effective sample size (sum_g 1 / sum_i w_i^2) must be at least
``MIN_ESS_PER_GROUP`` per group. A step pair that fails is refused by name in every book that
reads its dz.
"""

from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from reward_lens.measure.mismatch import GroupKL, group_kl, moderated_kl_se
from reward_lens.measure.ledger.price import (Ledger, LedgerArrays, LedgerBlock, StepSample, blocks, group_codes,
                                              in_threads, sample_codes, stack_range, stacked)


# Each direction's effective sample size must reach this many per prompt group (on average):
# below it a self-normalised expectation rests on about one sample of a group, and its
# standard error across groups no longer says how far it can be off.
MIN_ESS_PER_GROUP = 1.5

# The rollouts must be samples of pi_{t+1}. Where an inference engine sampled them (vLLM) and
# recorded its own log-probabilities, KL(pi_sampler || pi_{t+1}) along them (nats per sequence)
# may be at most this share of the step's D_t, beyond twice its standard error: past it the
# sampler's departure from the policy is a large part of what the ledger would read as the step.
SAMPLER_KL_MAX_SHARE = 0.1


@dataclass(frozen=True, eq=False)
class PairedLedger(Ledger):
    """A Ledger made from samples independent of the step, scored under pi_t and pi_{t+1}:
    step t+1's rollouts and, where recorded, held-out completions of pi_t (``heldout``)."""

    z: np.ndarray | None = None  # (n, k) features of the combined sample
    codes: np.ndarray | None = None  # (n,) group code 0..G-1 of each row
    n_groups: int = 0
    log_ratio: np.ndarray | None = None  # (n,) r_i = log pi_{t+1}(y_i) - log pi_t(y_i)
    heldout: np.ndarray | None = None  # (n,) True for pi_t's held-out completions; None: none recorded
    kl: np.ndarray | None = None  # (n,) token KL(pi_{t+1} || pi_t) summed along each row's prefixes
    d_hat: float = float("nan")  # mean_g KL(q_g || p_g): the same sample's plug-in, nats/seq (>= its KL_min)
    d_t: float | None = None  # D_t = mean_g E_q[kl]: the token-level KL along the sample, nats/seq
    # its standard error: conditional on the prompts (``Strata``) where every group of the step was
    # scored, with the sampling of the scored groups from the step's added where not (``group_sampling``)
    d_t_se: float | None = None
    d_t_dof: float = float("nan")  # the degrees of freedom of that SE (Welch-Satterthwaite over the strata)
    # what its interval's upper end adds for the tail a sharpened policy's sample did not hold, nats/seq
    # (``tail_allowance``; 0 where no prompt group is sharpened)
    d_t_tail: float | None = None
    dof: np.ndarray | None = None  # (k,) the degrees of freedom of each feature's SE, likewise
    pareto_k: float = float("nan")  # PSIS k-hat of the weights pi_t / pi_{t+1} (one-sided; NaN two-sided: bounded)
    pareto_k_max: float = 0.7
    ess: tuple[float, float] = (float("nan"), float("nan"))  # effective sample sizes towards (pi_t, pi_{t+1})
    dropped_rollouts: int = 0  # rollouts in groups of one (no within-group information)
    # the step's prompt groups, scored or not, and those the tap did not score under a cost budget
    # (dropped whole): n_groups of groups_in_step were used
    groups_in_step: int = 0
    groups_unscored: int = 0
    # KL(pi_sampler || pi_{t+1}) along the rollouts (mean over groups of log pi_sampler - log pi_{t+1})
    # and its SE, where the record has the sampler's log-probabilities (vLLM); None where it has not.
    # In a run's series of ledgers (``paired_ledger_series``) the SE is the engine-mismatch series'
    # (each pair's own moderated across its neighbours, ``measure.mismatch.moderated_kl_se``), the
    # pair's own sample's beside it (a ledger made alone: the two are its own)
    sampler_kl: float | None = None
    sampler_kl_se: float | None = None
    sampler_kl_se_own: float | None = None
    sampler_kl_dof: float | None = None  # the own SE's degrees of freedom and the units its variance is a mean
    sampler_kl_size: int = 0  # over (measure.mismatch.GroupKL)
    sampler_kl_within: bool = True  # GroupKL.within: the own SE is within the groups (False: across them)
    # the block of ledgers this one was made in, and its row there (``price.LedgerBlock``)
    block: LedgerBlock | None = field(default=None, repr=False)
    row: int = field(default=-1, repr=False)

    @cached_property
    def n_heldout(self) -> int:  # read per row by several books: counted once (the arrays are read-only)
        return int(self.heldout.sum()) if self.heldout is not None else 0

    @property
    def sides(self) -> str:
        """"two-sided" with held-out samples of pi_t, else "one-sided"."""
        return "two-sided" if self.n_heldout else "one-sided"

    def premise(self) -> str | None:
        """None when the weights hold the premises of self-normalised importance sampling in
        every direction used, and the rollouts are the policy's own samples; else the premise that
        failed: "sampler_mismatch", "heavy_tails" or "low_ess"."""
        if self.sampler_mismatch:
            return "sampler_mismatch"
        if self.pareto_k > self.pareto_k_max:
            return "heavy_tails"
        used = self.ess if self.n_heldout else self.ess[:1]
        if any(not e >= MIN_ESS_PER_GROUP * self.n_groups for e in used):
            return "low_ess"
        return None

    @property
    def sampler_mismatch(self) -> bool:
        """The sampling engine departs from pi_{t+1} by more than SAMPLER_KL_MAX_SHARE of D_t
        (the plug-in D_hat where there is no token KL), beyond twice its standard error.

        The estimator and its SE are the engine-mismatch series' (``measure.mismatch``: ``group_kl``
        on the pair's rows, the SE moderated across the run's pairs as the series' is across its
        steps), and the line, a tenth of D_t, is the finding ``engine_mismatch``'s. What differs is
        the decision, on purpose: this refuses one step pair, on that pair's evidence alone, at 2
        SE (a one-sided 2.3 % at the line: a pair wrongly kept costs a dz read off another
        policy's samples, a pair wrongly refused costs one priced step); the finding is a
        sequential claim about the run, checked at every step, which must stay quiet over a
        1,000-step run at its boundary, so it asks 3 SE at two steps in a row or a CUSUM of the
        scores past 5 (reading its t on the step's groups less one). A pair can be refused
        where the finding, needing evidence over steps, has not yet held."""
        if self.sampler_kl is None:
            return False
        d = self.d_t if self.d_t is not None else self.d_hat
        se = self.sampler_kl_se if self.sampler_kl_se is not None and self.sampler_kl_se == self.sampler_kl_se else 0.0
        return bool(self.sampler_kl - 2.0 * se > SAMPLER_KL_MAX_SHARE * max(d, 0.0))


def mis_log_weights(log_ratio: np.ndarray, heldout: np.ndarray | None, codes: np.ndarray, n_groups: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The balance-heuristic weights of every row within its group: ``(log q, log p, log w_q,
    log w_p)``, q towards pi_{t+1} and p towards pi_t, self-normalised within each group, and
    the raw weights w they were normalised from (1 / (n_a e^{-r} + n_b) and 1 / (n_a + n_b e^r),
    each at most 1/n of its side). Rows may be stacked (P, n) over samples of one layout."""
    r = np.asarray(log_ratio, dtype=np.float64)
    onehot = np.zeros((len(codes), n_groups))
    onehot[np.arange(len(codes)), codes] = 1.0
    size = onehot.sum(axis=0)
    n_a = (heldout.astype(np.float64) @ onehot) if heldout is not None else np.zeros(n_groups)
    n_b = size - n_a
    with np.errstate(divide="ignore"):
        la, lb = np.log(n_a)[codes], np.log(n_b)[codes]
    lwq = -np.logaddexp(la - r, lb)
    lwp = -np.logaddexp(la, lb + r)
    return lwq - _group_lse(lwq, codes, onehot), lwp - _group_lse(lwp, codes, onehot), lwq, lwp


def _group_lse(x: np.ndarray, codes: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """log sum exp of ``x`` (..., n) within each group, broadcast back to the rows: by a reshape
    where the groups are equal consecutive ``blocks`` (TRL's layout), else through ``onehot``."""
    g = onehot.shape[1]
    m = blocks(codes, g)
    if m:
        xb = x.reshape(*x.shape[:-1], g, m)
        gmax = xb.max(axis=-1)  # (..., G)
        return np.repeat(gmax + np.log(np.exp(xb - gmax[..., None]).sum(axis=-1)), m, axis=-1)
    # each group's maximum (a maximum is the same in any order): its rows made contiguous, one
    # reduceat, instead of a (..., G, n) temporary
    order = np.argsort(codes, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(codes[order]) != 0])
    gmax = np.full((*x.shape[:-1], g), -np.inf)
    gmax[..., codes[order[starts]]] = np.maximum.reduceat(x[..., order], starts, axis=-1)
    return (gmax + np.log(np.exp(x - gmax[..., codes]) @ onehot))[..., codes]


class Segments:
    """Rows laid out as consecutive segments, in each of which every prompt group 0..G-1 has the
    same m_s rows, one group after another: TRL's rollouts (one segment), a tapped record's
    rollouts and then its held-out completions (two, of m_b and m_a rows a group). With each
    segment on one side (the held-out rows, or the rollouts) and no two on the same side, a
    (group, side) stratum (``Strata``) is one group's block of one segment, and the stratified
    jackknife's sums over strata are sums over the m_s rows of (G, m_s, ...) views.

    Its arithmetic takes arrays laid out rows first, (n, P, ...) for P samples of the layout:
    a sum over a block of rows is then m_s - 1 additions of contiguous (P, ...) slabs, where on
    (P, n, ...) it is a reduction over a short strided axis (10x the cost of one pass over the
    array in numpy) or a one-hot product and a gather back onto the rows."""

    MAX_SEGMENTS = 4

    def __init__(self, spans: tuple[tuple[int, int, bool], ...], n_groups: int):
        self.spans = spans  # (first row, rows a group, side) of each segment
        self.n_groups = n_groups

    @classmethod
    def of(cls, codes: np.ndarray, n_groups: int, side: np.ndarray | None = None) -> Segments | None:
        """The segments of ``codes`` (n,) with the sides ``side`` (n,) bool or None (every row
        side b), where the rows are so laid out and each side is one segment; else None."""
        codes = np.asarray(codes)
        n = len(codes)
        if not n_groups or not n:
            return None
        spans, lo = [], 0
        while lo < n:
            if len(spans) == cls.MAX_SEGMENTS or codes[lo] != 0:
                return None
            run = codes[lo:lo + n // n_groups + 1] != 0
            m = int(np.argmax(run)) if run.any() else len(run)
            hi = lo + m * n_groups
            if hi > n or not (codes[lo:hi].reshape(n_groups, m) == np.arange(n_groups)[:, None]).all():
                return None
            on = False if side is None else bool(side[lo])
            if side is not None and not (np.asarray(side[lo:hi]) == on).all():
                return None
            spans.append((lo, m, on))
            lo = hi
        if len({on for _, _, on in spans}) != len(spans):
            return None
        return cls(tuple(spans), n_groups)

    def parts(self, xt: np.ndarray) -> list[np.ndarray]:
        """Each segment's rows of xt (n, ...) as a (G, m_s, ...) view."""
        g = self.n_groups
        return [xt[lo:lo + g * m].reshape(g, m, *xt.shape[1:]) for lo, m, _ in self.spans]

    def deleted_means(self, wt: np.ndarray, xt: np.ndarray) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """For weights wt (n, P) normalised within each group and values xt (n, P, k): the
        w-weighted group means (G, P, k), and ``Strata.deleted_means`` (each row's group's mean
        with that row deleted from its stratum) of each segment as (G, m_s, P, k), None for a
        segment of one row a group (its strata cannot lose a row). The same arithmetic."""
        wparts, xparts = self.parts(wt), self.parts(xt)
        wx = [w[..., None] * x for w, x in zip(wparts, xparts)]
        sums = [a.sum(axis=1) for a in wx]  # (G, P, k) each stratum's sum
        gm = sums[0]
        for t in sums[1:]:
            gm = gm + t
        out = []
        for (_, m, _), w, a, t in zip(self.spans, wparts, wx, sums):
            if m < 2:
                out.append(None)
                continue
            f = m / (m - 1)  # the other rows' weight after a deletion
            norm = 1.0 + (f - 1.0) * w.sum(axis=1, keepdims=True) - f * w  # (G, m, P)
            # a row that carried all of its group's weight leaves no weight behind: NaN (``Strata``)
            norm = np.where(norm > 0, norm, np.nan)
            a *= -f  # (gm + (f - 1) S) - f w x, in place
            a += (gm + (f - 1.0) * t)[:, None]
            a /= norm[..., None]
            out.append(a)
        return gm, out

    def jackknife(self, theta: list[np.ndarray | None], n_pairs: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``Strata.jackknife`` of the replicates theta, each segment's (G, m_s, P, k) (None:
        a segment whose strata cannot lose a row): the covariance (P, k, k) and each diagonal
        entry's degrees of freedom (P, k)."""
        cov = np.zeros((n_pairs, k, k))
        total, den = np.zeros((n_pairs, k)), np.zeros((n_pairs, k))
        for (_, m, _), t in zip(self.spans, theta):
            if t is None:
                continue
            dev = t - t.sum(axis=1, keepdims=True) / m
            weight = (m - 1) / m  # the stratum's (n_s - 1) / n_s
            rows = dev.reshape(-1, n_pairs, k)
            cov += weight * np.matmul(rows.transpose(1, 2, 0), rows.transpose(1, 0, 2))
            v = weight * (dev * dev).sum(axis=1)  # (G, P, k) each stratum's share
            total += v.sum(axis=0)
            den += (v * v).sum(axis=0) / (m - 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            dof = np.where(den > 0, total ** 2 / np.where(den > 0, den, 1.0), np.nan)
        return cov, dof


def group_log_weights(log_ratio: np.ndarray, codes: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """log p_g(i), the self-normalised log weight pi_t/pi_{t+1} of each rollout within its group
    (one-sided: every row drawn from pi_{t+1}), and D_g = KL(u_g || p_g) = mean_i (-log m_g -
    log p_g(i)) = mean r + log mean exp(-r) per group (>= 0 by Jensen; to second order
    1/2 Var_g(r))."""
    lw = -np.asarray(log_ratio, dtype=np.float64)
    size = np.bincount(codes, minlength=n_groups).astype(np.float64)
    gmax = np.full(n_groups, -np.inf)
    np.maximum.at(gmax, codes, lw)
    lse = gmax + np.log(np.bincount(codes, weights=np.exp(lw - gmax[codes]), minlength=n_groups))
    logp = lw - lse[codes]
    d_g = np.bincount(codes, weights=-np.log(size)[codes] - logp, minlength=n_groups) / size
    return logp, d_g


def pareto_threshold(s: int) -> float:
    """The sample-size dependent k-hat threshold min(1 - 1/log10 S, 0.7) (Vehtari et al. 2024, sec. 3)."""
    return min(1.0 - 1.0 / math.log10(s), 0.7) if s > 10 else 0.0


def pareto_khat(log_w: np.ndarray) -> float:
    """PSIS's k-hat: the shape of a generalised Pareto fitted to the largest
    M = min(S/5, 3 sqrt S) weights, above the next largest (Vehtari et al. 2024, sec. 3).

    The fit is Zhang & Stephens' (2009) empirical-Bayes estimate (Technometrics 51(3)), with
    m = 80 + floor(sqrt M) grid points and PSIS's weakly informative prior pulling the shape
    towards 0.5 with the weight of 10 observations -- the estimator PSIS itself uses, written
    out here because its reference implementations (loo, ArviZ) come with far larger
    dependencies. NaN when the tail has fewer than 5 points (S < 25).
    """
    return float(pareto_khats(np.asarray(log_w, dtype=np.float64).reshape(1, -1))[0])


# Rows of ``pareto_khats`` fitted at a time: the fit holds rows x grid x M floats (~80 x 12 for
# 64 rollouts), so a block of this many of them stays in cache (2 MiB); blocks go to threads
# (numpy releases the GIL inside each array operation; every row's fit is its own): 10,000 rows
# in 2.1x less time than as one batch on one thread (bench/blocks.py).
KHAT_BLOCK_FLOATS = 250_000
KHAT_THREADS = os.cpu_count() or 1


def pareto_khats(log_w: np.ndarray) -> np.ndarray:
    """``pareto_khat`` of each row of ``log_w`` (P, S), in batched passes over blocks of rows."""
    lw = np.asarray(log_w, dtype=np.float64)
    n_rows, s = lw.shape
    m = int(min(0.2 * s, 3 * math.sqrt(s)))
    if m < 5:
        return np.full(n_rows, np.nan)
    step = max(1, KHAT_BLOCK_FLOATS // ((80 + int(math.sqrt(m))) * m))
    los = list(range(0, n_rows, step))
    if len(los) > 1 and KHAT_THREADS > 1:
        with ThreadPoolExecutor(min(KHAT_THREADS, len(los))) as pool:
            parts = list(pool.map(lambda lo: _khats(lw[lo:lo + step], m), los))
    else:
        parts = [_khats(lw[lo:lo + step], m) for lo in los]
    return np.concatenate(parts) if parts else np.zeros(0)


def _khats(lw: np.ndarray, m: int) -> np.ndarray:
    """``pareto_khats`` of a block of rows, M the tail size."""
    w = np.sort(np.exp(lw - lw.max(axis=1, keepdims=True)), axis=1)
    x = w[:, -m:] - w[:, -m - 1:-m]  # exceedances, ascending
    flat = x[:, -1] <= 0  # no tail at all: k-hat -inf
    x = np.where(flat[:, None], 1.0, x)  # (placeholder rows, overwritten below)
    grid = 80 + int(math.sqrt(m))
    quartile = x[:, int(m / 4 + 0.5) - 1]
    # ties at the bottom of the tail (identical completions): the smallest positive gap
    quartile = np.where(quartile > 0, quartile, np.where(x > 0, x, np.inf).min(axis=1))
    b = 1.0 / x[:, -1:] + (1.0 - np.sqrt(grid / (np.arange(1, grid + 1) - 0.5)))[None, :] / 3.0 / quartile[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.log1p(-b[:, :, None] * x[:, None, :]).mean(axis=2)  # profile estimate of the shape at each b
        log_lik = m * (np.log(-b / k) - k - 1.0)
    log_lik = np.where(np.isfinite(log_lik), log_lik, -np.inf)
    weights = np.exp(log_lik - log_lik.max(axis=1, keepdims=True))
    b_post = (b * weights).sum(axis=1) / weights.sum(axis=1)
    shape = np.log1p(-b_post[:, None] * x).mean(axis=1)
    return np.where(flat, -np.inf, (m * shape + 10 * 0.5) / (m + 10))


def has_paired_sample(s: StepSample) -> bool:
    """Step s's rollouts carry log pi_s and log pi_{s-1} on every rollout, and groups."""
    return (s.logp is not None and s.logp_prev is not None and s.groups is not None
            and bool(np.isfinite(s.logp).all()) and bool(np.isfinite(s.logp_prev).all()))


def has_scored_groups(s: StepSample) -> bool:
    """Step s's rollouts carry groups and both log-probabilities on at least one rollout: every
    rollout (``has_paired_sample``), or those of the groups a tap under a cost budget scored."""
    return (s.logp is not None and s.logp_prev is not None and s.groups is not None
            and bool((np.isfinite(s.logp) & np.isfinite(s.logp_prev)).any()))


def scored_rows(sample: StepSample, codes: np.ndarray, n_groups: int) -> np.ndarray | NotFormed:
    """Which rollouts of a partly scored step are scored (log pi_t and log pi_{t-1} both
    finite), where the groups are scored whole or not at all (the budget contract); else why not:
    ``no_logp_prev`` where no rollout is scored, ``partly_scored_group`` (count: such groups)
    where a group has scored and unscored rollouts."""
    if sample.logp is None or sample.logp_prev is None or sample.groups is None:
        return NotFormed("no_logp_prev", sample.step)
    ok = np.isfinite(sample.logp) & np.isfinite(sample.logp_prev)
    if not ok.any():
        return NotFormed("no_logp_prev", sample.step)
    scored = np.bincount(codes, weights=ok, minlength=n_groups)
    size = np.bincount(codes, minlength=n_groups)
    partly = int(((scored > 0) & (scored < size)).sum())
    if partly:
        return NotFormed("partly_scored_group", sample.step, partly)
    return ok


@dataclass(frozen=True)
class NotFormed:
    """Why no ledger could be formed for a step pair: a reason code and the step it concerns
    (its words are in templates/refusals/RECORD_INCOMPLETE/cost.detail.j2)."""

    reason: str  # "no_logp_prev" | "prev_step" | "few_groups" | "one_rollout" | "heldout_unscored" | "partly_scored_group"
    step: int
    count: int | None = None  # few_groups: usable groups; one_rollout: rollouts


def previous_step(sample: StepSample) -> int | NotFormed:
    """The step whose policy the sample is scored under: ``logp_prev_step`` where recorded (a
    generation window when rollouts are reused across steps), else step - 1."""
    if sample.logp_prev_step is None:
        return sample.step - 1
    prev = np.unique(sample.logp_prev_step[np.isfinite(sample.logp_prev_step)])
    if len(prev) != 1 or not 0 <= prev[0] < sample.step:
        return NotFormed("prev_step", sample.step)
    return int(prev[0])


def _previous_steps(samples: Sequence[StepSample]) -> list[int | NotFormed]:
    """``previous_step`` of each sample: for samples that lie one after another in one read
    (``stack_range``), by the least and greatest finite ``logp_prev_step`` of each (one value
    exactly when they are equal), in one pass over the column."""
    where = stack_range(samples, "logp_prev_step")
    if where is None:
        return [previous_step(s) for s in samples]
    st, i0, i1 = where
    lo, hi = int(st.starts[i0]), int(st.starts[i1 - 1] + st.ns[i1 - 1])
    v = st.arrays["logp_prev_step"][lo:hi]
    finite = np.isfinite(v)
    seg = st.starts[i0:i1] - lo
    least = np.minimum.reduceat(np.where(finite, v, np.inf), seg)
    most = np.maximum.reduceat(np.where(finite, v, -np.inf), seg)
    return [int(a) if a == b and math.isfinite(a) and 0 <= a < s.step else NotFormed("prev_step", s.step)
            for s, a, b in zip(samples, least.tolist(), most.tolist())]


def paired_ledger(sample: StepSample, learning_rate: float | None = None, heldout: StepSample | None = None
                  ) -> PairedLedger | NotFormed:
    """The paired ledger of the step pair (previous step, sample.step) -- (t-1, t), or a
    generation window (t-R, t) -- or why it cannot be formed. ``heldout``: pi_t's held-out
    completions for the same prompts (their groups coded as the sample's), where recorded."""
    prep = _prepare(sample, heldout)
    if isinstance(prep, NotFormed):
        return prep
    return _ledgers([(sample, heldout, prep, learning_rate)])[0]


def paired_ledger_series(samples: Sequence[StepSample], eta_by_step: Mapping[int, float] | None = None,
                         heldout: Mapping[int, StepSample] | None = None
                         ) -> tuple[list[PairedLedger], dict[tuple[int, int], NotFormed]]:
    """Paired ledgers for every step whose rollouts are scored under the previous policy (with
    the held-out completions of that policy where ``heldout`` has them for the step), and, for
    the step pairs that could not be formed, why. Steps whose kept rows share a group layout
    are priced as one batch (``_ledgers``)."""
    why = {}
    names = samples[0].names if samples else ()
    heldout = heldout or {}
    batches: dict[tuple, list[int]] = {}
    items = []
    later = [s for s in samples if s.step != 0]
    scored = _scored_flags(later)
    prevs = _previous_steps(later)
    hos = [heldout.get(s.step) for s in later]
    # each held-out side's checks (scored, scored under the same previous policy), for those
    # that _prepare reads: one pass over the held-out read's columns
    ho_ok: list[bool | None] = [None] * len(later)
    looked = [j for j, h in enumerate(hos) if h is not None and h.n and h.groups is not None]
    if looked:
        seen = [hos[j] for j in looked]
        for j, ok, prev in zip(looked, _scored_flags(seen), _previous_steps(seen)):
            ho_ok[j] = ok and prev == prevs[j]
    for s in samples:
        if s.names != names:
            raise ValueError(f"step {s.step} is in basis {s.names}, not {names}: one feature basis per ledger")
    layouts: dict = {}
    for s, ok, prev, ho, hok in zip(later, scored, prevs, hos, ho_ok):
        prep = _prepare(s, ho, ok, prev, hok, layouts)
        if isinstance(prep, NotFormed):
            why[(prev if isinstance(prev, int) else s.step - 1, s.step)] = prep
            continue
        batches.setdefault((prep.n_groups, prep.codes.tobytes(), prep.side.tobytes()), []).append(len(items))
        items.append((s, ho, prep, None if eta_by_step is None else eta_by_step.get(prep.prev)))
    ledgers: list[PairedLedger | None] = [None] * len(items)
    k = len(names)
    blocks_made, tasks = [], []
    for members in batches.values():
        # every ledger's dz, SE and covariance are rows of one array per layout, filled batch by
        # batch: the books stack them back (``ledger_arrays``) without a copy
        count = len(members)
        n = np.full(count, len(items[members[0]][2].codes), dtype=np.int64)  # one layout: one n
        block = LedgerBlock(LedgerArrays(
            names=names, step_pairs=np.array([(items[i][2].prev, items[i][0].step) for i in members],
                                             dtype=np.int64).reshape(count, 2),
            delta_z=np.empty((count, k)), se=np.empty((count, k)), cov_delta=np.empty((count, k, k)), n_pre=n, n_post=n,
            units=np.zeros(count, dtype=np.int64), matched=np.zeros(count, dtype=bool),
            learning_rate=[items[i][3] for i in members], kind="paired"))
        blocks_made.append(block)
        tasks += [(members[lo:lo + LEDGER_BATCH], block, lo) for lo in range(0, count, LEDGER_BATCH)]

    def price(task: tuple) -> list[PairedLedger]:
        part, block, lo = task
        return _ledgers([items[i] for i in part], (block, lo))

    # every batch is its own arithmetic, written to its own rows of its block: on threads, the
    # same numbers (numpy releases the GIL inside each array operation)
    for (part, _, _), got in in_threads(iter(tasks), price):
        for i, lg in zip(part, got):
            ledgers[i] = lg
    for block in blocks_made:
        for a in (block.arrays.delta_z, block.arrays.se, block.arrays.cov_delta):
            a.flags.writeable = False  # read-only from here: ledger_arrays hands out slices of them
    _series_sampler_se(ledgers)
    return ledgers, why


def _series_sampler_se(ledgers: Sequence[PairedLedger]) -> None:
    """Each ledger's ``sampler_kl_se`` made the engine-mismatch series' SE over the run's ledgers
    in step order (``measure.mismatch.moderated_kl_se``: where resolved, its relative variance per
    rollout, or per group where the SE is across groups, pooled with its resolved neighbours' of
    the same kind), the pair's own staying in
    ``sampler_kl_se_own``; a ledger without a finite
    SE of its own keeps what it has and is no one's neighbour. Done once, as the ledgers are made,
    before any book reads their premise."""
    have = sorted((lg for lg in ledgers if lg.sampler_kl_se is not None and lg.sampler_kl_se == lg.sampler_kl_se),
                  key=lambda lg: tuple(lg.step_pair)[::-1])
    if not have:
        return
    se, _ = moderated_kl_se([lg.sampler_kl for lg in have], [lg.sampler_kl_se for lg in have],
                            [lg.sampler_kl_dof for lg in have], [lg.sampler_kl_size for lg in have],
                            [lg.sampler_kl_within for lg in have])
    for lg, v in zip(have, se.tolist()):
        if v == v:
            lg.__dict__["sampler_kl_se"] = v  # frozen: set as _made sets every field


# False: the paired ledgers' sums by one-hot products and gathers whatever the layout (``Segments``
# not used): the tests hold the two to the same numbers.
BY_SEGMENTS = True


# Step pairs priced in one batch at most: the batch's temporaries (P x n x k floats, 1.8 MB at
# 96 rows -- 64 rollouts and 32 held-out -- x 9 features) stay in cache and below the size glibc
# hands back to the kernel on every free, so they are reused instead of faulted in afresh. The
# stratified jackknife makes a dozen such temporaries a batch: 10,000 tapped step pairs priced
# in 1.2 s at 256 a batch against 2.5-3.0 s at 1,024, on one thread (0.96 s against 1.71 s on two).
LEDGER_BATCH = 256


@dataclass(frozen=True)
class _Prepared:
    prev: int
    keep: np.ndarray  # (n,) rollouts in groups of two or more
    keep_heldout: np.ndarray | None  # (n_heldout,) held-out rows of those groups
    codes: np.ndarray  # (n_kept,) group codes of the kept rows: rollouts, then held-out
    n_groups: int
    side: np.ndarray  # (n_kept,) True for held-out rows
    dropped: int = 0  # rollouts in groups of one
    every_heldout: bool = False  # held-out rows, every one of them kept
    groups_in_step: int = 0  # the step's prompt groups, scored or not
    unscored: int = 0  # groups the tap did not score (a cost budget): dropped whole


def _scored_flags(samples: Sequence[StepSample]) -> list[bool]:
    """``has_paired_sample`` of each sample: for samples that lie one after another in the
    report's one read (``stack_range``), one pass over each column of the stack."""
    flags = np.ones(len(samples), dtype=bool)
    for attr in ("logp", "logp_prev"):
        where = stack_range(samples, attr)
        if where is None:
            return [has_paired_sample(s) for s in samples]
        st, i0, i1 = where
        lo, hi = int(st.starts[i0]), int(st.starts[i1 - 1] + st.ns[i1 - 1])
        flags &= np.logical_and.reduceat(np.isfinite(st.arrays[attr][lo:hi]), st.starts[i0:i1] - lo)
    return [bool(f) and s.groups is not None for f, s in zip(flags.tolist(), samples)]


def _scored(s: StepSample) -> bool:
    return (s.logp is not None and s.logp_prev is not None and bool(np.isfinite(s.logp).all())
            and bool(np.isfinite(s.logp_prev).all()))


def _prepare(sample: StepSample, heldout: StepSample | None = None, scored: bool | None = None,
             prev: int | NotFormed | None = None, heldout_ok: bool | None = None,
             layouts: dict | None = None) -> _Prepared | NotFormed:
    """The checks and the group layout of one sample (and its held-out rows), before any
    arithmetic. ``scored``, ``prev`` and ``heldout_ok``: ``has_paired_sample(sample)``,
    ``previous_step(sample)``, and whether the held-out rows are scored under that same previous
    policy, where the caller worked them out for many. ``layouts``: the layouts worked out so
    far, by the group codes of both sides (a run's steps nearly all share one)."""
    live = None  # the scored rollouts, where only some groups are (a cost budget)
    if not (has_paired_sample(sample) if scored is None else scored):
        if sample.groups is None or sample.logp is None or sample.logp_prev is None:
            return NotFormed("no_logp_prev", sample.step)
        live = scored_rows(sample, *sample_codes(sample))
        if isinstance(live, NotFormed):
            return live
    prev = previous_step(sample) if prev is None else prev
    if isinstance(prev, NotFormed):
        return prev
    codes, n_groups = sample_codes(sample)
    has_heldout = heldout is not None and heldout.n and heldout.groups is not None
    ho_codes = np.asarray(heldout.groups, dtype=np.int64) if has_heldout else None
    unscored = 0
    if live is not None:
        scored_group = np.bincount(codes[live], minlength=n_groups) > 0
        unscored = int(n_groups - scored_group.sum())
        if ho_codes is not None:
            # held-out rows of a group whose rollouts were not scored: the group is neither
            # scored whole nor left out whole
            inside = ho_codes < n_groups
            stray = np.unique(ho_codes[inside][~scored_group[ho_codes[inside]]])
            if len(stray):
                return NotFormed("partly_scored_group", sample.step, len(stray))
    if layouts is None:
        paired_groups, layout = _layout(codes, n_groups, ho_codes, live=live)
    else:
        key = (n_groups, np.asarray(codes).tobytes(), None if ho_codes is None else ho_codes.tobytes(),
               None if live is None else live.tobytes())
        if key not in layouts:
            layouts[key] = _layout(codes, n_groups, ho_codes, shared=True, live=live)
        paired_groups, layout = layouts[key]
    if paired_groups < 2:
        return NotFormed("few_groups", sample.step, paired_groups)
    if has_heldout and not (_scored(heldout) and previous_step(heldout) == prev if heldout_ok is None else heldout_ok):
        return NotFormed("heldout_unscored", sample.step)
    return _Prepared(prev, *layout, groups_in_step=n_groups, unscored=unscored)


def _layout(codes: np.ndarray, n_groups: int, ho_codes: np.ndarray | None, shared: bool = False,
            live: np.ndarray | None = None) -> tuple[int, tuple]:
    """The groups of two or more rollouts, and (where there are two or more such groups) the
    arrays of a ``_Prepared`` after its previous step: the rows kept, the codes of the kept rows
    of both sides, their sides, the rollouts dropped. ``shared``: the arrays are made read-only,
    for every sample of the same layout to hold. ``live``: the scored rollouts, where a cost
    budget left whole groups unscored (their rows, and those groups, are left out)."""
    sizes = np.bincount(codes if live is None else codes[live], minlength=n_groups)  # an unscored group: 0
    paired_groups = int((sizes >= 2).sum())  # every such group has its rows among the kept
    if paired_groups < 2:
        return paired_groups, ()
    if paired_groups == n_groups and ho_codes is None:
        # every group of two or more, no held-out rows: every row kept, in its own codes
        layout = (np.ones(len(codes), dtype=bool), None, np.asarray(codes, dtype=np.int64), n_groups,
                  np.zeros(len(codes), dtype=bool))
    else:
        keep = sizes[codes] >= 2
        ho_keep = None
        if ho_codes is not None:
            ho_keep = (ho_codes < n_groups) & (sizes[np.minimum(ho_codes, n_groups - 1)] >= 2)
            all_codes = np.concatenate([codes[keep], ho_codes[ho_keep]])
        else:
            all_codes = codes[keep]
        side = np.zeros(len(all_codes), dtype=bool)
        side[int(keep.sum()):] = True
        dropped = int((sizes[codes] == 1).sum())  # scored rollouts alone in their group
        if keep.all() and (ho_keep is None or not (sizes < 2).any()):
            layout = (keep, ho_keep, np.asarray(all_codes, dtype=np.int64), n_groups, side, 0,
                      ho_keep is not None and bool(ho_keep.all()))
        else:
            recoded, g = group_codes(all_codes)
            layout = (keep, ho_keep, recoded, g, side, dropped)
    if shared:
        layout = tuple(_read_only(x) for x in layout)
    return paired_groups, layout


def _read_only(x):
    """An array as a read-only copy (a copy: never a view that would lock its base), else itself."""
    if isinstance(x, np.ndarray):
        x = x.copy()
        x.flags.writeable = False
    return x


# A prompt group whose sample's distinct completions hold at least this share of pi_{t+1}'s
# probability is sharpened: what the sample did not hold there is the policy's tail.
SHARP_SEEN = 0.5
# Rows of one prompt group whose log-probabilities under both policies agree within this many nats
# are one completion (the same completion scored in two batches differs by up to ~1e-5: padding).
SAME_COMPLETION_NATS = 1e-4


def tail_allowance(logp: np.ndarray, logp_prev: np.ndarray, kl: np.ndarray, codes: np.ndarray, n_groups: int,
                   sharp: float = SHARP_SEEN) -> np.ndarray:
    """What D_t's 95 % interval adds above its upper end for the tail its sample did not hold,
    nats per sequence, for P samples of one layout: ``logp``, ``logp_prev`` and ``kl`` (P, n) each
    row's log pi_{t+1}, log pi_t and token KL, ``codes`` (n,) its prompt group.

    On a sharpened policy a 4 + 4 sample of a prompt holds its few likely completions and seldom
    the rare ones, which can carry most of the token KL of a small update. The estimate is then
    low and its SE small together -- the sample shows no spread it did not see -- and no SE, its
    own or its neighbours', covers the truth (on the truth harness's collapsing run the moderated
    intervals covered 82 % of the redraws, 61 % on updates under 0.05 nats). What the sample
    does say is how much of pi_{t+1}'s probability it holds: the sum of pi_{t+1} over a group's
    distinct completions, ``s_g``. Where ``s_g`` >= ``sharp`` (``SHARP_SEEN``: the group is
    sharpened, what is missing is its tail), the mass it did not hold, ``1 - s_g``, is allowed the
    largest token KL any completion of the group carried:

        tail = mean_g [s_g >= sharp] (1 - s_g) max_i kl_gi        (D_t = mean_g E_q[kl])

    One completion: in order of log pi_{t+1} within the group, a row whose log-probabilities
    under both policies are within ``SAME_COMPLETION_NATS`` of the row before it repeats that
    row's completion (a chain of such rows is one; sorting keeps it O(n log n) per group).

    It is an allowance, not a bound: an unseen completion may carry more than any seen one. A
    group whose distinct completions hold less than half of the mass (a policy that still
    spreads) is sampled as its SE assumes and is allowed nothing. The harness measures what it
    buys (docs/science.md). Returns (P,) >= 0, NaN where a sharpened group's token KL is not
    finite (the ledgers pass only samples whose token KL is finite on every row)."""
    lp = np.asarray(logp, dtype=np.float64)
    lpp = np.asarray(logp_prev, dtype=np.float64)
    k = np.asarray(kl, dtype=np.float64)
    codes = np.asarray(codes)
    counts = np.bincount(codes, minlength=n_groups)
    c = int(counts.max()) if len(counts) else 0
    if not len(codes) or not c:
        return np.zeros(lp.shape[0])
    # each group's rows in their order, padded to the largest group: (G, c) and which are rows
    order = np.argsort(codes, kind="stable")
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    slot = np.arange(c)[None, :]
    valid = slot < counts[:, None]
    idx = order[np.where(valid, starts[:, None] + slot, 0)]
    a = lp[:, idx]  # (P, G, c)
    mass = np.where(valid[None], np.exp(np.minimum(a, 0.0)), 0.0)
    # the rows' mass with repeats counted again bounds the distinct completions' from above: a
    # group below the threshold even so (every group of a policy that spreads) needs no more
    seen = mass.sum(axis=-1)  # (P, G)
    near = seen >= sharp
    if near.any():
        on = np.broadcast_to(valid[None], a.shape)[near]  # (K, c)
        key = np.where(on, a[near], np.inf)  # padding sorts last
        order = np.argsort(key, axis=1, kind="stable")
        a_s = np.take_along_axis(key, order, axis=1)
        b_s = np.take_along_axis(lpp[:, idx][near], order, axis=1)
        new = np.ones(a_s.shape, dtype=bool)
        with np.errstate(invalid="ignore"):  # inf - inf in the padding, which counts for nothing
            new[:, 1:] = ((np.abs(np.diff(a_s, axis=1)) > SAME_COMPLETION_NATS)
                          | (np.abs(np.diff(b_s, axis=1)) > SAME_COMPLETION_NATS))
        first = np.take_along_axis(on, order, axis=1) & new
        seen[near] = np.where(first, np.take_along_axis(mass[near], order, axis=1), 0.0).sum(axis=1)
    seen = np.minimum(seen, 1.0)
    top = np.where(valid[None], k[:, idx], -np.inf).max(axis=-1)
    with np.errstate(invalid="ignore"):
        out = np.where(seen >= sharp, (1.0 - seen) * np.maximum(top, 0.0), 0.0).mean(axis=1)
    return np.where(np.isfinite(out), out, np.nan)


def _ledgers(items: Sequence[tuple[StepSample, StepSample | None, _Prepared, float | None]],
             block: tuple[LedgerBlock, int] | None = None) -> list[PairedLedger]:
    """The paired ledgers of samples whose kept rows share one group layout (and one split into
    rollouts and held-out rows), as one batch: every sample's weights, dz by group, its
    covariance, D_t, D_hat and k-hats by stacked arithmetic. Where every row is kept and there
    are no held-out rows, the samples' arrays are taken as they lie in the report's one read
    (``stacked``: a view, no copy), and equal consecutive groups are summed by reshape.
    ``block``: the ``LedgerBlock`` and the row of it the first item is (its dz, SE and
    covariance are written there, and the ledgers are views of them)."""
    first = items[0][2]
    codes, n_groups, side = first.codes, first.n_groups, first.side
    n = len(codes)
    two_sided = bool(side.any())
    m = blocks(codes, n_groups)
    # each side's rows in equal consecutive blocks by group (the tap's layout): sums over groups
    # and over (group, side) strata by reshape, the jackknife on (P, G, m_s, k) views
    seg = Segments.of(codes, n_groups, side if two_sided else None) if BY_SEGMENTS else None
    if not m:
        onehot = np.zeros((n, n_groups))
        onehot[np.arange(n), codes] = 1.0
    whole = all(prep.keep_heldout is None and not prep.dropped and not prep.unscored for _, _, prep, _ in items)
    # every rollout and every held-out row kept: each side's rows as they lie in its read, joined
    both = not whole and all(prep.every_heldout and not prep.dropped and not prep.unscored for _, _, prep, _ in items)
    samples = [s for s, _, _, _ in items]

    def rows(s: StepSample, ho: StepSample | None, prep: _Prepared, attr: str) -> np.ndarray | None:
        a = getattr(s, attr)
        if a is None:
            return None
        a = a[prep.keep]
        if prep.keep_heldout is not None:
            b = getattr(ho, attr)
            if b is None:
                return None
            a = np.concatenate([a, b[prep.keep_heldout]])
        return a

    def batch(attr: str) -> np.ndarray | None:
        """(P, n, ...) of every item's kept rows of ``attr``; None where one has none."""
        if whole:
            if any(getattr(s, attr) is None for s in samples):
                return None
            a = stacked(samples, attr)
            return a.reshape(len(items), n, *a.shape[1:])
        if both:
            held = [ho for _, ho, _, _ in items]
            if any(getattr(s, attr) is None for s in samples) or any(getattr(h, attr) is None for h in held):
                return None
            a, b = stacked(samples, attr), stacked(held, attr)
            return np.concatenate([a.reshape(len(items), -1, *a.shape[1:]), b.reshape(len(items), -1, *b.shape[1:])],
                                  axis=1)
        parts = [rows(s, ho, prep, attr) for s, ho, prep, _ in items]
        return None if any(x is None for x in parts) else np.stack(parts)

    def by_group(x: np.ndarray) -> np.ndarray:
        """Sums of x (P, n) or (P, n, k) over each group's rows: (P, G) or (P, G, k)."""
        if m:
            return x.reshape(x.shape[0], n_groups, m, *x.shape[2:]).sum(axis=2)
        return x @ onehot if x.ndim == 2 else onehot.T @ x

    z = batch("z")  # (P, n, k)
    logp, logp_prev = batch("logp"), batch("logp_prev")
    r = logp - logp_prev  # (P, n)
    log_q, log_p, lwq, lwp = mis_log_weights(r, side if two_sided else None, codes, n_groups)
    q, p = np.exp(log_q), np.exp(log_p)
    if seg is not None:  # the samples laid out rows first for its arithmetic (``Segments``)
        zt = np.ascontiguousarray(z.transpose(1, 0, 2))  # (n, P, k)
        qt, pt = np.ascontiguousarray(q.T), np.ascontiguousarray(p.T)
    if seg is not None and m:  # the same additions in the same order as by_group's reshape
        dz_g = np.ascontiguousarray(((qt - pt)[:, :, None] * zt).reshape(n_groups, m, *zt.shape[1:]).sum(axis=1)
                                    .transpose(1, 0, 2))
    else:
        dz_g = by_group((q - p)[:, :, None] * z)  # (P, G, k): E_q[z] - E_p[z] in each group
    # A feature equal on every row of each group moved by exactly 0 there (both weightings sum to
    # 1 in a group); the sums leave ~1e-17 of rounding, whose ratio to an SE of the same size
    # would read as a t statistic. It stays exactly 0, so its SE is 0: not identified.
    if seg is not None:
        parts = seg.parts(zt)
        constant = np.logical_and.reduce([(zb == parts[0][:, :1]).all(axis=(0, 1)) for zb in parts])  # (P, k)
    elif m:
        zb = z.reshape(len(items), n_groups, m, -1)
        constant = (zb == zb[:, :, :1, :]).all(axis=(1, 2))  # (P, k)
    else:
        first = np.zeros(n_groups, dtype=np.int64)
        first[codes[::-1]] = np.arange(n)[::-1]  # each group's first row
        constant = (z == z[:, first[codes], :]).all(axis=1)
    dz_g[np.broadcast_to(constant[:, None, :], dz_g.shape)] = 0.0
    dz = dz_g.mean(axis=1)
    # Sigma_dz conditional on the prompts: the stratified jackknife (``Strata``), each row
    # deleted from its (group, side) stratum, its group's dz_g worked out again in closed form
    if seg is not None:  # the same arithmetic on each segment's (G, m_s, P, k) rows
        mq, moved = seg.deleted_means(qt, zt)
        mp, dp = seg.deleted_means(pt, zt)
        shift = (mq - mp)[:, None]
        for a, b in zip(moved, dp):
            if a is not None:
                a -= b
                a -= shift
                a /= n_groups
                np.copyto(a, 0.0, where=constant)  # not identified: exactly no spread
        cov, dof = seg.jackknife(moved, len(items), z.shape[2])  # dz_(-i) less dz: a shift, the same spread
    else:
        mq, mp = by_group(q[:, :, None] * z), by_group(p[:, :, None] * z)
        strata = Strata(codes, side if two_sided else None, n_groups)
        moved = (strata.deleted_means(q, z, mq, codes) - strata.deleted_means(p, z, mp, codes)
                 - np.take(mq - mp, codes, axis=1))
        moved[np.broadcast_to(constant[:, None, :], moved.shape)] = 0.0  # not identified: exactly no spread
        cov, dof = strata.jackknife(moved / n_groups)  # dz_(-i) less dz: a shift, the same spread
    lost = ~np.isfinite(cov).all(axis=(1, 2))
    if lost.any() and n_groups > 1:
        # a deletion left a group with no weight (one row carried all of it): the jackknife is
        # undefined there, and the spread across prompt groups -- wider, never narrower -- is used
        dev = dz_g[lost] - dz[lost][:, None, :]
        cov[lost] = np.matmul(dev.transpose(0, 2, 1), dev) / (n_groups - 1) / n_groups
        dof[lost] = n_groups - 1
    # the scored groups are a sample of the step's (a cost budget): their sampling added
    share = np.array([n_groups / (n_groups + prep.unscored) for _, _, prep, _ in items])
    if (share < 1.0).any():
        cov, dof = group_sampling(cov, dof, dz_g, share)
    se = np.sqrt(np.clip(np.diagonal(cov, axis1=1, axis2=2), 0, None))
    if block is not None:  # the block's rows hold them; the ledgers are views of those rows
        b, lo = block[0].arrays, block[1]
        cut = slice(lo, lo + len(items))
        b.delta_z[cut], b.se[cut], b.cov_delta[cut] = dz, se, cov
        dz, se, cov = b.delta_z[cut], b.se[cut], b.cov_delta[cut]
    d_hat = by_group(q * (log_q - log_p)).mean(axis=1)  # (P,) mean_g KL(q_g || p_g)
    # One-sided, the weights pi_t / pi_{t+1} = e^{-r} are unbounded: their tail is the premise.
    # Two-sided, every balance-heuristic weight is at most 1/n of its side, so the estimates
    # have finite variance whatever the step and k-hat does not apply (the effective sample
    # sizes still do); it is NaN there.
    khat = np.full(len(items), np.nan) if two_sided else pareto_khats(-r)
    ess_p = (1.0 / by_group(p ** 2)).sum(axis=1)
    ess_q = (1.0 / by_group(q ** 2)).sum(axis=1)
    # D_t: the token KL along each sample's rows weighted towards pi_{t+1}, where it is finite on all of them
    kl = batch("kl_prev")
    kls = list(kl) if kl is not None else [rows(s, ho, prep, "kl_prev") for s, ho, prep, _ in items]
    d_t, d_t_se, d_t_dof = [None] * len(items), [None] * len(items), [float("nan")] * len(items)
    d_t_tail = [None] * len(items)
    if kl is not None:  # one pass over the batch's rows
        has = np.flatnonzero(np.isfinite(kl).all(axis=tuple(range(1, kl.ndim)))).tolist()
    else:
        has = [j for j, x in enumerate(kls) if x is not None and np.isfinite(x).all()]
    if has:
        kh = kl[has] if kl is not None else np.stack([kls[j] for j in has])
        per_group = by_group(q[has] * kh)  # (H, G)
        # its SE conditional on the prompts: the stratified jackknife, likewise
        if seg is not None:
            gk, moved = seg.deleted_means(np.ascontiguousarray(q[has].T), np.ascontiguousarray(kh.T)[:, :, None])
            var, dofs = seg.jackknife([None if a is None else (a - gk[:, None]) / n_groups for a in moved], len(has), 1)
            var, dofs = var[:, 0, 0], dofs[:, 0]
        else:
            var, dofs = strata.jackknife((strata.deleted_means(q[has], kh, per_group, codes) - per_group[:, codes])
                                         / n_groups)
        lost = ~np.isfinite(var)
        if lost.any() and n_groups > 1:  # a deletion left a group with no weight: the spread across groups
            var[lost] = per_group[lost].var(axis=1, ddof=1) / n_groups
            dofs[lost] = n_groups - 1
        if (share[has] < 1.0).any():  # the scored groups are a sample of the step's: as dz's
            v, f = group_sampling(var[:, None, None], dofs[:, None], per_group[:, :, None], share[has])
            var, dofs = v[:, 0, 0], f[:, 0]
        tail = tail_allowance(logp[has], logp_prev[has], kh, codes, n_groups).tolist()
        for j, v, e, f, a in zip(has, per_group.mean(axis=1).tolist(), np.sqrt(var).tolist(), dofs.tolist(), tail):
            d_t[j], d_t_se[j], d_t_dof[j], d_t_tail[j] = v, e, f, a
    out = []
    threshold = pareto_threshold(n)
    heldout = side if two_sided else None
    n_heldout = int(heldout.sum()) if heldout is not None else 0  # the batch's one layout
    for j, ((s, ho, prep, lr), d_hat_j, khat_j, ess_pj, ess_qj) in enumerate(zip(
            items, d_hat.tolist(), khat.tolist(), ess_p.tolist(), ess_q.tolist())):
        sampler = _sampler_kl(s, prep, ho)
        sampler_kl, sampler_se = (None, None) if sampler is None else (sampler.kl, sampler.se)
        out.append(_made({
            **_LEDGER_DEFAULTS,
            "step_pair": (prep.prev, s.step), "names": s.names, "delta_z": dz[j], "se": se[j], "cov_delta": cov[j],
            "n_pre": n, "n_post": n, "learning_rate": lr, "kind": "paired", "z": z[j], "codes": codes,
            "n_groups": n_groups, "log_ratio": r[j], "heldout": heldout, "kl": kls[j], "d_hat": d_hat_j,
            "d_t": d_t[j], "d_t_se": d_t_se[j], "d_t_dof": d_t_dof[j], "d_t_tail": d_t_tail[j], "dof": dof[j], "pareto_k": khat_j,
            "pareto_k_max": threshold, "ess": (ess_pj, ess_qj), "dropped_rollouts": prep.dropped,
            "groups_in_step": prep.groups_in_step, "groups_unscored": prep.unscored, "sampler_kl": sampler_kl,
            "sampler_kl_se": sampler_se, "sampler_kl_se_own": sampler_se,
            "sampler_kl_dof": None if sampler is None else sampler.dof,
            "sampler_kl_size": 0 if sampler is None else sampler.size,
            "sampler_kl_within": True if sampler is None else sampler.within,
            "block": None if block is None else block[0],
            "row": -1 if block is None else block[1] + j, "n_heldout": n_heldout}))
    return out


def group_sampling(cov: np.ndarray, dof: np.ndarray, per_group: np.ndarray, share: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The covariance of a mean over n measured prompt groups as an estimate of the mean over all
    N of the step's, the n drawn uniformly without replacement (the tap's budget): two-stage
    sampling (module docstring),

        Cov = (1 - f) S_b / n + f Cov_within,     f = n / N,

    ``cov`` (P, k, k) the covariance conditional on the measured groups (``Cov_within``), ``dof``
    (P, k) its degrees of freedom (NaN: none), ``per_group`` (P, n, k) each measured group's
    estimate (S_b: their sample covariance), ``share`` (P,) f. Each diagonal entry's degrees of
    freedom are Welch-Satterthwaite's over the two terms, the first on n - 1. Where f = 1 the
    inputs are returned as they are, exactly. With one group (n < 2) S_b is not identified: a
    ValueError (the ledger refuses such a pair as ``few_groups`` before this)."""
    per_group = np.asarray(per_group, dtype=np.float64)
    n = per_group.shape[1]
    f = np.asarray(share, dtype=np.float64)
    if not ((f > 0) & (f <= 1)).all():
        raise ValueError(f"share must be in (0, 1], not {f}")
    part = f < 1.0
    if not part.any():
        return cov, dof
    if n < 2:
        raise ValueError("one measured prompt group: the spread across groups is not identified")
    cov, dof = np.array(cov, dtype=np.float64), np.array(dof, dtype=np.float64)
    dev = per_group[part] - per_group[part].mean(axis=1, keepdims=True)
    between = np.matmul(dev.transpose(0, 2, 1), dev) / (n - 1) / n  # (Q, k, k): S_b / n
    fp = f[part][:, None, None]
    a = (1.0 - fp) * between
    c = fp * cov[part]
    cov[part] = a + c
    a_d, c_d = np.diagonal(a, axis1=1, axis2=2), np.diagonal(c, axis1=1, axis2=2)
    d_c = dof[part]
    with np.errstate(divide="ignore", invalid="ignore"):
        den = a_d ** 2 / (n - 1) + np.where(c_d > 0, c_d ** 2 / np.where(d_c > 0, d_c, np.nan), 0.0)
        dof[part] = np.where(den > 0, (a_d + c_d) ** 2 / np.where(den > 0, den, 1.0), d_c)
    return cov, dof


# Every field of a PairedLedger that has a default, with it: ``_made`` starts from these.
_LEDGER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PairedLedger) if f.default is not dataclasses.MISSING}
# ``_made`` skips __init__: a field made by a factory, or a __post_init__, would be left unmade
if hasattr(PairedLedger, "__post_init__") or any(
        f.default_factory is not dataclasses.MISSING for f in dataclasses.fields(PairedLedger)):
    raise TypeError("PairedLedger gained a field factory or __post_init__: make ledgers through __init__ in _ledgers")
_LEDGER_FIELDS = frozenset(f.name for f in dataclasses.fields(PairedLedger))


def _made(values: dict) -> PairedLedger:
    """``PairedLedger(**values)`` (every field given, plus ``n_heldout``, its cached count), made
    by filling the object's attributes at once: a frozen dataclass's __init__ sets its fields (37)
    one by one through object.__setattr__, which for the 10,000 ledgers of a run cost about as
    much as the arithmetic of their batches' weights. tests/unit/test_paired_columns.py holds the
    two to the same attributes."""
    lg = object.__new__(PairedLedger)
    lg.__dict__.update(values)
    return lg


def _sampler_kl(s: StepSample, prep: _Prepared, ho: StepSample | None = None) -> GroupKL | None:
    """KL(pi_sampler || pi) along each side's kept rows (samples of the sampler), where the
    record has the sampler's log-probabilities: side b against pi_{t+1} (``logp``), side a (the
    held-out rows, drawn by the engine while it held pi_t) against pi_t (``logp_prev``). Each is
    the mean over groups of mean(log pi_sampler - log pi), with its SE (``group_kl``); the side
    furthest from its policy (by the mean less twice its SE) is returned; None where no side has them."""
    sides = []
    if s.logp_sampler is not None and s.logp is not None:
        gap = (np.asarray(s.logp_sampler, dtype=np.float64) - np.asarray(s.logp, dtype=np.float64))[prep.keep]
        sides.append((gap, prep.codes[:len(gap)]))
    if (ho is not None and prep.keep_heldout is not None and ho.logp_sampler is not None
            and ho.logp_prev is not None):
        gap = (np.asarray(ho.logp_sampler, dtype=np.float64)
               - np.asarray(ho.logp_prev, dtype=np.float64))[prep.keep_heldout]
        sides.append((gap, prep.codes[len(prep.codes) - len(gap):]))
    best = None
    for gap, codes in sides:
        # the engine-mismatch series' own estimator (measure.mismatch): one computation, so this
        # check and the series (its finding, its curve) state the same number for the same rows
        got = group_kl(gap, codes, prep.n_groups)
        if got is None:
            continue
        low = got.kl - 2.0 * (got.se if got.se == got.se else 0.0)
        if best is None or low > best.kl - 2.0 * (best.se if best.se == best.se else 0.0):
            best = got
    return best


def independent_d_t(log_ratio: np.ndarray, heldout: np.ndarray | None, kl: np.ndarray, codes: np.ndarray,
                    n_groups: int, share: float = 1.0) -> tuple[float, float]:
    """D_t from rows independent of the step (``PairedLedger.d_t``, one sample): the token KL
    along each row weighted towards pi_{t+1} (balance heuristic), averaged over groups, and its
    standard error conditional on the prompts (the stratified jackknife over (group, side)
    strata: ``Strata``); NaN where no stratum has two rows. ``share``: the measured groups' share
    of the step's (a budget measured n of N); below 1 the SE is the ledger's two-stage one
    (``group_sampling``), an estimate of the mean over all the step's prompt groups, as the books
    read it, so that the tap's recorded ``kl_to_previous_se`` is the books' SE."""
    kl = np.asarray(kl, dtype=np.float64)
    codes = np.asarray(codes, dtype=np.int64)
    q = np.exp(mis_log_weights(np.asarray(log_ratio, dtype=np.float64), heldout, codes, n_groups)[0])
    per_group = np.bincount(codes, weights=q * kl, minlength=n_groups)
    strata = Strata(codes, None if heldout is None else np.asarray(heldout, dtype=bool), n_groups)
    mean = float(per_group.mean())
    deleted = mean + (strata.deleted_means(q[None], kl[None], per_group[None], codes) - per_group[codes][None]) / n_groups
    var, dof = strata.jackknife(deleted)
    if not np.isfinite(var[0]) and n_groups > 1:  # a deletion left a group with no weight: the spread across groups
        var, dof = per_group.var(ddof=1)[None] / n_groups, np.array([n_groups - 1.0])
    if not strata.spread:
        return mean, float("nan")
    if share < 1.0 and n_groups > 1:
        v, _ = group_sampling(var[:, None, None], np.asarray(dof, dtype=np.float64)[:, None],
                              per_group[None, :, None], np.array([share]))
        var = v[:, 0, 0]
    return mean, float(math.sqrt(var[0]))


class Strata:
    """The rows of a paired sample split by prompt group and side ((group, side): the held-out
    completions of pi_t and the rollouts of pi_{t+1} of one prompt are two strata), for standard
    errors conditional on the prompts: the spread the harness measures by redrawing the rows for
    the same prompts (the truth the oracle's own SE uses too), not the variation between
    prompts, which the estimate of this step on these prompts does not have.

    The estimates are smooth functions of the strata's weighted means (the balance heuristic's
    mixture proportions are the design's, fixed), and their variance is the stratified
    delete-one jackknife's: row i deleted from its stratum of n_s rows (its other rows weighing
    n_s / (n_s - 1)), sum_s (n_s - 1) / n_s sum_{i in s} (theta_(-i) - mean_s theta_(-.))^2.
    Measured against the real spread for fixed prompts (tests/unit/test_jackknife.py, a known
    model redrawn 600 times): real SD / SE 0.94-1.03 for dz and D_t, where the first-order
    (delta-method) variance of the same influences read 1.09-1.25 (it understates the
    self-normalised means of 4 held-out rows). A stratum of one row adds nothing it could
    estimate. Degrees of freedom: Welch-Satterthwaite, (sum_s v_s)^2 / sum_s v_s^2 / (n_s - 1)."""

    def __init__(self, codes: np.ndarray, side: np.ndarray | None, n_groups: int):
        self.ids = np.asarray(codes, dtype=np.int64) * 2 + (0 if side is None else np.asarray(side, dtype=np.int64))
        self.count = 2 * n_groups
        self.size = np.bincount(self.ids, minlength=self.count).astype(np.float64)
        self.spread = bool((self.size >= 2).any())
        n_s = self.size[self.ids]
        self.ok = n_s >= 2  # rows whose stratum can lose them
        self.factor = np.where(self.ok, n_s / np.maximum(n_s - 1, 1), 1.0)  # the other rows' weight after a deletion
        self.weight = np.where(self.size >= 2, (self.size - 1) / np.maximum(self.size, 1), 0.0)  # (S,)
        self._onehot = np.zeros((len(self.ids), self.count))
        self._onehot[np.arange(len(self.ids)), self.ids] = 1.0
        self._by_row: dict[int, tuple[np.ndarray, ...]] = {}

    def _rows(self, k: int) -> tuple[np.ndarray, ...]:
        """(f - 1, f, ok, the stratum's weight) of each row, laid out (n, k): the operands the
        arithmetic on (P, n, k) arrays multiplies each row's k values by, made once and contiguous
        (broadcast from (1, n, 1) they are taken k values at a time, at twice the cost): the same
        products."""
        got = self._by_row.get(k)
        if got is None:
            f = self.factor
            got = self._by_row[k] = tuple(np.ascontiguousarray(np.broadcast_to(a[:, None], (len(a), k)))
                                          for a in (f - 1.0, f, self.ok, self.weight[self.ids]))
        return got

    def stratum_sums(self, x: np.ndarray) -> np.ndarray:
        """Each row's stratum's sum of x (P, n) or (P, n, k), back on the rows."""
        if x.ndim == 2:
            return (x @ self._onehot)[:, self.ids]
        return np.take(np.matmul(x.transpose(0, 2, 1), self._onehot).transpose(0, 2, 1), self.ids, axis=1)

    def deleted_means(self, w: np.ndarray, x: np.ndarray | None, group_means: np.ndarray | None,
                      codes: np.ndarray) -> np.ndarray:
        """For weights w (P, n) normalised within each group, and values x (P, n) or (P, n, k)
        whose w-weighted group means are ``group_means`` (P, G[, k]): each row's group's mean with
        that row deleted from its stratum, (P, n[, k]). With x None: the weights' new sum, the
        normaliser sum_j c_j w_j."""
        f = self.factor
        norm = 1.0 + (f - 1.0) * self.stratum_sums(w) - f * w
        if x is None:
            return norm
        # a row that carried all of its group's weight leaves no weight behind: NaN, which the
        # callers replace by the spread across groups (``_ledgers``, ``independent_d_t``)
        norm = np.where(norm > 0, norm, np.nan)
        if x.ndim == 2:
            wx = w * x
            return (group_means[:, codes] + (f - 1.0) * self.stratum_sums(wx) - f * wx) / norm
        k = x.shape[2]
        f1, fk, _, _ = self._rows(k)
        wx = np.repeat(w[:, :, None], k, axis=2) * x  # w of each row, k times: w[:, :, None] * x
        return ((np.take(group_means, codes, axis=1) + f1 * self.stratum_sums(wx) - fk * wx)
                / np.repeat(norm[:, :, None], k, axis=2))

    def jackknife(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stratified jackknife's variance of the replicates theta (P, n) -- each row's value
        with it deleted -- and its degrees of freedom, each (P,); of theta (P, n, k), the
        covariance (P, k, k) and each diagonal entry's degrees of freedom (P, k)."""
        theta = np.asarray(theta, dtype=np.float64)
        flat = theta.ndim == 2
        t = theta[:, :, None] if flat else theta
        _, _, ok, weight = self._rows(t.shape[2])
        t = np.where(ok, t, 0.0)  # a row its stratum cannot lose adds nothing (NaN or not)
        mean = np.matmul(t.transpose(0, 2, 1), self._onehot) / np.maximum(self.size, 1)  # (P, k, S)
        dev = np.where(ok, t - np.take(mean.transpose(0, 2, 1), self.ids, axis=1), 0.0)
        scaled = dev * weight
        cov = np.matmul(scaled.transpose(0, 2, 1), dev)
        v = np.matmul((scaled * dev).transpose(0, 2, 1), self._onehot)  # (P, k, S) each stratum's share
        den = (v ** 2 / np.maximum(self.size - 1, 1)).sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            dof = np.where(den > 0, v.sum(axis=-1) ** 2 / np.where(den > 0, den, 1.0), np.nan)
        if flat:
            return cov[:, 0, 0], dof[:, 0]
        return cov, dof
