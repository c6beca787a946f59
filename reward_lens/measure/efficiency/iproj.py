"""KL_min exactly: the I-projection of a weighted sample onto a feature-mean constraint.

The paired ledger prices step t on samples independent of its update, grouped by prompt:
step t+1's rollouts and, where recorded, held-out completions of pi_t. On that sample pi_{t+1}
is the self-normalised weighting q_g of each group and pi_t the weighting p_g (multiple
importance sampling, ``paired.mis_log_weights``; with rollouts alone q_g is uniform and p_g(i)
prop. to pi_t(y_i) / pi_{t+1}(y_i)). The exact minimum divergence that the observed feature
movement required is

    KL_min = min_q'  mean_g KL(q'_g || p_g)   subject to   mean_g E_{q'_g}[z] = mean_g E_{q_g}[z],

an exponential tilting of p. Its convex dual (Csiszar 1975; Kullback 1959, ch. 3) is

    KL_min = max_lambda  lambda^T target - mean_g log sum_i p_g(i) exp(lambda^T z_i),

solved here by damped Newton (gradient E_q[z] - target, Hessian the within-group
covariance of z under q). Two properties make this the book's exact number:

* ``q`` is feasible, so KL_min <= mean_g KL(q_g || p_g) = D_hat, the same sample's plug-in
  estimate of D_t (biased low: the book's denominator is the token-level D_t instead).
* The dual value at *any* lambda is a lower bound on KL_min (weak duality), and the search
  starts at lambda = 0 (value 0) and never accepts a step that lowers the value, so the
  returned number lies in [0, KL_min] <= D_hat even if the iteration stops early.

To second order in the step, KL_min = 1/2 dz^T C^-1 dz with C the within-group covariance,
and KL_min / D_hat is the within-group R^2 of the log-ratio on the features.

Everything is vectorised over B replicates (the group weights of a jackknife or bootstrap), so
all replicates cost one batched solve.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from reward_lens.measure.ledger.paired import mis_log_weights
from reward_lens.measure.ledger.price import blocks

# Newton stops when the constraint is met to this many within-group standard deviations
# (the features are standardised first): far below any sampling error of dz.
GRAD_TOL = 1e-10
# ... or when Newton predicts less ascent than the dual value's rounding error (its terms are
# O(1) log-sums, each good to a few ulps): no float64 evaluation could see the gain.
VALUE_RTOL = 1e-15
MAX_ITER = 100


@dataclass(frozen=True)
class Projection:
    kl_min: np.ndarray  # (B,) nats: the dual value (a certified lower bound on the minimum)
    d_hat: np.ndarray  # (B,) nats: mean_g KL(q_g || p_g), the same sample's plug-in D_t
    converged: np.ndarray  # (B,) bool
    lam: np.ndarray  # (B, k) the tilt, in standardised feature units


def i_projection(z: np.ndarray, log_ratio: np.ndarray, codes: np.ndarray, n_groups: int,
                 group_weights: np.ndarray | None = None, heldout: np.ndarray | None = None) -> Projection:
    """KL_min and D_hat on a sample independent of the step.

    ``z`` (n, k): features (active ones only; any affine rescaling gives the same answer);
    ``log_ratio`` (n,): r_i = log pi_{t+1}(y_i) - log pi_t(y_i); ``codes`` (n,): group of each
    row; ``group_weights`` (B, G): weight of each group in each replicate (a jackknife's
    resampling counts), default one replicate with every group weighted equally; ``heldout``
    (n,): True for rows drawn from pi_t (None: every row drawn from pi_{t+1}).
    """
    order = np.argsort(codes, kind="stable")  # groups contiguous: segment sums by reduceat
    z = np.asarray(z, dtype=np.float64)[order]
    r = np.asarray(log_ratio, dtype=np.float64)[order]
    side = None if heldout is None else np.asarray(heldout, dtype=bool)[order]
    return i_projections(z[None], r[None], np.asarray(codes)[order], n_groups, group_weights, side)[0]


# Replicates solved together in one batch of ``i_projections``: the Hessian's deviations hold
# replicates x n x k floats, so a batch is capped at this many of them (2 MiB: a batch's arrays
# stay in cache). Batches go to threads (numpy releases the GIL inside each array operation;
# each replicate's arithmetic does not depend on the batch it is in). 2,000 step pairs x 9
# replicates: 1.9-2.4x less time than in 32 MiB batches on one thread (bench/blocks.py).
BATCH_FLOATS = 250_000
THREADS = os.cpu_count() or 1


def i_projections(z: np.ndarray, log_ratio: np.ndarray, codes: np.ndarray, n_groups: int,
                  group_weights: np.ndarray | None = None, heldout: np.ndarray | None = None) -> list[Projection]:
    """``i_projection`` of P samples that share one group layout, solved as one batch (the
    same damped Newton, each replicate of each sample with its own step and backtracking).

    ``z`` (P, n, k) and ``log_ratio`` (P, n): the samples, rows ordered so that ``codes`` (n,),
    shared by all of them, is non-decreasing (groups contiguous); ``group_weights`` (B, G) as
    in ``i_projection``, the same replicates for every sample; ``heldout`` (n,) as there, shared."""
    z = np.asarray(z, dtype=np.float64)
    r = np.asarray(log_ratio, dtype=np.float64)
    codes = np.asarray(codes)
    if len(codes) and (np.diff(codes) < 0).any():
        raise ValueError("i_projections needs the rows of every sample ordered by group (codes non-decreasing)")
    n_pairs, n, k = z.shape
    c = np.ones((1, n_groups)) if group_weights is None else np.asarray(group_weights, dtype=np.float64)
    c = c / c.sum(axis=1, keepdims=True)
    size = np.bincount(codes, minlength=n_groups).astype(np.float64)
    starts = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
    log_q, logp, _, _ = mis_log_weights(r, heldout, codes, n_groups)  # (P, n) each
    q = np.exp(log_q)
    # Centre each group on its target mean E_q[z] (the pooled constraint is then 0), and
    # standardise by the within-group SD: the I-projection is invariant, Newton is not.
    by_group = _with_groups(codes, n_groups)
    target = np.add.reduceat(q[:, :, None] * z, starts, axis=1)  # (P, G, k)
    zc = by_group(np.subtract, z, target)
    dev = by_group(np.subtract, z, np.add.reduceat(z, starts, axis=1) / size[:, None])
    sd = np.sqrt((dev ** 2).sum(axis=1) / max(n - n_groups, 1))  # (P, k)
    zs = zc / np.where(sd > 0, sd, 1.0)[:, None, :]
    d_g = np.add.reduceat(q * (log_q - logp), starts, axis=1)  # (P, G) KL(q_g || p_g)
    d_hats = d_g @ c.T  # (P, B)
    per_batch = max(1, BATCH_FLOATS // max(1, len(c) * n * k))
    los = list(range(0, n_pairs, per_batch))

    def batch(lo: int) -> list[Projection]:
        hi = min(n_pairs, lo + per_batch)
        value, converged, lam = _newton(zs[lo:hi], logp[lo:hi], codes, starts, c)
        b = len(c)
        return [Projection(kl_min=np.maximum(value[i * b:(i + 1) * b], 0.0), d_hat=d_hats[lo + i],
                           converged=converged[i * b:(i + 1) * b], lam=lam[i * b:(i + 1) * b])
                for i in range(hi - lo)]

    if len(los) > 1 and THREADS > 1:
        with ThreadPoolExecutor(min(THREADS, len(los))) as pool:
            parts = list(pool.map(batch, los))
    else:
        parts = [batch(lo) for lo in los]
    return [proj for part in parts for proj in part]


def _with_groups(codes: np.ndarray, n_groups: int):
    """``lambda op, x, per_group: op(x, per_group[:, codes])`` for rows x (P, n) or (P, n, k) and
    per-group arrays (P, G) or (P, G, k). Where the groups are equal consecutive blocks of m
    rows, by broadcasting over a (P, G, m, ...) view of x: the same numbers, without the gather
    along the rows (10-15x slower than the arithmetic it feeds)."""
    m = blocks(codes, n_groups)
    if not m:
        return lambda op, x, per_group: op(x, per_group[:, codes])
    return lambda op, x, per_group: op(x.reshape(x.shape[0], n_groups, m, *x.shape[2:]),
                                       per_group[:, :, None]).reshape(x.shape)


def _newton(zs: np.ndarray, logp: np.ndarray, codes: np.ndarray, starts: np.ndarray, c: np.ndarray):
    """The dual's damped Newton ascent for every replicate of every sample in ``zs`` (P, n, k):
    replicate j of sample p is row p * B + j (B = len(c)). Returns each row's dual value,
    whether it converged, and its tilt."""
    n_pairs, n, k = zs.shape
    b = len(c)
    pair = np.repeat(np.arange(n_pairs), b)  # each replicate's sample
    c_all = np.tile(c, (n_pairs, 1))
    by_group = _with_groups(codes, len(starts))

    def evaluate(lam_, rows):
        p_ = pair[rows]
        a = logp[p_] + np.matmul(zs[p_], lam_[:, :, None])[:, :, 0]  # (R', n)
        amax = np.maximum.reduceat(a, starts, axis=1)  # (R', G)
        e = np.exp(by_group(np.subtract, a, amax))
        zg = np.add.reduceat(e, starts, axis=1)
        value = -(c_all[rows] * (amax + np.log(zg))).sum(axis=1)
        return value, by_group(np.divide, e, zg)  # the dual value, and q: within-group tilted probabilities

    rows_all = np.arange(len(pair))
    lam = np.zeros((len(pair), k))
    value, q = evaluate(lam, rows_all)
    converged = np.zeros(len(pair), dtype=bool)
    live = np.ones(len(pair), dtype=bool)  # replicates still iterating (neither converged nor stalled)
    for _ in range(MAX_ITER):
        i = np.nonzero(live)[0]
        if not len(i):
            break
        ci, qi, zi = c_all[i], q[i], zs[pair[i]]
        mean_g = np.add.reduceat(qi[:, :, None] * zi, starts, axis=1)  # (R', G, k) E_q[z] per group
        grad = -np.einsum("bg,bgk->bk", ci, mean_g)
        done = np.abs(grad).max(axis=1, initial=0.0) < GRAD_TOL
        converged[i[done]] = True
        live[i[done]] = False
        i, ci, qi, zi, grad, mean_g = i[~done], ci[~done], qi[~done], zi[~done], grad[~done], mean_g[~done]
        if not len(i):
            break
        dev = by_group(np.subtract, zi, mean_g)
        hess = np.matmul(dev.transpose(0, 2, 1), by_group(np.multiply, qi, ci)[:, :, None] * dev) + 1e-12 * np.eye(k)
        step = np.linalg.solve(hess, grad[..., None])[..., 0]
        # Newton's predicted gain (half the squared decrement) below the value's own rounding:
        # the maximum is reached to float64 precision, and backtracking there only sees noise.
        flat = 0.5 * np.einsum("bk,bk->b", step, grad) <= VALUE_RTOL * (1.0 + np.abs(value[i]))
        converged[i[flat]] = True
        live[i[flat]] = False
        i, ci, step = i[~flat], ci[~flat], step[~flat]
        if not len(i):
            break
        t = np.ones(len(i))
        new_value, new_q = evaluate(lam[i] + step, i)
        for _ in range(40):  # backtracking: accept only steps that raise the dual value
            ok = np.isfinite(new_value) & (new_value >= value[i])
            if ok.all():
                break
            t = np.where(ok, t, t / 2)
            bad = ~ok
            v2, q2 = evaluate(lam[i[bad]] + t[bad, None] * step[bad], i[bad])
            new_value[bad], new_q[bad] = v2, q2
        ok = np.isfinite(new_value) & (new_value >= value[i])
        lam[i[ok]] += t[ok, None] * step[ok]
        value[i[ok]] = new_value[ok]
        q[i[ok]] = new_q[ok]
        live[i[~ok]] = False  # no ascent left at float64 precision: the value stands as a lower bound
    # value >= 0 up to rounding (it starts at lambda = 0, where it is -log 1 = 0).
    return value, converged, lam
