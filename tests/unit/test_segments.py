"""The paired ledgers' stratified jackknife on rows laid out in segments (``paired.Segments``:
each side's rows in equal consecutive blocks by group, the tap's layout), rows first, against
the general arithmetic (``Strata``: one-hot products and gathers, ``BY_SEGMENTS = False``) on
the same samples: dz, D_t, D_hat and the effective sample sizes to the last bit (their sums are
untouched), the covariance, SEs and degrees of freedom to rounding -- on one- and two-sided
samples, held-out strata of one row, a group of one rollout dropped, heavy weights, a row that
carries its group's weight, constant features, a NaN in the token KL and none at all."""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.measure.ledger import paired as paired_mod
from reward_lens.measure.ledger.paired import Segments, Strata, paired_ledger_series
from tests.unit.test_cost_columns import _irregular, _step

EXACT = ("delta_z", "d_t", "d_hat", "ess", "pareto_k", "n_groups")
CLOSE = ("se", "cov_delta", "dof", "d_t_se", "d_t_dof")


def _close(a, b, rel=1e-12):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape
    both_nan = np.isnan(a) & np.isnan(b)
    top = np.abs(b[np.isfinite(b)]).max(initial=0.0)
    scale = np.maximum(np.abs(b), top * 1e-6)  # a covariance's near-zero entries: to rounding of its largest
    assert (both_nan | (np.abs(a - b) <= rel * scale + 1e-300)).all(), (a, b)


def _layouts(seed):
    rng = np.random.default_rng(100 + seed)
    plan = {
        1: dict(sizes=[6] * 8, held=1),  # held-out strata of one row: they add nothing
        2: dict(sizes=[8] * 8, held=4, heavy=True),  # heavy weights on the rollouts' side
        3: dict(sizes=[6, 6, 1, 6, 6], held=4),  # a group of one rollout: dropped, the rest recoded
        4: dict(sizes=[5] * 6, held=3, nan_kl=True),
        5: dict(sizes=[4] * 5, held=2, no_kl=True),
        6: dict(sizes=[6] * 8, held=4, constant=True),
        7: dict(sizes=[6] * 8, held=4, one_varies=True),
        8: dict(sizes=[7] * 4),  # one-sided, one segment
        9: dict(sizes=[2] * 6, held=2, r_scale=3.0),
        10: dict(sizes=[3, 5, 4], held=2),  # unequal groups: the general arithmetic
    }
    samples, held = [], {}
    for step, kw in plan.items():
        s, ho = _step(rng, step, **kw)
        if step == 9:  # a row that carries all of its group's weight: its deletion leaves none (NaN)
            s.logp[0] += 800.0
        samples.append(s)
        if ho is not None:
            held[step] = ho
    return samples, held


@pytest.mark.parametrize("make", [_irregular, _layouts])
@pytest.mark.parametrize("seed", range(3))
def test_segmented_ledgers_are_the_general_arithmetic(make, seed, monkeypatch):
    samples, held = make(seed)
    fast, why = paired_ledger_series(samples, heldout=held)
    monkeypatch.setattr(paired_mod, "BY_SEGMENTS", False)
    slow, why_slow = paired_ledger_series(samples, heldout=held)
    assert why == why_slow and [lg.step_pair for lg in fast] == [lg.step_pair for lg in slow]
    segmented = 0
    for a, b in zip(fast, slow):
        segmented += Segments.of(a.codes, a.n_groups, a.heldout) is not None
        for name in EXACT:
            x, y = getattr(a, name), getattr(b, name)
            assert np.array_equal(np.asarray(x, dtype=float), np.asarray(y, dtype=float), equal_nan=True), name
        for name in CLOSE:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                _close(x, y)
    assert segmented >= 5


def test_segments_are_found_only_where_each_side_is_one_run_of_equal_blocks():
    rep = np.repeat
    g4 = np.arange(4)
    assert Segments.of(rep(g4, 3), 4).spans == ((0, 3, False),)
    two = Segments.of(np.r_[rep(g4, 3), rep(g4, 2)], 4, np.r_[np.zeros(12, bool), np.ones(8, bool)])
    assert two.spans == ((0, 3, False), (12, 2, True))
    assert Segments.of(np.r_[rep(g4, 3), rep(g4, 1)], 4, np.r_[np.zeros(12, bool), np.ones(4, bool)]).spans[1] == (
        12, 1, True)
    assert Segments.of(rep(g4, [3, 2, 3, 3]), 4) is None  # unequal groups
    assert Segments.of(np.r_[rep(g4, 3), rep(g4, 2)], 4) is None  # two segments on one side
    assert Segments.of(np.r_[rep(g4, 3), rep(g4, 2)], 4, np.r_[np.zeros(11, bool), np.ones(9, bool)]) is None
    assert Segments.of(np.r_[rep(g4, 3), 0, 1], 4, np.r_[np.zeros(12, bool), np.ones(2, bool)]) is None
    assert Segments.of(rep([1, 0, 2, 3], 2), 4) is None  # groups out of order
    assert Segments.of(np.tile(g4, 3), 4) is None  # interleaved


@pytest.mark.parametrize("m_b,m_a", [(6, 4), (5, 1), (3, 0), (2, 2)])
def test_segment_kernels_are_strata_kernels(m_b, m_a):
    rng = np.random.default_rng(m_b * 10 + m_a)
    g, n_pairs, k = 5, 7, 3
    codes = np.r_[np.repeat(np.arange(g), m_b), np.repeat(np.arange(g), m_a)].astype(np.int64)
    side = np.r_[np.zeros(g * m_b, bool), np.ones(g * m_a, bool)]
    seg = Segments.of(codes, g, side if m_a else None)
    strata = Strata(codes, side if m_a else None, g)
    n = len(codes)
    w = rng.uniform(size=(n_pairs, n)) ** 4  # uneven weights
    w[1, :m_b] = rng.pareto(0.7, size=m_b) + 1e-3  # heavy
    w[2, 0] = 1e6  # a row that carries (nearly) all of its group's weight
    w /= np.stack([np.bincount(codes, weights=row, minlength=g)[codes] for row in w])
    w[3, codes == 0] = 0.0
    w[3, 0] = 1.0  # ... and one that carries all of it (a deletion leaves none: NaN)
    x = rng.normal(size=(n_pairs, n, k)) * [1.0, 30.0, 1e-3]
    x[4, 2, 1] = np.nan
    gm = np.stack([np.stack([np.bincount(codes, weights=w[j] * x[j, :, c], minlength=g) for c in range(k)], 1)
                   for j in range(n_pairs)])
    want = strata.deleted_means(w, x, gm, codes)
    got_gm, parts = seg.deleted_means(np.ascontiguousarray(w.T), np.ascontiguousarray(x.transpose(1, 0, 2)))
    _close(got_gm.transpose(1, 0, 2), gm)
    rows = np.concatenate([(np.full((g, m, n_pairs, k), np.nan) if part is None else part).reshape(-1, n_pairs, k)
                           for part, (_, m, _) in zip(parts, seg.spans)])  # (n, P, k)
    got, ok = rows.transpose(1, 0, 2)[:, strata.ok], strata.ok
    # NaN where a deletion leaves no weight, and in the group of a NaN value (the one-hot product
    # spreads it over every group of its sample and feature)
    assert (np.isnan(got) <= np.isnan(want[:, ok])).all() and np.isnan(got[3]).any()
    fin = np.isfinite(got) & np.isfinite(want[:, ok])
    assert (np.isfinite(want[:, ok]) == np.isfinite(got))[np.arange(n_pairs) != 4].all()
    # (sample 2's heavy row leaves 1e-6 of its group's weight when deleted: the normaliser's
    # rounding, 1e-16 of its terms, is then 1e-10 of it, in either arithmetic)
    _close(got[fin], want[:, ok][fin], rel=1e-9)
    _close(got[np.arange(n_pairs) != 2][fin[np.arange(n_pairs) != 2]],
           want[:, ok][np.arange(n_pairs) != 2][fin[np.arange(n_pairs) != 2]])
    theta = rng.normal(size=(n_pairs, n, k)) * [1.0, 5.0, 1e-4]
    theta[5, 3, 0] = np.nan
    cov, dof = strata.jackknife(theta)
    tt = np.ascontiguousarray(theta.transpose(1, 0, 2))
    got_cov, got_dof = seg.jackknife([None if m < 2 else part for part, (_, m, _) in zip(seg.parts(tt), seg.spans)],
                                     n_pairs, k)
    _close(got_cov, cov)
    _close(got_dof, dof)
