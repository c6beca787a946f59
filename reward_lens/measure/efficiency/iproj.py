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
# ``group_jackknife``'s batches are larger: it makes a few dozen numpy calls a batch on arrays of
# G x n x k floats a sample, and at 250,000 floats (32 tapped samples) their overhead was a tenth
# of its time. On 2,048 tapped step pairs (96 rows, 9 features, 8 groups), chunks of 512 on two
# threads as the paired book runs it: 0.35 s at 250,000, 0.28 s at 500,000, 0.25 s at 1,000,000,
# 0.28 s at 2,000,000 (this host, AVX2). Where the groups lie in equal consecutive blocks (the
# tap's layout) each sample's numbers do not depend on its batch; elsewhere they do, in the last
# bit (a matrix product's), and ``group_jackknife`` keeps ``BATCH_FLOATS`` there.
JACKKNIFE_BATCH_FLOATS = 1_000_000
# Samples whose tilt bias (``_fixed_tilt_bias_blocks``, on (P, G, m) arrays) is made in one batch:
# 1,024 samples of 96 rows are 0.75 MiB an array.
TILT_BATCH = 1024


class _inline:
    """A stand-in for a thread pool that maps on the calling thread."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def map(fn, items):
        return map(fn, items)


def i_projections(z: np.ndarray, log_ratio: np.ndarray, codes: np.ndarray, n_groups: int,
                  group_weights: np.ndarray | None = None, heldout: np.ndarray | None = None,
                  workers: int | None = None) -> list[Projection]:
    """``i_projection`` of P samples that share one group layout, solved as one batch (the
    same damped Newton, each replicate of each sample with its own step and backtracking).

    ``z`` (P, n, k) and ``log_ratio`` (P, n): the samples, rows ordered so that ``codes`` (n,),
    shared by all of them, is non-decreasing (groups contiguous); ``group_weights`` (B, G) as
    in ``i_projection``, the same replicates for every sample; ``heldout`` (n,) as there, shared.
    ``workers``: threads for its batches (default ``THREADS``; a caller on threads of its own
    passes 1); each batch's arithmetic is its own, so the numbers do not depend on it."""
    z = np.asarray(z, dtype=np.float64)
    r = np.asarray(log_ratio, dtype=np.float64)
    codes = np.asarray(codes)
    if len(codes) and (np.diff(codes) < 0).any():
        raise ValueError("i_projections needs the rows of every sample ordered by group (codes non-decreasing)")
    n_pairs, n, k = z.shape
    c = np.ones((1, n_groups)) if group_weights is None else np.asarray(group_weights, dtype=np.float64)
    c = c / c.sum(axis=1, keepdims=True)
    per_batch = max(1, BATCH_FLOATS // max(1, len(c) * n * k))
    los = list(range(0, n_pairs, per_batch))

    def batch(lo: int) -> list[Projection]:
        hi = min(n_pairs, lo + per_batch)
        zs, logp, starts, d_g, _ = _prepared(z[lo:hi], r[lo:hi], codes, n_groups, heldout)  # in the batch's thread
        d_hats = d_g @ c.T  # (P', B)
        value, converged, lam = _newton(zs, logp, codes, starts, c)
        b = len(c)
        return [Projection(kl_min=np.maximum(value[i * b:(i + 1) * b], 0.0), d_hat=d_hats[i],
                           converged=converged[i * b:(i + 1) * b], lam=lam[i * b:(i + 1) * b])
                for i in range(hi - lo)]

    workers = THREADS if workers is None else workers
    if len(los) > 1 and workers > 1:
        with ThreadPoolExecutor(min(workers, len(los))) as pool:
            parts = list(pool.map(batch, los))
    else:
        parts = [batch(lo) for lo in los]
    return [proj for part in parts for proj in part]


def _prepared(z: np.ndarray, r: np.ndarray, codes: np.ndarray, n_groups: int, heldout: np.ndarray | None):
    """What every solve on samples z (P, n, k), r (P, n) starts from: z with each group centred
    on its target mean E_q[z] (the pooled constraint is then 0) and standardised by the
    within-group SD (the I-projection is invariant, Newton is not); log p_g(i) (P, n); each
    group's first row; each group's KL(q_g || p_g) (P, G); and whether each feature varies within
    each group (P, G, k)."""
    n = z.shape[1]
    size = np.bincount(codes, minlength=n_groups).astype(np.float64)
    starts = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
    log_q, logp, _, _ = mis_log_weights(r, heldout, codes, n_groups)  # (P, n) each
    q = np.exp(log_q)
    by_group = _with_groups(codes, n_groups)
    target = np.add.reduceat(q[:, :, None] * z, starts, axis=1)  # (P, G, k)
    zc = by_group(np.subtract, z, target)
    # a feature constant within a group is exactly at its target there: 0, not the rounding of the
    # weighted sum (a residue eps_g in every row of a group adds lambda . eps_g to the dual, which
    # is unbounded when every group is so: a sample constant within every group solved to 5e13)
    spread = np.maximum.reduceat(z, starts, axis=1) > np.minimum.reduceat(z, starts, axis=1)  # (P, G, k)
    zc = by_group(np.multiply, zc, spread)
    dev = by_group(np.subtract, z, np.add.reduceat(z, starts, axis=1) / size[:, None])
    sd = np.sqrt((dev ** 2).sum(axis=1) / max(n - n_groups, 1))  # (P, k)
    zs = zc / np.where(sd > 0, sd, 1.0)[:, None, :]
    d_g = np.add.reduceat(q * (log_q - logp), starts, axis=1)  # (P, G) KL(q_g || p_g)
    return zs, logp, starts, d_g, spread


@dataclass(frozen=True)
class GroupJackknife:
    """KL_min of P samples and of each with one prompt group deleted (``group_jackknife``)."""

    full: np.ndarray  # (P,) nats: KL_min of the whole sample (the dual value, as ``Projection.kl_min``)
    deleted: np.ndarray  # (P, G) nats: KL_min with group g deleted
    converged: np.ndarray  # (P,) bool: the whole sample's solve (and every deletion solved) converged
    solved: np.ndarray  # (P,) bool: the deletions solved from scratch (not by Newton steps)
    lam: np.ndarray | None = None  # (P, k) the whole sample's tilt, in the standardised units of ``_prepared``
    # (P, G) ``fixed_tilt_bias`` at ``lam``, made in the batches that stepped the deletions (None
    # where the deletions were solved: ``fixed_tilt_bias`` makes it then)
    bias: np.ndarray | None = None


# How ``group_jackknife`` gets KL_min with a group deleted: "exact" solves each deletion from
# lambda = 0 (G more solves per sample); "one_step" and "two_step" take Newton steps on the
# deleted dual from the whole sample's tilt, unchecked; "checked" takes two and solves from
# scratch the samples where the second step's gain says the steps may be off (``STEP_TOL``).
DELETIONS = ("checked", "exact", "one_step", "two_step")
STEPS = {"one_step": 1, "two_step": 2, "checked": 2}
# "checked" trusts the two steps of a sample while (G - 1) x its largest second-step gain -- what
# Newton still expected to gain after the first step, a measure (not a bound) of what the second leaves
# -- is at most this share of the jackknife's SE of KL_jk. Measured (bench/jackknife_deletions.py):
# on sharpened samples of 2 to 8 groups the error of KL_jk at most 0.028 of its SE and of the SE
# at most 3.6 % (both at G = 2), on collapse-like samples 0.013 and 1 %, on the bundled examples'
# and the truth harness's records 0.004 and 0.3 %. The samples solved are those with heavy weights
# and few groups, where Newton's quadratic model is poor from the whole sample's tilt: none of 8
# groups at mild weights, up to 80 % at G = 2 with the heaviest; a third of the collapsing run's.
# (A scan of this tolerance on 3,200 sharpened samples: at 0.1, errors up to 0.036 SE and 5.1 %,
# 17 % solved; at 0.05, 0.021 and 2.6 %, 22 %; at 0.03, 0.013 and 1.4 %, 26 %.)
STEP_TOL = 0.05
# ... and "checked" solves every deletion where the sample has fewer than STEP_MIN_GROUPS prompt
# groups or a group of fewer than STEP_MIN_ROWS rows. There a deletion moves the tilt far, the
# first step's Hessian is a poor model of the deleted dual's, and the second step's gain is no
# bound on what it leaves: an independent review found samples of 2 groups of 2 and 9 rows with
# heavy weights that the gain trusted while KL_jk was 0.27 of its SE off and its SE 27 % low.
# G + 1 solves of so few groups are cheap; the tap's layouts (8 groups of 12 rows) are stepped.
STEP_MIN_GROUPS = 4
STEP_MIN_ROWS = 4


def group_jackknife(z: np.ndarray, log_ratio: np.ndarray, codes: np.ndarray, n_groups: int,
                    heldout: np.ndarray | None = None, deletions: str = "checked",
                    workers: int | None = None) -> GroupJackknife:
    """KL_min of P samples that share one group layout (as ``i_projections``: rows ordered by
    group) and of each with each prompt group deleted, the delete-one-group jackknife's
    replicates.

    ``deletions="exact"``: every deletion solved from lambda = 0, batched with the whole
    sample (G + 1 solves per sample). Else the whole sample is solved and each deletion reached
    by Newton steps from its tilt lambda. With the targets centred (the dual is then
    Phi(lambda) = -(1/G) sum_g A_g(lambda), A_g the log-partition of group g's tilted p_g), the
    dual over the other G - 1 groups is Phi_(-g) = (G Phi + A_g) / (G - 1), its gradient
    (G grad + E_g[zs]) / (G - 1) and its negated Hessian (G H - Cov_g(zs)) / (G - 1), E_g and
    Cov_g under group g's tilted weights at lambda: every group's A_g, mean and covariance at
    the one lambda give every deletion's first step in closed form,

        KL_(-g) ~ Phi_(-g)(lambda) + 1/2 grad_(-g)^T H_(-g)^-1 grad_(-g).

    Deleting a group moves lambda by O(1/G) and the step's error is of third order in that
    move, but where a group's importance weights are heavy and G is small the move is large and
    the quadratic model poor (measured: one step's error in KL_jk up to 2 of its SEs at G = 2 and
    moderate weights, and 220 on a pair of the truth harness's collapsing run).
    ``"two_step"`` evaluates each deleted dual at its stepped tilt (G evaluations of the dual,
    about one more Newton iteration of the G deletions) and steps again with the first step's
    Hessian; ``"checked"`` (the default) does that and solves from scratch the deletions of the
    samples whose second step still expected to gain more than ``STEP_TOL`` of the jackknife's
    SE. The value is floored at 0 as a solve's is (the deleted dual is 0 at lambda = 0).
    Measured against the exact solves in bench/jackknife_deletions.py and
    tests/unit/test_jackknife.py. ``workers``: threads for its batches (default ``THREADS``; a
    caller that runs it on threads of its own passes 1); the numbers do not depend on it. Where
    the groups lie in equal consecutive blocks they do not depend on which samples are passed
    together either; elsewhere a matrix product's last bit does (``paired._group_lse``)."""
    if deletions not in DELETIONS:
        raise ValueError(f"deletions must be one of {DELETIONS}, not {deletions!r}")
    codes = np.asarray(codes)
    n_pairs = len(z)
    sizes = np.bincount(codes, minlength=n_groups) if n_groups else np.zeros(0, np.int64)
    few = n_groups < STEP_MIN_GROUPS or (len(sizes) and int(sizes.min()) < STEP_MIN_ROWS)
    if deletions == "exact" or n_groups < 2 or (deletions == "checked" and few):
        values, converged, lam = _solved_deletions(z, log_ratio, codes, n_groups, heldout, with_full=True,
                                                   workers=workers)
        return GroupJackknife(values[:, 0], values[:, 1:], converged, np.ones(n_pairs, dtype=bool), lam)
    z = np.asarray(z, dtype=np.float64)
    r = np.asarray(log_ratio, dtype=np.float64)
    if len(codes) and (np.diff(codes) < 0).any():
        raise ValueError("group_jackknife needs the rows of every sample ordered by group (codes non-decreasing)")
    _, n, k = z.shape
    steps = STEPS[deletions]
    c = np.full((1, n_groups), 1.0 / n_groups)
    two_sided = heldout is not None and bool(np.asarray(heldout).any())
    side = np.asarray(heldout, dtype=bool) if two_sided else None
    # the deletions hold each row's outer product of its deviations (n x k x k floats a sample)
    # and, for a second step, each row's tilted weight and features under every deletion (G x n x k)
    m = blocks(codes, n_groups)
    # where the groups are not equal consecutive blocks, the group sums of the weights are matrix
    # products (``paired._group_lse``), whose last bit depends on how many samples they are handed:
    # there the batches stay as they were (``BATCH_FLOATS``), so the numbers do too
    floats = JACKKNIFE_BATCH_FLOATS if m else BATCH_FLOATS
    per_batch = max(1, floats // max(1, n * k * max(k, n_groups if steps == 2 else 1)))
    los = list(range(0, n_pairs, per_batch))

    def batch(lo: int) -> tuple[np.ndarray, ...]:
        hi = min(n_pairs, lo + per_batch)
        # each sample's standardised features in its batch (on the batch's thread, in cache): every
        # sample's arithmetic is its own, so the same numbers as for all samples at once
        zs, logp, starts, _, spread = _prepared(z[lo:hi], r[lo:hi], codes, n_groups, heldout)
        value, converged, lam = _newton(zs, logp, codes, starts, c)
        deleted, gain = _step_deletions(zs, logp, lam, codes, starts, steps)
        # each group's term bias at the tilt, on the prepared features while they are in hand; in
        # equal blocks it reads them only through lambda . z, and is made after the batches (below)
        if two_sided and m:
            bias = (np.matmul(zs, lam[:, :, None])[:, :, 0], spread.any(axis=2))  # lambda . z (P, n), varies (P, G)
        elif two_sided:
            bias = _tilt_bias(z[lo:hi], r[lo:hi], zs, spread, lam, codes, n_groups, side)
        else:
            bias = np.zeros((hi - lo, n_groups))
        return np.maximum(value, 0.0), deleted, gain, converged, lam, bias

    def biases(lo: int) -> np.ndarray:
        hi = min(n_pairs, lo + TILT_BATCH)
        return _fixed_tilt_bias_blocks(r[lo:hi], a_all[lo:hi], side, varies[lo:hi], n_groups, m)

    asked = THREADS if workers is None else workers  # the fallback's solves below are batched anew
    workers = asked if len(los) > 1 else 1
    with ThreadPoolExecutor(min(workers, len(los))) if workers > 1 else _inline() as pool:
        parts = list(pool.map(batch, los))
        if two_sided and m:
            # the bias works on (P, G, m) arrays, k times smaller than the projections': in
            # batches of TILT_BATCH samples, not the projections' dozens (each sample's its own
            # arithmetic, so the same numbers), it is not a hundred numpy calls on a few KiB each
            a_all = np.concatenate([b[5][0] for b in parts])
            varies = np.concatenate([b[5][1] for b in parts])
            parts = [b[:5] for b in parts]
            bias = np.concatenate(list(pool.map(biases, range(0, n_pairs, TILT_BATCH))))
    full, deleted, gain, converged, lam, *rest = (np.concatenate(x) for x in zip(*parts))
    if rest:
        bias = rest[0]
    solved = np.zeros(n_pairs, dtype=bool)
    if deletions == "checked":
        g = n_groups
        dev = deleted - deleted.mean(axis=1, keepdims=True)
        se = np.sqrt((g - 1) / g * (dev ** 2).sum(axis=1))  # the jackknife's SE of KL_jk, as eta's
        with np.errstate(invalid="ignore"):
            # below the values' rounding (eta's guard on KL_jk) no step can be told from a solve
            trusted = (g - 1) * gain.max(axis=1) <= STEP_TOL * se + 4 * g * VALUE_RTOL * (1.0 + np.abs(full))
        solved = ~(trusted & np.isfinite(deleted).all(axis=1) & converged)
        if solved.any():
            again, ok, _ = _solved_deletions(z[solved], r[solved], codes, n_groups, heldout, with_full=False,
                                             workers=asked)
            deleted[solved] = again
            converged[solved] &= ok
    return GroupJackknife(full, deleted, converged, solved, lam, bias)


def _solved_deletions(z, r, codes, n_groups, heldout, with_full: bool, workers: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """KL_min of each sample with each group deleted, solved from lambda = 0 (P, G), preceded by
    the whole sample's (P, G + 1) ``with_full``; whether every solve converged (P,); and, with
    the whole sample, its tilt (P, k)."""
    weights = 1.0 - np.eye(n_groups)
    if with_full:
        weights = np.vstack([np.ones((1, n_groups)), weights])
    projs = i_projections(z, r, codes, n_groups, weights, heldout, workers=workers)
    lam = np.stack([proj.lam[0] for proj in projs]) if with_full else None
    return np.stack([proj.kl_min for proj in projs]), np.stack([proj.converged for proj in projs]).all(axis=1), lam


def _step_deletions(zs: np.ndarray, logp: np.ndarray, lam: np.ndarray, codes: np.ndarray, starts: np.ndarray,
                    steps: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """KL_min of each sample zs (P, n, k) with each group deleted (P, G), by Newton steps on
    the deleted dual from the whole sample's tilt ``lam`` (P, k) (``group_jackknife``): the
    first in closed form from each group's log-partition, mean and covariance at ``lam``; a
    second (``steps=2``) from the deleted duals evaluated at the stepped tilts (every group's
    log-partition and mean at each of them, G times one evaluation), with the first step's
    Hessian. Returns the values and the last step's predicted gain (P, G)."""
    n_pairs, n, k = zs.shape
    g = len(starts)
    by_group = _with_groups(codes, g)
    a = logp + np.matmul(zs, lam[:, :, None])[:, :, 0]  # (P, n)
    amax = np.maximum.reduceat(a, starts, axis=1)  # (P, G)
    e = np.exp(by_group(np.subtract, a, amax))
    zg = np.add.reduceat(e, starts, axis=1)
    log_part = amax + np.log(zg)  # (P, G) A_g(lambda)
    pt = by_group(np.divide, e, zg)  # within-group tilted probabilities
    mean_g = np.add.reduceat(pt[:, :, None] * zs, starts, axis=1)  # (P, G, k) E_g[zs]
    dev = by_group(np.subtract, zs, mean_g)
    m = blocks(codes, g)
    if m:  # groups of m rows one after another: each group's covariance by one batched product
        dv = dev.reshape(n_pairs, g, m, k)
        cov_g = np.matmul(dv.transpose(0, 1, 3, 2), pt.reshape(n_pairs, g, m, 1) * dv)  # (P, G, k, k)
    else:
        cov_g = np.add.reduceat((pt[:, :, None] * dev)[:, :, :, None] * dev[:, :, None, :], starts, axis=1)
    # the other groups' sums: the whole sample's, less the deleted group's
    phi = -(log_part.sum(axis=1, keepdims=True) - log_part) / (g - 1)  # (P, G) Phi_(-g)(lambda)
    grad = -(mean_g.sum(axis=1, keepdims=True) - mean_g) / (g - 1)  # (P, G, k)
    hess = (cov_g.sum(axis=1, keepdims=True) - cov_g) / (g - 1) + 1e-12 * np.eye(k)  # as _newton's
    step = np.linalg.solve(hess, grad[..., None])[..., 0]
    gain = 0.5 * np.einsum("pgk,pgk->pg", grad, step)
    if steps == 1:
        return np.maximum(phi + gain, 0.0), gain
    # the deleted duals at their stepped tilts: row d of (P, G, n) tilted by deletion d's lambda
    lam1 = lam[:, None, :] + step  # (P, G, k)
    a1 = logp[:, None, :] + np.matmul(lam1, zs.transpose(0, 2, 1))  # (P, G, n)
    amax1 = np.maximum.reduceat(a1, starts, axis=2)  # (P, G deleted, G)
    if m:
        e1 = np.exp(a1.reshape(n_pairs, g, g, m) - amax1[..., None])
        zg1 = e1.sum(axis=3)
        mean1 = np.matmul(e1.transpose(0, 2, 1, 3), zs.reshape(n_pairs, g, m, k)).transpose(0, 2, 1, 3)
    else:
        e1 = np.exp(a1 - amax1[:, :, codes])
        zg1 = np.add.reduceat(e1, starts, axis=2)
        mean1 = np.add.reduceat(e1[..., None] * zs[:, None], starts, axis=2)  # (P, G, G, k)
    mean1 = mean1 / zg1[..., None]
    log_part1 = amax1 + np.log(zg1)
    own = np.arange(g)
    phi1 = -(log_part1.sum(axis=2) - log_part1[:, own, own]) / (g - 1)  # (P, G) Phi_(-g)(lambda_g)
    grad1 = -(mean1.sum(axis=2) - mean1[:, own, own]) / (g - 1)
    gain1 = 0.5 * np.einsum("pgk,pgk->pg", grad1, np.linalg.solve(hess, grad1[..., None])[..., 0])
    # phi1, the deleted dual at the stepped tilt, is a lower bound on the deleted KL_min (weak
    # duality); phi1 + gain1 is Newton's prediction of its maximum (it may overshoot, which the
    # gain's check is there for), never below the dual's value at the whole sample's tilt, phi
    return np.maximum(np.maximum(phi1 + gain1, phi), 0.0), gain1


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
    def rows_of(x, rows):
        """x of each replicate's sample: x itself where that is every sample once, in order."""
        return x if b == 1 and len(rows) == n_pairs else x[pair[rows]]

    def evaluate(lam_, rows):
        a = rows_of(logp, rows) + np.matmul(rows_of(zs, rows), lam_[:, :, None])[:, :, 0]  # (R', n)
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
        ci, qi, zi = c_all[i], q[i], rows_of(zs, i)
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


def fixed_tilt_bias(z: np.ndarray, log_ratio: np.ndarray, codes: np.ndarray, n_groups: int,
                    heldout: np.ndarray | None, lam: np.ndarray) -> np.ndarray:
    """The stratified jackknife's estimate of the bias of each prompt group's term of the dual at
    a fixed tilt, for P samples laid out as ``i_projections`` wants them (P, G).

    Group g's term, phi_g(lambda) = lambda . E_{q_g}[z] - log E_{p_g}[exp(lambda . z)], is a
    function of self-normalised means over the group's few rows: the log of a mean and a ratio
    of means, each biased at O(1/n) within the group (Jensen's inequality; the bias of a ratio
    estimator). That bias does not shrink with the number of groups, so the delete-one-group
    jackknife leaves it in KL_min. Deleting one row of each side of the group in turn (the
    balance heuristic's counts less one on that side, the tilt ``lam`` held where the whole sample
    put it: the tilt's own noise is the group jackknife's), b_g = sum over sides s of
    (n_s - 1) (mean_i phi_g^(-i) - phi_g), Quenouille's estimate for the strata of a stratified
    sample. A side of fewer than two rows adds nothing; a group whose features are constant has
    phi_g = 0 at any tilt, and b_g = 0. ``lam`` (P, k): the tilt in the standardised units of
    ``_prepared`` (``GroupJackknife.lam``).

    Two-sided samples only (``heldout`` given): there the balance heuristic bounds every raw
    weight by 1/n of its side, and a deleted row moves phi_g by O(1/n). One-sided, p_g is
    proportional to exp(-r), unbounded, and a deletion of the heaviest row moves phi_g by O(1):
    measured on the truth harness's one-sided runs (tools/truth.py --budget default) the
    correction sent the moderate run's eta from 0.551 (truth 0.546) to 0.662. Zeros there, and
    for each group of a two-sided sample whose rows are all on one side (a group the held-out
    draw did not reach): its weights are the one-sided ones."""
    z = np.asarray(z, dtype=np.float64)
    if heldout is None or not np.asarray(heldout).any():
        return np.zeros((len(z), n_groups))
    r = np.asarray(log_ratio, dtype=np.float64)
    codes = np.asarray(codes)
    side = np.asarray(heldout, dtype=bool)
    n_pairs, n, k = z.shape
    per_batch = max(1, BATCH_FLOATS // max(1, n * k))
    out = np.zeros((n_pairs, n_groups))
    for lo in range(0, n_pairs, per_batch):  # batches of bounded size, as the jackknife's
        hi = min(n_pairs, lo + per_batch)
        zs, _, _, _, spread = _prepared(z[lo:hi], r[lo:hi], codes, n_groups, heldout)
        out[lo:hi] = _tilt_bias(z[lo:hi], r[lo:hi], zs, spread, lam[lo:hi], codes, n_groups, side)
    return out


def _tilt_bias(z: np.ndarray, r: np.ndarray, zs: np.ndarray, spread: np.ndarray, lam: np.ndarray,
               codes: np.ndarray, n_groups: int, side: np.ndarray) -> np.ndarray:
    """``fixed_tilt_bias`` of samples already prepared (``_prepared``: zs, and whether each feature
    varies in each group, ``spread``), two-sided (``side``)."""
    a_all = np.matmul(zs, lam[:, :, None])[:, :, 0]  # (P, n) lambda . z
    varies = spread.any(axis=2)  # (P, G)
    m = blocks(codes, n_groups)
    if m:  # groups of m rows one after another: every deletion of every group at once
        return _fixed_tilt_bias_blocks(r, a_all, side, varies, n_groups, m)
    n_pairs = len(z)
    out = np.zeros((n_pairs, n_groups))
    size = np.bincount(codes, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(size)[:-1]])
    for g in range(n_groups):
        rows = slice(starts[g], starts[g] + size[g])
        sg, rg, ag, zg = side[rows], r[:, rows], a_all[:, rows], zs[:, rows]
        n_a, n_b = int(sg.sum()), int((~sg).sum())
        # a group whose features are all constant has phi_g = 0 at any tilt: exactly 0 here, not
        # the rounding of its centring (the row's correction is then exactly the jackknife's); a
        # group with rows on one side only has unbounded weights: no correction, as one-sided
        if not varies[:, g].any() or not (n_a and n_b):
            continue
        full = _group_term(rg, ag, zg, lam, sg, n_a, n_b, None)
        for on_a, n_s in ((True, n_a), (False, n_b)):
            if n_s < 2:
                continue
            drop = np.flatnonzero(sg == on_a)  # each deletion: this row out, the counts less one
            reps = _group_term(rg, ag, zg, lam, sg, n_a - on_a, n_b - (not on_a), drop)  # (P, n_s)
            out[:, g] += np.where(varies[:, g], (n_s - 1) * (reps.mean(axis=1) - full[:, 0]), 0.0)
    return out


def _fixed_tilt_bias_blocks(r, a, side, varies, n_groups: int, m: int) -> np.ndarray:
    """``fixed_tilt_bias`` where the groups are equal consecutive blocks of m rows. A deletion on
    one side changes the balance heuristic's counts alike for every row of the group, so each
    side's weights are one (P, G, m) array, and a deletion leaves its row out of sums over the
    others (``_leave_one_out``): the group's term and all its deletions in a few passes over
    (P, G, m), the same arithmetic as the per-group loop up to rounding. Its dual term reads
    the features only through lambda . z (``a``), E_q[lambda . z] being lambda . E_q[z]."""
    n_pairs = len(r)
    g = n_groups
    rb, ab = r.reshape(n_pairs, g, m), a.reshape(n_pairs, g, m)
    sb = side.reshape(g, m)
    n_a = sb.sum(axis=1).astype(np.float64)  # (G,)
    n_b = m - n_a

    def weights(ca: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # the raw log weights towards pi_{t+1} and pi_t, as ``mis_log_weights``, at counts (G,):
        # a side left with no row has log 0 = -inf, which the weights absorb; pi_t's weight is
        # pi_{t+1}'s over the ratio, 1 / (n_a + n_b e^r) = e^-r / (n_a e^-r + n_b)
        with np.errstate(divide="ignore"):
            la, lb = np.log(np.maximum(ca, 0))[None, :, None], np.log(np.maximum(cb, 0))[None, :, None]
        lwq = -np.logaddexp(la - rb, lb)
        return lwq, lwq - rb  # (P, G, m) each

    lwq, lwp = weights(n_a, n_b)
    wq = np.exp(lwq - lwq.max(axis=2, keepdims=True))
    full = (wq * ab).sum(axis=2) / wq.sum(axis=2) - (_lse(lwp + ab) - _lse(lwp))  # (P, G)
    out = np.zeros((n_pairs, g))
    for on_a, n_s in ((True, n_a), (False, n_b)):
        if not (n_s >= 2).any():
            continue
        lwq, lwp = weights(n_a - on_a, n_b - (not on_a))
        mean_q = _leave_one_out_mean(lwq, ab)  # (P, G, m): E_q[lambda . z] with row d left out
        reps = mean_q - (_leave_one_out(lwp + ab) - _leave_one_out(lwp))
        rows = sb == on_a  # (G, m): the deletions of this side
        mean = np.where(rows, reps, 0.0).sum(axis=2) / np.maximum(n_s, 1)  # (P, G)
        out += np.where(n_s >= 2, (n_s - 1) * (mean - full), 0.0)
    # a group with rows on one side only has the one-sided weights, unbounded: no correction
    # there, as for a one-sided sample (``fixed_tilt_bias``)
    return np.where(varies & ((n_a > 0) & (n_b > 0))[None, :], out, 0.0)


def _leave_one_out(x: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis of x (..., m) leaving out each entry in turn (..., m), m >= 2:
    shifted by the largest entry, the sum less entry d is at least the largest's 1 where d is
    not the largest (no cancellation), and the largest is left out by a sum of the rest."""
    top = x.max(axis=-1, keepdims=True)
    e = np.exp(x - top)
    with np.errstate(divide="ignore"):
        out = top + np.log(e.sum(axis=-1, keepdims=True) - e)
    arg = x.argmax(axis=-1)[..., None]
    rest = np.where(np.arange(x.shape[-1]) == arg, -np.inf, x)
    out_arg = _lse(rest)[..., None]
    return np.where(np.arange(x.shape[-1]) == arg, out_arg, out)


def _leave_one_out_mean(lw: np.ndarray, a: np.ndarray) -> np.ndarray:
    """The weighted mean of a (..., m) under weights exp(lw), leaving out each entry in turn,
    shifted as ``_leave_one_out`` (the largest weight is left out by a sum of the rest)."""
    top = lw.max(axis=-1, keepdims=True)
    w = np.exp(lw - top)
    wa = w * a
    with np.errstate(divide="ignore", invalid="ignore"):  # the largest's own entry: replaced below
        out = (wa.sum(axis=-1, keepdims=True) - wa) / (w.sum(axis=-1, keepdims=True) - w)
    arg = lw.argmax(axis=-1)[..., None]
    first = np.arange(lw.shape[-1]) == arg
    rest = np.where(first, -np.inf, lw)
    w2 = np.exp(rest - rest.max(axis=-1, keepdims=True))
    out_arg = ((w2 * a).sum(axis=-1) / w2.sum(axis=-1))[..., None]
    return np.where(first, out_arg, out)


def _group_term(r, a, zs, lam, side, n_a: int, n_b: int, drop):
    """phi_g at the fixed tilt of one group's rows (r, a = lambda . z: (P, m); zs (P, m, k)), its
    balance-heuristic weights from the side counts n_a, n_b; with ``drop`` (D,) one value per
    deletion, that row left out (P, D); else the whole group's (P, 1)."""
    with np.errstate(divide="ignore"):
        la, lb = np.log(n_a), np.log(n_b)
    lwq = -np.logaddexp(la - r, lb)  # (P, m) raw weights towards pi_{t+1}, as ``mis_log_weights``
    lwp = -np.logaddexp(la, lb + r)
    m = r.shape[1]
    keep = np.ones((1, m), dtype=bool) if drop is None else np.arange(m)[None, :] != np.asarray(drop)[:, None]  # (D, m)
    mask = np.where(keep, 0.0, -np.inf)[None]  # (1, D, m)
    lq = lwq[:, None, :] + mask
    lq = lq - _lse(lq)[..., None]
    target = np.einsum("pdm,pmk->pdk", np.exp(lq), zs)  # (P, D, k) E_q[z]
    lp = lwp[:, None, :] + mask
    log_part = _lse(lp + a[:, None, :]) - _lse(lp)  # (P, D) log E_p[exp(lambda . z)]
    return np.einsum("pdk,pk->pd", target, lam) - log_part


def _lse(x: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis (every slice holds a finite entry)."""
    top = x.max(axis=-1)
    return top + np.log(np.exp(x - top[..., None]).sum(axis=-1))
