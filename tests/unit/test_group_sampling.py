"""The sampling of the measured prompt groups from the step's (``paired.group_sampling``): a step
pair priced on n of the step's N groups estimates the step's change over all N, and its variance
is two-stage (Cochran 1977, sec. 11.2): (1 - n/N) s_b^2 / n + (n/N) Var_within. Checked against
a table worked by hand and against brute-force enumeration of every subset of groups and every
draw of the within-group noise -- never against the implementation itself."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from reward_lens.measure.ledger.paired import group_sampling


def test_a_table_worked_by_hand():
    # n = 2 of N = 4 groups, the groups' estimates 1 and 3: s_b^2 = ((1-2)^2 + (3-2)^2) / 1 = 2,
    # s_b^2 / n = 1; f = 1/2; the within variance 0.5 on 10 degrees of freedom.
    # Var = (1 - 1/2) * 1 + 1/2 * 0.5 = 0.75; the terms 0.5 (on n - 1 = 1) and 0.25 (on 10):
    # dof = 0.75^2 / (0.5^2 / 1 + 0.25^2 / 10) = 0.5625 / 0.25625 = 2.1951219...
    cov, dof = group_sampling(np.array([[[0.5]]]), np.array([[10.0]]), np.array([[[1.0], [3.0]]]), np.array([0.5]))
    assert cov[0, 0, 0] == pytest.approx(0.75, rel=1e-15)
    assert dof[0, 0] == pytest.approx(0.5625 / 0.25625, rel=1e-14)
    assert dof[0, 0] == pytest.approx(2.1951219512195124, rel=1e-14)


def test_no_within_spread_leaves_the_between_term_on_n_minus_one():
    # 3 of 6 groups with estimates 0, 1, 5: mean 2, s_b^2 = (4 + 1 + 9) / 2 = 7, / n = 7/3; f = 1/2
    cov, dof = group_sampling(np.zeros((1, 1, 1)), np.full((1, 1), np.nan), np.array([[[0.0], [1.0], [5.0]]]),
                              np.array([0.5]))
    assert cov[0, 0, 0] == pytest.approx(7 / 6, rel=1e-15)
    assert dof[0, 0] == pytest.approx(2.0, rel=1e-14)


def test_every_group_measured_leaves_the_conditional_covariance_exactly():
    cov = np.array([[[0.3, 0.1], [0.1, 0.2]]])
    dof = np.array([[7.5, 3.25]])
    per_group = np.random.default_rng(0).normal(size=(1, 4, 2))
    got_cov, got_dof = group_sampling(cov, dof, per_group, np.array([1.0]))
    assert got_cov is cov and got_dof is dof  # budget=None: the ledgers' numbers untouched


def test_one_measured_group_has_no_spread_across_groups():
    with pytest.raises(ValueError, match="one measured prompt group"):
        group_sampling(np.zeros((1, 1, 1)), np.ones((1, 1)), np.zeros((1, 1, 1)), np.array([0.25]))
    with pytest.raises(ValueError, match="share"):
        group_sampling(np.zeros((1, 1, 1)), np.ones((1, 1)), np.zeros((1, 2, 1)), np.array([0.0]))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_unbiased_for_the_variance_about_the_mean_of_all_groups_by_enumeration(n):
    """N = 5 groups of true values y_g (2 behaviours); each measured group's estimate is y_g + e_g,
    e_g = +-s_g u_g with equal chances (a two-point within-group error: its variance s_g^2 u_g u_g^T).
    Over every one of the C(5, n) subsets and every one of the 2^n sign draws, equally likely: the
    mean of the estimated covariance equals the exact mean square error of the mean of the
    measured groups about the mean of all 5. The conditional covariance alone falls short."""
    N = 5
    y = np.array([[0.0, 1.0], [2.0, -1.0], [-1.5, 0.5], [4.0, 2.0], [0.5, 0.0]])
    s = np.array([0.3, 1.0, 0.5, 0.2, 0.8])
    u = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-0.8, 0.6], [1.0, 1.0]])
    target = y.mean(axis=0)
    mse = np.zeros((2, 2))
    mean_est = np.zeros((2, 2))
    mean_cond = np.zeros((2, 2))
    count = 0
    for subset in itertools.combinations(range(N), n):
        idx = np.array(subset)
        within = sum(s[g] ** 2 * np.outer(u[g], u[g]) for g in subset) / n ** 2  # the exact conditional covariance
        for signs in itertools.product((-1.0, 1.0), repeat=n):
            est_g = y[idx] + np.array(signs)[:, None] * s[idx, None] * u[idx]
            err = est_g.mean(axis=0) - target
            mse += np.outer(err, err)
            cov, _ = group_sampling(within[None], np.full((1, 2), 50.0), est_g[None], np.array([n / N]))
            mean_est += cov[0]
            mean_cond += within
            count += 1
    mse /= count
    mean_est /= count
    mean_cond /= count
    assert np.allclose(mean_est, mse, rtol=1e-12, atol=1e-14)
    assert (np.diag(mean_cond) < 0.9 * np.diag(mse)).all()  # conditional on the groups alone: too narrow


def test_the_tap_s_recorded_d_t_se_is_two_stage_where_the_budget_measured_a_subset():
    """``independent_d_t`` (what the tap records as ``kl_to_previous_se``) with ``share`` < 1:
    the books' two-stage variance, (1 - f) s_b^2 / n + f Var_within, its terms worked here from
    the rows (one-sided, equal weights: each group's D is the mean of its rows' KL)."""
    from reward_lens.measure.ledger.paired import independent_d_t

    kl = np.array([0.1, 0.3, 0.2, 0.6, 1.0, 0.8])
    codes = np.array([0, 0, 1, 1, 2, 2])
    mean, se_within = independent_d_t(np.zeros(6), None, kl, codes, 3)
    per_group = np.array([0.2, 0.4, 0.9])
    assert mean == pytest.approx(per_group.mean(), rel=1e-12)
    s_b2 = per_group.var(ddof=1)  # ((0.2-0.5)^2 + (0.4-0.5)^2 + (0.9-0.5)^2) / 2 = 0.13
    assert s_b2 == pytest.approx(0.13, rel=1e-12)
    f = 3 / 8  # 3 of the step's 8 groups measured
    _, se = independent_d_t(np.zeros(6), None, kl, codes, 3, share=f)
    assert se ** 2 == pytest.approx((1 - f) * 0.13 / 3 + f * se_within ** 2, rel=1e-12)
    assert independent_d_t(np.zeros(6), None, kl, codes, 3, share=1.0)[1] == se_within  # every group: as before
