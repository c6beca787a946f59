"""Tables written from whole columns read cell for cell as the per-cell filters write them:
``fmt_all`` is ``fmt`` of every value, ``html_rows`` escapes every cell as markupsafe does, and
the rows come out in order."""

from __future__ import annotations

import random
import struct

from markupsafe import escape

from reward_lens.report.render import _escape_all, fmt, fmt_all, html_rows, md_rows


def test_fmt_all_is_fmt_of_every_value():
    edges = [0.0, -0.0, 1e-3, -1e-3, 9.99e-4, 1e5, -1e5, 99999.9, 99999.99, 123.456, -0.5, float("nan"),
             float("inf"), -float("inf"), 1e-300, 5e-324, True, False, None, 3, -7]
    rng = random.Random(0)
    values = edges + [rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-8, 3) for _ in range(20_000)]
    for digits in (3, 4):
        assert fmt_all(values, digits) == [fmt(v, digits) for v in values]
    # a column of floats alone past 64 values takes the array path: every edge there too
    floats = [v for v in edges if v.__class__ is float] * 10
    assert len(floats) > 64 and fmt_all(floats, 4) == [fmt(v, 4) for v in floats]
    bits = [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(50_000)]
    texts = ["a\x00b", "50 %", "%s", ""]  # text where a number was expected (a report read from a file)
    for column in (bits, bits[:100] + texts, texts, [], (v for v in edges)):
        column = list(column)
        for digits in (1, 3, 4, 6):
            assert fmt_all(column, digits) == [fmt(v, digits) for v in column]
            assert fmt_all(iter(column), digits) == [fmt(v, digits) for v in column]


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

    row = dict(step_pair=[(0, 1)], steps=[1], status=["resolved"], kl_min=[1.0], kl_spent=[2.0], kl_spent_se=[0.1],
               kl_spent_interval=[(1.8, 2.2)], kl_spent_tail=[0.0], efficiency=[0.5],
               efficiency_null=[0.1], efficiency_debiased=[0.44], interval=[(0.3, 0.6)], no_interval=[False], p_value=[0.01],
               source=["record"], resolved=[True], d_t_checks=[{}], d_t_disagrees=[False])
    assert len(EfficiencyRows(**row)) == 1
    with pytest.raises(ValidationError):
        EfficiencyRows(**{**row, "efficiency": [-0.2]})
    assert len(EfficiencyRows(**{**row, "efficiency": [1.04]})) == 1


def test_rows_read_column_by_column_from_models_or_dicts():
    """``columns`` gives a book's list of row models (or the dicts of a report read back from
    JSON) as columns: every row's field, in row order."""
    from reward_lens.measure.price_book import PriceRow
    from reward_lens.report.render import Columns

    rows = [PriceRow(step_pair=(t, t + 1), reward_change=0.1 * t, se=0.01, d_t=0.5, reward_per_nat=0.2 * t,
                     p_value=0.5, resolved=t % 2 == 0) for t in range(5)]
    for given in (rows, [r.model_dump(mode="json") for r in rows]):
        c = Columns(given)
        assert c.reward_change == [r.reward_change for r in rows]
        assert c.resolved == [True, False, True, False, True]
        assert [tuple(p) for p in c.step_pair] == [r.step_pair for r in rows]
    assert Columns([]).se == []


def _md_cell_as_it_was(text: str, limit: int = 80) -> str:
    import html
    import re

    from reward_lens.report.render import visible

    text = visible(text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = html.escape(text.replace("\n", "⏎").replace("\r", "⏎"), quote=False)
    return re.sub(r"([\\`*_\[\]|~])", r"\\\1", text)


def test_md_cell_rewrites_as_the_escape_and_regex_did():
    from reward_lens.report.render import md_cell

    rng = random.Random(0)
    alphabet = [chr(i) for i in range(130)] + list("⏎…→é\u2028&<>\\`*_[]|~")
    for _ in range(5_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 90)))
        for limit in (80, 5):
            assert md_cell(text, limit) == _md_cell_as_it_was(text, limit), text


def _html_rows_as_they_were(columns, classes, row_classes=None):
    opens = [f'<td class="{c}">' if c else "<td>" for c in classes]
    rows = (f'<tr class="{escape(c)}">' for c in row_classes) if row_classes is not None else iter(lambda: "<tr>", None)
    return "".join(r + "".join(o + str(escape(v)) + "</td>" for o, v in zip(opens, cells)) + "</tr>\n"
                   for r, cells in zip(rows, zip(*columns)))


def test_rows_written_by_pattern_read_as_cell_by_cell():
    """md_rows and html_rows write each row with one pattern: the same text as joining cell by
    cell, a % in a cell or a class included, columns and classes of unequal lengths too."""
    cols = [["1→2", "3→4", "5→6"], ["50 %", "<b>", "%s"], ["a|b", "{}", "%%"], ["a\x00b", "&", "'\""]]
    assert md_rows(cols) == "".join(f"| {' | '.join(r)} |\n" for r in zip(*cols))
    assert md_rows([]) == "" and md_rows([[], []]) == ""
    for classes in (["", "num", "x%y", "t"], ["", "num"], ["num", "", "", "", ""], []):
        for row_classes in (None, ["row-a", "row-<b>", "row-%"], ["row-a"], ["row-\x00", "", "x"]):
            for c in (cols, [cols[0][:1], cols[1]], []):
                assert html_rows(c, classes, row_classes) == _html_rows_as_they_were(c, classes, row_classes), \
                    (c, classes, row_classes)


def test_a_column_of_record_text_is_md_cell_of_every_value():
    """md_cell_all rewrites a column in one pass where no text holds a control character, and
    cell by cell where one does: the same cells either way."""
    from reward_lens.report.render import md_cell, md_cell_all

    rng = random.Random(1)
    plain = [chr(i) for i in range(32, 127)] + list("⏎…→é\n&<>\\`*_[]|~")
    for alphabet in (plain, plain + ["\x00", "\x1b", "\r", "\x7f"]):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120))) for _ in range(300)]
        column = [rng.choice(texts) for _ in range(1_000)] + ["", "x" * 80, "y" * 81]
        assert md_cell_all(column) == [md_cell(v) for v in column]
    assert md_cell_all([]) == [] and md_cell_all([""]) == [""]


def test_a_column_is_formatted_once_for_a_reports_renderings_and_again_once_it_changed():
    """to_markdown and to_html of one report share the cells of the columns they both format;
    a column changed in between, another report, or a call outside a rendering formats afresh."""
    from reward_lens.report.render import _cells_of, fmt_all, fmt_interval_all

    class Report:  # anything a weak reference can point to stands for a report here
        pass

    report, column, intervals = Report(), [0.5, 1.5, float("nan")], [(0.1, 0.9), None, None]
    with _cells_of(report):
        cells = fmt_all(column)
        spans = fmt_interval_all(column, intervals)
    with _cells_of(report):
        assert fmt_all(column) is cells and fmt_interval_all(column, intervals) is spans
        assert fmt_all(column, 3) == ["0.5", "1.5", "—"] and fmt_all(column, 3) is not cells
        column[0] = 2.5  # changed in place: formatted again
        again = fmt_all(column)
        assert again == ["2.5", "1.5", "—"] and again is not cells
        intervals[1] = (1.0, 2.0)
        assert fmt_interval_all(column, intervals) == ["2.5 [0.1, 0.9]", "1.5 [1, 2]", "—"]
    with _cells_of(Report()):
        assert fmt_all(column) is not again
    assert fmt_all(column) == again and fmt_all(column) is not fmt_all(column)


def test_markdown_then_html_of_one_report_read_as_each_alone():
    from reward_lens.examples import example_record
    from reward_lens.record.reader import open_run
    from reward_lens.report import build_report, to_html, to_markdown

    report = build_report(open_run(example_record("tapped")))
    alone = report.model_copy(deep=True)
    md, html = to_markdown(report), to_html(report)
    assert html == to_html(alone) and md == to_markdown(report.model_copy(deep=True)) and md == to_markdown(report)


def test_a_long_table_shows_its_first_and_last_rows_with_a_gap_between(monkeypatch):
    """Past TABLE_WHOLE rows a page's table shows the first and last TABLE_ENDS, a row of "…"
    where the others were, and a sentence that counts them; up to it, every row."""
    from types import SimpleNamespace

    from reward_lens.report import render
    from reward_lens.report.render import Shown

    def table(n, short=0):
        return SimpleNamespace(step_pair=[(t, t + 1) for t in range(n)], x=list(range(n - short)),
                               shares={"a": list(range(n))})

    whole = Shown(table(render.TABLE_WHOLE))
    assert whole.gap is None and whole.omitted == 0 and whole.total == render.TABLE_WHOLE and whole.note("rows") == ""
    assert whole.x == list(range(render.TABLE_WHOLE))
    ends = render.TABLE_ENDS
    for n in (render.TABLE_WHOLE + 1, 10_000):
        cut = Shown(table(n))
        assert cut.total == n and cut.gap == ends and cut.omitted == n - 2 * ends
        assert cut.x == list(range(ends)) + list(range(n - ends, n))
        assert cut.shares == {"a": cut.x} and cut.step_pair[ends] == (n - ends, n - ends + 1)
        assert cut.note("step pairs") == (f"The first {ends} and the last {ends} of {n} step pairs are shown "
                                          f"({n - 2 * ends} between them are left out here; the report in JSON "
                                          "holds every row).")
        # a section read back from report.json is a dict: the same rows
        assert Shown({"step_pair": table(n).step_pair, "x": table(n).x}).x == cut.x
    # a column shorter than the table (a report.json edited by hand): each value stays beside its
    # own step pair, and the rows it lacks are not filled with another's
    short = Shown(table(1000, short=50))
    assert short.x == list(range(ends)) + list(range(1000 - ends, 950))
    # a bound below twice the ends never shows a row twice
    monkeypatch.setattr(render, "TABLE_WHOLE", 10)
    assert Shown(table(2 * ends)).gap is None and Shown(table(2 * ends + 1)).omitted == 1
    # the gap row, after the first rows, in Markdown and in HTML (each column's class kept, and
    # each row's class beside its own row)
    cols = [["1", "2", "3"], ["a", "b", "c"]]
    assert md_rows(cols, 2) == "| 1 | a |\n| 2 | b |\n| … | … |\n| 3 | c |\n"
    assert html_rows(cols, ["", "num"], None, 1) == (
        '<tr><td>1</td><td class="num">a</td></tr>\n<tr class="gap"><td>…</td><td class="num">…</td></tr>\n'
        '<tr><td>2</td><td class="num">b</td></tr>\n<tr><td>3</td><td class="num">c</td></tr>\n')
    assert html_rows(cols, ["", "num"], ["r1", "r2", "r3"], 2) == (
        '<tr class="r1"><td>1</td><td class="num">a</td></tr>\n<tr class="r2"><td>2</td><td class="num">b</td></tr>\n'
        '<tr class="gap"><td>…</td><td class="num">…</td></tr>\n<tr class="r3"><td>3</td><td class="num">c</td></tr>\n')
    assert md_rows(cols) == "| 1 | a |\n| 2 | b |\n| 3 | c |\n" and md_rows([[], []], 0) == ""
