"""Hotelling's T^2 test of a ledger's dz = 0, against scipy.stats written out by hand, and
its refusal to test a covariance that is singular or nearly so."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from reward_lens.measure.efficiency.eta import HOTELLING_MAX_CONDITION, hotelling_p, hotelling_p_many


def test_one_feature_is_the_two_sided_t_test():
    # k = 1: T^2 = dz^2 / var and F(1, N - 2) = t(N - 2)^2
    dz, var, units = 0.3, 0.01, 20
    want = 2 * stats.t.sf(abs(dz) / np.sqrt(var), units - 2)
    assert hotelling_p(np.array([dz]), np.array([[var]]), units) == pytest.approx(want, rel=1e-12)


def test_two_features_by_the_f_distribution():
    dz = np.array([0.2, -0.1])
    sigma = np.array([[0.02, 0.005], [0.005, 0.01]])
    units, k = 30, 2
    t2 = dz @ np.linalg.inv(sigma) @ dz
    two = stats.f.sf(t2 * (units - k - 1) / (k * (units - 2)), k, units - k - 1)
    one = stats.f.sf(t2 * (units - k) / (k * (units - 1)), k, units - k)  # P matched differences
    assert hotelling_p(dz, sigma, units) == pytest.approx(two, rel=1e-12)
    assert hotelling_p(dz, sigma, units, one_sample=True) == pytest.approx(one, rel=1e-12)


def test_untestable_covariances_give_one():
    dz = np.array([0.2, -0.1])
    assert hotelling_p(dz, np.array([[0.02, 0.0], [0.0, 0.01]]), 3) == 1.0  # N - k - 1 = 0
    assert hotelling_p(dz, np.array([[1.0, 1.0], [1.0, 1.0]]), 30) == 1.0  # singular
    assert hotelling_p(dz, np.array([[1.0, 0.0], [0.0, 0.0]]), 30) == 1.0  # a constant feature
    assert hotelling_p(dz, np.full((2, 2), np.nan), 30) == 1.0
    # nearly singular, in a scale-free sense: correlation 1 - 1e-12 is refused, 1 - 1e-6 tested,
    # whatever the features' units
    for scale in (1.0, 1e6):
        units_ = np.diag([1.0, scale])
        near = units_ @ np.array([[1.0, 1 - 1e-12], [1 - 1e-12, 1.0]]) @ units_
        fine = units_ @ np.array([[1.0, 1 - 1e-6], [1 - 1e-6, 1.0]]) @ units_
        assert hotelling_p(dz, near, 30) == 1.0
        assert hotelling_p(dz, fine, 30) < 1.0
    assert HOTELLING_MAX_CONDITION == 1e10


def test_many_at_once_equal_one_at_a_time():
    rng = np.random.default_rng(0)
    dz = rng.normal(size=(40, 3)) * 0.1
    a = rng.normal(size=(40, 3, 5))
    sigma = a @ a.transpose(0, 2, 1) / 50
    sigma[3] = np.outer([1, 2, 3], [1, 2, 3])  # singular
    units = rng.integers(3, 40, size=40)
    one = rng.random(40) < 0.5
    got = hotelling_p_many(dz, sigma, units, one)
    want = [hotelling_p(d, s, int(u), bool(o)) for d, s, u, o in zip(dz, sigma, units, one)]
    assert got[3] == 1.0 and np.allclose(got, want, rtol=1e-12, atol=0)
