"""The tap's cost budget (reward_lens/taps/budget.py): what an allowance buys, worked by hand
from unit costs, and the unbiasedness of the group choice."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from reward_lens.taps.budget import Budget, Shape


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
    # allowance 0.85 s. Two-sided at k = 2 costs 4 rows x 0.11 = 0.44 s a group: 1 group fits, not
    # the 2 a two-sided shape needs. One-sided costs 8 rows x 50 tokens x 1e-3 = 0.4 s a group: 2 fit.
    plan = b.plan(8, 8, 50)
    assert plan.shape == Shape(2, 0) and plan.reason == "fits" and len(plan.groups) == 2
    # one pass per row (the drawing side from its generation): 0.06 s a row, k = 2: 0.24 s a group
    b1 = _fed(Budget(0.1, heldout=4, passes=1))
    plan = b1.plan(8, 8, 50)
    assert plan.shape == Shape(3, 2)  # 3 groups two-sided: 0.72 s; 4 would cost 0.96 s
    b2 = _fed(Budget(0.3, heldout=4, passes=1))  # allowance 0.3 * 9.5 - 0.1 = 2.75 s
    plan = b2.plan(8, 8, 50)
    # 8 groups at k = 2 cost 1.92 s; k = 3 costs 2.88 s > 2.75: two per group and policy
    assert plan.shape == Shape(8, 2) and plan.groups == tuple(range(8))
    b3 = _fed(Budget(0.5, heldout=4, passes=1))  # allowance 4.65 s: k = 4 costs 3.84 s
    assert b3.plan(8, 8, 50).shape == Shape(8, 4)


def test_a_budget_too_small_for_any_group_measures_a_share_of_the_pairs():
    b = _fed(Budget(0.02, heldout=4), fwd=1e-2)  # allowance 0.02 * 9.5 - 0.1 = 0.09 s
    # the smallest shape, one-sided on 2 groups: 2 * 8 * 50 * 1e-2 = 8 s; p = 0.09 / 8
    plans = [b.plan(8, 8, 50) for _ in range(4000)]
    p = 0.09 / 8
    assert all(x.probability == pytest.approx(p) for x in plans)
    measured = [x for x in plans if x.measured]
    assert all(x.shape == Shape(2, 0) and x.reason == "share" for x in measured)
    assert all(x.reason == "skipped" for x in plans if not x.measured)
    # the share measured is p, within four binomial SDs
    assert abs(len(measured) - 4000 * p) <= 4 * math.sqrt(4000 * p * (1 - p))


def test_a_budget_too_small_for_extra_completions_is_one_sided():
    b = _fed(Budget(0.1, heldout=4, passes=2), gen=1e-2)  # generating is dear: no two-sided shape fits
    plan = b.plan(8, 8, 50)
    assert plan.shape.per_group == 0 and plan.shape.sides == "one-sided"


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
    """Two budgets fed the same timings and seed plan the same pairs, whatever else happened."""
    a, b = _fed(Budget(0.1, heldout=4, seed=5)), _fed(Budget(0.1, heldout=4, seed=5))
    assert [a.plan(8, 8, 50) for _ in range(20)] == [b.plan(8, 8, 50) for _ in range(20)]
