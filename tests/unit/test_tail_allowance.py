"""D_t's tail allowance (``ledger.paired.tail_allowance``): what the upper end of D_t's interval
adds for the completions a sharpened policy's sample did not hold. Checked against worked cases
and against a plain loop over the groups written here, not against the implementation."""
from __future__ import annotations

import math

import numpy as np
import pytest

from reward_lens.measure.efficiency.cost import _window_spread, _window_spreads
from reward_lens.measure.ledger.moderated import t975
from reward_lens.measure.ledger.paired import SAME_COMPLETION_NATS, SHARP_SEEN, paired_ledger, tail_allowance
from reward_lens.measure.ledger.price import StepSample

LN = math.log


def _loop(logp, logp_prev, kl, codes):
    """The allowance of one sample by a loop: per group, its rows in order of log pi_{t+1}, a row
    a new completion unless both its log-probabilities are within the tolerance of the row before
    it; the pi_{t+1} mass of the new ones; and (1 - mass) * the largest token KL where the mass
    is at least SHARP_SEEN."""
    out = []
    for g in sorted(set(codes.tolist())):
        rows = sorted(np.flatnonzero(codes == g).tolist(), key=lambda i: logp[i])
        s = 0.0
        for j, i in enumerate(rows):
            if j == 0 or abs(logp[i] - logp[rows[j - 1]]) > SAME_COMPLETION_NATS or abs(
                    logp_prev[i] - logp_prev[rows[j - 1]]) > SAME_COMPLETION_NATS:
                s += math.exp(min(logp[i], 0.0))
        s = min(1.0, s)
        out.append((1.0 - s) * max(kl[rows]) if s >= SHARP_SEEN else 0.0)
    return sum(out) / len(out)


def test_a_sharpened_group_is_allowed_the_mass_it_did_not_hold_at_its_largest_token_kl():
    # group 0: two completions, pi_{t+1} 0.5 and 0.3, each drawn twice (the second copy scored in
    # another batch, 5e-5 nats apart): it holds 0.8 of the mass, so 0.2 of it is allowed the
    # largest token KL seen there, 3 nats. Group 1: four distinct completions holding 0.18 of the
    # mass -- a policy that still spreads, sampled as the SE assumes: allowed nothing.
    logp = np.array([LN(0.5), LN(0.5) + 5e-5, LN(0.3), LN(0.3), LN(0.1), LN(0.05), LN(0.02), LN(0.01)])
    logp_prev = np.array([LN(0.4), LN(0.4), LN(0.2), LN(0.2) - 5e-5, LN(0.1), LN(0.1), LN(0.1), LN(0.1)])
    kl = np.array([1.0, 1.0, 3.0, 3.0, 9.0, 0.5, 0.5, 0.5])
    codes = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    got = tail_allowance(logp[None], logp_prev[None], kl[None], codes, 2)
    assert got.shape == (1,)
    assert got[0] == pytest.approx((0.2 * 3.0 + 0.0) / 2, rel=1e-12)
    # counted twice, the repeated completions would hold all the mass and be allowed nothing
    apart = logp.copy()
    apart[1] += 2 * SAME_COMPLETION_NATS
    assert tail_allowance(apart[None], logp_prev[None], kl[None], codes, 2)[0] == 0.0


def test_a_group_holding_every_completion_is_allowed_nothing():
    logp = np.array([LN(0.6), LN(0.4), LN(0.6), LN(0.4)])
    got = tail_allowance(logp[None], (logp - 1.0)[None], np.array([[2.0, 5.0, 2.0, 5.0]]), np.array([0, 0, 0, 0]), 1)
    assert got[0] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_it_is_the_loop_over_groups_on_any_layout(seed):
    """Groups of unequal sizes whose rows interleave (rollouts, then held-out rows, as a
    two-sided sample lies), repeated completions among them, several samples stacked."""
    rng = np.random.default_rng(seed)
    g = int(rng.integers(1, 6))
    codes = np.r_[np.repeat(np.arange(g), rng.integers(1, 6, size=g)), np.repeat(np.arange(g), 2)]
    n, p = len(codes), 3
    # completions of each group drawn from a few with known probabilities, so that repeats occur
    logp, logp_prev, kl = np.empty((p, n)), np.empty((p, n)), np.empty((p, n))
    for k in range(p):
        for grp in range(g):
            probs = rng.dirichlet(np.full(4, 0.3 if rng.random() < 0.6 else 3.0))
            rows = np.flatnonzero(codes == grp)
            pick = rng.choice(4, size=len(rows), p=probs)
            # scoring noise up to three times the tolerance: repeats chain, and some split
            logp[k, rows] = np.log(np.maximum(probs[pick], 1e-12)) + rng.uniform(-3e-4, 3e-4, len(rows))
            logp_prev[k, rows] = np.log(np.maximum(probs[pick], 1e-12)) - 0.3 * pick
            kl[k, rows] = 0.1 + pick * rng.uniform(0.5, 2.0)
    got = tail_allowance(logp, logp_prev, kl, codes, g)
    want = [_loop(logp[k], logp_prev[k], kl[k], codes) for k in range(p)]
    assert np.allclose(got, want, rtol=1e-12, atol=1e-15)


def test_the_interval_of_d_t_raises_its_upper_end_by_the_allowance_only():
    se, (lo, hi), tail = _window_spread(0.1, [(0.02, 6.0)], [0.05])
    half = t975(6.0) * 0.02
    assert se == pytest.approx(0.02) and tail == 0.05
    assert lo == pytest.approx(0.1 - half) and hi == pytest.approx(0.1 + half + 0.05)
    # a window's members: SEs add in quadrature, allowances add (a window's D_t is their sum)
    se, (lo, hi), tail = _window_spread(0.3, [(0.03, 5.0), (0.04, 8.0)], [0.01, None])
    assert tail == 0.01
    assert hi == pytest.approx(0.3 + t975(5.0) * 0.05 + 0.01)
    # the columns: a NaN allowance adds nothing, and the ends match the row-by-row form
    out, has, los, his, added = _window_spreads(np.array([0.1, 0.3]), np.array([0.02, 0.05]), np.array([6.0, 5.0]),
                                         np.array([True, True]), np.array([0.05, np.nan]))
    assert his[0] == pytest.approx(0.1 + t975(6.0) * 0.02 + 0.05) and his[1] == pytest.approx(0.3 + t975(5.0) * 0.05)
    assert los[0] == pytest.approx(0.1 - t975(6.0) * 0.02)
    assert added.tolist() == [0.05, 0.0]


def test_the_paired_ledger_carries_the_allowance_of_its_sample():
    """A two-sided sample of two prompt groups, one sharpened (two completions holding 0.9 of
    pi_{t+1}'s mass, drawn three and one times, and one held-out completion of pi_t's among
    them), one spread out: D_t's allowance is (1 - 0.9) times the first group's largest token KL,
    over the two groups."""
    names = ("x",)
    roll = StepSample(1, names, np.array([[0.0], [1.0], [0.0], [0.0], [2.0], [3.0], [4.0], [5.0]]),
                      groups=np.array([0, 0, 0, 0, 1, 1, 1, 1]),
                      logp=np.array([LN(0.6), LN(0.3), LN(0.6), LN(0.6), LN(0.05), LN(0.04), LN(0.03), LN(0.02)]),
                      logp_prev=np.array([LN(0.5), LN(0.2), LN(0.5), LN(0.5), LN(0.05), LN(0.05), LN(0.05), LN(0.05)]),
                      kl_prev=np.array([0.2, 0.7, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1]), n_groups=2)
    held = StepSample(1, names, np.array([[1.0], [6.0]]), groups=np.array([0, 1]),
                      logp=np.array([LN(0.3), LN(0.01)]), logp_prev=np.array([LN(0.2), LN(0.05)]),
                      kl_prev=np.array([0.7, 0.3]), n_groups=2)
    lg = paired_ledger(roll, heldout=held)
    assert lg.d_t is not None
    assert lg.d_t_tail == pytest.approx((1.0 - 0.9) * 0.7 / 2, rel=1e-9)
    # eta's estimate of the pair carries it (the book's intervals read it there)
    from reward_lens.measure.efficiency.eta import paired_estimate_columns

    est = paired_estimate_columns([(lg, np.array([0]))])
    assert est.d_t_tail.tolist() == pytest.approx([lg.d_t_tail]) and est.estimate(0).d_t_tail == est.d_t_tail[0]


def test_etas_lower_end_allows_for_d_ts_tail():
    """eta = K / D: D_t may be up to its tail allowance larger than measured, so eta's interval
    reaches down to lo * D / (D + tail); a lower end at or below 0 stays, and so does the upper."""
    from reward_lens.measure.efficiency.eta import EtaColumns, EtaEstimate, run_level, tail_low

    assert tail_low(0.4, 2.0, 0.5) == pytest.approx(0.4 * 2.0 / 2.5)
    assert tail_low(-0.1, 2.0, 0.5) == pytest.approx(-0.1) and tail_low(0.4, 2.0, 0.0) == pytest.approx(0.4)
    assert tail_low(0.4, 2.0, float("nan")) == pytest.approx(0.4)
    cov = np.array([[0.01, 0.0], [0.0, 0.04]])
    bare = EtaEstimate((0, 1), "paired", 1.0, 0.9, 2.0, 0.01, cov, dof=6.0, groups_varying=7)
    tailed = EtaEstimate((1, 2), "paired", 1.0, 0.9, 2.0, 0.01, cov, dof=6.0, groups_varying=7, d_t_tail=0.5)
    lo, hi = bare.interval()
    assert lo > 0
    lo2, hi2 = tailed.interval()
    assert hi2 == pytest.approx(hi) and lo2 == pytest.approx(lo * 2.0 / 2.5)
    # the columns state the same ends, entry by entry
    cols = EtaColumns.of([bare, tailed])
    los, his = cols.interval()
    assert los.tolist() == pytest.approx([lo, lo2]) and his.tolist() == pytest.approx([hi, hi2])
    assert cols.estimate(1).d_t_tail == 0.5 and cols.take(np.array([1])).d_t_tail.tolist() == [0.5]
    # a window's (and the run's) D_t is its members' sum, and so is the allowance
    run = run_level(cols)
    assert run.d_t_tail == pytest.approx(0.5) and run_level([bare, tailed]).d_t_tail == pytest.approx(0.5)
    r_lo, _ = run.interval()
    e, se = run.eta_debiased, run.se
    from tests.unit.interval_helpers import bias_aware_half

    # the run's interval also covers a bias up to its sums' correction, (2.0 - 1.8) / 4.0
    # (``eta.window``), and its lower end then allows for the summed tail
    assert run.bias_bound == pytest.approx(0.05)
    assert r_lo == pytest.approx((e - bias_aware_half(run.dof, se, 0.05)) * 4.0 / 4.5, rel=1e-9)


def test_both_books_state_the_allowance_on_a_sharpened_record(monkeypatch):
    """The task record (a Qwen3 pretrained to answer nearly deterministically, tapped two-sided):
    its prompt groups' samples hold most of pi_{t+1}'s mass, so its updates carry an allowance.
    The book of columns and the row-by-row book state the same intervals, to the last bit, and
    those are the moderated t interval of D_t with the allowance on its upper end, and eta's (its
    bias-aware half-width, ``interval_helpers.bias_aware_half``) with its lower end moved by it."""
    import reward_lens.measure.efficiency.cost as cost_mod
    from reward_lens.measure.efficiency.of_run import price_run
    from tests.unit.interval_helpers import bias_aware_half
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.measure.ledger.moderated import moderated_by_pair
    from reward_lens.measure.ledger.price import steps_from_run, whole_run
    from reward_lens.record import open_run
    from pathlib import Path

    REPO = Path(__file__).resolve().parents[2]
    run = open_run(REPO / "tests" / "fixtures" / "grpo_run" / "task")
    basis = features_from(str(REPO / "examples" / "features" / "task.yaml"))
    samples = steps_from_run(run, basis, window=whole_run(run))
    a = price_run(run, samples, ledger="paired")
    monkeypatch.setattr(cost_mod, "PAIRED_COLUMNS", False)
    b = price_run(run, samples, ledger="paired")
    tails = {tuple(lg.step_pair): lg.d_t_tail for lg in a.ledgers}
    assert sum(t > 0 for t in tails.values()) >= 0.5 * len(tails)
    rows_a, rows_b = a.book.rows, b.book.rows
    assert [r.step_pair for r in rows_a] == [r.step_pair for r in rows_b]
    assert [r.kl_spent_interval for r in rows_a] == [r.kl_spent_interval for r in rows_b]
    assert [r.kl_spent_tail for r in rows_a] == [r.kl_spent_tail for r in rows_b]
    # the report's column states the allowance each interval carries (null with the interval)
    assert a.book.columns.lists("kl_spent_tail") == [r.kl_spent_tail for r in rows_a]
    assert [r.interval for r in rows_a] == [r.interval for r in rows_b]
    spread = moderated_by_pair(a.ledgers)
    moved = 0
    for r in rows_a:
        if r.kl_spent_interval is None:
            assert r.kl_spent_tail is None
            continue
        assert r.kl_spent_tail == tails[r.step_pair]
        se, dof = spread[r.step_pair]
        half = t975(dof) * se
        assert r.kl_spent_interval[1] == pytest.approx(r.kl_spent + half + tails[r.step_pair], rel=1e-12)
        assert r.kl_spent_interval[0] == pytest.approx(max(r.kl_spent - half, 0.0), rel=1e-12, abs=1e-15)
        est = a.book._estimates[r.step_pair] if r.interval is not None else None
        if est is not None and tails[r.step_pair] > 0:
            lo = est.eta_debiased - bias_aware_half(est.dof_pooled, est.se, abs(est.kl_min - est.kl_min_debiased) / est.d_t)
            want = lo * r.kl_spent / (r.kl_spent + tails[r.step_pair]) if lo > 0 else lo
            assert r.interval[0] == pytest.approx(want, rel=1e-12, abs=1e-15)
            moved += lo > 0
    assert moved >= 1
