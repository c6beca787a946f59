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
