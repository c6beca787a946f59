"""The paired ledger and the exact KL_min, checked against independent computations: a primal
solver for the I-projection, least squares for the R^2 identity, brute-force subset
regressions for the LMG decomposition, and the balance heuristic written out group by group."""

from __future__ import annotations

from itertools import combinations
from math import factorial

import numpy as np
import pytest
import scipy.optimize as so

from reward_lens.measure.efficiency import cost_series
from reward_lens.measure.efficiency.eta import benjamini_hochberg, windows
from reward_lens.measure.efficiency.iproj import i_projection
from reward_lens.measure.efficiency.metric import within_group_metric
from reward_lens.measure.efficiency.shapley import shapley_shares
from reward_lens.measure.ledger.paired import paired_ledger
from reward_lens.measure.ledger.price import StepSample


def _primal(z, r, codes, n_groups):
    """min_q mean_g KL(q_g || p_g) s.t. mean_g E_q[z] = mean_g zbar_g, by SLSQP over softmax logits."""
    p = np.zeros(len(r))
    for g in range(n_groups):
        s = codes == g
        p[s] = np.exp(-r[s] - np.logaddexp.reduce(-r[s]))
    target = np.mean([z[codes == g].mean(0) for g in range(n_groups)], axis=0)

    def q_of(x):
        q = np.exp(x - x.max())
        for g in range(n_groups):
            s = codes == g
            q[s] /= q[s].sum()
        return q

    def obj(x):
        q = q_of(x)
        return float(np.sum(q * np.log(q / p)) / n_groups)

    def cons(x):
        q = q_of(x)
        return (q[:, None] * z).sum(0) / n_groups - target

    res = so.minimize(obj, np.zeros(len(r)), constraints=[{"type": "eq", "fun": cons}], method="SLSQP",
                      options={"ftol": 1e-15, "maxiter": 2000})
    d_hat = float(np.mean([np.mean(-np.log((codes == g).sum()) - np.log(p[codes == g])) for g in range(n_groups)]))
    return res.fun, d_hat


@pytest.mark.parametrize("seed", range(6))
def test_i_projection_matches_an_independent_primal_solver(seed):
    rng = np.random.default_rng(seed)
    n_groups, m, k = 3 + seed % 3, 5, 1 + seed % 3
    codes = np.repeat(np.arange(n_groups), m)
    z = rng.normal(size=(n_groups * m, k)) * rng.uniform(0.1, 50, size=k)  # features in different units
    r = 0.4 * rng.normal(size=len(codes)) + 0.02 * z[:, 0] / z[:, 0].std()
    proj = i_projection(z, r, codes, n_groups)
    kl, d_hat = _primal(z, r, codes, n_groups)
    assert proj.converged.all()
    assert proj.kl_min[0] == pytest.approx(kl, rel=1e-5, abs=1e-9)
    assert proj.d_hat[0] == pytest.approx(d_hat, rel=1e-12)


def test_i_projections_solves_many_samples_in_one_batch_each_as_the_primal_solver_does(monkeypatch):
    """Five samples of one group layout, solved together (and again split over batches of two
    samples), each against the independent primal solver; the jackknife replicates too."""
    from reward_lens.measure.efficiency import iproj

    rng = np.random.default_rng(11)
    n_groups, m, k = 4, 5, 2
    codes = np.repeat(np.arange(n_groups), m)
    z = rng.normal(size=(5, n_groups * m, k)) * np.array([1.0, 30.0])
    r = 0.3 * rng.normal(size=(5, n_groups * m)) + 0.05 * z[:, :, 0]
    weights = np.vstack([np.ones((1, n_groups)), 1.0 - np.eye(n_groups)])
    together = iproj.i_projections(z, r, codes, n_groups, weights)
    monkeypatch.setattr(iproj, "BATCH_FLOATS", 2 * len(weights) * n_groups * m * k)  # two samples a batch
    split = iproj.i_projections(z, r, codes, n_groups, weights)  # three batches, on threads
    monkeypatch.setattr(iproj, "THREADS", 1)
    one = iproj.i_projections(z, r, codes, n_groups, weights)
    assert all(np.array_equal(a.kl_min, b.kl_min) and np.array_equal(a.lam, b.lam) for a, b in zip(split, one))
    for p in range(5):
        for b, w in enumerate(weights):
            keep = np.repeat(w > 0, m)  # a jackknife replicate: the sample without one group
            kl, d_hat = _primal(z[p][keep], r[p][keep], np.repeat(np.arange(int(w.sum())), m), int(w.sum()))
            assert together[p].kl_min[b] == pytest.approx(kl, rel=1e-5, abs=1e-9)
            assert together[p].d_hat[b] == pytest.approx(d_hat, rel=1e-12)
        assert split[p].kl_min == pytest.approx(together[p].kl_min, rel=1e-12)
    with pytest.raises(ValueError, match="ordered by group"):
        iproj.i_projections(z, r, codes[::-1], n_groups)


def test_newton_stops_once_its_predicted_gain_is_below_the_values_rounding(monkeypatch):
    """With the gradient tolerance made unreachable, every replicate still stops as converged
    within a few iterations, at the same value: the predicted gain fell below what a float64
    evaluation of the dual can see (before this stop, replicates whose gradient rounding
    stayed above the tolerance ran all MAX_ITER iterations of 40 halvings each)."""
    from reward_lens.measure.efficiency import iproj

    rng = np.random.default_rng(5)
    n_groups, m, k = 6, 8, 3
    codes = np.repeat(np.arange(n_groups), m)
    z = rng.normal(size=(n_groups * m, k)) * np.array([1.0, 5.0, 200.0])
    r = 0.2 * rng.normal(size=len(codes)) + 0.03 * z[:, 0]
    weights = np.vstack([np.ones((1, n_groups)), 1.0 - np.eye(n_groups)])
    reference = i_projection(z, r, codes, n_groups, weights)
    monkeypatch.setattr(iproj, "GRAD_TOL", 0.0)
    monkeypatch.setattr(iproj, "MAX_ITER", 25)
    proj = i_projection(z, r, codes, n_groups, weights)
    assert proj.converged.all()
    assert proj.kl_min == pytest.approx(reference.kl_min, rel=1e-12)
    kl, _ = _primal(z, r, codes, n_groups)
    assert proj.kl_min[0] == pytest.approx(kl, rel=1e-5, abs=1e-9)


@pytest.mark.slow
def test_eta_exact_is_in_the_unit_interval_in_ten_thousand_cases_with_heavy_tails():
    """10^4 samples (500 batches of 20, each sample a separate I-projection through its own
    group weights), log-ratios drawn light- and heavy-tailed (Cauchy, scale up to 20)."""
    rng = np.random.default_rng(7)
    cases = bad = 0
    for batch in range(500):
        per, n_groups, m, k = 20, 4, 8, 1 + batch % 5
        codes = np.repeat(np.arange(per * n_groups), m)
        z = rng.normal(size=(len(codes), k)) * (1 + 10 * rng.random(k))
        if batch % 2:
            r = rng.standard_cauchy(len(codes)) * rng.uniform(0.1, 20)
        else:
            r = rng.normal(size=len(codes)) * rng.uniform(1e-4, 5) + 0.5 * z[:, 0] / z[:, 0].std()
        weights = np.kron(np.eye(per), np.ones((1, n_groups)))  # replicate b = sample b's groups only
        proj = i_projection(z, r, codes, per * n_groups, weights)
        ok = (proj.kl_min >= 0) & (proj.kl_min <= proj.d_hat * (1 + 1e-9) + 1e-12)
        bad += int((~ok).sum())
        cases += per
    assert cases == 10_000 and bad == 0


def _within(z, r, codes, n_groups):
    zc = z.copy()
    rc = r.copy()
    for g in range(n_groups):
        s = codes == g
        zc[s] -= z[s].mean(0)
        rc[s] -= r[s].mean()
    return zc, rc


def test_to_second_order_eta_is_the_within_group_r2_and_shares_are_its_lmg_decomposition():
    rng = np.random.default_rng(3)
    n_groups, m, k = 16, 40, 3
    codes = np.repeat(np.arange(n_groups), m)
    z = rng.normal(size=(n_groups * m, k)) @ np.array([[1, 0.5, 0], [0, 1, 0.3], [0, 0, 1]]) \
        + rng.normal(size=(n_groups, k))[codes]
    base = z @ np.array([1.0, -0.5, 0.25]) + rng.normal(size=len(codes))
    zc, _ = _within(z, base, codes, n_groups)
    errs = []
    for eps in (1e-1, 1e-2, 1e-3):
        r = eps * base
        proj = i_projection(z, r, codes, n_groups)
        eta = proj.kl_min[0] / proj.d_hat[0]
        _, rc = _within(z, r, codes, n_groups)
        beta, *_ = np.linalg.lstsq(zc, rc, rcond=None)
        r2 = 1 - ((rc - zc @ beta) ** 2).sum() / (rc ** 2).sum()
        errs.append(abs(eta - r2))
    assert errs[-1] < 1e-4 and errs[0] > errs[1] > errs[2]  # the difference vanishes with the step
    # The LMG identity holds exactly at first order: dz = Cov_w(z, r), G = C_w.
    r = base
    _, rc = _within(z, r, codes, n_groups)
    c = zc.T @ zc / len(r)
    dz = zc.T @ rc / len(r)
    var_r = rc @ rc / len(r)
    shares = shapley_shares(dz, c)

    def r2_of(subset):
        if not subset:
            return 0.0
        x = zc[:, list(subset)]
        b, *_ = np.linalg.lstsq(x, rc, rcond=None)
        return 1 - ((rc - x @ b) ** 2).sum() / (rc @ rc)

    lmg = np.zeros(k)
    for i in range(k):
        others = [j for j in range(k) if j != i]
        for size in range(k):
            for s in combinations(others, size):
                w = factorial(size) * factorial(k - size - 1) / factorial(k)
                lmg[i] += w * (r2_of(s + (i,)) - r2_of(s))
    np.testing.assert_allclose(shares, 0.5 * var_r * lmg, rtol=1e-9)
    # ... and the paired ledger's dz tends to that first-order dz as the step shrinks.
    eps = 1e-4
    sample = StepSample(1, ("a", "b", "c"), z, groups=codes.astype(str), logp=eps * r, logp_prev=np.zeros(len(r)))
    lg = paired_ledger(sample)
    np.testing.assert_allclose(lg.delta_z / eps, dz, rtol=1e-3)


def test_the_null_expectation_is_k_over_d():
    """With features independent of r, the mean eta over many samples is k/(n - G)."""
    rng = np.random.default_rng(11)
    n_groups, m, k, reps = 8, 8, 3, 400
    codes = np.repeat(np.arange(n_groups), m)
    etas = []
    for _ in range(reps):
        z = rng.normal(size=(len(codes), k))
        r = 1e-3 * rng.normal(size=len(codes))
        p = i_projection(z, r, codes, n_groups)
        etas.append(p.kl_min[0] / p.d_hat[0])
    d = len(codes) - n_groups
    assert np.mean(etas) == pytest.approx(k / d, rel=0.1)


def test_benjamini_hochberg_on_a_worked_example():
    # m = 5, q = 0.05: thresholds i q / m = 0.01 0.02 0.03 0.04 0.05 against the sorted p-values
    # 0.001 0.012 0.025 0.039 0.3: the largest i with p(i) <= i q / m is 4, so four are rejected.
    p = [0.001, 0.3, 0.025, 0.039, 0.012]
    assert benjamini_hochberg(p).tolist() == [True, False, True, True, True]
    # m = 2: 0.04 > 0.025 and 0.5 > 0.05, so none (a per-test 0.05 would have rejected 0.04).
    assert benjamini_hochberg([0.5, 0.04]).tolist() == [False, False]


def _sample(step, rng, r_scale=0.1, n_groups=8, m=8, heavy=False):
    codes = np.repeat(np.arange(n_groups), m)
    z = rng.normal(size=(n_groups * m, 2))
    r = r_scale * (z[:, 0] + 0.3 * rng.normal(size=len(codes)))
    if heavy:
        r = r_scale * rng.standard_cauchy(len(codes)) * 30
    # the token KL along each sample: about r^2 / 2 to second order, never negative
    return StepSample(step, ("f1", "f2"), z, groups=np.array([f"{step}:{c}" for c in codes]), logp=r,
                      logp_prev=np.zeros(len(r)), kl_prev=0.5 * r ** 2 + 1e-4)


def test_heavy_tailed_weights_refuse_the_step_pair_with_the_numbers():
    rng = np.random.default_rng(5)
    ledgers = [paired_ledger(_sample(1, rng)), paired_ledger(_sample(2, rng, heavy=True))]
    assert ledgers[1].pareto_k > ledgers[1].pareto_k_max
    book = cost_series(ledgers, within_group_metric(ledgers))
    assert [r.step_pair for r in book.rows] == [(0, 1)]
    (ref,) = book.refusals
    assert ref.code == "PREMISE_FAILED" and ref.context["premise"] == "heavy_tails"
    assert [tuple(p) for p in ref.subject.step_pairs] == [(1, 2)]
    assert "too large for its samples" in ref.detail and "1->2 k-hat" in ref.detail and f"{ledgers[1].pareto_k:.3g}"[:3] in ref.detail


def test_windows_are_ratios_of_sums_and_gaps_start_a_new_window():
    rng = np.random.default_rng(9)
    ledgers = [paired_ledger(_sample(s, rng, r_scale=0.02, m=16)) for s in (1, 2, 3, 5, 6)]
    book1 = cost_series(ledgers, within_group_metric(ledgers))
    est = [book1._estimates[r.step_pair] for r in book1.rows]
    wins = windows(est, 2)
    assert [w.step_pair for w in wins] == [(0, 2), (2, 3), (4, 6)]
    assert wins[0].kl_min == pytest.approx(est[0].kl_min + est[1].kl_min)
    assert wins[0].d_t == pytest.approx(est[0].d_t + est[1].d_t)
    book2 = cost_series(ledgers, within_group_metric(ledgers), window=2)
    assert [r.steps for r in book2.rows] == [2, 1, 2]


def test_a_group_of_one_is_dropped_and_too_few_groups_is_named():
    rng = np.random.default_rng(2)
    s = _sample(1, rng, n_groups=3, m=4)
    groups = s.groups.copy()
    groups[0] = "alone"
    lg = paired_ledger(StepSample(1, s.names, s.z, groups=groups, logp=s.logp, logp_prev=s.logp_prev))
    assert lg.dropped_rollouts == 1
    one = StepSample(1, s.names, s.z[:4], groups=s.groups[:4], logp=s.logp[:4], logp_prev=s.logp_prev[:4])
    why = paired_ledger(one)
    assert (why.reason, why.step, why.count) == ("few_groups", 1, 1)


def test_pareto_khat_recovers_the_shape_of_a_generalised_pareto_tail():
    """Against draws of known shape (scipy's genpareto), on samples large enough that the
    estimate should sit near the truth: the tail index of the importance weights."""
    from scipy import stats

    from reward_lens.measure.ledger.paired import pareto_khat

    rng = np.random.default_rng(0)
    for xi in (0.2, 0.5, 0.9):
        est = [pareto_khat(np.log(stats.genpareto.rvs(xi, size=4000, random_state=rng))) for _ in range(10)]
        assert np.median(est) == pytest.approx(xi, abs=0.12)
    # light-tailed weights (log-normal with small spread) read well below the 0.7 threshold
    assert pareto_khat(rng.normal(scale=0.1, size=4000)) < 0.3


def _scalar_khat(log_w):
    """The one-row k-hat as it was written before the batched fit (Zhang & Stephens 2009 with
    PSIS's prior), kept here as the reference the batched fit must reproduce."""
    import math

    lw = np.asarray(log_w, dtype=np.float64)
    m = int(min(0.2 * lw.size, 3 * math.sqrt(lw.size)))
    w = np.sort(np.exp(lw - lw.max()))
    x = w[-m:] - w[-m - 1]
    if x[-1] <= 0:
        return float("-inf")
    grid = 80 + int(math.sqrt(m))
    quartile = x[int(m / 4 + 0.5) - 1]
    if quartile <= 0:
        quartile = x[x > 0].min()
    b = 1.0 / x[-1] + (1.0 - np.sqrt(grid / (np.arange(1, grid + 1) - 0.5))) / 3.0 / quartile
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.log1p(-b[:, None] * x[None, :]).mean(axis=1)
        log_lik = m * (np.log(-b / k) - k - 1.0)
    log_lik = np.where(np.isfinite(log_lik), log_lik, -np.inf)
    weights = np.exp(log_lik - log_lik.max())
    b_post = float((b * weights).sum() / weights.sum())
    return (m * float(np.log1p(-b_post * x).mean()) + 5.0) / (m + 10)


def test_pareto_khats_fits_each_row_as_if_alone():
    """Rows of very different scales, a row with ties at the bottom of its tail and a row with
    no tail at all, fitted together: each row's k-hat is the one it gets alone (nothing leaks
    across rows: each row's own maximum, quartile and posterior)."""
    from reward_lens.measure.ledger.paired import pareto_khat, pareto_khats

    rng = np.random.default_rng(4)
    rows = [rng.normal(scale=s, size=64) for s in (0.01, 0.5, 3.0)]
    rows.append(np.concatenate([np.zeros(60), [0.1, 0.2, 0.3, 2.0]]))  # ties below the tail's top
    rows.append(np.full(64, -1.5))  # every weight equal: no exceedance, k-hat -inf
    got = pareto_khats(np.stack(rows))
    alone = [pareto_khat(r) for r in rows]
    assert got.tolist() == alone
    np.testing.assert_allclose(got, [_scalar_khat(r) for r in rows], rtol=1e-12, atol=0)
    assert got[-1] == -np.inf and np.isfinite(got[:-1]).all()
    assert np.isnan(pareto_khats(rng.normal(size=(3, 20)))).all()  # tail of fewer than 5 points


def test_pareto_khats_in_blocks_on_threads_are_the_whole_batch_bit_for_bit(monkeypatch):
    from reward_lens.measure.ledger import paired

    lw = np.random.default_rng(8).normal(size=(50, 64)) * np.linspace(0.01, 3.0, 50)[:, None]
    whole = paired.pareto_khats(lw)
    monkeypatch.setattr(paired, "KHAT_BLOCK_FLOATS", 3 * 88 * 12)  # blocks of 3 rows
    monkeypatch.setattr(paired, "KHAT_THREADS", 3)
    assert np.array_equal(paired.pareto_khats(lw), whole)


def test_adaptive_windows_merge_until_the_combined_p_value_resolves():
    from reward_lens.measure.efficiency.eta import FDR_Q, fisher_combined

    rng = np.random.default_rng(12)
    ledgers = [paired_ledger(_sample(s, rng, r_scale=0.02, m=16)) for s in range(1, 9)]
    book = cost_series(ledgers, within_group_metric(ledgers))
    est = [book._estimates[r.step_pair] for r in book.rows]
    wins = windows(est, "adaptive")
    assert [w.step_pair[0] for w in wins][0] == 0 and wins[-1].step_pair[1] == 8  # the run, covered once
    assert sum(w.steps for w in wins) == 8
    for w in wins[:-1]:  # every closed window is the first prefix whose combined p is below q
        members = [e for e in est if w.step_pair[0] <= e.step_pair[0] and e.step_pair[1] <= w.step_pair[1]]
        assert fisher_combined([e.p_value for e in members]) <= FDR_Q
        assert all(fisher_combined([e.p_value for e in members[:i]]) > FDR_Q for i in range(1, len(members)))


def test_batched_within_group_f_test_matches_the_dummy_variable_regression():
    """R^2 within groups is 1 - RSS(r ~ groups + z) / RSS(r ~ groups) (Frisch-Waugh-Lovell): the
    full regression with one indicator per group, by lstsq, is the independent reference. Samples
    with a duplicated feature (rank-deficient z) and a constant-within-group r ride in the batch."""
    from scipy import stats

    from reward_lens.measure.efficiency.eta import within_group_r2_test, within_group_r2_tests

    rng = np.random.default_rng(11)
    codes = np.repeat(np.arange(6), [3, 5, 4, 6, 2, 4])
    n, k, g = len(codes), 3, 6
    z = rng.normal(size=(4, n, k))
    r = 0.4 * z[:, :, 0] + rng.normal(size=(4, n))
    z[2, :, 2] = z[2, :, 1]  # rank-deficient: two identical features
    r[3] = codes * 0.7  # r constant within groups: nothing to explain
    onehot = np.eye(g)[codes]
    r2, p, d = within_group_r2_tests(z, r, codes, g)
    assert d == n - g
    for i in range(3):
        rss_g = np.sum((r[i] - onehot @ np.linalg.lstsq(onehot, r[i], rcond=None)[0]) ** 2)
        full = np.hstack([onehot, z[i]])
        rss_f = np.sum((r[i] - full @ np.linalg.lstsq(full, r[i], rcond=None)[0]) ** 2)
        want = 1 - rss_f / rss_g
        assert r2[i] == pytest.approx(want, rel=1e-10)
        f = (want / k) / ((1 - want) / (d - k))
        assert p[i] == pytest.approx(stats.f.sf(f, k, d - k), rel=1e-9)
        assert (r2[i], p[i]) == pytest.approx(within_group_r2_test(z[i], r[i], codes, g)[:2], rel=1e-12)
    assert r2[3] == 0.0 and p[3] == 1.0


def _jackknife_cov(full, deleted):
    """The delete-one jackknife of one stratum, in loops: (n - 1) / n sum_i (theta_(-i) - mean
    theta_(-.))(...)^T over its rows' deletions (``full`` is unused: the spread is about their mean)."""
    deleted = [np.atleast_1d(np.asarray(x, dtype=float)) for x in deleted]
    n = len(deleted)
    out = np.zeros((len(deleted[0]), len(deleted[0])))
    if n < 2:
        return out
    mean = sum(deleted) / n
    for x in deleted:
        out += np.outer(x - mean, x - mean)
    return out * (n - 1) / n


def _ledger_by_loops(s):
    """One paired ledger by its definitions, group by group in plain loops: groups of one
    dropped, p_g(i) prop. to pi_t/pi_{t+1}, dz_g = E_u[z] - E_p[z], D_hat = mean_g (mean r + log
    mean exp(-r)), D_rb from the token-level KL by group; Sigma and D_rb's SE conditional on the
    prompts: each group's estimate worked out again with each of its rows left out, the
    jackknife's spread of those, summed over groups, over G^2."""
    labels = list(dict.fromkeys(s.groups.tolist()))
    kept = [g for g in labels if (s.groups == g).sum() >= 2]
    dz_g, d_g, kl_g, cov, kl_var = [], [], [], 0.0, 0.0

    def dz_of(z, r):
        w = np.exp(-r) / np.exp(-r).sum()
        return z.mean(0) - (w[:, None] * z).sum(0)

    for g in kept:
        rows = s.groups == g
        r = s.logp[rows] - s.logp_prev[rows]
        z = s.z[rows]
        dz_g.append(dz_of(z, r))
        d_g.append(r.mean() + np.log(np.exp(-r).mean()))
        ng = int(rows.sum())
        rest = [np.arange(ng) != i for i in range(ng)]  # one side: leaving a row out is deleting it
        cov = cov + _jackknife_cov(dz_g[-1], [dz_of(z[k], r[k]) for k in rest])
        if s.kl_prev is not None:
            kl = s.kl_prev[rows]
            kl_g.append(kl.mean())
            kl_var += float(_jackknife_cov(kl.mean(), [kl[k].mean() for k in rest])[0, 0])
    dz_g = np.array(dz_g)
    G = len(kept)
    d_rb = (np.mean(kl_g), np.sqrt(kl_var) / G) if kl_g else (None, None)
    return dz_g.mean(0), cov / G ** 2, float(np.mean(d_g)), d_rb


def test_a_series_of_many_group_layouts_prices_each_step_as_its_definition_does():
    """Steps of several group layouts (groups of one dropped, groups interleaved, the token-level
    KL recorded on some) one after another, plus a step that cannot be formed: priced in batches by layout,
    each ledger equals the group-by-group definition and keeps its step's place."""
    from reward_lens.measure.ledger.paired import pareto_khat, paired_ledger_series

    rng = np.random.default_rng(23)
    samples = [_sample(0, rng)]
    for step in range(1, 13):
        s = _sample(step, rng, n_groups=3 + step % 3, m=8 + step % 2)
        kl = np.abs(rng.normal(size=s.n)) if step % 4 == 0 else None
        groups = s.groups.copy()
        if step % 5 == 0:
            groups[0] = "alone"
        if step == 8:  # step 2's group sizes, its rows' groups interleaved: another layout
            groups = rng.permutation(groups)
        samples.append(StepSample(step, s.names, s.z, groups=groups, logp=s.logp, logp_prev=s.logp_prev,
                                  kl_prev=kl))
    samples[7] = StepSample(7, samples[7].names, samples[7].z, groups=samples[7].groups, logp=samples[7].logp)  # unscored
    ledgers, why = paired_ledger_series(samples)
    assert [lg.step_pair for lg in ledgers] == [(t - 1, t) for t in range(1, 13) if t != 7]
    assert list(why) == [(6, 7)] and why[(6, 7)].reason == "no_logp_prev"
    for lg in ledgers:
        s = samples[lg.step_pair[1]]
        dz, cov, d_hat, (d_rb, d_rb_se) = _ledger_by_loops(s)
        np.testing.assert_allclose(lg.delta_z, dz, rtol=1e-10, atol=1e-15)
        np.testing.assert_allclose(lg.cov_delta, cov, rtol=1e-9, atol=1e-18)
        np.testing.assert_allclose(lg.se, np.sqrt(np.diag(cov)), rtol=1e-9)
        assert lg.d_hat == pytest.approx(d_hat, rel=1e-10)
        assert lg.dropped_rollouts == (1 if lg.step_pair[1] % 5 == 0 else 0)
        assert (lg.d_t is None) == (d_rb is None)
        if d_rb is not None:
            assert (lg.d_t, lg.d_t_se) == pytest.approx((d_rb, d_rb_se), rel=1e-12)
        # the weights towards pi_t are 1 / (m e^r): the same tail shape as e^{-r}
        assert lg.pareto_k == pytest.approx(pareto_khat(-lg.log_ratio), rel=1e-12, nan_ok=True)


def test_the_within_group_metric_of_many_layouts_is_each_samples_within_group_covariance():
    """Ledgers in groups of equal blocks (TRL's layout), interleaved, and of unequal sizes, in one
    series: each step's G is sum_g sum_i (z_i - zbar_g)(z_i - zbar_g)^T / (n - G) of its own
    sample, worked out here group by group."""
    rng = np.random.default_rng(17)
    ledgers = []
    for step in range(1, 10):
        s = _sample(step, rng, n_groups=4, m=6)
        groups = s.groups
        if step % 3 == 1:
            groups = rng.permutation(groups)  # interleaved
        elif step % 3 == 2:
            groups = groups.copy()
            groups[:3] = groups[6]  # unequal sizes
        ledgers.append(paired_ledger(StepSample(step, s.names, s.z, groups=groups, logp=s.logp, logp_prev=s.logp_prev)))
    g = within_group_metric(ledgers)
    for lg in ledgers:
        zc = np.vstack([lg.z[lg.codes == c] - lg.z[lg.codes == c].mean(axis=0) for c in range(lg.n_groups)])
        want = zc.T @ zc / (len(lg.z) - lg.n_groups)
        np.testing.assert_allclose(g.for_step(lg.step_pair[0]).matrix, want, rtol=1e-12, atol=1e-15)


def _two_sided_by_loops(s, ho):
    """The two-sided ledger by its definition, group by group in plain loops, from the
    probabilities themselves (not the log-ratio): every row of a group is a draw from the
    mixture n_a pi_t + n_b pi_{t+1}; q(y) prop. to pi_{t+1}(y) / mixture, p(y) prop. to pi_t(y) /
    mixture, each normalised within the group; dz_g = E_q[z] - E_p[z], D_g = E_q[kl]. Sigma and
    D's SE conditional on the prompts: each row deleted from its side of its group (the side's
    other rows weighing n_s / (n_s - 1), the mixture the design's), the group's estimates worked
    out again, the jackknife's spread within each side of each group, summed, over G^2."""
    dz_g, d_g, cov, dvar = [], [], 0.0, 0.0
    for g in sorted(set(s.groups.tolist())):
        a, b = ho.groups == g, s.groups == g
        lp1 = np.r_[s.logp[b], ho.logp[a]]  # log pi_{t+1}
        lp0 = np.r_[s.logp_prev[b], ho.logp_prev[a]]  # log pi_t
        z = np.vstack([s.z[b], ho.z[a]])
        kl = np.r_[s.kl_prev[b], ho.kl_prev[a]]
        held = np.r_[np.zeros(b.sum(), bool), np.ones(a.sum(), bool)]
        mix = a.sum() * np.exp(lp0) + b.sum() * np.exp(lp1)

        def estimates(c):
            q, p = c * np.exp(lp1) / mix, c * np.exp(lp0) / mix
            q, p = q / q.sum(), p / p.sum()
            return (q[:, None] * z).sum(0) - (p[:, None] * z).sum(0), (q * kl).sum()

        dz, d = estimates(np.ones(len(z)))
        dz_g.append(dz)
        d_g.append(d)
        for side in (held, ~held):
            dels = []
            for i in np.flatnonzero(side):
                c = np.ones(len(z))
                c[side] = side.sum() / (side.sum() - 1)
                c[i] = 0.0
                dels.append(estimates(c))
            cov = cov + _jackknife_cov(dz, [x[0] for x in dels])
            dvar += float(_jackknife_cov(d, [x[1] for x in dels])[0, 0])
    dz_g = np.array(dz_g)
    G = len(dz_g)
    return dz_g.mean(0), cov / G ** 2, float(np.mean(d_g)), float(np.sqrt(dvar) / G)


def test_held_out_samples_of_pi_t_combine_by_the_balance_heuristic():
    """Rollouts of pi_{t+1} and held-out completions of pi_t of the same prompts, scored under
    both: the ledger equals the balance-heuristic definition worked out group by group, each
    weight is at most 1/n of its side, and the held-out rows are the ones the ledger marks."""
    from reward_lens.measure.ledger.paired import mis_log_weights

    rng = np.random.default_rng(41)
    n_groups, m, h = 5, 8, 3
    s = _sample(4, rng, r_scale=0.5, n_groups=n_groups, m=m)
    s = StepSample(4, s.names, s.z, groups=np.repeat(np.arange(n_groups), m), logp=s.logp - 3.0,
                   logp_prev=s.logp_prev - 3.0 + 0.2 * rng.normal(size=s.n), kl_prev=s.kl_prev, n_groups=n_groups)
    zh = rng.normal(size=(n_groups * h, 2)) + 0.5
    lp0 = -3.0 + 0.3 * rng.normal(size=len(zh))
    ho = StepSample(4, s.names, zh, groups=np.repeat(np.arange(n_groups), h), logp=lp0 + 0.4 * zh[:, 0],
                    logp_prev=lp0, kl_prev=np.abs(rng.normal(size=len(zh))) * 0.1, n_groups=n_groups)
    lg = paired_ledger(s, heldout=ho)
    assert lg.n_heldout == n_groups * h and lg.sides == "two-sided"
    dz, cov, d_t, d_t_se = _two_sided_by_loops(s, ho)
    np.testing.assert_allclose(lg.delta_z, dz, rtol=1e-10)
    np.testing.assert_allclose(lg.cov_delta, cov, rtol=1e-9)
    assert lg.d_t == pytest.approx(d_t, rel=1e-12) and lg.d_t_se == pytest.approx(d_t_se, rel=1e-9)
    _, _, lwq, lwp = mis_log_weights(lg.log_ratio, lg.heldout, lg.codes, lg.n_groups)
    assert (np.exp(lwq) <= 1 / m + 1e-12).all() and (np.exp(lwp) <= 1 / h + 1e-12).all()
    assert np.isnan(lg.pareto_k) and lg.premise() is None  # bounded weights: k-hat does not apply
    # a held-out sample of another step's policy is not combined
    bad = StepSample(4, s.names, zh, groups=ho.groups, logp=ho.logp, logp_prev=ho.logp_prev, kl_prev=ho.kl_prev,
                     logp_prev_step=np.full(len(zh), 1.0), n_groups=n_groups)
    assert paired_ledger(s, heldout=bad).reason == "heldout_unscored"


def test_two_sided_ledger_without_held_out_rows_is_the_one_sided_one():
    """n_a = 0: the balance heuristic is uniform on pi_{t+1}'s rollouts and prop. to
    pi_t / pi_{t+1} towards pi_t, so the two-sided code path gives the one-sided ledger."""
    rng = np.random.default_rng(43)
    s = _sample(3, rng, r_scale=0.3)
    empty = StepSample(3, s.names, np.zeros((0, 2)), groups=np.zeros(0, dtype=np.int64), logp=np.zeros(0),
                       logp_prev=np.zeros(0), kl_prev=np.zeros(0), n_groups=0)
    one, two = paired_ledger(s), paired_ledger(s, heldout=empty)
    np.testing.assert_array_equal(one.delta_z, two.delta_z)
    assert one.d_t == two.d_t and two.heldout is None


def test_a_feature_constant_in_every_group_is_not_identified_not_a_t_of_rounding():
    """A behaviour equal on every row of each prompt group (a length at the cap, a collapsed
    policy's one completion) moved by exactly 0 in each group, whatever the weights: its dz
    and SE are 0 -- not 1e-17 over 4e-17, which reads as t = 0.25 and enters BH as a cell."""
    from reward_lens.measure.decisions import decide_from

    rng = np.random.default_rng(21)
    s = _sample(1, rng)
    codes = np.repeat(np.arange(8), 8)
    per_group = 1.0 / 3.0 + 0.1 * codes  # differs between groups, not within: sums that round
    s = StepSample(1, ("f1", "f2", "f3"), np.column_stack([s.z, per_group]), groups=codes, logp=s.logp,
                   logp_prev=s.logp_prev, kl_prev=s.kl_prev, n_groups=8)
    ho_codes = np.repeat(np.arange(8), 4)
    held = StepSample(1, ("f1", "f2", "f3"), np.column_stack([rng.normal(size=(32, 2)), 1.0 / 3.0 + 0.1 * ho_codes]),
                      groups=ho_codes, logp=0.1 * rng.normal(size=32), logp_prev=np.zeros(32),
                      kl_prev=np.full(32, 1e-3), n_groups=8)
    for lg in (paired_ledger(s), paired_ledger(s, heldout=held)):
        assert lg.delta_z[2] == 0.0 and lg.se[2] == 0.0 and not lg.cov_delta[2].any()
        assert lg.se[:2].min() > 0
        d = decide_from([lg], ("f1", "f2", "f3"), ledger="paired")
        assert d.identified[0].tolist() == [True, True, False]


def test_a_jackknife_bias_of_zero_to_rounding_is_zero():
    """Eight prompt groups of the same rows: deleting any one leaves KL_min where it was, so the
    jackknife's correction is 0 and the row's null is 0 -- not -1e-14 nats shown as a number."""
    from reward_lens.measure.efficiency.eta import paired_estimate

    rng = np.random.default_rng(3)
    base_z, base_r = rng.normal(size=(8, 2)), 0.2 * rng.normal(size=8)
    order = np.concatenate([rng.permutation(8) for _ in range(8)])  # each group the same rows, reordered:
    z = base_z[order]  # sums in another order, so the delete-one values differ in their last places
    r = base_r[order] + 0.3 * z[:, 0]
    codes = np.repeat(np.arange(8), 8)
    s = StepSample(1, ("f1", "f2"), z, groups=np.array([f"1:{c}" for c in codes]), logp=r, logp_prev=np.zeros(64),
                   kl_prev=0.5 * r ** 2 + 1e-4)
    est = paired_estimate(paired_ledger(s), np.array([0, 1]))
    assert est.kl_min > 1e-3
    assert est.null_kl == 0.0 and est.kl_min_debiased == est.kl_min


def test_ledgers_of_a_reports_read_equal_those_of_the_same_samples_alone():
    """The report's one read hands the paired ledger views of one stack (``whole`` batches: no
    copy, groups summed by reshape); the same samples rebuilt from copies, with their groups
    shuffled into an interleaved layout (the onehot path), give the same ledgers to rounding,
    and ``_scored_flags`` (one pass over the stack) says what ``has_paired_sample`` says of each."""
    from pathlib import Path

    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.paired import _scored_flags, has_paired_sample, paired_ledger_series
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).parents[1] / "fixtures" / "grpo_run" / "paired")
    samples = steps_from_run(run, SurfaceFeatures())
    later = [s for s in samples if s.step]
    assert _scored_flags(later) == [has_paired_sample(s) for s in later] and all(_scored_flags(later))
    ledgers, _ = paired_ledger_series(samples)
    assert len(ledgers) == len(later)
    stack = samples[0].stack.arrays["z"]
    assert all(np.shares_memory(lg.z, stack) for lg in ledgers)  # the read's own rows, not copies
    rng = np.random.default_rng(3)
    for lg, s in zip(ledgers, later):
        order = rng.permutation(s.n)
        alone = StepSample(s.step, s.names, s.z[order].copy(), groups=np.asarray(s.groups)[order].copy(),
                           logp=s.logp[order].copy(), logp_prev=s.logp_prev[order].copy())
        want = paired_ledger(alone)
        np.testing.assert_allclose(lg.delta_z, want.delta_z, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(lg.cov_delta, want.cov_delta, rtol=1e-9, atol=1e-18)
        assert lg.d_hat == pytest.approx(want.d_hat, rel=1e-9, abs=1e-15)
        assert lg.ess == pytest.approx(want.ess, rel=1e-12)
        assert lg.pareto_k == pytest.approx(want.pareto_k, rel=1e-9, nan_ok=True)


def test_scored_flags_find_the_one_step_with_a_missing_log_probability():
    """A step of the read whose log pi_t is NaN on one row is not scored; its neighbours are."""
    from reward_lens.measure.ledger.paired import _scored_flags, has_paired_sample
    from reward_lens.measure.ledger.price import _samples

    steps = np.repeat([1, 2, 3], 4)
    logp = -np.arange(12.0)
    logp[6] = np.nan
    cols = {"group_id": np.tile([0, 0, 1, 1], 3), "logp_pre": logp, "logp_prev": logp - 0.1}
    samples = _samples(steps, np.ones((12, 1)), cols, {"logp_pre"}, ("f",), coded=True)
    assert _scored_flags(samples) == [True, False, True] == [has_paired_sample(s) for s in samples]


def test_ledger_arrays_of_a_blocks_rows_are_its_slices_and_of_anything_else_a_stack():
    """Paired ledgers of one layout are made as rows of one block: ``ledger_arrays`` of a run
    of them in order is a read-only slice of the block, equal to stacking their attributes; of
    ledgers out of order, with a gap, or of two layouts, the stack itself."""
    from reward_lens.measure.ledger.paired import paired_ledger_series
    from reward_lens.measure.ledger.price import ledger_arrays

    rng = np.random.default_rng(29)
    samples = [_sample(step, rng, n_groups=4, m=6 if step < 9 else 5) for step in range(13)]  # two layouts
    ledgers, _ = paired_ledger_series(samples, {t: 0.1 * t for t in range(13)})
    assert len({id(lg.block) for lg in ledgers}) == 2
    for part, sliced in ((ledgers[:8], True), (ledgers[2:6], True), (ledgers[8:], True), (ledgers, False),
                         (ledgers[5:1:-1], False), (ledgers[0:6:2], False)):
        a = ledger_arrays(part)
        assert np.shares_memory(a.delta_z, part[0].block.arrays.delta_z) == sliced
        if sliced:
            assert not a.delta_z.flags.writeable and not a.cov_delta.flags.writeable
        np.testing.assert_array_equal(a.delta_z, np.stack([lg.delta_z for lg in part]))
        np.testing.assert_array_equal(a.se, np.stack([lg.se for lg in part]))
        np.testing.assert_array_equal(a.cov_delta, np.stack([lg.cov_delta for lg in part]))
        assert a.step_pairs.tolist() == [list(lg.step_pair) for lg in part]
        assert a.learning_rate == [lg.learning_rate for lg in part] and a.kind == "paired"
        assert a.n_pre.tolist() == [lg.n_pre for lg in part] and not a.matched.any() and not a.units.any()


def _two_sided(rng, steps: int) -> tuple[list[StepSample], dict[int, StepSample]]:
    """Steps of 4 prompt groups x 6 rollouts, each with 2 held-out completions of pi_t per group
    (their groups coded as the step's)."""
    samples, held = [], {}
    for step in range(steps):
        s = _sample(step, rng, r_scale=0.3, n_groups=4, m=6)
        s = StepSample(step, s.names, s.z, groups=np.repeat(np.arange(4), 6), logp=s.logp, logp_prev=s.logp_prev,
                       kl_prev=s.kl_prev, n_groups=4)
        samples.append(s)
        zh = rng.normal(size=(8, 2))
        lp0 = 0.2 * rng.normal(size=8)
        held[step] = StepSample(step, s.names, zh, groups=np.repeat(np.arange(4), 2), logp=lp0 + 0.3 * zh[:, 0],
                                logp_prev=lp0, kl_prev=np.abs(rng.normal(size=8)) * 0.1, n_groups=4)
    return samples, held


def test_a_two_sided_series_prices_each_step_as_its_ledger_alone():
    """Steps with held-out completions of pi_t (the rows of a batch not all the read's own):
    priced as a series, in blocks, each ledger equals the two-sided ledger of its step alone,
    D_t included."""
    from reward_lens.measure.ledger.paired import paired_ledger_series

    rng = np.random.default_rng(31)
    samples, held = _two_sided(rng, 6)
    ledgers, why = paired_ledger_series(samples, heldout=held)
    assert not why and [lg.step_pair for lg in ledgers] == [(t - 1, t) for t in range(1, 6)]
    for lg in ledgers:
        want = paired_ledger(samples[lg.step_pair[1]], heldout=held[lg.step_pair[1]])
        assert lg.sides == "two-sided" and lg.block is not None
        np.testing.assert_allclose(lg.delta_z, want.delta_z, rtol=1e-10, atol=1e-15)
        np.testing.assert_allclose(lg.cov_delta, want.cov_delta, rtol=1e-9, atol=1e-18)
        assert (lg.d_t, lg.d_t_se) == pytest.approx((want.d_t, want.d_t_se), rel=1e-12)


def test_previous_steps_of_a_read_say_what_previous_step_says_of_each():
    """``_previous_steps`` (the least and greatest finite logp_prev_step of each step of one read)
    gives what ``previous_step`` (the unique finite value) gives: one value below the step, a
    NaN or infinite row ignored; two values, the step itself, or a negative step not formed. A
    step whose column is null throughout (absent) takes the way one sample at a time."""
    from reward_lens.measure.ledger.paired import NotFormed, _previous_steps, previous_step
    from reward_lens.measure.ledger.price import _samples

    steps = np.repeat([1, 2, 3, 4, 5, 6], 3)
    prev = np.array([0, 0, np.nan, 0, 1, 1, 3, 3, 3, -1, -1, -1, 4, np.inf, 4, 2, 5, 5])
    samples = _samples(steps, np.ones((18, 1)), {"logp_prev_step": prev}, {"logp_prev_step"}, ("f",))
    got = _previous_steps(samples)
    assert got == [previous_step(s) for s in samples]
    assert got == [0, NotFormed("prev_step", 2), NotFormed("prev_step", 3), NotFormed("prev_step", 4), 4,
                   NotFormed("prev_step", 6)]
    absent = prev.copy()
    absent[3:6] = np.nan  # step 2 has none: the stack has no array of its own for it
    samples = _samples(steps, np.ones((18, 1)), {"logp_prev_step": absent}, {"logp_prev_step"}, ("f",))
    assert samples[1].logp_prev_step is None
    assert _previous_steps(samples) == [previous_step(s) for s in samples] == [0, 1, *got[2:]]


def test_estimates_of_a_two_sided_series_equal_each_ledgers_own():
    """``paired_estimates`` and ``rollout_tests`` take the ledgers of one batch together (one
    gather, the jackknife as array arithmetic); each number is the one its ledger gets alone, to
    the rounding of a matrix product over a different number of rows."""
    from reward_lens.measure.efficiency.eta import paired_estimates, rollout_tests
    from reward_lens.measure.ledger.paired import paired_ledger_series

    rng = np.random.default_rng(37)
    samples, held = _two_sided(rng, 9)
    ledgers, _ = paired_ledger_series(samples, heldout=held)
    for idx in (np.arange(2), np.array([1])):
        items = [(lg, idx) for lg in ledgers]
        together = paired_estimates(items)
        assert rollout_tests(items) == [rollout_tests([it])[0] for it in items]
        for it, est in zip(items, together):
            alone = paired_estimates([it])[0]
            assert (est.kl_min, est.kl_min_debiased, est.d_t, est.p_value) == pytest.approx(
                (alone.kl_min, alone.kl_min_debiased, alone.d_t, alone.p_value), rel=1e-12, abs=1e-15)
            assert est.converged == alone.converged and est.step_pair == alone.step_pair
            np.testing.assert_allclose(est.cov, alone.cov, rtol=1e-10, atol=1e-18)


def test_projections_over_equal_groups_broadcast_to_the_numbers_a_gather_gives(monkeypatch):
    """Where every group is m rows in a row (rollouts and held-out rows sorted by group), the
    Newton's per-group means are taken to the rows by broadcasting; forced to gather by codes
    instead, every dual value, tilt and convergence flag is the same to the last bit."""
    import reward_lens.measure.efficiency.iproj as iproj

    rng = np.random.default_rng(41)
    n_groups, m, k = 5, 6, 3
    z = rng.normal(size=(4, n_groups * m, k))
    r = 0.3 * z[:, :, 0] + 0.1 * rng.normal(size=(4, n_groups * m))
    codes = np.repeat(np.arange(n_groups), m)
    side = np.tile([False] * 4 + [True] * 2, n_groups)
    weights = np.vstack([np.ones((1, n_groups)), 1.0 - np.eye(n_groups)])
    fast = iproj.i_projections(z, r, codes, n_groups, weights, side)
    monkeypatch.setattr(iproj, "blocks", lambda codes, n_groups: 0)
    slow = iproj.i_projections(z, r, codes, n_groups, weights, side)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a.kl_min, b.kl_min)
        np.testing.assert_array_equal(a.lam, b.lam)
        np.testing.assert_array_equal(a.converged, b.converged)
    assert all(a.kl_min[0] > 0 for a in fast)  # a tilt that moved something


def test_a_layout_worked_out_once_is_what_each_step_gets_alone():
    """``paired_ledger_series`` works out each distinct group layout once (``layouts``) and
    hands every step of it the same read-only arrays: for a step with every group kept, one
    with a group of one rollout dropped, one with held-out rows (one of them in that dropped
    group), and one with too few groups, ``_prepare`` says what it says without the memo."""
    from reward_lens.measure.ledger.paired import NotFormed, _prepare

    def sample(step, groups, heldout_groups=None):
        n = len(groups)
        s = StepSample(step, ("f",), np.arange(n, dtype=float)[:, None], groups=np.array(groups), logp=np.zeros(n),
                       logp_prev=np.zeros(n), n_groups=max(groups) + 1)
        if heldout_groups is None:
            return s, None
        k = len(heldout_groups)
        return s, StepSample(step, ("f",), np.ones((k, 1)), groups=np.array(heldout_groups), logp=np.zeros(k),
                             logp_prev=np.zeros(k), n_groups=max(heldout_groups) + 1)

    cases = [sample(1, [0, 0, 1, 1, 2, 2]), sample(2, [0, 0, 1, 1, 2, 2]), sample(3, [0, 0, 1, 2, 2]),
             sample(4, [0, 0, 1, 2, 2], [0, 1, 2, 2]), sample(5, [0, 0, 1, 1, 2, 2], [0, 0, 1, 2]),
             sample(6, [0, 1, 2, 2])]
    layouts: dict = {}
    for s, ho in cases + cases:  # each layout twice: the second time from the memo
        got, want = _prepare(s, ho, layouts=layouts), _prepare(s, ho)
        if isinstance(want, NotFormed):
            assert got == want == NotFormed("few_groups", s.step, 1)
            continue
        for f in ("prev", "n_groups", "dropped", "every_heldout"):
            assert getattr(got, f) == getattr(want, f)
        for f in ("keep", "keep_heldout", "codes", "side"):
            a, b = getattr(got, f), getattr(want, f)
            assert (a is None and b is None) or (np.array_equal(a, b) and not a.flags.writeable)
    assert len(layouts) == 5  # steps 1 and 2 share one
