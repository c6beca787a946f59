"""Tables written from whole columns read cell for cell as the per-cell filters write them:
``fmt_all`` is ``fmt`` of every value, ``html_rows`` escapes every cell as markupsafe does, and
the rows come out in order."""

from __future__ import annotations

import random

from markupsafe import escape

from reward_lens.report.render import _escape_all, fmt, fmt_all, html_rows, md_rows


def test_fmt_all_is_fmt_of_every_value():
    edges = [0.0, -0.0, 1e-3, -1e-3, 9.99e-4, 1e5, -1e5, 99999.9, 99999.99, 123.456, -0.5, float("nan"),
             float("inf"), -float("inf"), 1e-300, 5e-324, True, False, None, 3, -7]
    rng = random.Random(0)
    values = edges + [rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-8, 3) for _ in range(20_000)]
    for digits in (3, 4):
        assert fmt_all(values, digits) == [fmt(v, digits) for v in values]


def test_whole_columns_are_escaped_as_each_cell_is():
    cells = ["<b>", "x&y", '"q"', "'", "plain", "", "—", "a\x00b"]  # a NUL: escaped cell by cell
    assert _escape_all(cells) == [str(escape(c)) for c in cells]
    assert _escape_all(cells[:-1]) == [str(escape(c)) for c in cells[:-1]]
    assert _escape_all([]) == [] and _escape_all([""]) == [""]
    html = html_rows([["1→2", "3→4"], ["<i>", "ok"]], ["", "num"])
    assert html == '<tr><td>1→2</td><td class="num">&lt;i&gt;</td></tr>\n<tr><td>3→4</td><td class="num">ok</td></tr>\n'
    assert md_rows([["1→2", "3→4"], ["a", "b"]]) == "| 1→2 | a |\n| 3→4 | b |\n"


def test_interval_and_note_columns_and_row_classes():
    from reward_lens.report.render import fmt_interval_all, prefixed, with_note

    assert fmt_interval_all([0.5, None, 0.25], [(0.1, 0.9), None, None]) == ["0.5 [0.1, 0.9]", "—", "0.25"]
    assert with_note(["a", "b"], [False, True], "(note)") == ["a", "b (note)"]
    html = html_rows([["x", "y"]], [""], prefixed(["resolved", "<u>"], "row-"))
    assert html == '<tr class="row-resolved"><td>x</td></tr>\n<tr class="row-&lt;u&gt;"><td>y</td></tr>\n'


def test_the_efficiency_columns_refuse_a_negative_eta():
    """An efficiency is a ratio of two divergences: never below 0 (validated). Above 1 is a
    paired row's noise around an independent D_t (beyond 3 SE it is refused before it gets
    here), so the model takes it."""
    import pytest
    from pydantic import ValidationError

    from reward_lens.measure.efficiency.section import EfficiencyRows

    row = dict(step_pair=[(0, 1)], steps=[1], status=["resolved"], kl_min=[1.0], kl_spent=[2.0], efficiency=[0.5],
               efficiency_null=[0.1], efficiency_debiased=[0.44], interval=[(0.3, 0.6)], p_value=[0.01],
               source=["record"], resolved=[True], d_t_checks=[{}], d_t_disagrees=[False])
    assert len(EfficiencyRows(**row)) == 1
    with pytest.raises(ValidationError):
        EfficiencyRows(**{**row, "efficiency": [-0.2]})
    assert len(EfficiencyRows(**{**row, "efficiency": [1.04]})) == 1
