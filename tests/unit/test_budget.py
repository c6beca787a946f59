"""The tap's cost budget (reward_lens/taps/budget.py): what an allowance buys, worked by hand
from unit costs, and the unbiasedness of the group choice."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from reward_lens.record.schema import tap_floor
from reward_lens.taps.budget import MIN_SHARE, Budget, Shape

# the floor at 4 + 4 completions (heldout 4): a quarter of the pairs at 2 + 2 is the same sampling
# as an eighth at 4 + 4 (worked by hand: 0.25 * 2 / 4)
FLOOR = 0.125


def test_the_floor_is_a_spend_not_a_count():
    assert MIN_SHARE == 0.25 and tap_floor(4) == FLOOR and tap_floor(2) == MIN_SHARE
    assert tap_floor(0) == tap_floor(None) == MIN_SHARE  # one-sided: a quarter
    assert tap_floor(3) == pytest.approx(1 / 6) and tap_floor(8) == pytest.approx(1 / 16)


def _fed(budget: Budget, *, step=10.0, tap=0.5, fixed=0.1, fwd=1e-3, gen=2e-4) -> Budget:
    """A budget that has seen steps of ``step`` s (``tap`` s of them the tap's, ``fixed`` s of it
    paid every step), ``fwd`` s per forward token, and generations of 100 rows over 50 decoding
    steps whose time is all rows (compute-bound: ``gen`` s per row and decoding step)."""
    for _ in range(3):
        budget.observe_step(step, tap, fixed)
        budget.observe_forward(fwd * 1000, 1000)
        budget.observe_generation(gen * 100 * 50, 100, 20, 50)
    return budget


def test_no_budget_measures_every_group_whole():
    plan = Budget(None, heldout=4).plan(8, 8, 50)
    assert plan.shape == Shape(8, 4) and plan.groups == tuple(range(8)) and plan.reason == "unbounded"


def test_the_first_pair_is_measured_whole_to_learn_the_costs():
    plan = Budget(0.1, heldout=4).plan(8, 8, 50)
    assert plan.shape == Shape(8, 4) and plan.reason == "first"


def test_the_allowance_is_the_fraction_of_the_untapped_step_less_the_fixed_cost():
    b = _fed(Budget(0.1, heldout=4))
    # untapped step = 10 - 0.5 = 9.5 s; allowance = 0.1 * 9.5 - 0.1 = 0.85 s
    assert b.untapped_step == pytest.approx(9.5)
    assert b.allowance() == pytest.approx(0.85)


def test_two_sided_shapes_by_hand():
    # one extra row of 50 tokens: 2 passes x 1e-3 s a token, and 50 decoding steps x 2e-4 s: 0.11 s
    b = _fed(Budget(0.1, heldout=4, passes=2))
    assert b.cost(Shape(1, 1), 8, 50) == pytest.approx(2 * 0.11)  # a row from each policy
    # allowance 0.85 s. Two-sided at k = heldout = 4 costs 8 rows x 0.11 = 0.88 s a group: not one
    # group fits, let alone the 2 a two-sided shape needs. One-sided would fit 2 groups (0.4 s a
    # group), but two-sided pairs on a share of the steps come first: whole (8 groups, k = 4: 7.04
    # s), covered 0.85 / 7.04 = 0.121 of the pairs, under the floor: an eighth of them
    plan = b.plan(8, 8, 50)
    assert plan.probability == FLOOR and plan.reason in ("floor", "skipped")
    assert (plan.shape, plan.groups) in ((Shape(8, 4), tuple(range(8))), (None, ()))
    # one pass per row (the drawing side from its generation): 0.06 s a row, k = 4: 0.48 s a group;
    # one group fits 0.85 s, not two: a share again (whole 3.84 s, covered 0.22, above the floor)
    b1 = _fed(Budget(0.1, heldout=4, passes=1))
    plan = b1.plan(8, 8, 50)
    assert plan.reason in ("share", "skipped") and plan.probability == pytest.approx(0.85 / 3.84)
    # issue 62: never more groups at k = 2 (3 groups of 2 + 2 cost 0.72 s and would fit)
    assert all(x.shape is None or x.shape.per_group == 4 for x in (b1.plan(8, 8, 50) for _ in range(8)))
    b2 = _fed(Budget(0.3, heldout=4, passes=1))  # allowance 0.3 * 9.5 - 0.1 = 2.75 s
    plan = b2.plan(8, 8, 50)
    # k = 4 costs 0.48 s a group: 5 groups (2.40 s) fit, 6 (2.88 s) do not; 8 at k = 2 (1.92 s) would.
    # 5 is under MIN_SUBSET_GROUPS (8): whole pairs (3.84 s) on 2.75 / 3.84 of the steps instead
    assert plan.probability == pytest.approx(2.75 / 3.84) and plan.reason in ("share", "skipped")
    assert plan.shape in (Shape(8, 4), None)
    # a generation of 32 groups: 5 fit, still under 8; at allowance 4.65 s, 9 groups (4.32 s) fit
    b3 = _fed(Budget(0.5, heldout=4, passes=1))  # allowance 4.65 s: every group of 8 at k = 4 costs 3.84 s
    assert b3.plan(8, 8, 50).shape == Shape(8, 4)
    plan = b3.plan(32, 8, 50)
    assert plan.shape == Shape(9, 4) and plan.reason == "fits" and len(plan.groups) == 9
    b4 = _fed(Budget(0.3, heldout=3, passes=1))  # a tap of heldout 3: 0.36 s a group, 7 groups fit: a share
    plan = b4.plan(8, 8, 50)
    assert plan.probability == pytest.approx(2.75 / 2.88) and plan.shape in (Shape(8, 3), None)


def test_a_share_is_two_sided_and_whole_with_the_probability_its_allowance_covers():
    b = _fed(Budget(0.2, heldout=4, passes=2))  # allowance 0.2 * 9.5 - 0.1 = 1.8 s
    # two-sided at k = 4 is 0.88 s a group: 2 groups (1.76 s) fit, under MIN_SUBSET_GROUPS: whole
    # pairs (7.04 s) on 1.8 / 7.04 of the steps
    assert b.plan(8, 8, 50).probability == pytest.approx(1.8 / 7.04)
    # allowance 0.85 s: one group two-sided costs 0.88 s, so no shape fits every pair. A generation
    # of 3 groups: whole (3 groups, k = 4) costs 2.64 s, the allowance covers 0.85 / 2.64 of the pairs
    c = _fed(Budget(0.1, heldout=4, passes=2))
    plans = [c.plan(3, 8, 50) for _ in range(400)]
    p = 0.85 / 2.64
    assert p > FLOOR and all(x.probability == pytest.approx(p) for x in plans)
    measured = [x for x in plans if x.measured]
    assert all(x.shape == Shape(3, 4) and x.groups == (0, 1, 2) and x.reason == "share" for x in measured)
    assert all(x.reason == "skipped" and x.shape is None for x in plans if not x.measured)
    # systematic: the count is within one of n p, never an unlucky coin's
    assert abs(len(measured) - 400 * p) <= 1
    # a generation of 8 groups: whole costs 7.04 s, covered 0.121 < an eighth: the floor
    plans = [c.plan(8, 8, 50) for _ in range(400)]
    assert 0.85 / 7.04 < FLOOR and all(x.probability == FLOOR for x in plans)
    assert {x.reason for x in plans} == {"floor", "skipped"}
    assert sum(x.measured for x in plans) in (49, 50, 51)


def test_a_budget_too_small_for_any_group_measures_the_floor_s_share_whole():
    b = _fed(Budget(0.02, heldout=4), fwd=1e-2)  # allowance 0.02 * 9.5 - 0.1 = 0.09 s
    plans = [b.plan(8, 8, 50) for _ in range(800)]
    assert all(x.probability == FLOOR for x in plans)
    measured = [x for x in plans if x.measured]
    assert all(x.shape == Shape(8, 4) and x.reason == "floor" for x in measured)
    assert all(x.reason == "skipped" for x in plans if not x.measured)
    assert abs(len(measured) - 800 * FLOOR) <= 1
    # the allowance below the fixed cost (a budget of 1e-4): the floor still measures an eighth
    tiny = _fed(Budget(1e-4, heldout=4))
    assert tiny.allowance() < 0
    plans = [tiny.plan(8, 8, 50) for _ in range(40)]
    assert sum(x.measured for x in plans) in (4, 5, 6) and all(x.probability == FLOOR for x in plans)
    # one-sided (heldout 0), the floor is a quarter of the pairs
    one = _fed(Budget(1e-4, heldout=0))
    plans = [one.plan(8, 8, 50) for _ in range(40)]
    assert sum(x.measured for x in plans) in (9, 10, 11) and all(x.probability == MIN_SHARE for x in plans)


def test_a_budget_too_small_for_extra_completions_measures_two_sided_pairs_on_a_share():
    """The owner's ruling (issue 57): two-sided pairs on a share of the steps before one-sided
    pairs on all of them, which a budget that fits one-sided everywhere used to buy."""
    b = _fed(Budget(0.1, heldout=4, passes=2), gen=1e-2)  # generating is dear: no two-sided shape fits
    plans = [b.plan(8, 8, 50) for _ in range(100)]
    assert all(x.shape is None or x.shape.sides == "two-sided" for x in plans)
    assert sum(x.measured for x in plans) in (12, 13)  # the floor: 100 / 8


def test_a_tap_that_draws_no_extra_completions_is_one_sided():
    b = _fed(Budget(0.1, heldout=0))  # one-sided costs 0.4 s a group: 2 fit the 0.85 s
    plan = b.plan(8, 8, 50)
    assert plan.shape == Shape(2, 0) and plan.reason == "fits" and plan.shape.sides == "one-sided"
    c = _fed(Budget(0.1, heldout=0), fwd=1e-2)  # a group 4 s: a share, whole, one-sided
    plans = [c.plan(8, 8, 50) for _ in range(40)]
    assert {x.shape for x in plans if x.measured} == {Shape(8, 0)}


def test_a_small_run_is_never_starved():
    """24 updates of 8 prompt groups of 4 at the default budget, where the tap's fixed work alone
    takes a tenth of the step (issue 57: 10 of 24 updates unread, 2 two-sided, nothing resolved):
    an eighth or more of the pairs are measured two-sided over every group at 4 + 4 (as budget=None
    measures a pair: the sampling of a quarter at the 2 + 2 issue 57 asked for), spread over the run."""
    b = Budget(0.1, heldout=4, seed=3)
    plans = [b.plan(8, 4, 40)]  # the first pair, whole: the costs are learned from it
    for _ in range(23):
        b.observe_step(0.08, 0.012, 0.009)  # an untapped step of 68 ms; the fixed work 9 ms of it
        b.observe_forward(2e-5 * 320, 320)
        b.observe_generation(0.05, 32, 0, 40)
        plans.append(b.plan(8, 4, 40))
    measured = [i for i, x in enumerate(plans) if x.measured]
    assert plans[0].reason == "first"
    assert len(measured) >= 1 + int(23 * FLOOR)
    assert all(plans[i].shape == Shape(8, 4) and plans[i].reason in ('share', 'floor') for i in measured[1:])
    gaps = [b - a for a, b in zip(measured[1:], measured[2:])]
    assert max(gaps) <= 1 / FLOOR + 1  # spread evenly, not in a clump


def test_each_pair_of_a_share_is_measured_with_its_probability():
    """Systematic sampling with a random start: over seeds, pair i of a share is measured with
    probability p at every position i (what keeps a share's estimators unbiased), not only on
    average over the run."""
    n, seeds, p = 8, 400, FLOOR
    hits = [0] * n
    for seed in range(seeds):
        b = _fed(Budget(0.02, heldout=4, seed=seed), fwd=1e-2)
        for i in range(n):
            hits[i] += b.plan(8, 8, 50).measured
    sd = math.sqrt(seeds * p * (1 - p))
    assert all(abs(h - seeds * p) <= 4 * sd for h in hits), hits


def test_a_latency_bound_generation_charges_the_extra_rows_its_slope():
    """Decoding steps that take as long with more rows cost the extras nothing; steps that grow
    by 1 ms a row charge each extra row 1 ms a step; never more than the time shared out."""
    flat = Budget(0.1, heldout=4)
    for rows in (64, 80, 96, 80):
        flat.observe_generation(0.5 * 64, rows, rows - 64, 64)  # 0.5 s a step whatever the rows
    assert flat.row_step_cost() == pytest.approx(0.0, abs=1e-9)
    sloped = Budget(0.1, heldout=4)
    for rows in (64, 80, 96, 80):
        sloped.observe_generation((0.1 + 1e-3 * rows) * 64, rows, rows - 64, 64)
    assert sloped.row_step_cost() == pytest.approx(1e-3)
    assert sloped.costs.generate == pytest.approx(1e-3 * 64)
    one = Budget(0.1, heldout=4)
    one.observe_generation(0.5 * 64, 80, 16, 64)  # one size seen: the time of a step shared out
    assert one.row_step_cost() == pytest.approx(0.5 / 80)


def test_groups_are_chosen_uniformly_at_random():
    """Every group is chosen with probability m / G (chi-square against uniform, one seed)."""
    b = _fed(Budget(0.1, heldout=4, passes=2))
    counts = Counter()
    draws = 3000
    for _ in range(draws):
        counts.update(b.choose(8, 3))
    expected = draws * 3 / 8
    chi2 = sum((counts[g] - expected) ** 2 / expected for g in range(8))
    assert chi2 < 24.3  # chi-square(7) at p = 0.001
    assert b.choose(8, 8) == tuple(range(8)) and b.choose(8, 20) == tuple(range(8))


def test_the_choice_never_reads_a_sampled_value():
    """Two budgets fed the same timings and seed plan the same pairs, whatever else happened: a
    plan's arguments are the generation's size and the timing, and no sampled value reaches it."""
    import inspect

    for kw in ({}, {"fwd": 1e-2}, {"gen": 1e-2}):  # fits, floor, a share instead of one-sided
        a, b = _fed(Budget(0.1, heldout=4, seed=5), **kw), _fed(Budget(0.1, heldout=4, seed=5), **kw)
        assert [a.plan(8, 8, 50) for _ in range(20)] == [b.plan(8, 8, 50) for _ in range(20)]
    assert list(inspect.signature(Budget.plan).parameters) == ["self", "n_groups", "rows_per_group",
                                                               "tokens_per_row", "heldout"]
