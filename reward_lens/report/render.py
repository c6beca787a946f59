"""Render a Report as Markdown, single-file HTML and JSON (views of the same data)."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache, wraps
from operator import attrgetter, is_
from pathlib import Path

import jinja2
import numpy as np
from markupsafe import Markup, escape
from pydantic import BaseModel

from reward_lens.report.model import Report
from reward_lens_spec.paths import templates_dir
from reward_lens_spec.render import (code_list, compiled_templates, first_sentence, format_nats, html_view,
                                     in_sentence, inline_html, markdown_view, percent, render_template)

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def visible(text: str) -> str:
    """Control characters as ``\\xNN`` (a NUL or escape byte is not text a page can show)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def md_cell(text: str, limit: int = 80) -> str:
    """Record text made safe for one GFM table cell: nothing it contains can end the cell,
    open a tag, start a code span or emphasis, or break the row."""
    text = visible(text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return _md_escape(text)


def _md_escape(text: str) -> str:
    """``md_cell``'s rewrites after the cut, each of one character (so text joined by any other
    separator is rewritten as each piece is): line breaks as ⏎; < > & as entities (& first):
    no raw HTML; Markdown's specials backslashed (the backslash first). Replaces, not a regex
    or str.translate: 4x faster on a cell."""
    text = text.replace("\n", "⏎").replace("\r", "⏎").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("\\", "\\\\").replace("`", "\\`").replace("*", "\\*").replace("_", "\\_").replace(
        "[", "\\[").replace("]", "\\]").replace("|", "\\|").replace("~", "\\~")


def fmt(x, digits: int = 4) -> str:
    if x.__class__ is not float:  # floats are nearly every call: they skip these tests
        if x is None:
            return "—"
        if isinstance(x, bool):
            return "yes" if x else "no"
        if isinstance(x, int):
            return str(x)
        if not isinstance(x, float):  # text where a number was expected (a report read from a file)
            return str(x)
    if x == 0:
        return "0"
    if x != x:  # NaN: a quantity that could not be estimated
        return "—"
    ax = abs(x)
    return f"{x:.{digits - 1}e}" if ax < 1e-3 or ax >= 1e5 else f"{x:.{digits}g}"


# Whole columns into table rows: a book that keeps its rows as columns (10,000 step pairs are a
# few lists) names its columns and their formats in its template, and these render every row
# at once -- the same cells a loop over rows writes, without a template loop per row.
def prose_cell(text: str) -> str:
    """Prose from the templates (code spans kept) for one GFM table cell: pipes escaped, one line."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def prose_cell_capped(text: str, limit: int = 300) -> str:
    """``prose_cell`` of prose read back from a report (a diff's headlines), at most ``limit``
    characters: cut at a word outside a code span, so no code span is left open."""
    cell = prose_cell(text)
    if len(cell) <= limit:
        return cell
    cut = cell[: limit - 1]
    if cut.count("`") % 2:  # inside a code span: end before it
        cut = cut[: cut.rfind("`")]
    return cut.rstrip() + "…"


# ---- columns formatted once per report ---------------------------------------------------------
# to_markdown and to_html of one report format the same columns (the cost and price books'
# 10,000-row tables are in both), so a column function marked ``_shared`` keeps what it returned
# for the report being rendered and the other rendering reads it back. The cells are kept for
# the report rendered last (dropped with it, or when another report is rendered), keyed by the
# column lists themselves -- each held, so its id stays its own -- and read back only while every
# list still holds the very same elements (compared by identity; a report is a frozen model and
# its columns hold numbers, texts and pairs), so a column that changed is formatted again.
# Nothing here changes a column it is given or one it returns.

_cells: ContextVar[dict | None] = ContextVar("reward_lens_render_cells", default=None)
_last: list = [None, None]  # a weak reference to the report rendered last, and its cells


@contextmanager
def _cells_of(report):
    """While rendering ``report``: the cells ``_shared`` functions keep for it."""
    ref, cells = _last
    if ref is None or ref() is not report:
        cells = {}
        try:
            ref = weakref.ref(report, lambda _, c=cells: c.clear())
        except TypeError:  # no weak reference to it: cells for this rendering only
            ref = None
        _last[:] = [ref, cells]
    token = _cells.set(cells)
    try:
        yield
    finally:
        _cells.reset(token)


def _same(kept: list, args: tuple) -> bool:
    return all(k is None or (k[0] is a and len(k[1]) == len(a) and all(map(is_, k[1], a))) for k, a in zip(kept, args))


def _shared(fn):
    """``fn`` (positional arguments: its columns as lists, the rest numbers or text) returning
    for a report being rendered what it returned for the same columns before (see above)."""
    @wraps(fn)
    def shared(*args):
        cells = _cells.get()
        if cells is None or not all(a.__class__ in (list, int, str) for a in args):
            return fn(*args)
        key = (fn.__name__, *(id(a) if a.__class__ is list else a for a in args))
        hit = cells.get(key)
        if hit is not None and _same(hit[0], args):
            return hit[1]
        out = cells[key] = ([(a, list(a)) if a.__class__ is list else None for a in args], fn(*args))
        return out[1]
    return shared


@_shared
def fmt_all(values, digits: int = 4) -> list[str]:
    """``fmt`` of every value of a column: for each float (nearly all of them) the %-spec that
    writes it as ``fmt`` does (``%.0s`` writes nothing of its value: "0" and "—" are literal),
    for anything else ``fmt``'s text, and the column written by one ``%``, split at the NULs
    between its cells (30 % faster than a ``format`` call a float; the same text, tested)."""
    if digits < 1:
        return [fmt(x, digits) for x in values]
    values = values if values.__class__ in (list, tuple) else list(values)
    g, e = f"%.{digits}g", f"%.{digits - 1}e"
    if len(values) > 64 and set(map(type, values)) == {float}:
        # a column of floats (nearly every long one): each value's spec chosen by array operations,
        # the same choice as the loop below makes (a fifth of the time of formatting it)
        a = np.array(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            sci = ((-1e-3 < a) & (a < 1e-3)) | ~((-1e5 < a) & (a < 1e5))
        specs = np.where(a == 0, "%.0s0", np.where(a != a, "%.0s—", np.where(sci, e, g))).tolist()
    else:
        specs = [("%.0s0" if x == 0 else "%.0s—" if x != x else e if -1e-3 < x < 1e-3 or not -1e5 < x < 1e5 else g)
                 if x.__class__ is float else "%s" for x in values]
    if not specs:
        return []
    if "%s" in specs:
        values = [x if x.__class__ is float else fmt(x, digits) for x in values]
    cells = ("\x00".join(specs) % tuple(values)).split("\x00")
    return cells if len(cells) == len(specs) else [fmt(x, digits) for x in values]  # a NUL in a text


class Columns:
    """Rows (models, or dicts where a report was read back from JSON) read column by column:
    ``columns.name`` is every row's ``name``, in row order -- for a book that keeps a list of
    row models, so its template can hand whole columns to ``md_rows``/``html_rows``."""

    def __init__(self, rows):
        self._rows = rows if rows.__class__ is list else list(rows)
        classes = set(map(type, self._rows))
        # frozen models' columns are the same lists for md and html (fmt_all's cells shared)
        self._frozen = all(issubclass(c, BaseModel) and c.model_config.get("frozen") for c in classes)

    def __getattr__(self, name: str) -> list:
        if name.startswith("_"):
            raise AttributeError(name)
        return (_frozen_column if self._frozen else _column)(self._rows, name)


def _column(rows: list, name: str) -> list:
    try:
        return list(map(attrgetter(name), rows))
    except AttributeError:  # rows read back from JSON are dicts
        return [r[name] for r in rows]


_frozen_column = _shared(_column)


def text_all(values) -> list[str]:
    """A column of names or labels: the value, or "—" where there is none."""
    return [v or "—" for v in values]


@_shared
def pairs_all(values) -> list[str]:
    """A column of step pairs (t, u) as "t→u"."""
    return [f"{a}→{b}" for a, b in values]


@_shared
def fmt_interval_all(values, intervals, digits: int = 4) -> list[str]:
    """A column of values with their intervals: "v [lo, hi]", or "v" where there is none."""
    rows = list(zip(fmt_all(values, digits), intervals))
    given = [iv for _, iv in rows if iv is not None]
    each = fmt_all.__wrapped__  # the ends are lists of this call's own: nothing to keep
    lo, hi = iter(each([iv[0] for iv in given], digits)), iter(each([iv[1] for iv in given], digits))
    return [c if iv is None else f"{c} [{next(lo)}, {next(hi)}]" for c, iv in rows]


def with_note(cells, flags, note: str) -> list[str]:
    """The cells, with `` note`` after each one whose flag is set."""
    return [f"{c} {note}" if f else c for c, f in zip(cells, flags)]


def md_value(x, limit: int = 80) -> str:
    """A value read from a report in a Markdown cell: numbers formatted, anything else as
    record text (escaped by ``md_cell``)."""
    return md_cell(fmt(x), limit)


def md_cell_all(values) -> list[str]:
    """``md_cell`` of every value of a column of record text: each distinct text made safe once
    (a column of 10,000 rows says where D_t comes from in a few sentences, or, naming each
    step's rollouts, in 10,000). Texts with no control character (nothing for ``visible`` to
    rewrite, and no NUL) are cut, joined by NUL, rewritten in one pass and split again."""
    values = list(values)
    texts = list(set(values))
    if not all(v.__class__ is str for v in texts) or _CONTROL.search("".join(texts)):  # cell by cell
        safe = {v: md_cell(v) for v in texts}
    else:
        cut = "\x00".join([v if len(v) <= 80 else v[:79] + "…" for v in texts])
        safe = dict(zip(texts, _md_escape(cut).split("\x00")))
    return [safe[v] for v in values]


def prefixed(values, prefix: str) -> list[str]:
    return [prefix + v for v in values]


def fmt_columns(columns: dict, names, digits: int = 4) -> list[list[str]]:
    """``fmt_all`` of the columns ``names`` of a mapping of columns, in that order."""
    return [fmt_all(columns[n], digits) for n in names]


def md_rows(columns: list[list[str]], gap: int | None = None) -> str:
    """Markdown table rows, one per entry of the columns (cells already formatted and safe):
    each row's cells joined by one ``join``, the rows by another (no Python per row or cell).
    ``gap``: a row of "…" after that many rows, where a ``Shown`` table leaves rows out."""
    rows = list(map(" | ".join, zip(*columns)))
    if gap is not None and rows:
        rows.insert(gap, " | ".join(["…"] * len(columns)))
    return "| " + " |\n| ".join(rows) + " |\n" if rows else ""


# A page's table of a row per step pair shows every row up to TABLE_WHOLE of them; a longer one
# shows its first and last TABLE_ENDS rows (a run of 10,000 steps is 10,000 rows a table, 30,000
# lines of Markdown no one reads and most of the time a report spends rendering). The HTML
# figures cover every row, and the JSON report holds every row. The margin between the two (at
# least 50 rows left out) keeps a table from being cut by a handful.
TABLE_WHOLE = 250
TABLE_ENDS = 100


class Shown:
    """The rows of a long table that a page shows (see ``TABLE_WHOLE``): ``shown.name`` is column
    ``name`` of ``columns`` (attributes that are lists, in row order), cut to its first and last
    ``TABLE_ENDS`` entries where the table has more than ``TABLE_WHOLE`` rows. ``total``: the
    table's rows; ``gap``: where the rows left out were (after the first ``TABLE_ENDS``), for
    ``md_rows`` and ``html_rows``, None where none were; ``omitted``: how many."""

    def __init__(self, columns, key: str = "step_pair"):
        self._columns = columns
        self.total = len(self._column(key))
        cut = self.total > max(TABLE_WHOLE, 2 * TABLE_ENDS)  # never a row shown twice
        self.gap = TABLE_ENDS if cut else None
        self.omitted = self.total - 2 * TABLE_ENDS if cut else 0

    def _cut(self, column: list) -> list:
        # the rows of the table's own length (``key``'s): a column of another length (a report.json
        # edited by hand) shows each value beside its own step pair, or none, never another's
        return column[:TABLE_ENDS] + column[self.total - TABLE_ENDS:self.total]

    def _column(self, name: str):
        try:
            return getattr(self._columns, name)
        except AttributeError:  # a section read back from JSON is a dict
            return self._columns[name]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        column = self._column(name)
        if self.gap is None:
            return column
        if isinstance(column, dict):  # columns by name (a book's shares per behaviour)
            return {k: self._cut(v) for k, v in column.items()}
        return self._cut(column)

    def note(self, what: str) -> str:
        """The sentence that says which rows a cut table shows ("" for a whole one)."""
        if self.gap is None:
            return ""
        return render_template("report/table_cut.j2", {"ends": TABLE_ENDS, "total": self.total, "what": what,
                                                       "omitted": self.omitted})


def _escape_all(cells: list[str]) -> list[str]:
    """HTML-escape every cell of a column: the column joined by NUL (which escaping leaves as
    it is), escaped in one call and split again; cell by cell if a cell holds a NUL."""
    joined = "\x00".join(cells)
    if joined.count("\x00") != max(len(cells) - 1, 0):
        return [str(escape(v)) for v in cells]
    return str(escape(joined)).split("\x00") if cells else []


def _wrapped_all(cells: list[str], open_: str, close: str) -> list[str]:
    """``open_ + escaped cell + close`` for every cell of a column: the escaped column's NULs
    replaced by ``close NUL open_`` and split there, so no Python runs per cell (cell by cell
    where a cell or the tags hold a NUL)."""
    joined = "\x00".join(cells)
    if joined.count("\x00") != max(len(cells) - 1, 0) or "\x00" in open_ + close:
        return [open_ + str(escape(v)) + close for v in cells]
    if not cells:
        return []
    return (open_ + str(escape(joined)).replace("\x00", close + "\x00" + open_) + close).split("\x00")


def html_rows(columns: list[list[str]], classes: list[str], row_classes: list[str] | None = None,
              gap: int | None = None) -> Markup:
    """HTML table rows, one per entry of the columns: every cell escaped, ``classes[j]`` the
    class of column j's cells (empty: none), ``row_classes[i]`` the class of row i. As many
    rows as the shortest column (and ``row_classes``), a cell for each column that has a class.
    Each column's cells are wrapped in their tags at once (``_wrapped_all``), each row's cells
    joined by one ``join`` and the rows by another. ``gap``: a row of "…" after that many rows,
    where a ``Shown`` table leaves rows out."""
    if not columns:
        return Markup("")
    count = min(len(col) for col in columns)
    if row_classes is not None:
        count = min(count, len(row_classes))
    cells = [_wrapped_all(col[:count], f'<td class="{c}">' if c else "<td>", "</td>")
             for c, col in zip(classes, columns)]
    cells.insert(0, _wrapped_all(row_classes[:count], '<tr class="', '">') if row_classes is not None else
                 ["<tr>"] * count)
    rows = list(map("".join, zip(*cells)))
    if gap is not None and rows:
        rows.insert(gap, '<tr class="gap">' + "".join(f'<td class="{c}">…</td>' if c else "<td>…</td>"
                                                      for c in classes[:len(columns)]))
    return Markup("</tr>\n".join(rows) + "</tr>\n" if count else "")


@lru_cache(maxsize=None)
def environment(root: str, autoescape: bool) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(root), undefined=jinja2.StrictUndefined,
                             bytecode_cache=compiled_templates("html" if autoescape else "text"),
                             autoescape=autoescape, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(md_cell=md_cell, md_value=md_value, fmt=fmt, prose_md=markdown_view, visible=visible, num3=format_nats,
                       pct=percent, codes=code_list, prose_cell=prose_cell,
                       fmt_all=fmt_all, text_all=text_all, pairs_all=pairs_all, fmt_columns=fmt_columns,
                       md_rows=md_rows, html_rows=html_rows, fmt_interval_all=fmt_interval_all, with_note=with_note,
                       md_cell_all=md_cell_all, prefixed=prefixed, columns=Columns, shown=Shown,
                       prose_html=lambda t: Markup(html_view(t)), md_inline=lambda t: Markup(inline_html(t)),
                       prose_cell_capped=prose_cell_capped, in_sentence=in_sentence, first_sentence=first_sentence,
                       rest_after_first=lambda t: t[len(first_sentence(t)):].strip())
    return env


def to_markdown(report: Report) -> str:
    with _cells_of(report):
        return environment(str(templates_dir()), False).get_template("report/report.md.j2").render(r=report)


def to_json(report: Report, pretty: bool = False) -> str:
    """Compact by default, ``pretty`` indents for reading; written by pydantic's own serialiser
    (7-10x faster than a dump to Python objects and ``json.dumps``; the same values, and a
    non-finite float becomes null rather than the invalid ``NaN``).

    Compact JSON of a built report serialises each book's section with its own model and
    splices it in: a section held as ``data`` (typed ``Any`` there) is otherwise serialised by
    inspecting every value, 4x slower at 10,000 steps. The same text either way (tested)."""
    if pretty or not all(b.data is None or isinstance(b.data, BaseModel) for b in report.books):
        return report.model_dump_json(indent=2 if pretty else None) + "\n"
    head = report.model_copy(update={"books": []}).model_dump_json()
    if head.count('"books":[]') != 1:  # not the layout spliced here
        return report.model_dump_json() + "\n"
    at = head.index('"books":[]') + len('"books":[')
    parts = [head[:at]]  # joined once at the end: the report's 16 MB are copied once, not four times
    for i, b in enumerate(report.books):
        shell = b.model_copy(update={"data": None}).model_dump_json()
        if not shell.endswith(',"data":null}'):
            return report.model_dump_json() + "\n"
        parts += [","] if i else []
        parts += [shell] if b.data is None else [shell[:-len("null}")], b.data.model_dump_json(), "}"]
    parts += [head[at:], "\n"]
    return "".join(parts)


def figures(report: Report) -> tuple[dict[str, list[dict]], list[dict]]:
    """Every book's figures and the training curves, drawn as inline SVG."""
    from reward_lens.report import plots

    def draw(fig, prefix: str) -> dict:
        return {"id": fig.id, "caption": fig.caption, "svg": Markup(plots.render_figure(
            fig.model_copy(update={"id": f"{prefix}-{fig.id}"})))}

    books = {b.id: [draw(f, b.id) for f in b.figures] for b in report.books}
    return books, [draw(f, "run") for f in report.curves]


BROWSER_SCRIPT = (Path(__file__).parent / "browser.js").read_text(encoding="utf-8")


def browser_data(report: Report) -> Markup:
    """The browser's rows as JSON inside <script type="application/json">: every <, > and &
    escaped as \\u00XX, so no text from a record can end the element or open a tag."""
    def num(x):
        return x if x is not None and math.isfinite(x) else None

    rows = [{"step": b.step, "prompt": visible(b.prompt), "completion": visible(b.completion), "reward": num(b.reward),
             "advantage": num(b.advantage), "features": b.features} for b in report.browser]
    text = json.dumps({"features": list(report.basis.model_dump()["features"]), "rows": rows}, ensure_ascii=False,
                      allow_nan=False, default=str)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(text)


def to_html(report: Report) -> str:
    from reward_lens.report import plots

    figs, curves = figures(report)
    head = report.headline_figure
    headline_fig = {"caption": head.caption, "svg": Markup(plots.render_figure(head))} if head is not None else None
    script_hash = base64.b64encode(hashlib.sha256(BROWSER_SCRIPT.encode()).digest()).decode()
    with _cells_of(report):
        return environment(str(templates_dir()), True).get_template("report/report.html.j2").render(
            r=report, figs=figs, curves=curves, browser_json=browser_data(report),
            browser_script=Markup(BROWSER_SCRIPT), script_hash=script_hash, headline_fig=headline_fig)
