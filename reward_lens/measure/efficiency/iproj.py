"""KL_min exactly: the I-projection of a weighted sample onto a feature-mean constraint.

The paired ledger prices step t on rollouts y ~ pi_{t+1}, grouped by prompt. On that sample
pi_{t+1} is the uniform distribution u_g of each group and pi_t is the self-normalised
reweighting p_g(i) prop. to pi_t(y_i) / pi_{t+1}(y_i). The exact minimum divergence that the
observed feature movement required is

    KL_min = min_q  mean_g KL(q_g || p_g)   subject to   mean_g E_{q_g}[z] = mean_g E_{u_g}[z],

an exponential tilting of p. Its convex dual (Csiszar 1975; Kullback 1959, ch. 3) is

    KL_min = max_lambda  lambda^T target - mean_g log sum_i p_g(i) exp(lambda^T z_i),

solved here by damped Newton (gradient E_q[z] - target, Hessian the within-group
covariance of z under q). Two properties make this the book's exact number:

* ``u`` is feasible, so KL_min <= mean_g KL(u_g || p_g) = D_hat, the same sample's estimate of
  D_t. The ratio eta = KL_min / D_hat is therefore <= 1 by construction, at any step size.
* The dual value at *any* lambda is a lower bound on KL_min (weak duality), and the search
  starts at lambda = 0 (value 0) and never accepts a step that lowers the value, so the
  returned number lies in [0, KL_min] <= D_hat even if the iteration stops early.

To second order in the step, KL_min = 1/2 dz^T C^-1 dz with C the within-group covariance,
and KL_min / D_hat is the within-group R^2 of the log-ratio on the features.

Everything is vectorised over B replicates (the group weights of a jackknife or bootstrap), so
all replicates cost one batched solve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reward_lens.measure.ledger.paired import group_log_weights

# Newton stops when the constraint is met to this many within-group standard deviations
# (the features are standardised first): far below any sampling error of dz.
GRAD_TOL = 1e-10
MAX_ITER = 100


@dataclass(frozen=True)
class Projection:
    kl_min: np.ndarray  # (B,) nats: the dual value (a certified lower bound on the minimum)
    d_hat: np.ndarray  # (B,) nats: mean_g KL(u_g || p_g), the same sample's D_t
    converged: np.ndarray  # (B,) bool
    lam: np.ndarray  # (B, k) the tilt, in standardised feature units


def i_projection(z: np.ndarray, log_ratio: np.ndarray, codes: np.ndarray, n_groups: int,
                 group_weights: np.ndarray | None = None) -> Projection:
    """KL_min and D_hat on a sample drawn from pi_{t+1}.

    ``z`` (n, k): features (active ones only; any affine rescaling gives the same answer);
    ``log_ratio`` (n,): r_i = log pi_{t+1}(y_i) - log pi_t(y_i); ``codes`` (n,): group of each
    rollout; ``group_weights`` (B, G): weight of each group in each replicate (a jackknife's
    resampling counts), default one replicate with every group weighted equally.
    """
    z = np.asarray(z, dtype=np.float64)
    r = np.asarray(log_ratio, dtype=np.float64)
    order = np.argsort(codes, kind="stable")  # groups contiguous: segment sums by reduceat
    z, r, codes = z[order], r[order], np.asarray(codes)[order]
    n, k = z.shape
    c = np.ones((1, n_groups)) if group_weights is None else np.asarray(group_weights, dtype=np.float64)
    c = c / c.sum(axis=1, keepdims=True)
    size = np.bincount(codes, minlength=n_groups).astype(np.float64)
    starts = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
    # Standardise by the within-group SD: the I-projection is invariant, Newton is not.
    zc = z - (np.add.reduceat(z, starts, axis=0) / size[:, None])[codes]
    sd = np.sqrt((zc ** 2).sum(axis=0) / max(n - n_groups, 1))
    zs = zc / np.where(sd > 0, sd, 1.0)
    logp, d_g = group_log_weights(r, codes, n_groups)
    # The target E_u[z] per group is 0 after centring, so the constraint is mean_g E_q[z] = 0.
    d_hat = c @ d_g
    b = c.shape[0]
    lam = np.zeros((b, k))

    def evaluate(lam_, c_):
        a = logp[None, :] + lam_ @ zs.T  # (B', n)
        amax = np.maximum.reduceat(a, starts, axis=1)  # (B', G)
        e = np.exp(a - amax[:, codes])
        zg = np.add.reduceat(e, starts, axis=1)
        value = -(c_ * (amax + np.log(zg))).sum(axis=1)
        return value, e / zg[:, codes]  # the dual value, and q: within-group tilted probabilities

    value, q = evaluate(lam, c)
    converged = np.zeros(b, dtype=bool)
    live = np.ones(b, dtype=bool)  # replicates still iterating (neither converged nor stalled)
    for _ in range(MAX_ITER):
        i = np.nonzero(live)[0]
        if not len(i):
            break
        ci, qi = c[i], q[i]
        mean_g = np.add.reduceat(qi[:, :, None] * zs[None, :, :], starts, axis=1)  # (B', G, k) E_q[z] per group
        grad = -np.einsum("bg,bgk->bk", ci, mean_g)
        done = np.abs(grad).max(axis=1, initial=0.0) < GRAD_TOL
        converged[i[done]] = True
        live[i[done]] = False
        i, ci, qi, grad, mean_g = i[~done], ci[~done], qi[~done], grad[~done], mean_g[~done]
        if not len(i):
            break
        dev = zs[None, :, :] - mean_g[:, codes, :]
        hess = np.einsum("bn,bnk,bnl->bkl", qi * ci[:, codes], dev, dev) + 1e-12 * np.eye(k)
        step = np.linalg.solve(hess, grad[..., None])[..., 0]
        t = np.ones(len(i))
        new_value, new_q = evaluate(lam[i] + step, ci)
        for _ in range(40):  # backtracking: accept only steps that raise the dual value
            ok = np.isfinite(new_value) & (new_value >= value[i])
            if ok.all():
                break
            t = np.where(ok, t, t / 2)
            bad = ~ok
            v2, q2 = evaluate(lam[i[bad]] + t[bad, None] * step[bad], ci[bad])
            new_value[bad], new_q[bad] = v2, q2
        ok = np.isfinite(new_value) & (new_value >= value[i])
        lam[i[ok]] += t[ok, None] * step[ok]
        value[i[ok]] = new_value[ok]
        q[i[ok]] = new_q[ok]
        live[i[~ok]] = False  # no ascent left at float64 precision: the value stands as a lower bound
    # value >= 0 up to rounding (it starts at lambda = 0, where it is -log 1 = 0).
    return Projection(kl_min=np.maximum(value, 0.0), d_hat=d_hat, converged=converged, lam=lam)
