"""The behavioural metric G = J F^-1 J^T (seed, section "The three numbers").

Rung 1 (``covariance_bound``) estimates G by the pooled within-step covariance C of the
features. Since G <= C in the Loewner order (the part of a feature's variance a parameter
move can reach is at most its variance), KL_min computed from C is a *lower* bound on the
true minimum. Rung 2 (``fisher_kernel``) takes per-sequence score vectors S (n x |theta|,
from ``reward_lens.measure.whitebox.scores``; this module itself needs only numpy) and
computes G in kernel form, never forming the |theta| x |theta| Fisher:

    G_lambda = (1/n) Zc^T K (K + n lambda I)^-1 Zc,   K = S S^T,

which is J (F + lambda)^-1 J^T with J = (1/n) Zc^T S and F = (1/n) S^T S (push-through).

The rung-2 limit stated where it is defined: with fewer rollouts than parameters (every
real policy), the undamped kernel plug-in gives G-hat = C-hat exactly and h^2 = 1 for every
feature, whatever is true. The damping is the entire content of that estimate, which is
why every MetricG carries ``damping`` and ``damping_stable``, and a reading with
``damping_stable = False`` is to be read as the covariance bound with a shrinkage applied,
not as a measurement of G.

Degenerate features are handled by name, never by a LinAlgError: a feature whose pooled
within-step variance is zero (constant in every step, e.g. length at the cap) is excluded
as ``constant``; a feature whose variance is explained by the features before it in the
basis to within a fraction ``COLLINEAR_TOL`` is excluded as ``collinear``. Excluded
features keep their place in ``names``; they carry no share and their movement is named,
not priced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import math

import numpy as np

from reward_lens.measure.ledger.price import (StepSample, blocks, group_sums, in_threads, segment_scatter, stack_views,
                                              stacked)

# Relative SD below which a feature counts as constant: 1e-12 of max(1, |mean|), i.e. at
# float64 round-off, so that only genuinely constant features are excluded.
CONSTANT_TOL = 1e-12
# A feature whose residual variance fraction, given the features before it, is below this
# is collinear. 1e-10 keeps the condition number of the active correlation matrix under
# about 1e10. At that conditioning the exact Shapley sweep keeps only about 4 correct digits
# (measured: relative error of the share sum 6.6e-5 at condition 1e9-1e12), so every row
# checks its share sum against KL_min (cost.SHARE_SUM_RTOL) and says when it misses.
COLLINEAR_TOL = 1e-10

METHODS = ("covariance_bound", "fisher_kernel")


@dataclass(frozen=True, eq=False)
class MetricG:
    """An estimate of G in the basis ``names``.

    ``matrix`` is k x k in feature units squared. ``active`` are the features KL_min is
    computed over; ``excluded`` says why each other feature is left out. ``h2[f]`` is
    G_ff / C_ff: 1 for the covariance bound by construction.
    """

    matrix: np.ndarray
    names: tuple[str, ...]
    method: str
    n: int
    damping: float
    damping_stable: bool
    h2: dict[str, float]
    active: tuple[str, ...]
    excluded: dict[str, str] = field(default_factory=dict)
    reading: str = ""
    diagnostics: dict[str, float] = field(default_factory=dict)
    scope: str = "pooled"
    by_step: Mapping[int, MetricG] = field(default_factory=dict)  # scope "per_step": G_t for each step t

    def for_step(self, t: int) -> MetricG:
        """The metric that prices the movement of step t (pi_t -> pi_{t+1})."""
        if self.scope != "per_step":
            return self
        if t not in self.by_step:
            raise KeyError(f"the per-step metric has no estimate at step {t}")
        return self.by_step[t]

    # What a book pricing thousands of step pairs reads of each step's metric, without making
    # one MetricG per step where ``by_step`` holds them as arrays (``StepMetrics``).
    def active_of(self, t: int) -> tuple[str, ...]:
        return self.by_step.active(t) if isinstance(self.by_step, StepMetrics) else self.for_step(t).active

    def excluded_of(self, t: int) -> dict[str, str]:
        return self.by_step.excluded(t) if isinstance(self.by_step, StepMetrics) else self.for_step(t).excluded

    def matrix_of(self, t: int) -> np.ndarray:
        return self.by_step.matrix(t) if isinstance(self.by_step, StepMetrics) else self.for_step(t).matrix

    def matrices_of(self, steps: Sequence[int]) -> np.ndarray:
        """``matrix_of`` of each step, stacked (n, k, k)."""
        if isinstance(self.by_step, StepMetrics):
            return self.by_step.matrices[[self.by_step.position[t] for t in steps]]
        return np.stack([self.matrix_of(t) for t in steps])

    @property
    def active_index(self) -> np.ndarray:
        return active_index(self.names, self.active)


def active_index(names: tuple[str, ...], active: tuple[str, ...]) -> np.ndarray:
    """The positions of ``active`` in ``names`` (read-only: one array per pair of tuples, which
    10,000 step pairs in a few active sets share)."""
    return _active_index(tuple(names), tuple(active))


@lru_cache(maxsize=4096)
def _active_index(names: tuple[str, ...], active: tuple[str, ...]) -> np.ndarray:
    out = np.array([names.index(a) for a in active], dtype=int)
    out.flags.writeable = False
    return out


class StepMetrics(Mapping):
    """The per-step metrics of a MetricG of scope "per_step", held as arrays: step t's G_t
    (``matrices``), its active set and exclusions (``sets``) and rollouts; the MetricG of a
    step is made when it is asked for (a 10,000-step run needs 10,000 estimates, and a book
    prices them from the arrays). ``reading(t)`` says how step t's estimate was made."""

    def __init__(self, steps: Sequence[int], matrices: np.ndarray, sets: Sequence[tuple[tuple[str, ...], dict[str, str]]],
                 ns: Sequence[int], names: tuple[str, ...], reading):
        self.steps = [int(t) for t in steps]
        self.position = {t: i for i, t in enumerate(self.steps)}
        self.matrices, self.sets, self.ns = matrices, list(sets), [int(n) for n in ns]
        self.names, self._reading = names, reading
        self._made: dict[int, MetricG] = {}

    def __getitem__(self, t: int) -> MetricG:
        if t not in self._made:
            i = self.position[t]  # KeyError for a step it has no estimate for, as a dict
            active, excluded = self.sets[i]
            self._made[t] = MetricG(matrix=self.matrices[i], names=self.names, method="covariance_bound", n=self.ns[i],
                                    damping=0.0, damping_stable=True, h2={a: 1.0 for a in active}, active=active,
                                    excluded=excluded, reading=self._reading(t))
        return self._made[t]

    def __contains__(self, t) -> bool:
        return t in self.position

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def active(self, t: int) -> tuple[str, ...]:
        return self.sets[self.position[t]][0]

    def excluded(self, t: int) -> dict[str, str]:
        return self.sets[self.position[t]][1]

    def matrix(self, t: int) -> np.ndarray:
        return self.matrices[self.position[t]]


def pooled_covariance(samples: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Pooled within-step covariance, grand mean, total rollouts, degrees of freedom."""
    return _pooled(np.array([s.n for s in samples]), *step_scatter(samples))


def _pooled(ns: np.ndarray, scat: np.ndarray, sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    dof = int(np.where(ns >= 2, ns - 1, 0).sum())
    if dof < 1:
        raise ValueError(f"metric_g needs at least one step with two or more rollouts (got {len(ns)} step(s), "
                         f"with {', '.join(str(int(n)) for n in ns[:5])}{', ...' if len(ns) > 5 else ''} rollouts)")
    n = int(ns.sum())
    return scat.sum(axis=0) / dof, sums.sum(axis=0) / max(n, 1), n, dof


def _active_set(c: np.ndarray, mean: np.ndarray, names: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    excluded: dict[str, str] = {}
    sd = np.sqrt(np.clip(np.diag(c), 0, None))
    keep: list[int] = []
    for j, name in enumerate(names):
        if sd[j] <= CONSTANT_TOL * max(1.0, abs(mean[j])):
            excluded[name] = "constant: its within-step variance is zero in every step of the window"
            continue
        if keep:
            r = c[np.ix_(keep + [j], keep + [j])] / np.outer(sd[keep + [j]], sd[keep + [j]])
            rss = r[:-1, :-1]
            rsj = r[:-1, -1]
            resid = 1.0 - rsj @ np.linalg.solve(rss, rsj)
            if resid < COLLINEAR_TOL:
                with_ = ", ".join(names[i] for i in keep)
                excluded[name] = (f"collinear: {1 - resid:.12f} of its variance is explained by earlier "
                                  f"features ({with_})")
                continue
        keep.append(j)
    return tuple(names[i] for i in keep), excluded


def _cholesky_diagonals(mats: np.ndarray) -> np.ndarray:
    """The diagonals of the Cholesky factors of a stack of matrices (W, k, k), NaN for a matrix
    that is not positive definite. numpy refuses the whole stack for one such matrix, so a
    refused stack is halved until the refusals are isolated: a few more batched calls, not one
    call per matrix."""
    try:
        return np.diagonal(np.linalg.cholesky(mats), axis1=1, axis2=2)
    except np.linalg.LinAlgError:
        if len(mats) == 1:
            return np.full((1, mats.shape[-1]), np.nan)
        half = len(mats) // 2
        return np.concatenate([_cholesky_diagonals(mats[:half]), _cholesky_diagonals(mats[half:])])


def _active_sets(cs: np.ndarray, means: np.ndarray, names: tuple[str, ...]):
    """``_active_set`` for a stack of covariances (W, k, k) at once, with the same result.

    Windows are grouped by which features are constant in them. In each group the first
    window is decided by ``_active_set`` itself, and its decision is then *checked* on every
    window of the group in a few batched operations: each kept feature's residual variance
    fraction given the kept ones before it is at least ``COLLINEAR_TOL`` (the squared
    diagonal of the Cholesky factor of the kept features' correlation matrix, in basis
    order), and each feature it excluded as collinear has a residual fraction below it given
    the kept features before it. A window where the check fails is decided by
    ``_active_set`` too."""
    cs = np.asarray(cs, dtype=np.float64)
    out: list = [None] * len(cs)
    if not len(cs):
        return out
    sd = np.sqrt(np.clip(np.diagonal(cs, axis1=1, axis2=2), 0, None))
    const = sd <= CONSTANT_TOL * np.maximum(1.0, np.abs(means))
    # each window's pattern of constant features as one integer (k <= 64 bits; wider as bytes)
    pattern = const @ (1 << np.arange(const.shape[1], dtype=np.uint64)) if const.shape[1] <= 64 else \
        np.array([row.tobytes() for row in const])
    _, which = np.unique(pattern, return_inverse=True)
    for p in range(int(which.max()) + 1):
        idx = np.flatnonzero(which.reshape(-1) == p)
        active, excluded = _active_set(cs[idx[0]], means[idx[0]], names)
        out[idx[0]] = (active, excluded)
        rest = idx[1:]
        keep = [names.index(a) for a in active]
        if not len(rest) or not keep:
            continue
        sdr = np.where(sd[rest] > 0, sd[rest], 1.0)  # constant features are not used below
        corr = cs[rest] / (sdr[:, :, None] * sdr[:, None, :])
        diag = _cholesky_diagonals(corr[:, keep][:, :, keep]) ** 2
        ok = (diag >= COLLINEAR_TOL).all(axis=1)  # NaN (not positive definite) fails
        # Only windows whose kept features passed go on: every leading block of their kept
        # correlation is then positive definite, so the solves below cannot be singular.
        rest, corr = rest[ok], corr[ok]
        ok = ok[ok]
        reasons: dict[str, np.ndarray] = {}
        for name, why in excluded.items():
            if not why.startswith("collinear"):
                continue
            j = names.index(name)
            before = [i for i in keep if i < j]
            rkk = corr[:, before][:, :, before]
            rkj = corr[:, before, j]
            resid = 1.0 - np.einsum("wi,wi->w", rkj, np.linalg.solve(rkk, rkj[..., None])[..., 0])
            ok &= resid < COLLINEAR_TOL
            reasons[name] = resid
        with_ = {name: ", ".join(names[i] for i in keep if i < names.index(name)) for name in reasons}
        explained = {name: (1 - resid).tolist() for name, resid in reasons.items()}
        for q in np.flatnonzero(ok).tolist():
            ex = dict(excluded)
            for name in reasons:  # the fraction explained is the window's own
                ex[name] = (f"collinear: {explained[name][q]:.12f} of its variance is explained by earlier "
                            f"features ({with_[name]})")
            out[rest[q]] = (active, ex)
    for i in range(len(cs)):
        if out[i] is None:
            out[i] = _active_set(cs[i], means[i], names)
    return out


# scope="auto" prices each step with its own covariance when every step has at least this
# many rollouts per feature (a 9-feature basis: 90 rollouts), else pools the window.
PER_STEP_MIN_PER_FEATURE = 10


def metric_g(samples: Sequence[StepSample], method: str = "covariance_bound", **kwargs) -> MetricG:
    """Estimate G from per-step samples.

    ``method="covariance_bound"``: G ~ C, the within-step feature covariance; KL_min from it
    is a lower bound. ``damping`` is 0 and ``damping_stable`` True: no damping enters.

    ``scope`` (covariance bound only): ``"pooled"`` (default) pools the within-step
    covariance over the window, which is what a few rollouts per step allow, and assumes
    the covariance is stationary over it: where the policy's feature covariance shrinks
    (a policy collapsing onto the rewarded behaviour), the pooled C can fall below G_t and
    KL_min can exceed the true minimum; the envelope check then refuses. ``"per_step"``
    uses C_t, the covariance of pi_t's own rollouts, for the step t -> t+1, where the bound
    G_t <= C_t holds exactly. ``"local"`` pools over the ``LOCAL_HALF_WIDTH`` steps on
    either side of t. ``"auto"`` picks per_step when every step has at least
    ``PER_STEP_MIN_PER_FEATURE`` rollouts per feature, else local.
    """
    if not samples:
        raise ValueError("metric_g needs at least one StepSample")
    names = samples[0].names
    for s in samples:
        if s.names != names:
            raise ValueError(f"step {s.step} is in basis {s.names}, not {names}")
    if method == "covariance_bound":
        scope = kwargs.pop("scope", "pooled")
        if kwargs:
            raise TypeError(f"covariance_bound takes only scope=, got {sorted(kwargs)}")
        if scope == "auto":
            enough = min(s.n for s in samples) >= PER_STEP_MIN_PER_FEATURE * len(names)
            scope = "per_step" if enough else "local"
        if scope == "per_step":
            return _per_step(samples)
        if scope == "local":
            return _local(samples)
        if scope != "pooled":
            raise ValueError(f"scope must be 'pooled', 'local', 'per_step' or 'auto', not {scope!r}")
        c, mean, n, _ = pooled_covariance(samples)
        active, excluded = _active_set(c, mean, names)
        return MetricG(
            matrix=c, names=names, method=method, n=n, damping=0.0, damping_stable=True,
            h2={a: 1.0 for a in active}, active=active, excluded=excluded,
            reading="covariance bound, pooled over the window: G is taken as the within-step covariance C >= G, "
                    "so KL_min is a lower bound on the true minimum while C is stationary over the window",
        )
    if method == "fisher_kernel":
        if kwargs.get("scores") is None and kwargs.get("kernel") is None:
            raise ValueError("metric_g(method='fisher_kernel') needs scores= (the per-sequence score vectors of the "
                             "step's rollouts, reward_lens.measure.whitebox.scores.score_matrix) or kernel= (K = S S^T, "
                             "e.g. reward_lens.measure.whitebox.sketch.sketched_kernel)")
        return fisher_kernel_metric(samples, **kwargs)
    raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")


# scope="local" pools the within-step covariance over the steps within this many steps of t:
# 21 steps x 8 rollouts = 147 degrees of freedom for a 9-feature basis, while a run's feature
# covariance changes over tens of steps (KL_min with the whole-run pool ranged 0.08-2.3x the
# +-10-step one on the reference records).
LOCAL_HALF_WIDTH = 10


# Steps are centred and summed this many rollouts at a time: the centred copy of a block stays
# in cache, where one of every rollout (46 MB at 640,000 x 9) would be paged in only to be freed.
BLOCK_ROWS = 1 << 15


def _step_blocks(ordered: Sequence[StepSample], per_step):
    """All steps' feature sums (P, k), and ``per_step(zc, starts, ns)`` of their rollouts centred
    on their step's mean, block by block of whole steps (each block's rows relative to it)."""
    ns = np.fromiter((x.n for x in ordered), np.int64, len(ordered))
    k = ordered[0].z.shape[1]
    z = stacked(ordered) if ns.any() else np.zeros((0, k))
    starts = np.r_[0, np.cumsum(ns)[:-1]]
    some = ns > 0
    sums = np.zeros((len(ordered), k))
    sums[some] = np.add.reduceat(z, starts[some], axis=0)  # reduceat cannot sum an empty segment
    means = sums / np.maximum(ns, 1)[:, None]
    parts, i = [], 0
    while i < len(ordered):  # blocks of whole steps, at least one step each
        j = max(i + 1, int(np.searchsorted(starts, starts[i] + BLOCK_ROWS, side="right")))
        j = min(j, len(ordered))
        a, b = int(starts[i]), int(starts[j - 1] + ns[j - 1])
        zc = z[a:b] - np.repeat(means[i:j], ns[i:j], axis=0)
        parts.append(per_step(zc, starts[i:j] - a, ns[i:j]))
        i = j
    return sums, parts


def step_sums(ordered: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    """Each step's feature sums and sums of squared deviations from its mean (the diagonal of
    ``step_scatter``), for all steps at once."""
    scat, sums = step_scatter(ordered)
    return sums, np.diagonal(scat, axis1=1, axis2=2).copy()


def step_scatter(ordered: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    """Each step's scatter sum_i (z_i - mean)(z_i - mean)^T (zero for a step of one rollout)
    and feature sums, for all steps at once (``segment_scatter`` of the centred rollouts);
    worked out once per run of samples of a stack, for the metric and the cost section both
    (read-only)."""
    k = ordered[0].z.shape[1]

    def make():
        sums, parts = _step_blocks(ordered, lambda zc, starts, ns: segment_scatter(zc, starts, np.where(ns >= 2, ns, 0)))
        scat = np.concatenate(parts) if parts else np.zeros((0, k, k))
        scat.flags.writeable = sums.flags.writeable = False
        return scat, sums

    st = ordered[0].stack
    return st.memo("step_scatter", ordered, make) if st is not None else make()


def _window_sum(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``values[lo[i]:hi[i]].sum(axis=0)`` for every i, added in index order: offset d adds
    ``values[lo + d]`` to every window still inside, as slices wherever consecutive windows
    read consecutive values (the middle of a run of steps), gathered elsewhere."""
    out = np.zeros((len(lo),) + values.shape[1:], dtype=values.dtype)
    for d in range(int((hi - lo).max(initial=0))):
        rows = np.flatnonzero(lo + d < hi)
        src = lo[rows] + d
        # runs in which both the window and the value it adds advance by one
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(src) != 1)) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, len(rows)]
        long = ends - starts >= 8
        for a, b in zip(starts[long].tolist(), ends[long].tolist()):
            out[rows[a]:rows[b - 1] + 1] += values[src[a]:src[b - 1] + 1]
        short = np.concatenate([np.arange(a, b) for a, b in zip(starts[~long].tolist(), ends[~long].tolist())] or
                               [np.zeros(0, np.int64)])
        out[rows[short]] += values[src[short]]
    return out


def _local(samples: Sequence[StepSample]) -> MetricG:
    names = samples[0].names
    ordered = sorted(samples, key=lambda x: x.step)
    steps = np.array([s.step for s in ordered])
    lo = np.searchsorted(steps, steps - LOCAL_HALF_WIDTH, side="left")
    hi = np.searchsorted(steps, steps + LOCAL_HALF_WIDTH, side="right")
    ns = np.array([x.n for x in ordered])
    dofs = np.where(ns >= 2, ns - 1, 0)
    scat, sums = step_scatter(ordered)
    # the steps within the half-width, by bisection; each window adds its steps' scatter in
    # step order, all windows at once: offset d adds the (lo + d)-th step where it is inside
    w_dof = _window_sum(dofs, lo, hi)
    if (w_dof < 1).any():
        bad = steps[np.flatnonzero(w_dof < 1)[:5]].tolist()
        raise ValueError(f"metric_g needs at least one step with two or more rollouts within {LOCAL_HALF_WIDTH} "
                         f"steps of every step; steps {bad} have none")
    w_n = _window_sum(ns, lo, hi)
    cs = _window_sum(scat, lo, hi) / w_dof[:, None, None]
    ms = _window_sum(sums, lo, hi) / np.maximum(w_n, 1)[:, None]
    by_step = StepMetrics(steps.tolist(), cs, _active_sets(cs, ms, names), w_n.tolist(), names,
                          lambda t: f"covariance bound pooled over steps {t} +- {LOCAL_HALF_WIDTH}")
    c_pool, mean, n, _ = _pooled(ns, scat, sums)
    active, excluded = _active_set(c_pool, mean, names)
    return MetricG(matrix=c_pool, names=names, method="covariance_bound", n=n, damping=0.0, damping_stable=True,
                   h2={a: 1.0 for a in active}, active=active, excluded=excluded, scope="per_step", by_step=by_step,
                   reading=f"covariance bound, local: the step t -> t+1 is priced with the within-step covariance "
                           f"pooled over steps t - {LOCAL_HALF_WIDTH} .. t + {LOCAL_HALF_WIDTH} (C is not stationary "
                           "over a run; KL_min is a lower bound while it is stationary over that window)")


def _per_step(samples: Sequence[StepSample]) -> MetricG:
    names = samples[0].names
    for s in samples:
        if s.n < 2:
            raise ValueError(f"step {s.step} has {s.n} rollout: a per-step covariance needs at least 2")
    cs = np.stack([np.atleast_2d(np.cov(s.z, rowvar=False, ddof=1)) for s in samples])
    sets = _active_sets(cs, np.stack([s.z.mean(axis=0) for s in samples]), names)
    by_step = StepMetrics([s.step for s in samples], cs, sets, [s.n for s in samples], names,
                          lambda t: f"covariance bound at step {t}")
    c_pool, mean, n, _ = pooled_covariance(samples)
    active, excluded = _active_set(c_pool, mean, names)
    return MetricG(matrix=c_pool, names=names, method="covariance_bound", n=n, damping=0.0, damping_stable=True,
                   h2={a: 1.0 for a in active}, active=active, excluded=excluded, scope="per_step", by_step=by_step,
                   reading="covariance bound, per step: the step t -> t+1 is priced with C_t, the covariance of "
                           "pi_t's own rollouts (G_t <= C_t), so KL_min is a lower bound on the true minimum")


# Ledgers centred at a time by ``within_group_metric`` (cf. ``paired.LEDGER_BATCH``, 256: the paired
# ledgers' stratified jackknife keeps a dozen temporaries a batch; the metric's centring, one).
LEDGER_BLOCK = 1024


def within_group_metric(ledgers) -> MetricG:
    """Rung 1 for paired ledgers: step pair (t, t+1) is priced with the within-prompt-group
    covariance of its own independent sample (step t+1's rollouts), C_w = sum_g sum_i (z_i -
    zbar_g)(z_i - zbar_g)^T / (n - G). Within groups, because a policy move changes the
    conditional law of z given the prompt, so the bound G <= E_x Cov(z | x) is the one that
    applies; the between-prompt variance is not movement a step can buy.

    No shrinkage towards a target is applied (Ledoit-Wolf / OAS shrink towards a multiple of
    the identity, which has no meaning across features in different units, and a shrunk C is
    no longer an upper bound on G): the exact KL_min of the paired book does not use G at all,
    and where n - G is small relative to k the quadratic form and its shares are read as the
    covariance bound of a noisy C, which the row's null expectation k / (n - G) states.
    """
    if not ledgers:
        raise ValueError("within_group_metric needs at least one paired ledger")
    names = ledgers[0].names
    k = len(names)
    cs, mean_z = np.empty((len(ledgers), k, k)), np.empty((len(ledgers), k))
    ns = [len(lg.z) for lg in ledgers]
    layouts: dict[tuple[int, bytes], list[int]] = {}  # ledgers whose samples share a group layout
    for q, lg in enumerate(ledgers):
        layouts.setdefault((lg.n_groups, np.asarray(lg.codes).tobytes()), []).append(q)
    tasks = []
    for members in layouts.values():
        lg0 = ledgers[members[0]]
        codes, g = np.asarray(lg0.codes), lg0.n_groups
        m = blocks(codes, g)
        size = None if m else np.bincount(codes, minlength=g).astype(float)
        # small temporaries: reused, not faulted in; each block its own rows of cs and mean_z, so
        # the blocks go to threads (numpy releases the GIL inside each array operation), each
        # stacking its own ledgers' samples (a view where a batch of ledgers holds them so)
        tasks += [(members[lo:lo + LEDGER_BLOCK], codes, g, m, size) for lo in range(0, len(members), LEDGER_BLOCK)]

    def block(task: tuple) -> None:
        rows, codes, g, m, size = task
        zq = stack_views([ledgers[q].z for q in rows])  # (L, n, k)
        if m:  # groups of m rollouts one after another: sums by reshape, as bincount adds them,
            # and centred by broadcasting (a gather of the means to every row costs 3-20x more)
            zb = zq.reshape(len(zq), g, m, k)
            zc = (zb - (zb.sum(axis=2) / m)[:, :, None, :]).reshape(zq.shape)
        else:  # every ledger's groups as ids of their own: one bincount per feature for the block,
            # each bin summed in the same order as a bincount of the ledger alone
            uid = (np.arange(len(zq))[:, None] * g + codes[None, :]).reshape(-1)
            sums = group_sums(zq.reshape(-1, k), uid, len(zq) * g).reshape(len(zq), g, k)
            zc = zq - (sums / size[:, None])[:, codes]
        cs[rows] = zc.transpose(0, 2, 1) @ zc / max(len(codes) - g, 1)
        mean_z[rows] = zq.mean(axis=1)

    for _ in in_threads(iter(tasks), block):
        pass
    sets = _active_sets(cs, mean_z, names)
    sample_of = {lg.step_pair[0]: lg.step_pair[1] for lg in ledgers}
    by_step = StepMetrics([lg.step_pair[0] for lg in ledgers], cs, sets, ns, names,
                          lambda t: f"within-group covariance of step {sample_of[t]}'s rollouts")
    first = by_step[ledgers[0].step_pair[0]]
    return MetricG(matrix=first.matrix, names=names, method="covariance_bound",
                   n=sum(ns), damping=0.0, damping_stable=True, h2=first.h2,
                   active=first.active, excluded=first.excluded, scope="per_step", by_step=by_step,
                   reading="covariance bound, within prompt groups, per step: the step t -> t+1 is priced with the "
                           "within-group covariance of step t+1's rollouts (G_t <= E_x Cov(z | x)); the exact "
                           "KL_min needs no G")


# ---------------------------------------------------------------------------- rung 2
# Damping: n lambda = rho * tr(K) / n. rho is chosen by exact leave-one-out cross-validation of
# the kernel ridge regression of z on the scores (Allen's PRESS, from one eigendecomposition),
# minimised over log rho in [RHO_MIN, RHO_MAX] by a bounded scalar search, not a grid. An
# optimum within BOUNDARY_TOL (in log rho) of either end is not identified by the data: rung 2
# then refuses rather than report an eta set by the search range.
RHO_MIN, RHO_MAX = 1e-8, 1e3
BOUNDARY_TOL = 0.05
# An upper end of the range whose total leave-one-out error exceeds the optimum's by no more
# than this many standard errors of the per-rollout difference is as good as the optimum (the
# "one-standard-error" reading of cross-validation, at ~95 %).
LOO_SE_MULT = 2.0
# damping_stable needs all three, each stated here with its reason:
# a 4x change of rho (rho/2 -> 2 rho) moves KL_min by less than a factor 4^0.25 ~ 1.41;
ELASTICITY_MAX = 0.25
# the effective degrees of freedom tr K (K + n lambda)^-1 are at most half of n (a fit that
# uses every sample interpolates: G = C again);
DF_MAX_FRACTION = 0.5
# and KL_min exceeds the covariance-bound value by 10 % (else rung 2 says nothing rung 1
# did not).
FLOOR_RATIO_MIN = 1.1
# A sketched kernel adds a fourth: KL_min from a second, independently seeded sketch agrees
# within this fraction (the sketch's own error, measured rather than assumed).
SKETCH_AGREEMENT = 0.05
# K = S S^T is accumulated over column blocks of S of this many parameters (float32 in,
# float64 out): no float64 copy of S and no mask the size of S.
KERNEL_BLOCK = 1 << 20


def kernel_from_scores(scores: np.ndarray) -> np.ndarray:
    """K = S S^T in float64 from S (n x |theta|, any float dtype), block by block."""
    s = np.asarray(scores)
    if s.ndim != 2:
        raise ValueError(f"scores must be a matrix (n x |theta|), not shape {s.shape}")
    k = np.zeros((s.shape[0], s.shape[0]), dtype=np.float64)
    for a in range(0, s.shape[1], KERNEL_BLOCK):
        b = s[:, a:a + KERNEL_BLOCK].astype(np.float64)
        if not np.isfinite(b).all():
            raise ValueError("scores contain NaN or infinite values; no metric is built from them")
        k += b @ b.T
    return k


def _as_kernel(kernel) -> tuple[np.ndarray, dict[str, float]]:
    """A kernel given as an array, or as a SketchedKernel (with its sketch dimension)."""
    if hasattr(kernel, "kernel") and hasattr(kernel, "dim"):
        return np.asarray(kernel.kernel, dtype=np.float64), {"sketch_dim": float(kernel.dim),
                                                               "sketch_seed": float(kernel.seed)}
    return np.asarray(kernel, dtype=np.float64), {}


def fisher_kernel_metric(samples: Sequence[StepSample], scores: np.ndarray | None = None, *,
                         kernel=None, kernel_check=None, rho: float | None = None,
                         delta_z: np.ndarray | None = None) -> MetricG:
    """Rung 2 for one step: ``samples`` is the single StepSample whose rollouts ``scores``
    were computed on (row i of S is grad log pi(y_i) at the pre-step policy).

    ``rho`` fixes the damping (n lambda = rho tr(K)/n); by default it is chosen by exact
    leave-one-out cross-validation of the kernel ridge regression of z on the scores, from
    one eigendecomposition of K, over a continuous range (``RHO_MIN``..``RHO_MAX``); an
    optimum at the edge of the range is reported in ``diagnostics["at_boundary"]`` and the
    cost book refuses the reading (ENVELOPE_VIOLATED, premise ``damping_unidentified``). ``delta_z`` (the step's movement, same basis) lets the
    stability check use KL_min itself; without it the check uses the KL_min expected for
    a movement distributed like the features, 1/2 tr(G^-1 C).

    ``kernel`` replaces ``scores`` by K = S S^T itself (n x n), e.g. a ``SketchedKernel``;
    ``kernel_check`` is a second, independently seeded sketch: the metric is built from it
    too, and ``damping_stable`` also needs the two KL_min to agree within
    ``SKETCH_AGREEMENT``.
    """
    if len(samples) != 1:
        raise ValueError("fisher_kernel takes the one StepSample its scores were computed on, "
                         f"not {len(samples)} steps")
    (sample,) = samples
    n = sample.n
    if (scores is None) == (kernel is None):
        raise ValueError("fisher_kernel takes scores= or kernel=, exactly one")
    if scores is not None:
        if np.ndim(scores) != 2 or np.shape(scores)[0] != n:
            raise ValueError(f"scores have shape {np.shape(scores)}; they need one row per rollout of step "
                             f"{sample.step} ({n})")
        k, sketch = kernel_from_scores(scores), {}
    else:
        k, sketch = _as_kernel(kernel)
        if k.shape != (n, n):
            raise ValueError(f"the kernel has shape {k.shape}; step {sample.step} has {n} rollouts, so it needs "
                             f"({n}, {n})")
        if not np.isfinite(k).all():
            raise ValueError("the kernel contains NaN or infinite values; no metric is built from it")
        k = (k + k.T) / 2
    if n < 2:
        raise ValueError(f"step {sample.step} has {n} rollout: a metric needs at least 2")
    names = sample.names
    zc = sample.z - sample.z.mean(axis=0)
    c = zc.T @ zc / n
    active, excluded = _active_set(c, sample.z.mean(axis=0), names)
    idx = [names.index(a) for a in active]
    evals, evecs = np.linalg.eigh(k)
    evals = np.clip(evals, 0.0, None)
    zh = evecs.T @ zc  # features in K's eigenbasis
    scale = float(np.trace(k)) / n
    if scale <= 0:
        raise ValueError("all score vectors are zero: the policy's log-probabilities do not depend on theta here")

    def shrink(r: float) -> np.ndarray:
        return evals / (evals + r * scale)

    def g_of(r: float) -> np.ndarray:
        return (zh.T * shrink(r)) @ zh / n

    def loo_each(log_r: float) -> np.ndarray:
        """Exact leave-one-out squared error of each rollout: sum_j (e_ij / (1 - H_ii))^2, with
        H = K (K + n lambda)^-1 = V diag(f) V^T and e = (I - H) Zc, on the active features
        standardised (so each feature counts equally)."""
        f = shrink(math.exp(log_r))
        resid = evecs @ (((1 - f)[:, None]) * zh[:, idx] / sd_active)
        h = (evecs ** 2) @ f
        return ((resid / np.maximum(1 - h, 1e-12)[:, None]) ** 2).sum(axis=1)

    def loo(log_r: float) -> float:
        return float(loo_each(log_r).sum())

    chosen_by = "caller" if rho is not None else "leave-one-out"
    at_boundary = False
    if rho is None:
        sd_active = np.sqrt(np.clip(np.diag(c)[idx], 1e-300, None)) if idx else np.ones(0)
        lo_, hi_ = math.log(RHO_MIN), math.log(RHO_MAX)
        from scipy import optimize  # only rung 2 needs it

        res = optimize.minimize_scalar(loo, bounds=(lo_, hi_), method="bounded", options={"xatol": 1e-4})
        rho = float(math.exp(res.x))
        # At an edge, or not better than the upper edge by more than the LOO error's own noise:
        # a curve that is flat towards infinite damping (features unpredictable from the
        # scores) has no identified optimum, wherever the search stopped on its plateau, and
        # there G -> 0 and KL_min grows without bound with the damping. (Flat towards zero
        # damping is harmless: G -> C, the covariance bound, a finite reading.)
        best = loo_each(res.x)
        diff = loo_each(hi_) - best  # per rollout: the rollouts are the independent units
        se = float(diff.std(ddof=1) * math.sqrt(len(diff))) if len(diff) > 1 else 0.0
        flat = float(diff.sum()) <= LOO_SE_MULT * se
        at_boundary = min(res.x - lo_, hi_ - res.x) < BOUNDARY_TOL or flat
    c_a = c[np.ix_(idx, idx)]

    def stat(g: np.ndarray) -> float:
        ga = g[np.ix_(idx, idx)]
        if delta_z is not None:
            d = np.asarray(delta_z, dtype=np.float64)[idx]
            return float(0.5 * d @ np.linalg.solve(ga, d))
        return float(0.5 * np.trace(np.linalg.solve(ga, c_a)))

    g = g_of(rho)
    diag = {"rho": rho, "df": float(shrink(rho).sum()), "n": float(n), "at_boundary": float(at_boundary), **sketch}
    if idx:
        lo, mid, hi, floor = stat(g_of(rho / 2)), stat(g), stat(g_of(rho * 2)), stat(c)
        diag["elasticity"] = abs(np.log(hi) - np.log(lo)) / np.log(4) if lo > 0 and hi > 0 else float("inf")
        diag["floor_ratio"] = mid / floor if floor > 0 else float("inf")
        diag["kl_min_stat"] = mid
    reasons = []
    if kernel_check is not None:
        other = fisher_kernel_metric(samples, kernel=kernel_check, delta_z=delta_z)
        a, b = diag.get("kl_min_stat", 0.0), other.diagnostics.get("kl_min_stat", 0.0)
        gap = abs(a - b) / max(abs(a), abs(b)) if max(abs(a), abs(b)) > 0 else 0.0
        diag["sketch_disagreement"] = gap
        if gap > SKETCH_AGREEMENT:
            reasons.append(f"two sketch seeds disagree: KL_min {a:.4g} vs {b:.4g} ({gap:.1%} > "
                           f"{SKETCH_AGREEMENT:.0%}); a larger sketch is needed")
    if at_boundary:
        reasons.append(f"the leave-one-out optimum of the damping is at the edge of its search range "
                       f"[{RHO_MIN:g}, {RHO_MAX:g}] (rho = {rho:.3g}): the data do not identify it")
    if diag.get("elasticity", float("inf")) >= ELASTICITY_MAX:
        reasons.append(f"KL_min moves with the damping (elasticity {diag.get('elasticity', float('inf')):.2f} "
                       f">= {ELASTICITY_MAX})")
    if diag["df"] > DF_MAX_FRACTION * n:
        reasons.append(f"effective degrees of freedom {diag['df']:.1f} exceed {DF_MAX_FRACTION:g} n")
    if diag.get("floor_ratio", 0.0) < FLOOR_RATIO_MIN:
        reasons.append(f"KL_min is within {FLOOR_RATIO_MIN:g}x of the covariance bound "
                       f"(ratio {diag.get('floor_ratio', 0.0):.3f})")
    stable = not reasons
    h2 = {names[i]: float(g[i, i] / c[i, i]) for i in idx}
    lam = rho * scale / n
    reading = (f"Fisher kernel (rung 2), n = {n}, damping lambda = {lam:.3g} (rho = {rho:.3g}, by "
               f"{chosen_by})")
    if sketch:
        reading += f", from a seeded sketch of dimension {int(sketch['sketch_dim']):,}"
    reading += ": stable" if stable else (": damping not stable (" + "; ".join(reasons) + "), so read it as the "
                                          "covariance bound with a shrinkage applied, not as a measurement of G")
    return MetricG(matrix=g, names=names, method="fisher_kernel", n=n, damping=lam, damping_stable=stable,
                   h2=h2, active=active, excluded=excluded, reading=reading, diagnostics=diag)
