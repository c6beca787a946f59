"""The truth harness's own arithmetic (tools/truth.py), checked against cases worked by hand:
the oracle's I-projection, its bootstrap of eta, and how an interval is checked against a
truth that has its own error."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import truth  # noqa: E402


def test_the_oracles_i_projection_of_a_binary_behaviour_is_the_kl_of_the_two_weightings():
    """One behaviour taking two values: the constraint E[z] = E_q[z] fixes the projected law to
    q itself, so KL_min = KL(q || p), here 3/4 log(3/2) + 1/4 log(1/2), in each of two groups
    that share the one tilt (rows interleaved, not ordered by group)."""
    z = np.array([[0.0], [1.0], [0.0], [1.0]])
    groups = np.array([0, 0, 1, 1])[[0, 2, 1, 3]]
    z = z[[0, 2, 1, 3]]
    q = np.array([0.75, 0.25, 0.75, 0.25])[[0, 2, 1, 3]]
    p = np.full(4, 0.5)
    want = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert truth._iproj_scipy(z, np.log(q), np.log(p), groups) == pytest.approx(want, rel=1e-8)


def test_a_behaviour_constant_in_the_sample_buys_nothing():
    z = np.ones((6, 1))
    q = np.full(6, 1 / 3)
    assert truth._iproj_scipy(z, np.log(q), np.log(q[::-1]), np.repeat([0, 1], 3)) == 0.0


def _pool(rng, n=40, shift=1.0):
    pool = truth.Pool((3, 4), ["x"])
    for side, mean in (("a", 0.0), ("b", shift)):
        x = rng.normal(mean, 1.0, size=2 * n)
        pool.z[side] = x[:, None]
        pool.groups[side] = np.repeat([0, 1], n)
        # log-densities of N(0, 1) (pi_t) and N(shift, 1) (pi_t+1) at the samples: the token KL
        # along a sample of pi_t+1 is its log-ratio, whose mean is shift^2 / 2
        pool.logp_t[side] = -0.5 * x ** 2
        pool.logp_t1[side] = -0.5 * (x - shift) ** 2
        pool.kl[side] = pool.logp_t1[side] - pool.logp_t[side]
    return pool


def test_the_oracles_eta_spread_is_seeded_and_shrinks_with_its_samples():
    """A Gaussian location shift, where the mean is a sufficient statistic (eta near 1): the
    bootstrap SD of the oracle's eta is reproducible for a step pair, positive, and about halves
    when the samples quadruple."""
    small, large = _pool(np.random.default_rng(0), n=50), _pool(np.random.default_rng(0), n=200)
    sd, mean = truth.oracle_eta_spread(small, draws=40)
    assert (sd, mean) == truth.oracle_eta_spread(small, draws=40)
    assert sd > 0 and 0.5 < mean < 1.5
    sd_large, _ = truth.oracle_eta_spread(large, draws=40)
    assert 0.3 < sd_large / sd < 0.8


def test_an_interval_is_checked_against_a_truth_with_its_own_error_in_quadrature():
    # estimate 1.0 +- 0.3 (its own t quantile inside the half-width), the truth 1.5 with SD 0.2:
    # |1.0 - 1.5| = 0.5 against sqrt(0.3^2 + (1.96 * 0.2)^2) = 0.494 -- just outside
    assert not truth._covers(1.0, 0.3, 1.5, 0.2)
    assert truth._covers(1.0, 0.3, 1.49, 0.2)
    assert truth._covers(1.0, 0.3, 1.29, float("nan"))  # a truth with no stated error is exact
    assert not truth._covers(1.0, 0.3, 1.31, float("nan"))


def test_one_sequence_scored_in_two_batches_is_one_distinct_sequence():
    """Duplicates differ by up to ~1e-5 nats when scored in batches of other paddings; at a
    rounding edge a fixed number of decimals split them. Within 1e-4 under both policies they
    are one sequence; a different sequence of nearly the same log pi_{t+1} but another log pi_t
    is another."""
    lp1 = np.array([-0.10000, -0.099995, -2.3, -0.10001, -0.100002])
    lp0 = np.array([-0.20000, -0.200004, -2.0, -0.19999, -0.9])
    got = truth._distinct(lp1, lp0)
    assert len(got) == 3 and np.exp(got).sum() == pytest.approx(math.exp(-2.3) + 2 * math.exp(-0.1), rel=1e-4)


def test_the_resolved_rows_of_redrawn_runs_are_decided_book_wide_per_run():
    """Benjamini-Hochberg at 0.05 over each redrawn run's rows, by hand: run 0's p-values 0.001
    and 0.04 (ranks 1 and 2 of 2: thresholds 0.025 and 0.05) both reject; run 1's 0.03, 0.5 and
    0.9 (ranks 1-3 of 3: thresholds 0.0167, 0.033 and 0.05) none. A row without an interval (run
    1's 0.5) is decided with the run and left out of the medians. The candidate decided on the
    held-out side's p-values (the fourth entries) alone: run 0's 0.5 and 0.001 reject the second
    (0.001 <= 0.025; 0.5 > 0.05), run 1's 0.001, 0.002 and 0.9 the first two (thresholds 0.0167
    and 0.033), so its resolved rows read 0.1, -0.2 and -0.4."""
    # each entry: (p, estimable, eta - truth, held-out p, eta, truth, the test's dfn and dfd)
    draws = {0: [(0.001, True, 0.3, 0.5, 0.8, 0.5, 3, 21), (0.04, True, 0.1, 0.001, 0.6, 0.5, 3, 21)],
             1: [(0.03, True, -0.2, 0.001, 0.3, 0.5, 3, 21), (0.9, True, -0.4, 0.002, 0.1, 0.5, 3, 21),
                 (0.5, False, 9.0, 0.9, 9.5, 0.5, 3, 21)]}
    sel = truth._selection(draws)
    assert sel["n"] == 4 and sel["n_resolved"] == 2
    assert sel["resolved"] == pytest.approx(0.2) and sel["other"] == pytest.approx(-0.3)
    assert sel["every"] == pytest.approx(-0.05)
    assert sel["n_heldout"] == 3 and sel["heldout"] == pytest.approx(-0.2)
    # each run's own median over the rows it resolves, as a record's is taken: run 0's of 0.3 and
    # 0.1; run 1 resolves none and is left out
    assert sel["per_run"] == [pytest.approx(0.2)]
    # the candidate adjusts run 0's two resolved rows (its threshold 0.05 * 2 / 2): 0.04 is barely
    # in, its eta goes to 0 (-0.5 from the truth); 0.001's scaled down, so the median falls
    adjusted = truth.selection_adjusted(np.array([0.8, 0.6]), np.array([0.001, 0.04]), 3, 21, 0.05)
    assert adjusted[1] == 0.0 and 0.0 < adjusted[0] < 0.8
    assert sel["adjusted"] == pytest.approx(float(np.median(adjusted - 0.5)))


def test_the_selection_candidates_noncentralities_solve_their_equations():
    """``selection_lambdas`` checked against scipy.stats' noncentral F: the unconditional lambda puts
    half the mass above the observed F, the conditional one half the mass above F_c above it too."""
    from scipy import stats

    p, dfn, dfd, p_star = np.array([1e-4, 0.003, 1e-9]), np.array([3, 2, 9]), np.array([21, 22, 15]), 0.03
    lam_u, lam_c = truth.selection_lambdas(p, dfn, dfd, p_star)
    f_obs, f_c = stats.f.isf(p, dfn, dfd), stats.f.isf(p_star, dfn, dfd)
    assert (lam_c <= lam_u).all() and (lam_c < lam_u).any() and (lam_c > 0).all()
    assert stats.ncf.sf(f_obs, dfn, dfd, lam_u) == pytest.approx(0.5, abs=1e-6)
    # a p-value of 0 (its F beyond a float) is left as it is
    assert truth.selection_adjusted(np.array([0.7, 0.7]), np.array([0.0, 0.001]), 3, 21, 0.05)[0] == 0.7
    assert (stats.ncf.sf(f_obs, dfn, dfd, lam_c) / stats.ncf.sf(f_c, dfn, dfd, lam_c)) == pytest.approx(0.5, abs=1e-6)


def test_a_yes_or_no_tail_flag_is_scored_on_the_misses_it_flags():
    draws = [({"f": 1.0}, True, True), ({"f": 1.0}, False, False), ({"f": 0.0}, True, False),
             ({"f": 0.0}, False, True), ({"f": 0.0}, False, False)]
    got = truth._flag_separation(draws, "f")
    assert got["flags"] == pytest.approx(0.4) and got["band"] == pytest.approx(0.5)
    assert got["ci"] == pytest.approx(0.5) and got["cover_rest"] == pytest.approx(2 / 3)


def test_the_harness_leaves_out_the_draws_the_book_refuses_for_the_envelope():
    """A redrawn estimate enters the run's decision and lends its SE only where the book would state
    it (the harness and the book both read ``EtaColumns.outside_envelope``): KL_jk 1.2 against a D_t of 1.0 with an SE of the difference of 0.1 is 2 SE over (kept),
    1.4 is 4 SE over (refused, beyond 3); a D_t of 0 or NaN is refused."""
    from reward_lens.measure.efficiency.eta import EtaEstimate

    def est(k, d):
        return EtaEstimate(step_pair=(0, 1), kind="paired", kl_min=k, kl_min_debiased=k, d_t=d, p_value=0.01,
                           cov=np.array([[0.005, 0.0], [0.0, 0.005]]), dof=5.0, groups_varying=4)

    from reward_lens.measure.efficiency.eta import EtaColumns

    got = EtaColumns.of([est(1.2, 1.0), est(0.3, 1.0), est(1.4, 1.0), est(0.1, 0.0), est(0.1, float("nan"))])
    assert got.outside_envelope.tolist() == [False, False, True, True, True]


def _step_pool(rng, groups=8, per=16, measured=2):
    """A pool of ``groups`` prompt groups, ``per`` samples of each policy per group, the tap having
    measured the first ``measured`` (``truth.step_prompts``' order)."""
    pool = truth.Pool((3, 4), ("x", "y"), measured=measured)
    for side in ("a", "b"):
        g = np.repeat(np.arange(groups), per)
        pool.groups[side] = g
        pool.z[side] = rng.normal(size=(len(g), 2)) + g[:, None]  # the groups differ
        lp = -3.0 + rng.normal(size=len(g))
        pool.logp_t[side], pool.logp_t1[side] = lp, lp + 0.2 * rng.normal(size=len(g))
        pool.kl[side] = 0.01 * (1 + g) + 0.001 * rng.random(len(g))  # later groups spend more
    return pool


def test_the_measured_groups_truth_is_over_those_groups_alone_and_survives_the_cache(tmp_path):
    rng = np.random.default_rng(3)
    pool = _step_pool(rng)
    sub = pool.restricted()
    assert sub.n_groups == 2 and set(sub.groups["a"].tolist()) == {0, 1}
    every, measured = truth.oracle_truth(pool), truth.oracle_truth(sub)
    # the groups' token KL grows with their index: the measured two spend less than the step's eight
    assert every.dz.shape == measured.dz.shape == (2,)
    assert 0.01 < measured.d_t < 0.03 < every.d_t
    whole = truth.Pool((3, 4), ("x", "y"))  # no count: every group was measured
    whole.groups, whole.z, whole.logp_t, whole.logp_t1, whole.kl = (
        pool.groups, pool.z, pool.logp_t, pool.logp_t1, pool.kl)
    assert whole.restricted() is whole
    truth.save_pools({(3, 4): pool}, tmp_path / "p.npz")
    back = truth.load_pools(tmp_path / "p.npz")[(3, 4)]
    assert back.measured == 2 and np.array_equal(back.z["b"], pool.z["b"])


def test_a_redraw_under_a_budget_scores_as_many_groups_afresh_and_leaves_the_others_unscored():
    """As the tap writes a budgeted pair: n of the step's N groups scored (both log-probabilities,
    the token KL, held-out rows), the others' rollouts present with null scores; the ledger then
    knows the step's N groups, and which n are scored varies from draw to draw."""
    from reward_lens.measure.ledger.paired import paired_ledger

    rng = np.random.default_rng(4)
    pool = _step_pool(rng)
    seen = set()
    for _ in range(20):
        roll, held, logp = truth._draw(pool, (3, 4), ["x", "y"], rng, 4, 4)
        scored = np.isfinite(roll.logp_prev)
        on = sorted(set(roll.groups[scored].tolist()))
        assert len(on) == 2 and sorted(set(held.groups.tolist())) == on
        assert np.isnan(roll.kl_prev[~scored]).all() and len(roll.groups) == 8 * 4
        assert len(logp) == scored.sum() + len(held.groups)
        lg = paired_ledger(roll, heldout=held)
        assert (lg.n_groups, lg.groups_in_step, lg.groups_unscored) == (2, 8, 6)
        seen.add(tuple(on))
    assert len(seen) > 5
