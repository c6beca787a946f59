"""Paired eta on samples of few rows per prompt group (issue 41): the jackknife's degrees of
freedom from the groups that vary, a sample in which no group varies priced as nothing, and the
within-group bias of the dual's terms (``iproj.fixed_tilt_bias``) against a brute-force
stratified jackknife written out here and against the bias it estimates, by simulation."""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from reward_lens.measure.efficiency.eta import groups_varying, jackknife_dof, paired_estimates
from reward_lens.measure.efficiency.iproj import fixed_tilt_bias
from reward_lens.measure.ledger.paired import paired_ledger
from reward_lens.measure.ledger.price import StepSample


def _brute_phi(z, r, held, lam_raw):
    """One group's dual term in raw feature units, the balance heuristic written out row by row:
    lam . sum_i q_i z_i - log sum_i p_i exp(lam . z_i), q_i prop. to pi_{t+1}(y_i) / mix(y_i) and
    p_i to pi_t(y_i) / mix(y_i), mix = n_a pi_t + n_b pi_{t+1} (r = log pi_{t+1} - log pi_t)."""
    n_a, n_b = int(held.sum()), int((~held).sum())
    q = np.array([1.0 / (n_a * math.exp(-x) + n_b) for x in r])
    p = np.array([1.0 / (n_a + n_b * math.exp(x)) for x in r])
    q, p = q / q.sum(), p / p.sum()
    return float(lam_raw @ (q @ z) - math.log(sum(pi * math.exp(lam_raw @ zi) for pi, zi in zip(p, z))))


def _brute_bias(z, r, codes, held, lam_raw):
    """Quenouille's stratified jackknife of each group's term, each row deleted in turn."""
    out = []
    for g in np.unique(codes):
        rows = np.flatnonzero(codes == g)
        full = _brute_phi(z[rows], r[rows], held[rows], lam_raw)
        b = 0.0
        for side in (True, False):
            mine = [i for i in rows if held[i] == side]
            if len(mine) < 2:
                continue
            reps = []
            for i in mine:
                keep = np.array([j for j in rows if j != i])
                reps.append(_brute_phi(z[keep], r[keep], held[keep], lam_raw))
            b += (len(mine) - 1) * (np.mean(reps) - full)
        out.append(b)
    return np.array(out)


def _pooled_sd(z, codes):
    """The within-group SD the solver standardises by (``iproj._prepared``)."""
    dev = z.copy()
    for g in np.unique(codes):
        dev[codes == g] -= z[codes == g].mean(axis=0)
    return np.sqrt((dev ** 2).sum(axis=0) / (len(z) - len(np.unique(codes))))


def test_fixed_tilt_bias_equals_the_stratified_jackknife_written_out():
    rng = np.random.default_rng(5)
    codes = np.repeat(np.arange(3), 7)
    held = np.tile(np.r_[np.zeros(4, bool), np.ones(3, bool)], 3)  # 4 rows of pi_{t+1}, 3 of pi_t a group
    z = rng.normal(size=(len(codes), 2)) * [1.0, 5.0]
    r = 1.5 * z[:, 0] + 0.5 * rng.normal(size=len(codes))
    lam = np.array([0.7, -0.3])  # standardised units
    got = fixed_tilt_bias(z[None], r[None], codes, 3, held, lam[None])[0]
    want = _brute_bias(z, r, codes, held, lam / _pooled_sd(z, codes))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert np.abs(want).max() > 1e-3  # a case where there is something to correct


def test_fixed_tilt_bias_of_unequal_groups_equals_the_jackknife_written_out():
    """Groups of 5, 9 and 6 rows, one with a single held-out row (its side adds nothing)."""
    rng = np.random.default_rng(11)
    codes = np.repeat(np.arange(3), [5, 9, 6])
    held = np.r_[[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]].astype(bool)
    z = rng.normal(size=(len(codes), 3)) * [1.0, 3.0, 0.2]
    r = 2.0 * z[:, 0] - 3.0 * z[:, 2] + 0.5 * rng.normal(size=len(codes))
    lam = np.array([0.4, 0.1, -0.6])
    got = fixed_tilt_bias(z[None], r[None], codes, 3, held, lam[None])[0]
    want = _brute_bias(z, r, codes, held, lam / _pooled_sd(z, codes))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_fixed_tilt_bias_is_zero_where_nothing_can_be_biased():
    rng = np.random.default_rng(6)
    codes = np.repeat(np.arange(2), 8)
    held = np.tile(np.r_[np.zeros(4, bool), np.ones(4, bool)], 2)
    z = rng.normal(size=(16, 1))
    z[codes == 1] = 2.0  # group 1 constant: its term is lam . (z - z) = 0 at any tilt
    r = z[:, 0] + rng.normal(size=16)
    b = fixed_tilt_bias(z[None], r[None], codes, 2, held, np.array([[0.9]]))[0]
    assert b[1] == 0.0 and b[0] != 0.0
    # no tilt: every term is 0 whatever the rows
    assert not fixed_tilt_bias(z[None], r[None], codes, 2, held, np.zeros((1, 1))).any()
    # one-sided samples: not corrected (unbounded weights)
    assert not fixed_tilt_bias(z[None], r[None], codes, 2, None, np.array([[0.9]])).any()


def test_fixed_tilt_bias_removes_most_of_a_terms_bias_by_simulation():
    """pi_t = N(0, 1) and pi_{t+1} = N(0.8, 1) over a scalar y, z = y: the term at lam is
    lam E_{t+1}[z] - log E_t[exp(lam z)] = lam 0.8 - lam^2 / 2 exactly. From 4 + 4 draws its
    plug-in is biased; with the correction taken off the bias is a fraction of it."""
    rng = np.random.default_rng(7)
    lam, mu = 0.9, 0.8
    exact = lam * mu - lam ** 2 / 2
    held = np.r_[np.zeros(4, bool), np.ones(4, bool)]
    codes = np.zeros(8, dtype=int)
    plug, fixed = [], []
    for _ in range(4000):
        y = np.r_[rng.normal(mu, 1.0, 4), rng.normal(0.0, 1.0, 4)]
        r = mu * y - mu ** 2 / 2  # log N(y; mu, 1) - log N(y; 0, 1)
        z = y[:, None]
        phi = _brute_phi(z, r, held, np.array([lam]))
        sd = _pooled_sd(z, codes)[0]
        b = fixed_tilt_bias(z[None], r[None], codes, 1, held, np.array([[lam * sd]]))[0, 0]
        plug.append(phi)
        fixed.append(phi - b)
    bias_plug, bias_fixed = np.mean(plug) - exact, np.mean(fixed) - exact
    se = np.std(fixed, ddof=1) / math.sqrt(len(fixed))
    assert abs(bias_plug) > 10 * se  # the plug-in's bias is resolved
    assert abs(bias_fixed) < 0.35 * abs(bias_plug)


def test_groups_varying_and_the_dof_they_give():
    z = np.zeros((1, 12, 2))
    codes = np.repeat(np.arange(4), 3)
    z[0, 0, 0] = 1.0  # group 0 varies in feature 0
    z[0, 7, 1] = -2.0  # group 2 in feature 1
    z[0, 9:12, :] = 5.0  # group 3 constant at another value
    assert groups_varying(z, codes, 4).tolist() == [2]
    assert jackknife_dof(2, 4) == 1.0 and jackknife_dof(1, 4) == 1.0 and jackknife_dof(8, 8) == 7.0


def _sample(z, r, codes, held_rows):
    """A paired ledger of one step pair from rows of pi_{t+1} and held-out rows of pi_t."""
    kl = 0.5 * r ** 2 + 1e-3
    rows = ~held_rows
    g = int(codes.max()) + 1
    roll = StepSample(1, ("f1", "f2"), z[rows], groups=codes[rows], logp=r[rows], logp_prev=np.zeros(rows.sum()),
                      kl_prev=kl[rows], n_groups=g)
    held = StepSample(1, ("f1", "f2"), z[held_rows], groups=codes[held_rows], logp=r[held_rows],
                      logp_prev=np.zeros(held_rows.sum()), kl_prev=kl[held_rows], n_groups=g)
    return paired_ledger(roll, heldout=held)


def _two_groups():
    rng = np.random.default_rng(8)
    codes = np.repeat(np.arange(8), 8)
    held = np.tile(np.r_[np.zeros(4, bool), np.ones(4, bool)], 8)
    z = np.repeat(rng.normal(size=(8, 2)), 8, axis=0)  # constant within every group ...
    for g in (2, 5):  # ... but two
        z[codes == g] = rng.normal(size=(8, 2))
    r = 0.3 * rng.normal(size=64) + 0.5 * z[:, 0]
    return z, r, codes, held


def test_the_interval_uses_t_on_the_groups_that_vary():
    """Eight groups, the features vary within two of them: t on 1 degree of freedom, by hand."""
    lg = _sample(*_two_groups())
    (est,) = paired_estimates([(lg, np.array([0, 1]))])
    assert est.groups_varying == 2 and est.dof == 1.0
    lo, hi = est.interval()
    q = float(special.stdtrit(1, 0.975))  # 12.7
    assert math.isclose(hi - lo, 2 * q * est.se, rel_tol=1e-12)


def _one_group_varies(seed=8):
    rng = np.random.default_rng(seed)
    codes = np.repeat(np.arange(8), 8)
    held = np.tile(np.r_[np.zeros(4, bool), np.ones(4, bool)], 8)
    z = np.repeat(rng.normal(size=(8, 2)), 8, axis=0)  # constant within every group but group 3
    z[codes == 3] = rng.normal(size=(8, 2))
    r = 0.3 * rng.normal(size=64) + 0.5 * z[:, 0]
    return _sample(z, r, codes, held)


def test_with_one_group_varying_the_jackknifes_spread_is_the_estimate_itself():
    """Why such an eta has no interval, by hand: deleting the one group that varies leaves
    KL_min = 0, deleting any other of the G scales it by G / (G - 1), so the delete-one-group
    replicates' spread, (G - 1) / G sum (theta_g - mean)^2, is KL_min^2 exactly: an SE that is
    the estimate, whatever its error."""
    from reward_lens.measure.efficiency.iproj import group_jackknife

    lg = _one_group_varies()
    order = np.argsort(lg.codes, kind="stable")
    jk = group_jackknife(lg.z[order][None], np.asarray(lg.log_ratio)[order][None], lg.codes[order], 8,
                         np.asarray(lg.heldout)[order])
    k, deleted = float(jk.full[0]), jk.deleted[0]
    assert k > 0
    np.testing.assert_allclose(np.delete(deleted, 3), k * 8 / 7, rtol=1e-6)
    assert abs(deleted[3]) < 1e-9
    var = 7 / 8 * ((deleted - deleted.mean()) ** 2).sum()
    assert math.isclose(math.sqrt(var), k, rel_tol=1e-6)


def test_with_one_group_varying_eta_states_no_interval_and_leaves_the_median():
    """The book keeps such a row's estimate, its test and its status, states no interval, says so
    (``no_interval``), and leaves it out of the median over resolved rows."""
    from reward_lens.measure.efficiency.cost import cost_series
    from reward_lens.measure.efficiency.metric import within_group_metric

    lg = _one_group_varies()
    (est,) = paired_estimates([(lg, np.array([0, 1]))])
    assert est.groups_varying == 1 and not est.estimable
    book = cost_series([lg], within_group_metric([lg]))
    (row,) = book.rows
    assert row.status in ("resolved", "unresolved") and row.efficiency_debiased is not None
    assert row.interval is None and row.no_interval
    two = _sample(*_two_groups())
    assert paired_estimates([(two, np.array([0, 1]))])[0].estimable
    assert cost_series([two], within_group_metric([two])).rows[0].interval is not None


def test_the_median_over_resolved_rows_leaves_out_an_eta_with_no_interval():
    from reward_lens.measure.efficiency.eta import EtaEstimate, headline

    def est(eta, varying):
        return EtaEstimate(step_pair=(0, 1), kind="paired", kl_min=eta, kl_min_debiased=eta, d_t=1.0, p_value=0.0,
                           cov=np.diag([1e-4, 1e-6]), dof=5.0, groups_varying=varying)

    med, _ = headline([est(0.1, 3), est(0.2, 4), est(0.9, 1)])
    assert math.isclose(med, 0.15)
    assert headline([est(0.9, 1)]) == (None, None)


def test_a_sample_constant_within_every_group_prices_nothing():
    """No priced feature varies within any prompt group: KL_min is 0 whatever the step did, and
    the book says nothing was priced rather than showing an eta of 0."""
    from reward_lens.measure.efficiency.cost import cost_series
    from reward_lens.measure.efficiency.metric import within_group_metric

    rng = np.random.default_rng(9)
    codes = np.repeat(np.arange(4), 8)
    held = np.tile(np.r_[np.zeros(4, bool), np.ones(4, bool)], 4)
    z = np.repeat(rng.normal(size=(4, 2)), 8, axis=0)
    r = 0.4 * rng.normal(size=32)
    lg = _sample(z, r, codes, held)
    (est,) = paired_estimates([(lg, np.array([0, 1]))])
    assert est.groups_varying == 0 and est.kl_min == 0.0
    book = cost_series([lg], within_group_metric([lg]))
    assert [row.status for row in book.rows] == ["nothing_priced"] and book.rows[0].efficiency is None


def test_a_group_with_rows_on_one_side_only_is_not_corrected_and_nothing_warns():
    """In a two-sided sample, a prompt group the held-out draw did not reach has the one-sided
    weights (unbounded): its term gets no correction, as a one-sided sample's; the groups beside
    it keep theirs (equal blocks and the per-group loop alike); and the masked entries (a side's
    count less one below zero, a largest weight left out) raise no numpy warning."""
    import warnings

    from reward_lens.measure.efficiency import iproj

    rng = np.random.default_rng(4)
    g, m = 4, 8
    codes = np.repeat(np.arange(g), m)
    held = np.tile(np.r_[np.zeros(4, bool), np.ones(4, bool)], g)
    held[codes == 3] = False
    z = rng.normal(size=(g * m, 1))
    r = 2.0 * z[:, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = fixed_tilt_bias(z[None], r[None], codes, g, held, np.array([[1.0]]))[0]
    assert b[3] == 0.0 and (b[:3] != 0).all()
    blocks = iproj.blocks
    try:
        iproj.blocks = lambda *_: 0  # the per-group loop
        loop = fixed_tilt_bias(z[None], r[None], codes, g, held, np.array([[1.0]]))[0]
    finally:
        iproj.blocks = blocks
    np.testing.assert_allclose(loop, b, rtol=1e-10, atol=1e-14)
