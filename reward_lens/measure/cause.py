"""The cause book: what the reward asked for, directly and indirectly, and how much of the
movement it explains.

The selection differential of step t is ``s_t = Cov_t(z, A)`` within prompt groups: the
covariance of each feature with the advantage the trainer used, over the rollouts of step t,
centred in each prompt group (Price's selection differential; to first order a policy-gradient
step moves the feature means along it). It is non-zero for every feature that merely
*correlates* with what the reward pays for. Quantitative genetics separates direct from
indirect selection with the selection *gradient* (Lande & Arnold 1983, "The measurement of
selection on correlated characters", Evolution 37): beta = P^-1 s, P the within-group covariance
of the features -- the partial regression of fitness on the features; here fitness is the
reward, centred within each prompt group (the advantage divides it by a spread that differs
from group to group, which would lend features the reward does not pay for a partial
coefficient of their own). The book pools it
over the run (the within-group regression of A on z over every step's rollouts), with a
standard error that counts prompt groups as the independent units (cluster-robust sandwich),
and decides *directly selected* by BH at q = 0.05 over the features; features so collinear
within groups (|r| > ``COLLINEAR_R``) that their gradients cannot be told apart are tested
jointly (Wald) and share the decision. Its SE is that of the differential summed over steps.

Against the observed movement ``dz_t`` of the same step (the cost book's ledger) and its metric
G_t (the cost book's, on its active features), the book reports the G^-1 cosine

    cos_t = dz^T G^-1 s / sqrt(dz^T G^-1 dz * s^T G^-1 s)

and splits ``KL_quad = 1/2 dz^T G^-1 dz`` into the part along s,
``(dz^T G^-1 s)^2 / (2 s^T G^-1 s)``, and the collateral rest (both >= 0 by Cauchy-Schwarz;
they sum to KL_quad exactly), over the step pairs whose movement is resolved only (the run's
decisions): a split of an unresolved movement is a split of noise, and is neither drawn nor
stated. A feature is *selected* (indirectly or directly) over the run when BH at q = 0.05 over
the features rejects sum_t s_t = 0 (SE: the steps' SEs in quadrature).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import special

from reward_lens.measure.books import BookResult, RunContext, status_of
from reward_lens.measure.decisions import asked_words, selection_of
from reward_lens.measure.efficiency.section import premise_refusals
from reward_lens.measure.efficiency.cost import rollouts_refusal
from reward_lens.measure.efficiency.eta import FDR_Q, benjamini_hochberg
from reward_lens.measure.efficiency.metric import MetricG, active_index
from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.measure.ledger.price import (Ledger, StepSample, blocks, group_sums, ledger_arrays, stack_range,
                                              stacked, unit_ids)
from reward_lens_spec import Subject, load_book, make_refusal
from reward_lens_spec.render import render_template


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CauseRows(_M):
    """Every step pair's comparison, as columns: entry i of each list (and of each feature's
    list) belongs to ``step_pair[i]``."""

    step_pair: list[tuple[int, int]]
    selection: dict[str, list[float]] = Field(description="s_t = Cov_t(z, A) within groups, feature units x "
                                                          "advantage")
    se: dict[str, list[float]]
    cosine: list[float | None] = Field(description="G^-1 cosine of dz_t and s_t; null when either is zero")
    kl_quad: list[float] = Field(description="1/2 dz^T G^-1 dz on the active features (nats per sequence)")
    kl_along: list[float] = Field(description="the part of kl_quad along s (nats per sequence)")
    kl_collateral: list[float] = Field(description="kl_quad - kl_along (nats per sequence)")
    resolved: list[bool] = Field(description="the cost book resolved this step pair's KL_min from noise")


class SelectedOut(_M):
    feature: str
    total: float = Field(description="sum over steps of s_t (the differential)")
    se: float
    t: float
    p: float
    selected: bool = Field(description="the differential is resolved: the reward selected on it, directly or "
                                       "through a feature it correlates with")
    gradient: float | None = Field(None, description="beta: the within-group partial regression of the advantage "
                                                     "on the feature (advantage per feature unit); null when the "
                                                     "feature is constant within groups")
    gradient_se: float | None = None
    gradient_p: float | None = Field(None, description="of beta = 0, its own test (1 for a beta of 0 to rounding)")
    joint_p: float | None = Field(None, description="of the betas of it and the features collinear with it, all 0 "
                                                    "(their joint Wald test); null when it has none")
    direct: bool = Field(False, description="BH at q = 0.05 over the features rejects beta = 0 for this feature on "
                                            "its own: the reward asked for this feature itself")
    jointly: bool = Field(False, description="BH at q = 0.05 rejects the joint test of its cluster of collinear "
                                             "features: the reward asked for the cluster, and which member cannot "
                                             "be told apart")
    collinear_with: list[str] = Field(default_factory=list, description="features too collinear within groups "
                                                                        "to tell apart from this one")
    asked: Literal["directly", "jointly", "no"] = Field("no", description="what the reward asked for of it: "
                                                                          "direct, jointly or no")
    direction: int = Field(0, description="the direction asked for: +1 more, -1 less, 0 not asked")
    asked_for: str | None = Field(None, description="``asked`` in the words every page uses (measure/decisions.py): "
                                                    "yes (more|less), jointly with ..., no")


class CauseSection(_M):
    rows: CauseRows
    selected: list[SelectedOut]
    summary: dict[str, float | int | str | None]


def selection_differential(sample: StepSample) -> tuple[np.ndarray, np.ndarray]:
    """s = Cov(z, A) within prompt groups over one step's rollouts, and its SE (groups as units;
    with one group, its rollouts)."""
    return selection_differentials([sample])[sample.step]


# Rows centred at a time where groups lie in blocks: the block's products stay in cache.
GROUP_BLOCK_ROWS = 1 << 15


def selection_differentials(samples: Sequence[StepSample]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``selection_differential`` of every sample in one segmented pass (no Python per step):
    group means and the per-group sums of zc * ac by bincount over global group ids, each
    step's sums by segment. Same definitions, same numbers to rounding."""
    if not samples:
        return {}
    s_all, se = _selection_arrays(samples)
    return {x.step: (a, b) for x, a, b in zip(samples, s_all, se)}


class _WithinGroups:
    """Features z (n, k) and a response a (n,) centred on their prompt groups' means (``uid``: each
    row's group, 0..total-1), handed out a block of groups at a time (``spans``) where the groups
    lie in equal consecutive blocks, TRL's layout (broadcasting: no gather of the means and no
    n x k temporary); else in one span, the group means gathered to every row."""

    def __init__(self, z: np.ndarray, a: np.ndarray, uid: np.ndarray, total: int):
        self.z, self.a, self.uid, self.total, self.k = z, a, uid, total, z.shape[1]
        self.size = np.bincount(uid, minlength=total).astype(float)
        self.gm = group_sums(z, uid, total) / self.size[:, None]
        self.am = np.bincount(uid, weights=a, minlength=total) / self.size
        self.m = blocks(uid, total)
        step = max(1, GROUP_BLOCK_ROWS // self.m) if self.m else max(total, 1)
        self.spans = [(lo, min(total, lo + step)) for lo in range(0, total, step)]

    def block(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The centred rows of groups lo..hi-1 (every row where the groups are not in blocks)."""
        m, k = self.m, self.k
        if not m:
            return self.z - self.gm[self.uid], self.a - self.am[self.uid]
        zc = (self.z.reshape(self.total, m, k)[lo:hi] - self.gm[lo:hi, None, :]).reshape(-1, k)
        return zc, (self.a.reshape(self.total, m)[lo:hi] - self.am[lo:hi, None]).reshape(-1)

    def sums(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Each group's sum of ``rows`` (a ``block(lo, hi)``'s rows, or a product of them)."""
        if not self.m:
            return group_sums(rows, self.uid, self.total)
        return rows.reshape(hi - lo, self.m, self.k).sum(axis=1)


def _selection_arrays(samples: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    """``selection_differentials`` as arrays (P, k): s and its SE, row i for samples[i]."""
    if not samples:
        return np.zeros((0, 0)), np.zeros((0, 0))
    k = samples[0].z.shape[1]
    z = stacked(samples)
    a = np.asarray(stacked(samples, "advantages"), dtype=float)
    ns = np.fromiter((x.n for x in samples), np.int64, len(samples))
    uid, gs = unit_ids(samples)  # every sample here has groups
    offsets = np.concatenate([[0], np.cumsum(gs)[:-1]])
    total = int(gs.sum())
    w = _WithinGroups(z, a, uid, total)
    size = w.size

    def products(lo: int, hi: int) -> np.ndarray:  # (z - zbar_g)(A - Abar_g), rows of groups lo..hi-1
        zc, ac = w.block(lo, hi)
        zc *= ac[:, None]  # the block's own
        return zc

    u = np.concatenate([w.sums(products(lo, hi), lo, hi) for lo, hi in w.spans])  # (groups, k)
    s_all = np.add.reduceat(u, offsets, axis=0) / ns[:, None]
    step_of_group = np.repeat(np.arange(len(samples)), gs)
    resid = u - size[:, None] * s_all[step_of_group]
    with np.errstate(divide="ignore", invalid="ignore"):
        var_groups = gs[:, None] / (gs[:, None] - 1) * np.add.reduceat(resid ** 2, offsets, axis=0) / ns[:, None] ** 2
        var_rows = None
        if (gs < 2).any():  # a step of one prompt group: its rollouts' products are the units
            prod = products(0, total)
            rstart = np.concatenate([[0], np.cumsum(ns)[:-1]])
            p1 = np.add.reduceat(prod, rstart, axis=0)
            p2 = np.add.reduceat(prod ** 2, rstart, axis=0)
            var_rows = (p2 - p1 ** 2 / ns[:, None]) / (ns[:, None] - 1) / ns[:, None]
    se = np.full((len(samples), k), np.nan)
    se[gs >= 2] = np.sqrt(var_groups[gs >= 2])
    one = (gs < 2) & (ns >= 3)  # one prompt group: its rollouts are the units
    if one.any():
        se[one] = np.sqrt(np.clip(var_rows[one], 0, None))
    return s_all, se


# Features whose within-group correlation exceeds this in absolute value cannot have their
# gradients told apart by any realistic sample (the gradient's variance grows as 1/(1 - r^2)):
# they are tested jointly.
COLLINEAR_R = 0.95
# A standardised gradient below this fraction of the response's spread is rounding, not
# selection (see ``selection_gradient``): 16x float32's relative rounding of a reward.
ZERO_GRADIENT = 1e-6


class Gradient(NamedTuple):
    """The selection gradient of every feature (arrays over the basis): ``beta``, its SE, ``p`` of
    its own Wald test (1 for a coefficient of 0 to rounding: never a p of 0 beside an SE of
    rounding), the collinear ``clusters`` (index lists of 2 or more), and for a member of a
    cluster ``p_joint``, the joint Wald p-value of the cluster's betas (NaN for the others), and
    ``direction``: the sign (+1/-1) in which the cluster's fitted reward covaries with it (0 for
    the others)."""

    beta: np.ndarray
    se: np.ndarray
    p: np.ndarray
    clusters: list[list[int]]
    p_joint: np.ndarray
    direction: np.ndarray


def selection_gradient(samples: Sequence[StepSample]) -> Gradient:
    """beta, its cluster-robust SE, its p-value and the collinear clusters, pooled over the
    samples: the least-squares regression of the within-group centred reward (the advantage
    where the record has no rewards) on the
    within-group centred features over every rollout, with the prompt groups as clusters
    (V = (X'X)^-1 (sum_g X_g' e_g e_g' X_g) (X'X)^-1 G / (G - 1)). A feature constant within
    every group gets NaN; a cluster of collinear features also gets the joint Wald p-value of
    its betas (chi^2 with as many degrees of freedom as members), the test its members share."""
    k = samples[0].z.shape[1] if samples else 0
    nan = np.full(k, np.nan)
    if not samples:
        return Gradient(nan, nan, nan, [], nan, np.zeros(k, dtype=int))
    z = stacked(samples)
    # The response is the reward where the record has it: within a group the advantage is the
    # centred reward divided by the group's spread (GRPO), a scale that differs from group to
    # group, so a pooled regression on the advantage gives features the reward does not pay for
    # a partial coefficient of their own; on the centred reward, a reward that is a linear
    # function of some features gives every other feature none.
    attr = "rewards" if all(s.rewards is not None for s in samples) else "advantages"
    a = np.asarray(stacked(samples, attr), dtype=float)
    uid, gs = unit_ids(samples)
    total = int(gs.sum())
    w = _WithinGroups(z, a, uid, total)  # centred a block of groups at a time: no n x k temporary
    # the sums of squares and products of the centred features by matrix products (a mean of
    # squares along the rows is a strided reduction 10x slower)
    zz, za, aa = np.zeros((k, k)), np.zeros(k), 0.0
    for lo, hi in w.spans:
        zc, ac = w.block(lo, hi)
        zz += zc.T @ zc
        za += zc.T @ ac
        aa += float(ac @ ac)
    n = len(z)
    scale = np.sqrt(np.clip(np.diag(zz), 0, None) / n)
    z_max, z_min = _column_extremes(z)
    live = scale > 1e-12 * np.maximum(1.0, np.maximum(z_max, -z_min))
    beta, se, p, p_joint = nan.copy(), nan.copy(), nan.copy(), nan.copy()
    direction = np.zeros(k, dtype=int)
    if not live.any() or total < 3:
        return Gradient(beta, se, p, [], p_joint, direction)
    # dead features (no spread within any group) keep a scale of 1 and a coefficient of 0: they
    # are dropped from the k x k products only, and no column of the n x k rows is gathered
    unit = np.where(live, scale, 1.0)
    xtx = (zz / np.outer(unit, unit))[np.ix_(live, live)]
    inv = np.linalg.pinv(xtx)
    b = inv @ (za / unit)[live]
    b_all = np.zeros(k)
    b_all[live] = b / unit[live]  # per unscaled centred feature
    scores = np.empty((total, k))
    for lo, hi in w.spans:  # a second pass: the residuals need the coefficients
        zc, ac = w.block(lo, hi)
        zc *= (ac - zc @ b_all)[:, None]  # the block's own
        scores[lo:hi] = w.sums(zc, lo, hi)
    scores = scores[:, live] / unit[live]  # (G, k') per-cluster score sums, in scaled units
    meat = scores.T @ scores * total / (total - 1)
    v = inv @ meat @ inv
    live_idx = np.flatnonzero(live)
    beta[live] = b / scale[live]
    se[live] = np.sqrt(np.clip(np.diag(v), 0, None)) / scale[live]
    with np.errstate(divide="ignore", invalid="ignore"):
        corr = xtx / np.sqrt(np.outer(np.diag(xtx), np.diag(xtx)))
    clusters = _clusters(np.abs(corr) > COLLINEAR_R)
    # A reward that is an exact linear function of some features leaves residuals at rounding
    # level (TRL keeps rewards in float32: relative rounding ~6e-8), where any coefficient,
    # however close to 0, looks significant: a standardised beta (response units per feature SD)
    # below ZERO_GRADIENT of the response's spread is 0, not a selection.
    zero = np.abs(b) <= ZERO_GRADIENT * max(float(np.sqrt(aa / n)), 1e-300)
    # each coefficient's own test; one of 0 to rounding is 0, with p = 1, whatever its SE
    dv = np.diag(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.where(dv > 0, 2 * special.ndtr(-np.abs(b / np.sqrt(np.where(dv > 0, dv, 1.0)))), 1.0)
    p[live_idx] = np.where(zero, 1.0, own)
    for members in clusters:
        if len(members) == 1:
            continue
        idx = live_idx[members]
        if zero[members].all():
            p_joint[idx] = 1.0
        else:
            bm, vm = b[members], v[np.ix_(members, members)]
            p_joint[idx] = float(special.chdtrc(len(members), float(bm @ np.linalg.pinv(vm) @ bm)))
        # the direction the reward asks the cluster's members in: the sign of the covariance of
        # each member with the cluster's part of the fitted reward
        fitted = xtx[np.ix_(members, members)] @ b[members]
        direction[idx] = np.where(fitted > 0, 1, np.where(fitted < 0, -1, 0))
    # within a cluster the reward does pay for, a member whose own coefficient is 0 to rounding
    # (a duplicate of the member the fit gave the weight) is shown as that 0: its sign, +-2e-13,
    # is the summation order's and would decide whether it "moved as asked"
    beta[live_idx[zero]] = 0.0
    return Gradient(beta, se, p, [[int(live_idx[m]) for m in c] for c in clusters if len(c) > 1], p_joint, direction)


def _column_extremes(z: np.ndarray, rows: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """``z.max(axis=0), z.min(axis=0)`` of rows z (n, k), by reducing ``rows`` rows' worth of
    columns at a time (a reduction down a column of k = 9 is a strided loop, 7x slower at
    640,000 rows): a maximum is the same in any order."""
    n, k = z.shape
    if not z.size:  # no rows or no columns: numpy's own (which raises where there is no row)
        return z.max(axis=0), z.min(axis=0)
    cut = n - n % rows if z.flags.c_contiguous else 0
    hi, lo = np.full(k, -np.inf), np.full(k, np.inf)
    if cut:
        flat = z[:cut].reshape(-1, rows * k)
        hi, lo = flat.max(axis=0).reshape(rows, k).max(axis=0), flat.min(axis=0).reshape(rows, k).min(axis=0)
    if cut < n:
        hi, lo = np.maximum(hi, z[cut:].max(axis=0)), np.minimum(lo, z[cut:].min(axis=0))
    return hi, lo


def _clusters(adjacent: np.ndarray) -> list[list[int]]:
    """Connected components of a boolean adjacency matrix, each in index order."""
    n = len(adjacent)
    seen = np.zeros(n, dtype=bool)
    out = []
    for i in range(n):
        if seen[i]:
            continue
        stack, comp = [i], []
        seen[i] = True
        while stack:
            j = stack.pop()
            comp.append(j)
            for nb in np.flatnonzero(adjacent[j] & ~seen):
                seen[nb] = True
                stack.append(int(nb))
        out.append(sorted(comp))
    return out


def selection_of_run(samples: Sequence[StepSample]) -> None:
    """Each step's selection differentials, worked out for the cause book ahead of it (memoised
    on the report's read, as ``cause_series`` asks for them): they read the samples alone."""
    _memoised_selection([s for s in samples if s.advantages is not None and s.groups is not None])


def _memoised_selection(every: list[StepSample]) -> tuple[np.ndarray, np.ndarray] | None:
    """``_selection_arrays(every)``, once per run of the report's read that ``every`` is (a view,
    no copy); None where it is not one."""
    stack = every[0].stack if every else None
    if stack is None or stack_range(every) is None or stack_range(every, "advantages") is None:
        return None
    return stack.memo("selection_differentials", every, lambda: _selection_arrays(every))


def step_selection(every: list[StepSample], sel: list[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    """``_selection_arrays(sel)``: each step's differential is its own rows' alone, so where
    ``every`` step with advantages and groups lies in one run of the report's read (a view, no
    copy), they are worked out for all of them, once (memoised on the read), and ``sel``'s rows
    picked; else for ``sel`` itself."""
    got = _memoised_selection(every)
    if got is None:
        return _selection_arrays(sel)
    s_all, se_all = got
    pos = {x.step: i for i, x in enumerate(every)}
    rows = np.array([pos[x.step] for x in sel], dtype=np.int64)
    return s_all[rows], se_all[rows]


def _split(dz: np.ndarray, s: np.ndarray, g: np.ndarray) -> list[tuple[float | None, float, float]]:
    """For each of P step pairs (dz, s: (P, k), g: (P, k, k)): the G^-1-cosine of dz and s,
    KL_quad = dz' G^-1 dz / 2, and the part of it along s (at most KL_quad)."""
    sol = np.linalg.solve(g, np.stack([dz, s], axis=2))  # G^-1 dz, G^-1 s
    q_dz = np.einsum("pi,pi->p", dz, sol[:, :, 0])
    q_s = np.einsum("pi,pi->p", s, sol[:, :, 1])
    cross = np.einsum("pi,pi->p", dz, sol[:, :, 1])
    out = []
    for qd, qs, c in zip(q_dz.tolist(), q_s.tolist(), cross.tolist()):
        kl = 0.5 * qd
        if qd <= 0 or qs <= 0:
            out.append((None, kl, 0.0))
        else:
            out.append((c / math.sqrt(qd * qs), kl, min(kl, 0.5 * c ** 2 / qs)))
    return out


def cause_series(ledgers: Sequence[Ledger], samples: Sequence[StepSample], metric: MetricG,
                 resolved_pairs: set[tuple[int, int]] | None = None) -> CauseSection:
    """``resolved_pairs``: the step pairs whose movement is resolved from noise (the cost book's
    KL_min rows); the cosine and the split are summarised over those only (all when None)."""
    by_step = {s.step: s for s in samples if s.advantages is not None and s.groups is not None}
    names = list(metric.names)
    arrays = ledger_arrays(ledgers) if ledgers else None
    ts = arrays.step_pairs[:, 0].tolist() if arrays is not None else []
    sel = list({t: by_step[t] for t in ts if t in by_step}.values())  # each step once, in ledger order
    s_of, se_of = step_selection(list(by_step.values()), sel)
    row_of = {x.step: i for i, x in enumerate(sel)}
    kept, rows, actives = [], [], []  # the ledgers priced: their place, their step's differential and active set
    for q, t in enumerate(ts):
        if t not in row_of:
            continue
        try:
            actives.append(metric.active_of(t))
        except KeyError:
            continue
        kept.append(q)
        rows.append(row_of[t])
    kept = np.array(kept, dtype=np.int64)
    dz = arrays.delta_z[kept] if arrays is not None else np.zeros((0, len(names)))
    s_all = s_of[rows] if rows else np.zeros((0, len(names)))
    se_all = se_of[rows] if rows else np.zeros((0, len(names)))
    mats = metric.matrices_of([ts[q] for q in kept.tolist()]) if len(kept) else None
    splits: list = [None] * len(kept)
    by_active: dict[tuple[str, ...], list[int]] = {}
    for i, active in enumerate(actives):
        by_active.setdefault(active, []).append(i)
    for active, members in by_active.items():  # pairs priced in one active set: one batched solve
        idx = active_index(metric.names, active)
        if not len(idx):
            got = [(None, 0.0, 0.0)] * len(members)
        else:
            got = _split(dz[members][:, idx], s_all[members][:, idx], mats[members][:, idx][:, :, idx])
        for i, v in zip(members, got):
            splits[i] = v
    pairs = [tuple(p) for p in arrays.step_pairs[kept].tolist()] if len(kept) else []
    cos, kl, along = (list(v) for v in zip(*splits)) if splits else ([], [], [])
    resolved = [resolved_pairs is None or pair in resolved_pairs for pair in pairs]
    rows = CauseRows(step_pair=pairs, selection=dict(zip(names, s_all.T.tolist())),
                     se=dict(zip(names, se_all.T.tolist())), cosine=cos, kl_quad=kl, kl_along=along,
                     kl_collateral=[q - a for q, a in zip(kl, along)], resolved=resolved)
    selected = []
    if pairs:
        tot = s_all.sum(axis=0)
        se = np.sqrt(np.nansum(np.square(se_all), axis=0))
        with np.errstate(divide="ignore", invalid="ignore"):
            tt = np.where(se > 0, tot / se, 0.0)
        p = np.where(se > 0, 2 * special.ndtr(-np.abs(tt)), 1.0)
        rej = benjamini_hochberg(p, FDR_Q)
        g = selection_gradient(sel)
        # one BH over the features: each feature's own test, a cluster's members their joint one
        in_cluster = ~np.isnan(g.p_joint)
        decided = np.where(in_cluster, g.p_joint, g.p)
        testable = ~np.isnan(decided)
        rejected = np.zeros(len(names), dtype=bool)
        rejected[testable] = benjamini_hochberg(decided[testable], FDR_Q)
        partners = {j: [names[m] for m in c if m != j] for c in g.clusters for j in c}
        selected = []
        for j, n in enumerate(names):
            direct, jointly = bool(rejected[j] and not in_cluster[j]), bool(rejected[j] and in_cluster[j])
            sel_j = selection_of(direct, jointly, _num(g.beta[j]), int(g.direction[j]), partners.get(j, []),
                                 bool(rej[j]), float(tot[j]))
            selected.append(SelectedOut(
                feature=n, total=float(tot[j]), se=float(se[j]), t=float(tt[j]), p=float(p[j]),
                selected=bool(rej[j]), gradient=_num(g.beta[j]), gradient_se=_num(g.se[j]), gradient_p=_num(g.p[j]),
                joint_p=_num(g.p_joint[j]), direct=direct, jointly=jointly, collinear_with=partners.get(j, []),
                asked=sel_j.asked, direction=sel_j.direction, asked_for=asked_words(sel_j)))
    res = [i for i, r in enumerate(resolved) if r]
    kq = sum(kl[i] for i in res)
    cosines = [cos[i] for i in res if cos[i] is not None]
    summary = {"rows": len(pairs), "rows_resolved": len(res), "features_selected": sum(x.selected for x in selected),
               "features_direct": sum(x.direct for x in selected), "features_jointly": sum(x.jointly for x in selected),
               "median_cosine": float(np.median(cosines)) if cosines else None,
               "fraction_along": (sum(along[i] for i in res) / kq) if kq > 0 else None}
    return CauseSection(rows=rows, selected=selected, summary=summary)


def _num(v: float) -> float | None:
    return None if v != v else float(v)


def cause_figures(c: CauseSection) -> list[FigureOut]:
    """The split of the movement's required divergence, over the step pairs whose movement is
    resolved only: an unresolved movement's split is noise and is not drawn."""
    res = [i for i, r in enumerate(c.rows.resolved) if r]
    if not res:
        return []
    x = [float(c.rows.step_pair[i][0]) for i in res]
    return [FigureOut(id="cause-split", x_label="step t (pair t → t+1)", caption=(
        "At the step pairs whose movement is resolved: ½ Δzᵀ G⁻¹ Δz split into the part along what the reward "
        "selected (the differential s) and the rest, collateral (nats per sequence, stacked). Unresolved step "
        "pairs are left out."), panels=[Panel(
            y_label="nats per sequence", series=[
                Series(label="along s (asked for)", x=x, y=[c.rows.kl_along[i] for i in res], style="stack"),
                Series(label="collateral", x=x, y=[c.rows.kl_collateral[i] for i in res], style="stack")])])]


def advantages_refusal(ctx: RunContext, book_id: str = "cause"):
    run = ctx.run
    cols = set(run.rollout_columns())
    missing = [c for c in ("advantage", "group_id") if c not in cols]
    return make_refusal("RECORD_INCOMPLETE", load_book(book_id), Subject(run_id=run.run_id), {
        "requirement": "advantages", "run": run.short_id, "missing": missing,
        "framework": run.manifest.framework.name})


def cause_section(ctx: RunContext) -> BookResult:
    run = ctx.run
    if not run.n_rollouts:
        return BookResult("refused", "No rollouts: nothing to ask for.", [rollouts_refusal(run, [])])
    samples = ctx.samples
    if not any(s.advantages is not None and s.groups is not None for s in samples):
        return BookResult("refused", "The record has no advantages (or no prompt groups): what the reward asked "
                          "for cannot be read.", [advantages_refusal(ctx)])
    priced = ctx.priced
    if priced is None or priced.metric is None or not priced.ledgers:
        return BookResult("refused", "No step pair has a feature movement to compare with.",
                          [rollouts_refusal(run, samples)])
    d = ctx.decisions
    usable = set(d.usable)
    ledgers = [lg for lg in priced.ledgers if tuple(lg.step_pair) in usable]  # refused pairs: no dz to compare
    if not ledgers:
        return BookResult("refused", "No step pair's movement can be read, so none can be compared with what the "
                          "reward asked for.", premise_refusals(run, priced, "cause"))
    sec = cause_series(ledgers, samples, priced.metric, set(d.resolved))
    refusals = premise_refusals(run, priced, "cause")
    status = status_of(bool(sec.rows.step_pair), refusals, sec.summary["features_selected"] > 0)
    groups: list[list[SelectedOut]] = []  # the clusters asked for jointly, each once, in basis order
    for x in sec.selected:
        if x.jointly and not any(x in grp for grp in groups):
            groups.append([y for y in sec.selected if y is x or y.feature in x.collinear_with])
    ctxt = {"s": sec.summary, "c": sec, "sel": [x for x in sec.selected if x.selected],
            "direct": [x for x in sec.selected if x.direct], "jointly": groups}
    headline = render_template("report/books/cause.headline.j2", ctxt).strip()
    return BookResult(status, headline, refusals, sec, cause_figures(sec))
