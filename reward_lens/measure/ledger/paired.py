"""The paired ledger: step t priced on rollouts independent of its update.

The unpaired (two-sample) ledger compares step t's rollouts with step t+1's: different
samples of different prompts, so its dz carries sampling noise of order 1/sqrt(n) whatever
the step size, while D_t shrinks with the step squared. The paired ledger uses *one* sample,
step t+1's rollouts y ~ pi_{t+1} (drawn before any gradient touched them, so independent of
step t's update), scored under both policies: r_i = log pi_{t+1}(y_i) - log pi_t(y_i) (the
record's ``logp_pre - logp_prev``). In Price's covariance form, within each prompt group g,

    dz_g = E_{u_g}[z] - E_{p_g}[z] = -(m_g) Cov_g(p_g, z),   p_g(i) prop. to exp(-r_i),

(u_g uniform over the group, p_g its self-normalised reweighting to pi_t), and dz is the mean
over groups. The sampling noise now scales with the spread of the weights, i.e. with the
step. Groups are the independent units: Sigma_dz = Cov_g(dz_g) / G.

Never on the rollouts the step trained on: there log pi_{t+1}/pi_t is inflated by the update
itself (GRPO raises the log-probability of positive-advantage rollouts), which is why the
record's ``logp_post`` is never read here.

Premise check: the weights pi_t / pi_{t+1} must not be too heavy-tailed for self-normalised
importance sampling. ``pareto_khat`` fits a generalised Pareto distribution to their upper
tail (Vehtari et al. 2024, "Pareto smoothed importance sampling", JMLR 25(72)); above
min(1 - 1/log10 S, 0.7) the estimate is unreliable and the book refuses the step pair.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from reward_lens.measure.ledger.price import Ledger, StepSample, group_codes, sample_codes


@dataclass(frozen=True, eq=False)
class PairedLedger(Ledger):
    """A Ledger made from one sample of pi_{t+1}, scored under pi_t and pi_{t+1}."""

    z: np.ndarray | None = None  # (n, k) features of the independent sample
    codes: np.ndarray | None = None  # (n,) group code 0..G-1 of each rollout
    n_groups: int = 0
    log_ratio: np.ndarray | None = None  # (n,) r_i = log pi_{t+1}(y_i) - log pi_t(y_i)
    d_hat: float = float("nan")  # mean_g KL(u_g || p_g): D_t on this same sample, nats/seq
    d_rb: float | None = None  # D_t from the token-level KL along the sample's prefixes, nats/seq
    d_rb_se: float | None = None
    pareto_k: float = float("nan")  # PSIS k-hat of the weights pi_t / pi_{t+1}
    pareto_k_max: float = 0.7
    dropped_rollouts: int = 0  # rollouts in groups of one (no within-group information)


def group_log_weights(log_ratio: np.ndarray, codes: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """log p_g(i), the self-normalised log weight pi_t/pi_{t+1} of each rollout within its group,
    and D_g = KL(u_g || p_g) = mean_i (-log m_g - log p_g(i)) = mean r + log mean exp(-r) per
    group (>= 0 by Jensen; to second order 1/2 Var_g(r))."""
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


@dataclass(frozen=True)
class NotFormed:
    """Why no ledger could be formed for a step pair: a reason code and the step it concerns
    (its words are in templates/refusals/RECORD_INCOMPLETE/cost.detail.j2)."""

    reason: str  # "no_logp_prev" | "prev_step" | "few_groups" | "one_rollout"
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


def paired_ledger(sample: StepSample, learning_rate: float | None = None) -> PairedLedger | NotFormed:
    """The paired ledger of the step pair (previous step, sample.step) -- (t-1, t), or a
    generation window (t-R, t) -- or why it cannot be formed."""
    prep = _prepare(sample)
    if isinstance(prep, NotFormed):
        return prep
    return _ledgers([(sample, prep, learning_rate)])[0]


def paired_ledger_series(samples: Sequence[StepSample], eta_by_step: Mapping[int, float] | None = None
                         ) -> tuple[list[PairedLedger], dict[tuple[int, int], NotFormed]]:
    """Paired ledgers for every step whose rollouts are scored under the previous policy,
    and, for the step pairs that could not be formed, why. Steps whose kept rollouts share a
    group layout are priced as one batch (``_ledgers``)."""
    why = {}
    names = samples[0].names if samples else ()
    batches: dict[tuple, list[int]] = {}
    items = []
    for s in samples:
        if s.names != names:
            raise ValueError(f"step {s.step} is in basis {s.names}, not {names}: one feature basis per ledger")
        if s.step == 0:
            continue
        prep = _prepare(s)
        if isinstance(prep, NotFormed):
            prev = previous_step(s)
            why[(prev if isinstance(prev, int) else s.step - 1, s.step)] = prep
            continue
        batches.setdefault((prep.n_groups, prep.codes.tobytes()), []).append(len(items))
        items.append((s, prep, None if eta_by_step is None else eta_by_step.get(s.step - 1)))
    ledgers: list[PairedLedger | None] = [None] * len(items)
    for members in batches.values():
        for i, lg in zip(members, _ledgers([items[i] for i in members])):
            ledgers[i] = lg
    return ledgers, why


@dataclass(frozen=True)
class _Prepared:
    prev: int
    keep: np.ndarray  # (n,) rollouts in groups of two or more
    codes: np.ndarray  # (n_kept,) group codes of the kept rollouts
    n_groups: int


def _prepare(sample: StepSample) -> _Prepared | NotFormed:
    """The checks and the group layout of one sample, before any arithmetic."""
    if not has_paired_sample(sample):
        return NotFormed("no_logp_prev", sample.step)
    prev = previous_step(sample)
    if isinstance(prev, NotFormed):
        return prev
    codes, n_groups = sample_codes(sample)
    sizes = np.bincount(codes, minlength=n_groups)
    keep = sizes[codes] >= 2
    if keep.all():
        if n_groups < 2:
            return NotFormed("few_groups", sample.step, int((sizes >= 2).sum()))
        return _Prepared(prev, keep, np.asarray(codes, dtype=np.int64), n_groups)
    if int(np.unique(codes[keep]).size) < 2:
        return NotFormed("few_groups", sample.step, int((sizes >= 2).sum()))
    codes, n_groups = group_codes(codes[keep])
    return _Prepared(prev, keep, codes, n_groups)


def _ledgers(items: Sequence[tuple[StepSample, _Prepared, float | None]]) -> list[PairedLedger]:
    """The paired ledgers of samples whose kept rollouts share one group layout, as one batch:
    every sample's weights, dz by group, its covariance, D_hat and k-hat by stacked arithmetic."""
    first = items[0][1]
    codes, n_groups = first.codes, first.n_groups
    n = len(codes)
    onehot = np.zeros((n, n_groups))
    onehot[np.arange(n), codes] = 1.0
    size = onehot.sum(axis=0)
    z = np.stack([s.z[prep.keep] for s, prep, _ in items])  # (P, n, k)
    r = np.stack([(s.logp - s.logp_prev)[prep.keep] for s, prep, _ in items])  # (P, n)
    lw = -r
    gmax = np.where(onehot.T[None] > 0, lw[:, None, :], -np.inf).max(axis=2)  # (P, G) per-group maximum
    lse = gmax + np.log(np.exp(lw - gmax[:, codes]) @ onehot)
    logp = lw - lse[:, codes]  # log p_g(i), as group_log_weights
    d_g = ((-np.log(size))[codes] - logp) @ onehot / size  # (P, G) KL(u_g || p_g)
    p = np.exp(logp)
    dz_g = (onehot.T @ z) / size[:, None] - onehot.T @ (p[:, :, None] * z)  # (P, G, k)
    dz = dz_g.mean(axis=1)
    dev = dz_g - dz[:, None, :]
    cov = np.matmul(dev.transpose(0, 2, 1), dev) / (n_groups - 1) / n_groups  # Cov_g(dz_g) / G
    khat = pareto_khats(-r)
    out = []
    for j, (s, prep, lr) in enumerate(items):
        d_rb = d_rb_se = None
        if s.kl_prev is not None and np.isfinite(s.kl_prev).all():
            per_group = (s.kl_prev[prep.keep] @ onehot) / size
            d_rb = float(per_group.mean())
            d_rb_se = float(per_group.std(ddof=1) / math.sqrt(n_groups))
        out.append(PairedLedger(
            step_pair=(prep.prev, s.step), names=s.names, delta_z=dz[j],
            se=np.sqrt(np.clip(np.diag(cov[j]), 0, None)), cov_delta=cov[j], n_pre=n, n_post=n,
            learning_rate=lr, kind="paired", z=z[j], codes=codes, n_groups=n_groups, log_ratio=r[j],
            d_hat=float(d_g[j].mean()), d_rb=d_rb, d_rb_se=d_rb_se, pareto_k=float(khat[j]),
            pareto_k_max=pareto_threshold(n), dropped_rollouts=int(len(prep.keep) - n)))
    return out
