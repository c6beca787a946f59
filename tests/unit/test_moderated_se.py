"""D_t's standard error moderated across neighbouring updates (``ledger.moderated``): worked by
hand, its edges, and what it is for -- intervals that cover a heavy-tailed update's D_t where
the sample's own SE is small exactly when the sample missed the tail."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from reward_lens.measure.ledger.moderated import moderated_d_t_se, t975
from reward_lens.measure.ledger.paired import independent_d_t


def test_worked_by_hand_with_a_window_of_one():
    """u_s = G_s (SE_s / D_s)^2 = 4 * 0.01, 4 * 0.04, 1 * 0.01 = 0.04, 0.16, 0.01. Each update's
    relative variance is half its own and half its window's mean (which holds it too): the own term
    weighs a = 1/2 + 1/(2m), each other b = 1/(2m), m the window's updates."""
    se, dof = moderated_d_t_se([1.0, 2.0, 4.0], [0.1, 0.4, 0.4], [5.0, 10.0, 2.0], [4, 4, 1], window=1)
    # update 0, window {0, 1}: a = 3/4, b = 1/4; v = 0.03 + 0.04 = 0.07, SE = 1 * sqrt(0.07 / 4)
    assert se[0] == pytest.approx(math.sqrt(0.07 / 4), rel=1e-12)
    assert dof[0] == pytest.approx(0.07 ** 2 / (0.75 ** 2 * 0.04 ** 2 / 5 + 0.25 ** 2 * 0.16 ** 2 / 10), rel=1e-12)
    # update 1, window {0, 1, 2}: a = 2/3, b = 1/6; v = 0.16 * 2/3 + 0.05 / 6 = 0.115
    assert se[1] == pytest.approx(2 * math.sqrt(0.115 / 4), rel=1e-12)
    assert dof[1] == pytest.approx(0.115 ** 2 / ((2 / 3) ** 2 * 0.16 ** 2 / 10 + (1 / 6) ** 2 * (0.04 ** 2 / 5 + 0.01 ** 2 / 2)),
                                   rel=1e-12)
    # update 2, one prompt group, window {1, 2}: v = 0.75 * 0.01 + 0.25 * 0.16 = 0.0475, SE = 4 * sqrt(0.0475)
    assert se[2] == pytest.approx(4 * math.sqrt(0.0475), rel=1e-12)
    assert dof[2] == pytest.approx(0.0475 ** 2 / (0.75 ** 2 * 0.01 ** 2 / 2 + 0.25 ** 2 * 0.16 ** 2 / 10), rel=1e-12)


def test_pooled_alone_is_the_windows_mean():
    """With no weight of its own (own_weight 0) an update's relative variance is its window's mean."""
    se, dof = moderated_d_t_se([1.0, 2.0, 4.0], [0.1, 0.4, 0.4], [5.0, 10.0, 2.0], [4, 4, 1], window=1, own_weight=0.0)
    assert se[0] == pytest.approx(math.sqrt(0.1 / 4), rel=1e-12)  # mean u of {0, 1} = 0.1
    assert dof[0] == pytest.approx(0.2 ** 2 / (0.04 ** 2 / 5 + 0.16 ** 2 / 10), rel=1e-12)
    assert se[2] == pytest.approx(4 * math.sqrt(0.085), rel=1e-12)  # mean u of {1, 2} = 0.085


def test_a_window_of_none_is_the_samples_own_se():
    d, s, f, g = [0.5, 0.02, 3.0], [0.05, 0.001, 0.9], [7.0, 3.0, 12.0], [8, 8, 2]
    se, dof = moderated_d_t_se(d, s, f, g, window=0)
    assert se == pytest.approx(s, rel=1e-12) and dof == pytest.approx(f, rel=1e-12)


def test_an_update_without_a_d_t_takes_no_part_and_is_no_ones_neighbour():
    se, dof = moderated_d_t_se([1.0, float("nan"), 2.0, 0.0], [0.1, 0.1, 0.2, 0.1], [5, 5, 5, 5], [1, 1, 1, 1],
                               window=1)  # u = 0.01 at both measured updates
    assert math.isnan(se[1]) and math.isnan(se[3]) and math.isnan(dof[1])
    # updates 0 and 2 are each other's neighbours: u = 0.01 both, mean 0.01
    assert se[0] == pytest.approx(0.1) and se[2] == pytest.approx(0.2)
    assert se[0] == pytest.approx(moderated_d_t_se([1.0, 2.0], [0.1, 0.2], [5, 5], [1, 1], window=1)[0][0])


def test_every_se_zero_is_zero_without_degrees_of_freedom_and_states_no_interval():
    """Samples constant in their token KL, and neighbours alike, say nothing of the spread: the
    pooled SE is 0, and the cost book states no interval for such a D_t rather than an exact one."""
    from reward_lens.measure.efficiency.cost import _window_spread

    se, dof = moderated_d_t_se([0.3, 0.4], [0.0, 0.0], [float("nan"), float("nan")], [8, 8])
    assert se.tolist() == [0.0, 0.0] and np.isnan(dof).all()
    assert t975(float("nan")) == pytest.approx(1.959963984540054)
    assert _window_spread(0.3, [(0.0, float("nan"))]) == (None, None, None)
    assert _window_spread(0.3, [None]) == (None, None, None)


def test_a_small_term_beside_large_ones_is_not_lost_to_rounding():
    """One update of relative SE 1e-2 at D = 1e-6 beside twelve of relative SE 1e-5: the last
    updates' windows hold only the small terms, and their SE is 1e-5, not a cancellation's 0."""
    se, dof = moderated_d_t_se([1e-6] + [1.0] * 12, [1e-8] + [1e-5] * 12, [5.0] * 13, [1] * 13)
    # the last window holds four equal terms: a = 5/8, b = 1/8; dof = 5 / (a^2 + 3 b^2)
    assert se[-1] == pytest.approx(1e-5, rel=1e-9) and dof[-1] == pytest.approx(5 / (0.625 ** 2 + 3 / 64))


def test_a_windows_interval_takes_its_members_fewest_degrees_of_freedom():
    """Members' moderated SEs share most of their pooled terms, so their dof do not add."""
    from reward_lens.measure.efficiency.cost import _window_spread

    se, (lo, hi), tail = _window_spread(2.0, [(0.3, 10.0), (0.4, 4.0)])
    assert se == pytest.approx(0.5) and (hi - lo) / 2 == pytest.approx(t975(4.0) * 0.5) and tail == 0.0


def test_the_interval_of_a_kl_stops_at_zero():
    """A D_t of 0.1 with an SE of 0.2 on 4 degrees of freedom: the t interval reaches
    0.1 - 2.776 x 0.2 = -0.455, and a KL is never negative, so it is stated from 0 (row by row and
    as columns alike); the upper end is unchanged."""
    from reward_lens.measure.efficiency.cost import _window_spread, _window_spreads

    se, (lo, hi), _ = _window_spread(0.1, [(0.2, 4.0)])
    assert se == pytest.approx(0.2) and lo == 0.0 and hi == pytest.approx(0.1 + 2.7764451051977987 * 0.2)
    out, has, los, his, _ = _window_spreads(np.array([0.1, 5.0]), np.array([0.2, 0.2]), np.array([4.0, 4.0]),
                                         np.array([True, True]))
    assert has.all() and los.tolist() == [0.0, pytest.approx(5.0 - 2.7764451051977987 * 0.2)]
    assert his.tolist() == [pytest.approx(hi), pytest.approx(5.0 + 2.7764451051977987 * 0.2)]


def test_the_tail_allowance_is_stated_beside_the_interval_it_raises():
    """The upper end adds the members' tail allowances (a window's summed; None adds nothing) and
    the book states how much, so a reader can tell sampling spread from the allowance: by hand,
    D_t 2.0 with members' SEs 0.3 and 0.4 on 10 and 4 dof and allowances 0.25 and 0.5."""
    from reward_lens.measure.efficiency.cost import _window_spread, _window_spreads

    se, (lo, hi), tail = _window_spread(2.0, [(0.3, 10.0), (0.4, 4.0)], [0.25, 0.5])
    assert tail == 0.75 and hi == pytest.approx(2.0 + 2.7764451051977987 * 0.5 + 0.75)
    assert lo == pytest.approx(2.0 - 2.7764451051977987 * 0.5)  # the lower end is the t interval's
    # as columns: a row with an allowance, one without (NaN adds nothing: 0), one with no SE (none stated)
    *_, his, tails = _window_spreads(np.array([2.0, 2.0, 2.0]), np.array([0.5, 0.5, np.nan]), np.array([4.0] * 3),
                                     np.array([True, True, False]), np.array([0.75, np.nan, 0.75]))
    assert tails[:2].tolist() == [0.75, 0.0] and np.isnan(tails[2])
    assert his[0] == pytest.approx(hi) and his[1] == pytest.approx(hi - 0.75)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="one length"):
        moderated_d_t_se([1.0, 2.0], [0.1], [1.0, 1.0], [1, 1])
    with pytest.raises(ValueError, match="window"):
        moderated_d_t_se([1.0], [0.1], [1.0], [1], window=-1)
    # a missing value (None) takes no part, as NaN does
    se, _ = moderated_d_t_se([1.0, None], [0.1, 0.1], [1.0, 1.0], [1, 1])
    assert se[0] == pytest.approx(0.1) and math.isnan(se[1])


def _update(rng, tail_share: float, tail_kl: float, groups: int = 8, per: int = 4):
    """One update's two-sided sample of a policy whose token KL is 0.05 nats on most completions
    and ``tail_kl`` on a share ``tail_share`` of them (both policies alike, log-ratio 0: the
    balance heuristic's weights are equal). Returns (D, its own SE, dof) and the truth."""
    n = groups * 2 * per
    kl = np.where(rng.random(n) < tail_share, tail_kl, 0.05) * rng.uniform(0.9, 1.1, n)
    codes = np.repeat(np.arange(groups), 2 * per)
    side = np.tile(np.r_[np.ones(per, bool), np.zeros(per, bool)], groups)
    d, se = independent_d_t(np.zeros(n), side, kl, codes, groups)
    return d, se, 2 * per - 1.0, 0.05 * (1 - tail_share) + tail_kl * tail_share


def test_moderated_intervals_cover_a_heavy_tail_the_samples_own_se_does_not_see():
    """A run of 60 updates of one policy whose completions carry ten times the bulk's KL one time
    in fifty: 64 rows an update hold one such completion about seven times in ten, and the others
    hold none and have a tiny SE. The sample's own intervals cover the truth on about three
    updates in four; the moderated ones, which borrow the tail neighbouring updates caught, on more;
    pooled alone (no weight of its own) on about their rate -- on such a run, where every update
    has the same tail, pooling alone is best, and the weight of the sample's own variance (chosen
    on the truth harness's real runs, whose updates differ) costs coverage."""
    rng = np.random.default_rng(7)
    own_cov = mod_cov = pool_cov = total = 0
    for _ in range(20):  # 20 runs
        ups = [_update(rng, 0.02, 0.5) for _ in range(60)]
        d, s, f, truth = (np.array(x) for x in zip(*ups))
        se, dof = moderated_d_t_se(d, s, f, np.full(len(d), 8))
        se0, dof0 = moderated_d_t_se(d, s, f, np.full(len(d), 8), own_weight=0.0)
        own_cov += sum(abs(a - b) <= t975(c) * e for a, b, c, e in zip(d, truth, f, s))
        mod_cov += sum(abs(a - b) <= t975(c) * e for a, b, c, e in zip(d, truth, dof, se))
        pool_cov += sum(abs(a - b) <= t975(c) * e for a, b, c, e in zip(d, truth, dof0, se0))
        total += len(d)
    assert own_cov / total < 0.8
    assert mod_cov / total >= own_cov / total + 0.05
    assert pool_cov / total >= 0.9


def test_the_cost_book_states_each_updates_d_t_with_its_moderated_interval_and_a_window_adds_them():
    """The report's D_t column: each paired row's interval is its D_t +- t * the moderated SE,
    and a window of two updates (separate samples) has the root sum of its members' squares."""
    from pathlib import Path

    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "tapped")
    samples = steps_from_run(run, SurfaceFeatures())
    one = price_run(run, samples, ledger="paired").book
    lgs = sorted((lg for lg in price_run(run, samples, ledger="paired").ledgers if lg.d_t is not None),
                 key=lambda lg: lg.step_pair)
    se, dof = moderated_d_t_se([lg.d_t for lg in lgs], [lg.d_t_se for lg in lgs], [lg.d_t_dof for lg in lgs],
                               [lg.n_groups for lg in lgs])
    by_pair = {tuple(lg.step_pair): (s, f) for lg, s, f in zip(lgs, se, dof)}
    rows = [r for r in one.rows if r.kl_spent_se is not None]
    assert len(rows) >= 20
    for r in rows:
        s, f = by_pair[r.step_pair]
        assert r.kl_spent_se == pytest.approx(s, rel=1e-12)
        lo, hi = r.kl_spent_interval
        assert lo < r.kl_spent < hi and (hi - lo) / 2 == pytest.approx(t975(f) * s, rel=1e-9)
    two = [r for r in price_run(run, samples, ledger="paired", window=2).book.rows
           if r.steps == 2 and r.kl_spent_se is not None]
    assert len(two) >= 8
    for r in two:
        a, b = by_pair[(r.step_pair[0], r.step_pair[0] + 1)][0], by_pair[(r.step_pair[0] + 1, r.step_pair[1])][0]
        assert r.kl_spent_se == pytest.approx(math.hypot(a, b), rel=1e-12)


def test_a_callers_d_t_takes_no_interval_from_the_records_se():
    """Unpaired rows: the record's kl_to_previous_se is the SE of the record's D_t. Where the caller
    supplies D_t (``kl_spent``) the row states no interval from it; where the record's D_t is read,
    the record's SE."""
    from pathlib import Path

    from reward_lens.measure.efficiency.cost import cost_series
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "tapped")
    pr = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="unpaired")
    rec, se = run.telemetry_column("kl_to_previous"), run.telemetry_column("kl_to_previous_se")
    mine = cost_series(pr.ledgers, pr.metric, run_=run, kl_spent={s: 10 * v for s, v in rec.items()})
    assert mine.rows and all(r.kl_spent_se is None and r.kl_spent_interval is None for r in mine.rows)
    theirs = cost_series(pr.ledgers, pr.metric, run_=run)
    assert theirs.rows and all(r.kl_spent_se == se[r.step_pair[0]] for r in theirs.rows)


def test_eta_se_pools_its_variance_with_the_neighbouring_updates_worked_by_hand():
    """Three rows of SE 0.1, 0.2 and 0.4 on 3 degrees of freedom each, one update on either side,
    the own weight 1/2. The first row's window holds two rows: its own term weighs 1/2 + 1/4, the
    other 1/4, so v = 0.75 x 0.01 + 0.25 x 0.04 = 0.0175, on 0.0175^2 / ((0.75^2 x 0.01^2 +
    0.25^2 x 0.04^2) / 3) = 5.88 degrees of freedom. The middle one's holds three: 2/3 x 0.04 +
    1/6 x (0.01 + 0.16) = 0.055. The variance is pooled, not the relative variance: eta is a
    ratio on one scale across updates."""
    from reward_lens.measure.ledger.moderated import moderated_eta_se

    se, dof = moderated_eta_se([0.1, 0.2, 0.4], [3.0, 3.0, 3.0], window=1)
    assert se[0] == pytest.approx(math.sqrt(0.0175)) and dof[0] == pytest.approx(0.0175 ** 2 / (
        (0.75 ** 2 * 1e-4 + 0.25 ** 2 * 0.04 ** 2) / 3))
    assert se[1] == pytest.approx(math.sqrt(2 / 3 * 0.04 + 1 / 6 * 0.17))
    # a row with no finite SE takes no part and is no one's neighbour
    se2, _ = moderated_eta_se([0.1, float("inf"), 0.2, 0.4], [3.0, 3.0, 3.0, 3.0], window=1)
    assert math.isnan(se2[1]) and se2[[0, 2, 3]] == pytest.approx(se)
    with pytest.raises(ValueError, match="one length"):
        moderated_eta_se([0.1, 0.2], [3.0])


def test_a_paired_books_rows_pool_in_step_order_and_the_interval_reads_the_pooled_se():
    """``eta.moderate``: rows given out of step order are pooled in step order; a row that states
    no interval (one prompt group varies) takes no part; the interval is eta_debiased -+ t on the
    pooled degrees of freedom x the pooled SE; the estimate and its own SE are unchanged, and an
    unpaired book's rows are not pooled."""
    from reward_lens.measure.efficiency.eta import EtaColumns, EtaEstimate, _t975, moderate
    from reward_lens.measure.ledger.moderated import moderated_eta_se

    def est(pair, k, se_k, gv):  # K with variance se_k^2 and D = 1 exactly: eta's SE is se_k
        return EtaEstimate(step_pair=pair, kind="paired", kl_min=k, kl_min_debiased=k, d_t=1.0, p_value=0.01,
                           cov=np.array([[se_k ** 2, 0.0], [0.0, 0.0]]), dof=3.0, groups_varying=gv)

    rows = [est((2, 3), 0.5, 0.4, 8), est((0, 1), 0.3, 0.1, 8), est((1, 2), 0.2, 0.9, 1), est((3, 4), 0.6, 0.2, 8)]
    got = moderate(EtaColumns.of(rows))
    want, dof = moderated_eta_se([0.1, 0.4, 0.2], [3.0, 3.0, 3.0])  # (0, 1), (2, 3), (3, 4): step order
    assert got.pooled.tolist() == [True, True, False, True]
    assert got.se[[1, 0, 3]] == pytest.approx(want) and got.se[2] == pytest.approx(0.9)
    assert got.own_se == pytest.approx([0.4, 0.1, 0.9, 0.2])
    e = got.estimate(0)
    lo, hi = e.interval()
    assert e.se == pytest.approx(want[1]) and (hi - lo) / 2 == pytest.approx(_t975(dof[1]) * want[1])
    assert e.eta_debiased == 0.5 and got.estimate(2).se_pooled is None
    lo_c, hi_c = got.interval()
    assert lo_c[0] == lo and hi_c[0] == hi
    unpaired = EtaColumns.of([EtaEstimate(step_pair=(0, 1), kind="unpaired", kl_min=0.1, kl_min_debiased=0.1,
                                          d_t=1.0, p_value=0.5, cov=np.eye(2))])
    assert moderate(unpaired) is unpaired


def test_rows_far_apart_in_step_order_are_not_neighbours_whatever_order_they_come_in():
    """Nine rows given shuffled, the book's window (three rows on either side): each row's pooled
    SE is that of its step-order neighbours, written out (a = 1/2 + 1/(2m) for its own variance,
    1/(2m) for each other one), so the first and last rows, which share no neighbour, differ."""
    from reward_lens.measure.efficiency.eta import EtaColumns, EtaEstimate, moderate

    se_by_step = [0.1, 0.2, 0.4, 0.8, 0.3, 0.5, 0.05, 0.6, 1.0]

    def est(t):
        s = se_by_step[t]
        return EtaEstimate(step_pair=(t, t + 1), kind="paired", kl_min=0.5, kl_min_debiased=0.5, d_t=1.0,
                           p_value=0.01, cov=np.array([[s * s, 0.0], [0.0, 0.0]]), dof=4.0, groups_varying=8)

    order = [5, 0, 8, 3, 1, 7, 2, 6, 4]
    got = moderate(EtaColumns.of([est(t) for t in order]))
    for q, t in enumerate(order):
        window = [s for s in range(t - 3, t + 4) if 0 <= s < len(se_by_step)]
        m = len(window)
        v = 0.5 * se_by_step[t] ** 2 + sum(se_by_step[s] ** 2 for s in window) / (2 * m)
        assert got.se[q] == pytest.approx(math.sqrt(v), rel=1e-12), t
    assert got.se[order.index(0)] != pytest.approx(got.se[order.index(8)])


def test_a_known_variance_adds_nothing_to_the_degrees_of_freedom_and_bad_input_is_named():
    """Welch-Satterthwaite: (sum of the terms)^2 / sum of term^2 / dof. Two rows of SE 0.1, the
    first on 4 degrees of freedom and the second known (infinite), window 1: each row's own term
    weighs 3/4 and the other's 1/4, so v = 0.0075 + 0.0025 = 0.01. The first row's dof is 0.01^2 /
    (0.0075^2 / 4) = 7.11 -- not 0.01^2 / (0.0075^2 / 4 + 0.0025^2 / 1) = 4.92, as a known variance
    read as one degree of freedom gave -- and the second's 0.01^2 / (0.0025^2 / 4) = 64. Every term
    known: normal (NaN dof)."""
    from reward_lens.measure.ledger.moderated import moderated_eta_se, pooled_variances

    se, dof = moderated_eta_se([0.1, 0.1], [4.0, float("inf")], window=1)
    assert se == pytest.approx([0.1, 0.1]) and dof == pytest.approx([1e-4 / (0.0075 ** 2 / 4), 64.0])
    _, dof = moderated_eta_se([0.1, 0.1], [float("inf"), float("inf")], window=1)
    assert np.isnan(dof).all()
    # an SE beyond the float range when squared takes no part, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        se, _ = moderated_eta_se([0.1, 1e200, 0.1], [4.0, 4.0, 4.0], window=1)
        d_se, _ = moderated_d_t_se([1.0, 1e-160, 1.0], [0.1, 1.0, 0.1], [4.0, 4.0, 4.0], [8, 8, 8], window=1)
    assert np.isnan(se[1]) and se[[0, 2]] == pytest.approx([0.1, 0.1])
    assert np.isnan(d_se[1]) and np.isfinite(d_se[[0, 2]]).all()
    for bad, match in ((dict(u=[0.1, 0.2], dof=[1.0]), "one length"), (dict(u=[0.1, np.nan], dof=[1.0, 1.0]), "finite"),
                       (dict(u=[0.1, -1.0], dof=[1.0, 1.0]), "finite"),
                       (dict(u=[0.1, 0.2], dof=[1.0, 1.0], window=-1), "window"),
                       (dict(u=[0.1, 0.2], dof=[1.0, 1.0], own_weight=3.0), "own_weight")):
        with pytest.raises(ValueError, match=match):
            pooled_variances(**bad)


def test_the_books_eta_intervals_are_the_pooled_ses_computed_apart():
    """On the bundled tapped run, every paired row's interval is eta_debiased -+ c x SE with SE and
    c worked out here apart from the book: each row's own SE by the delta method from the
    jackknife's covariance of (KL_jk, D_t), pooled by a written-out loop over the rows that state an
    interval in step order (three on either side, half its own variance and half the window's
    mean); c the bias-aware critical value on Welch-Satterthwaite's degrees of freedom, found by
    scipy's root finder on scipy's t (``interval_helpers``): P(|T + b / SE| <= c) = 0.95 with b the row's own bias
    correction in eta, |KL_min - KL_jk| / D_t (t975 where b is 0). The headline's interval reads
    the same SEs; the statuses are the book's decision, which pooling does not touch."""
    from pathlib import Path

    from scipy import stats

    from tests.unit.interval_helpers import bias_aware_half

    from reward_lens.measure.efficiency import eta as eta_mod
    from reward_lens.measure.efficiency.cost import cost_series
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "tapped")
    pr = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="paired")
    book = pr.book
    est = book.estimates
    pairs = sorted(p for p in est if est[p].estimable)
    own, dof = [], []
    for p in pairs:
        e = est[p]
        grad = np.array([1.0 / e.d_t, -e.kl_min_debiased / e.d_t ** 2])
        own.append(math.sqrt(max(float(grad @ e.cov @ grad), 0.0)))
        dof.append(e.dof)
    rows = {r.step_pair: r for r in book.rows}
    stated = widened = 0
    for i, p in enumerate(pairs):
        window = range(max(0, i - 3), min(len(pairs), i + 4))
        m = len(window)
        coef = {j: 0.5 / m + (0.5 if j == i else 0.0) for j in window}
        v = sum(c * own[j] ** 2 for j, c in coef.items())
        ws = v * v / sum((c * own[j] ** 2) ** 2 / dof[j] for j, c in coef.items())
        b = abs(est[p].kl_min - est[p].kl_min_debiased) / est[p].d_t / math.sqrt(v)
        q = bias_aware_half(ws, 1.0, b)  # in SEs
        assert q >= float(stats.t.ppf(0.975, ws)) - 1e-12 and q <= b + float(stats.t.ppf(0.975, ws)) + 1e-12
        lo, hi = rows[p].interval
        e = est[p].eta_debiased
        assert lo == pytest.approx(e - q * math.sqrt(v), rel=1e-9, abs=1e-12), p
        assert hi == pytest.approx(e + q * math.sqrt(v), rel=1e-9, abs=1e-12), p
        stated += 1
        widened += b > 0.1
    assert widened >= 3  # rows whose correction is a tenth of their SE or more: the bound is at work
    assert stated >= 10 and all(rows[p].interval is None for p in est if not est[p].estimable)
    # pooling moves no status, and the headline's interval is not the unpooled one
    plain = eta_mod.moderate
    try:
        eta_mod.moderate = lambda c: c
        unpooled = cost_series(pr.ledgers, pr.metric, run_=run)
    finally:
        eta_mod.moderate = plain
    assert [r.status for r in unpooled.rows] == [r.status for r in book.rows]
    assert unpooled.headline()[0] == book.headline()[0] and unpooled.headline()[1] != book.headline()[1]
