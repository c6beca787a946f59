"""The decisions and intervals checked against numbers worked by hand, not against the modules'
own constants nor a stored report (issue 63): a ``decide_from`` whose p-values and Benjamini-
Hochberg outcome are written out below; eta's standard error from jackknife replicates written
out as literals; the CUSUM's parameters and false-alarm target pinned as literals, with a Monte
Carlo of its run length that reads none of the module's constants.

Each case fails on the single-line slips tools/mutation_check.py makes (a one-sided p-value,
``K = 0.5``, the jackknife's ``(g - 1) / g`` inverted): a change of any of these numbers has to
change this file too, on purpose."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from reward_lens.measure import decisions
from reward_lens.measure import sequential as sq
from reward_lens.measure.efficiency import eta as eta_mod
from reward_lens.measure.efficiency.iproj import GroupJackknife
from reward_lens.measure.ledger.paired import PairedLedger, paired_ledger
from reward_lens.measure.ledger.price import StepSample


# ------------------------------------------------------------------ decide_from, worked by hand
@dataclass
class _Ledger:
    """The fields ``ledger_arrays`` and ``t_dof`` read of a ledger, set by hand."""

    step_pair: tuple[int, int]
    delta_z: np.ndarray
    se: np.ndarray
    n_groups: int = 0  # 0: a normal test (no prompt groups to count degrees of freedom from)
    dof: np.ndarray | None = None
    names: tuple[str, ...] = ("a", "b")
    kind: str = "unpaired"
    n_pre: int = 16
    n_post: int = 16
    units: int = 16
    matched: bool = False
    learning_rate: float | None = None
    cov_delta: np.ndarray = field(default_factory=lambda: np.eye(2))


@dataclass
class _NotFormed:
    reason: str


def _lg(pair, dz, se, **kw):
    return _Ledger(pair, np.array(dz, dtype=float), np.array(se, dtype=float), **kw)


def test_decide_from_by_hand_two_sided_p_and_benjamini_hochberg():
    """Three usable step pairs, two features, one cell not identified (SE 0), one refused pair.

    Normal tests (no prompt groups): z = dz / SE, p = 2 (1 - Phi(|z|)):
      (0,1) a: z = 3   -> p = 0.0026998    b: z = 0.5 -> p = 0.6170751
      (1,2) a: z = -2.2 -> p = 0.0278069   b: SE 0   -> not identified, p NaN
      (2,3) a: z = 2   -> p = 0.0455003    b: z = 2.6 -> p = 0.0093224
    BH at q = 0.05 over the m = 5 identified cells, sorted p against q i / m:
      0.0027 <= 0.01, 0.0093 <= 0.02, 0.0278 <= 0.03, 0.0455 > 0.04, 0.617 > 0.05
    so the three smallest are rejected: (0,1) a, (2,3) b, (1,2) a -- and (2,3) a, whose p is
    below 0.05 on its own, is not. The refused pair (3,4) has a huge z and joins no test."""
    ledgers = [_lg((0, 1), [3.0, 0.5], [1.0, 1.0]), _lg((1, 2), [-2.2, 0.0], [1.0, 0.0]),
               _lg((2, 3), [1.0, 2.6], [0.5, 1.0]), _lg((3, 4), [50.0, 50.0], [1.0, 1.0])]
    d = decisions.decide_from(ledgers, ("a", "b"), not_formed={(3, 4): _NotFormed("few_groups")})
    assert d.usable == ((0, 1), (1, 2), (2, 3)) and dict(d.refused) == {(3, 4): "few_groups"}
    want_p = np.array([[0.0026997961, 0.6170750775], [0.0278068950, np.nan], [0.0455002639, 0.0093223760]])
    np.testing.assert_allclose(d.p, want_p, rtol=1e-7)
    np.testing.assert_array_equal(d.identified, [[True, True], [True, False], [True, True]])
    np.testing.assert_array_equal(d.moved, [[True, False], [True, False], [False, True]])
    np.testing.assert_allclose(d.t[[0, 1, 2], [0, 0, 0]], [3.0, -2.2, 2.0], rtol=1e-12)
    assert d.pairs_moved == ((0, 1), (1, 2), (2, 3)) and d.cells_moved("a") == 2 and d.cells_moved("b") == 1
    assert d.summary()["cells_moved"] == 3 and d.summary()["cells_identified"] == 5
    assert d.cells_not_identified() == 1 and d.n_pairs == 4


def test_decide_from_by_hand_student_t_on_the_ledgers_degrees_of_freedom():
    """With degrees of freedom the test is Student's t: at t = 2.7764451 on 4 df (the ledger's
    own) and t = 2.2281389 on 10 df (11 prompt groups less one, where its own dof is not
    finite) p is 0.05 exactly; a normal test would give 0.0055 and 0.0259."""
    lg = _lg((0, 1), [2.7764451052, -2.2281388520], [1.0, 1.0], n_groups=11, dof=np.array([4.0, np.nan]))
    d = decisions.decide_from([lg], ("a", "b"))
    np.testing.assert_allclose(d.p, [[0.05, 0.05]], rtol=1e-8)
    # two p-values of 0.05 exactly: BH at q = 0.05 rejects both (0.05 <= 0.05 * 2 / 2)
    np.testing.assert_array_equal(d.moved, [[True, True]])


def test_benjamini_hochberg_by_hand():
    """Eight p-values, q = 0.05: thresholds 0.00625 i. Sorted: 0.001 (<= 0.00625), 0.008 (<=
    0.0125), 0.039 (> 0.01875), 0.041 (> 0.025), 0.042 (> 0.03125), 0.06, 0.074, 0.205: the step-up
    rule stops at the largest i whose p passes, i = 2. With 0.039 -> 0.018: i = 3 passes."""
    p = np.array([0.041, 0.001, 0.205, 0.039, 0.008, 0.074, 0.042, 0.06])
    np.testing.assert_array_equal(eta_mod.benjamini_hochberg(p, 0.05),
                                  [False, True, False, False, True, False, False, False])
    p[3] = 0.018
    np.testing.assert_array_equal(eta_mod.benjamini_hochberg(p, 0.05),
                                  [False, True, False, True, True, False, False, False])
    assert eta_mod.FDR_Q == 0.05  # the book-wide rate the docs state


# ------------------------------------------------------------- eta's SE from written-out replicates
def _one_sided_ledger():
    """Four prompt groups of two rollouts, one feature that varies in every group, log-ratio 0 (each
    row weighs 1/2 in its group) and the token KL of each row written out: each group's D is the
    mean of its two rows, D_g = (0.6, 0.3, 1.0, 0.4), D = 0.575."""
    kl = np.array([0.5, 0.7, 0.2, 0.4, 0.9, 1.1, 0.3, 0.5])
    z = np.array([0.0, 1.0] * 4)[:, None]
    codes = np.repeat(np.arange(4), 2)
    s = StepSample(1, ("f",), z, groups=codes, logp=np.zeros(8), logp_prev=np.zeros(8), kl_prev=kl, n_groups=4)
    lg = paired_ledger(s)
    assert isinstance(lg, PairedLedger), lg  # formed, not refused
    return lg


def test_eta_se_from_jackknife_replicates_written_out(monkeypatch):
    """KL_min of the whole sample and with each group deleted stated as literals (the jackknife's
    replicates; no solver runs): KL = 0.30, KL_(-g) = (0.27, 0.35, 0.26, 0.30). By hand:

      KL_jk = G KL - (G - 1) mean KL_(-g) = 1.2 - 3 * 0.295 = 0.315
      D_(-g) = (sum D_g - D_g) / (G - 1) = (1.7, 2.0, 1.3, 1.9) / 3
      cov = (G - 1) / G * sum_g (theta_g - mean)(theta_g - mean)^T over theta_g = (KL_(-g), D_(-g))
      SE(eta) by the delta method on KL_jk / D: grad (1 / D, -KL_jk / D^2)

    every product written out below with plain floats, and the result pinned as a literal."""
    full = 0.30
    deleted = [0.27, 0.35, 0.26, 0.30]
    monkeypatch.setattr(eta_mod, "group_jackknife", lambda z, r, codes, g, side, deletions, workers=1: GroupJackknife(
        full=np.array([full]), deleted=np.array([deleted]), converged=np.array([True]), solved=np.array([False]),
        lam=np.zeros((1, 1)), bias=np.zeros((1, 4))))
    est = eta_mod.paired_estimate(_one_sided_ledger(), np.array([0]))

    g = 4
    d_g = [0.6, 0.3, 1.0, 0.4]
    d = sum(d_g) / g
    k_jk = g * full - (g - 1) * sum(deleted) / g
    d_del = [(sum(d_g) - x) / (g - 1) for x in d_g]
    mk, md = sum(deleted) / g, sum(d_del) / g
    c_kk = (g - 1) / g * sum((a - mk) ** 2 for a in deleted)
    c_dd = (g - 1) / g * sum((b - md) ** 2 for b in d_del)
    c_kd = (g - 1) / g * sum((a - mk) * (b - md) for a, b in zip(deleted, d_del))
    g0, g1 = 1 / d, -k_jk / d ** 2
    se = math.sqrt(g0 * g0 * c_kk + 2 * g0 * g1 * c_kd + g1 * g1 * c_dd)

    assert d == pytest.approx(0.575, rel=1e-15) and k_jk == pytest.approx(0.315, rel=1e-14)
    assert est.kl_min == pytest.approx(full, rel=1e-14) and est.d_t == pytest.approx(d, rel=1e-14)
    assert est.kl_min_debiased == pytest.approx(k_jk, rel=1e-12)
    np.testing.assert_allclose(est.cov, [[c_kk, c_kd], [c_kd, c_dd]], rtol=1e-12)
    assert est.own_se == pytest.approx(se, rel=1e-12)
    # on paper: c_kk = 0.75 * 0.0049 = 0.003675, c_dd = 0.75 * 0.0319444 = 0.0239583, c_kd = 0.75 * 0.0105
    # = 0.007875; grad (1.7391304, -0.9527410): var = 0.0111153 - 0.0260967 + 0.0217473 = 0.0067659
    assert se == pytest.approx(0.0822547, rel=1e-5)
    # degrees of freedom: the groups in which the feature varies (all 4), less one: t_{3, 0.975} = 3.18245
    assert est.dof == 3.0
    lo, hi = est.interval()
    assert (hi - lo) / 2 == pytest.approx(3.1824463053 * se, rel=1e-9)


# ------------------------------------------------------------ the CUSUM, its numbers pinned here
# The watch's reference value (Page's k, in standard errors of one step's level) and the sequential
# findings' threshold h (specs/findings/*.yaml), and the false-alarm probabilities the module's
# docstring and docs/findings.md state for them: one one-sided sum of independent N(0, 1) scores
# reaching h = 5 within 30 steps 0.025 %, within 100 steps 0.09 %. Literals on purpose.
K_PINNED = 1.0
H_PINNED = 5.0
U_MAX_PINNED = 8.0


def _run_lengths(k: float, h: float, steps: int, runs: int, shift: float, rng) -> np.ndarray:
    """The first step (1-based) at which C_t = max(0, C_{t-1} + u_t - k) reaches h over
    ``runs`` simulated runs of N(shift, 1) scores; steps + 1 where it never does."""
    c = np.zeros(runs)
    first = np.full(runs, steps + 1)
    for t in range(steps):
        c = np.maximum(0.0, c + rng.standard_normal(runs) + shift - k)
        first = np.where((c >= h) & (first > steps), t + 1, first)
    return first


def test_the_cusum_parameters_are_the_documented_ones():
    assert sq.K == K_PINNED and sq.U_MAX == U_MAX_PINNED and sq.MIN_GROUPS == 2
    import yaml
    from pathlib import Path

    specs = Path(__file__).resolve().parents[2] / "specs" / "findings"
    hs = {p.stem: yaml.safe_load(p.read_text())["params"].get("h") for p in sorted(specs.glob("*.yaml"))}
    hs = {k: v for k, v in hs.items() if v is not None}
    assert hs, "no sequential finding states h"
    assert set(hs.values()) == {H_PINNED}, hs


def test_the_false_alarm_target_by_monte_carlo_of_the_run_length():
    """400,000 simulated runs of 100 steps of the recursion with k = 1, h = 5 (literals): the
    share whose run length is at most 30 and at most 100 steps against the stated 0.025 % and
    0.09 %, and the Brook-Evans chain the module computes against both. A K of 0.5 puts the
    chain at 9.7 % in 100 steps; a sum that subtracted nothing, at nearly 100 %."""
    rng = np.random.default_rng(63)
    runs = 400_000
    rl = _run_lengths(K_PINNED, H_PINNED, 100, runs, 0.0, rng)
    for steps, target in ((30, 0.00025), (100, 0.0009)):
        mc = float((rl <= steps).mean())
        se = math.sqrt(target * (1 - target) / runs)
        assert abs(mc - target) <= 4 * se + 2e-5, (steps, mc, target)
        assert sq.false_alarm_probability(H_PINNED, steps) == pytest.approx(target, rel=0.1)
    # the chain itself, with k passed as the literal, to three figures
    assert sq.false_alarm_probability(H_PINNED, 100, k=K_PINNED) == pytest.approx(0.000907, rel=5e-3)


def test_the_detection_delay_by_monte_carlo():
    """A shift of 2 SE per step (what K = 1 is tuned to: k = shift / 2): with the literal k the
    sum gains 1 per step on average, so it reaches h = 5 in a median of 5 steps; by Monte Carlo
    within 5 steps in 53 % of runs and within 8 in 89 %, and the chain says the same (with K = 0.5:
    a median of 4 steps, 71 % within 4)."""
    rng = np.random.default_rng(64)
    rl = _run_lengths(K_PINNED, H_PINNED, 20, 100_000, 2.0, rng)
    for steps, target in ((4, 0.324), (5, 0.531), (8, 0.890)):
        mc = float((rl <= steps).mean())
        assert mc == pytest.approx(target, abs=0.01), (steps, mc)
        assert sq.false_alarm_probability(H_PINNED, steps, shift=2.0) == pytest.approx(target, abs=0.002)
    assert np.median(rl) == 5


def test_the_series_watch_sums_scores_with_the_pinned_k():
    """A series whose steps sit at known normal scores: the sums move by u - 1 per step (k = 1
    literal), so three steps at +3 SE put C+ at 2 + 2 + 2 = 6 >= h = 5, and C- stays 0."""
    s = sq.SeriesWatch()
    G = 10_000  # so many groups that t is the normal and the reference barely moves
    sd = 1.0
    ss = (G - 1) * sd ** 2
    s.observe(0, 0.0, G, ss, G, ss)
    for _ in range(200):  # a long flat history: the reference is 0, its own noise negligible
        s.observe(0, 0.0, G, ss, G, ss)
    se = sd * math.sqrt(1 / G)
    ups = []
    for t in range(1, 4):
        s.observe(t, 3.0 * se, G, ss, G, ss)
        ups.append(s.up)
    assert s.last_score == pytest.approx(3.0, rel=0.02)
    assert ups == pytest.approx([2.0, 4.0, 6.0], rel=0.03)
    assert s.down == 0.0


def test_eta_intervals_by_hand_t_quantiles_and_the_delta_method():
    """Two estimates with their covariance written out (KL = 0.2, D = 0.5, var KL 0.0004, var D
    0.0009, cov 0.0003): eta = 0.4; by the delta method var = (0.0004 - 2 * 0.4 * 0.0003 + 0.16 *
    0.0009) / 0.25 = 0.001216, SE = 0.0348712. The 95 % interval is eta +- t_{dof, 0.975} SE:
    1.959964 on infinite degrees of freedom, 2.364624 on 7 -- one object and the columns alike."""
    cov = np.array([[0.0004, 0.0003], [0.0003, 0.0009]])
    se = math.sqrt((0.0004 - 2 * 0.4 * 0.0003 + 0.16 * 0.0009) / 0.25)
    assert se == pytest.approx(0.03487119155, rel=1e-9)
    ests = [eta_mod.EtaEstimate((0, 1), "unpaired", 0.2, 0.2, 0.5, 0.01, cov, dof=float("inf")),
            eta_mod.EtaEstimate((1, 2), "unpaired", 0.2, 0.2, 0.5, 0.01, cov, dof=7.0)]
    cols = eta_mod.EtaColumns.of(ests)
    lo, hi = cols.interval()
    for i, (e, q) in enumerate(zip(ests, (1.959963984540054, 2.3646242515927844))):
        assert e.eta_debiased == pytest.approx(0.4, rel=1e-15) and e.own_se == pytest.approx(se, rel=1e-12)
        assert e.interval() == pytest.approx((0.4 - q * se, 0.4 + q * se), rel=1e-12)
        assert (lo[i], hi[i]) == pytest.approx((0.4 - q * se, 0.4 + q * se), rel=1e-12)
    np.testing.assert_allclose(cols.own_se, [se, se], rtol=1e-12)


def test_jackknife_degrees_of_freedom_by_hand():
    """The groups in which a priced feature varies, less one, at least one, at most G - 1."""
    assert [eta_mod.jackknife_dof(v, 8) for v in (0, 1, 2, 3, 8, 9)] == [1.0, 1.0, 1.0, 2.0, 7.0, 7.0]
    np.testing.assert_array_equal(eta_mod.jackknife_dofs(np.array([0, 1, 2, 3, 8, 9]), 8), [1, 1, 1, 2, 7, 7])


def test_benjamini_hochberg_rejects_at_its_threshold_exactly():
    """p equal to q i / m is rejected (the rule is p_(i) <= q i / m): 0.025 and 0.05 at m = 2."""
    np.testing.assert_array_equal(eta_mod.benjamini_hochberg(np.array([0.05, 0.025]), 0.05), [True, True])
    np.testing.assert_array_equal(eta_mod.benjamini_hochberg(np.array([0.0500001, 0.025]), 0.05), [False, True])


def test_normal_scores_at_zero_degrees_of_freedom_and_past_float64():
    """No degrees of freedom: the normal itself (a z of 2 scores 2, not the 1.05 of t on 1 df);
    a tail beyond float64 (t on 3 df at 1e300, the normal at 50) scores the clip, U_MAX = 8."""
    assert sq.normal_score(2.0, 0) == pytest.approx(2.0, rel=1e-12)
    assert sq.normal_score(-1.5, 0) == pytest.approx(-1.5, rel=1e-12)
    assert sq.normal_score(50.0, 0) == U_MAX_PINNED and sq.normal_score(-1e300, 3) == -U_MAX_PINNED


def test_a_series_first_step_is_not_scored_read_alone_or_in_a_block():
    """The first step has no steps before it to be read against: it joins the reference and
    scores nothing, whether observed alone or as a block of one (last_score stays None)."""
    one, block = sq.SeriesWatch(), sq.SeriesWatch()
    one.observe(0, 0.5, 4, 0.03, 16, 1.0)
    block.observe_many(np.array([0]), np.array([0.5]), np.array([4]), np.array([0.03]), np.array([16]),
                       np.array([1.0]))
    for s in (one, block):
        assert s.last_score is None and s.up == 0.0 and s.down == 0.0 and s.reference == pytest.approx(0.5)


def test_decide_from_by_hand_degrees_of_freedom_fallbacks():
    """Where a ledger states no usable degrees of freedom the test uses its prompt groups less one:
    a dof of 0 or NaN with 11 groups -> t on 10 df (p = 0.05 at 2.2281389, where a normal test
    gives 0.0259); a ledger with no dof at all and 5 groups -> t on 4 df (p = 0.05 at 2.7764451)."""
    d = decisions.decide_from([_lg((0, 1), [2.2281388520, -2.2281388520], [1.0, 1.0], n_groups=11,
                                   dof=np.array([0.0, np.nan]))], ("a", "b"))
    np.testing.assert_allclose(d.p, [[0.05, 0.05]], rtol=1e-8)
    d = decisions.decide_from([_lg((0, 1), [2.7764451052, 1.0], [1.0, 1.0], n_groups=5)], ("a", "b"))
    assert d.p[0, 0] == pytest.approx(0.05, rel=1e-8)
    # both together: with one ledger lacking dof every ledger is read one by one (``t_dof``)
    d = decisions.decide_from([_lg((0, 1), [2.7764451052, 1.0], [1.0, 1.0], n_groups=5),
                               _lg((1, 2), [2.2281388520, -2.2281388520], [1.0, 1.0], n_groups=11,
                                   dof=np.array([0.0, np.nan]))], ("a", "b"))
    np.testing.assert_allclose(d.p[[0, 1, 1], [0, 0, 1]], [0.05, 0.05, 0.05], rtol=1e-8)


def test_eta_replicates_carry_the_per_group_bias_correction(monkeypatch):
    """The replicates of the test above with each group's own O(1/n) bias stated too, b = (0.01,
    0.02, 0.0, 0.03): KL_jk less their mean (0.315 - 0.015 = 0.3) and each replicate less the mean
    over the groups it keeps, (sum b - b_g) / (G - 1) = (0.05, 0.04, 0.06, 0.03) / 3: so the KL
    replicates become (0.253333, 0.336667, 0.24, 0.29)."""
    full, deleted, bias = 0.30, [0.27, 0.35, 0.26, 0.30], [0.01, 0.02, 0.0, 0.03]
    monkeypatch.setattr(eta_mod, "group_jackknife", lambda z, r, codes, g, side, deletions, workers=1: GroupJackknife(
        full=np.array([full]), deleted=np.array([deleted]), converged=np.array([True]), solved=np.array([False]),
        lam=np.zeros((1, 1)), bias=np.array([bias])))
    est = eta_mod.paired_estimate(_one_sided_ledger(), np.array([0]))
    g = 4
    kept = [a - (sum(bias) - b) / (g - 1) for a, b in zip(deleted, bias)]
    assert kept == pytest.approx([0.27 - 0.05 / 3, 0.35 - 0.04 / 3, 0.24, 0.29], rel=1e-12)
    mk = sum(kept) / g
    c_kk = (g - 1) / g * sum((a - mk) ** 2 for a in kept)
    assert est.kl_min_debiased == pytest.approx(0.3, rel=1e-12)
    assert est.cov[0, 0] == pytest.approx(c_kk, rel=1e-12)
