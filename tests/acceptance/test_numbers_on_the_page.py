"""Every number on a report's first screen -- the summary card and each book's headline, in
Markdown and HTML -- is a number of report.json, written by one of the page's formats: no
sentence recounts or rounds on its own, so two sentences cannot disagree.

Two checks. ``SLOTS`` maps each sentence's number slots (templates/report/card.j2, the books'
headlines) to the report.json field each reports and the filter that writes it: every occurrence
of a mapped sentence on the page must state exactly that field, so a wrong number fails (a number
of the right kind from another field no longer passes). Every other number on the first screen
must at least be some value of report.json (the pool check): a sentence not yet mapped is held to
that until it is added to ``SLOTS`` -- one line each."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from reward_lens.examples import example_features, example_record
from reward_lens.measure.ledger.features import features_from
from reward_lens.record import open_run
from reward_lens.report import build_report
from reward_lens.report.render import fmt, to_html, to_json, to_markdown
from reward_lens_spec.render import format_nats, percent

# Numbers the page states that are the method's, not the run's: the false discovery rate of
# every decision, an interval's coverage, and the two prompt groups a paired ledger needs.
CONSTANTS = {"0.05", "95", "2"}
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?: %)?")


def _leaves(obj, out: set[str]) -> set[str]:
    if isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)
    elif isinstance(obj, bool) or obj is None:
        pass
    elif isinstance(obj, int):
        out.add(str(obj))
    elif isinstance(obj, float):
        out |= {format_nats(obj), fmt(obj), fmt(obj, 3), percent(obj), f"{obj:+.3g}", f"{obj:.3g}"}
    return out


# A run id is hex digits, not a number of the run: one that starts with a digit ("run:443efe88…")
# would read as 443 in the title
RUN_ID = re.compile(r"run:[0-9a-f]+…?")


def _first_screen_md(md: str) -> str:
    """The summary (card and book table) of the Markdown report, code spans and run ids removed."""
    head = md.split("\n## Run\n")[0]
    return RUN_ID.sub("", re.sub(r"`[^`]*`", "", head))


def _first_screen_html(page: str) -> str:
    card = page.split('<section id="summary-card"', 1)[1].split("</section>", 1)[0]
    card = card.split('<figure id="headline-figure">')[0]  # the figure's axis ticks are drawn, not stated
    table = page.split('<section id="book-status-table">', 1)[1].split("</section>", 1)[0]
    text = re.sub(r"<code>.*?</code>", "", card + table)
    return RUN_ID.sub("", html.unescape(re.sub(r"<[^>]+>", " ", text)))


# ------------------------------------------------------------------ the map: sentence slot -> field
# Each entry is a sentence of the first screen as a pattern, its number slots written
# {field:filter}. field: a path into report.json (dots; a list element by index, or by
# [key=value] where value may be $name, a slot captured before it in the same sentence); the
# prefixes below abbreviate the books' summaries. filter: the template's (num3, pct, int, or a
# format spec such as +.3g); "name" captures a word (a behaviour) without checking it. Text
# outside the slots is a regular expression. Every entry must match on some bundled example
# (test_every_mapped_sentence_is_on_some_page), so a reworded sentence cannot leave its entry
# checking nothing.
PREFIX = {"cost.": "books[id=cost].data.summary.", "price.": "books[id=price].data.summary.",
          "effect.": "books[id=effect].data.summary.", "cause.": "books[id=cause].data.summary.",
          "agreement.": "books[id=agreement].data.summary."}
SLOTS = (
    # templates/report/card.j2
    r"moved the policy by a median of {glance.d_t_median:num3} nats",
    r"over the {glance.d_t_updates:int} updates measured, {glance.d_t_total:num3} nats in all",
    r"The changes in the {glance.features:int} named behaviours needed {glance.kl_min_total:num3} of those nats",
    r"needed {glance.kl_min_total:num3} of the {glance.eta_d_t:num3} nats spent at the {glance.eta_updates:int} of "
    r"those updates η is read on",
    r"η = {glance.eta_run:pct} \[{glance.eta_run_interval.0:pct}, {glance.eta_run_interval.1:pct}\], the share",
    r"`{f:name}` took {glance.shares[feature=$f].share:pct}",
    r"over the {glance.resolved:int} of {glance.priced:int} updates whose movement is",
    r"{glance.refused:int} of {glance.updates:int} updates are not read",
    # card.j2's windows (issue 62): single updates too noisy, eta over windows of consecutive updates
    r"their median 95 % interval is ±{glance.eta_headline.row_half_width:pct}\), so it is read over",
    r"each pooled until its interval is at most ±{glance.eta_headline.target:pct} \(half the run's η",
    r"{glance.eta_headline.windows_resolved:int} resolve it from 0",
    r"{glance.eta_headline.windows[first=$a].eta:pct} \[{glance.eta_headline.windows[first=$a].interval.0:pct}, "
    r"{glance.eta_headline.windows[first=$a].interval.1:pct}\] over steps {a:name}–"
    r"{glance.eta_headline.windows[first=$a].last:int} \({glance.eta_headline.windows[first=$a].updates:int}",
    # templates/report/cost_headline.j2
    r"needed \({cost.kl_min_total:num3} of {cost.d_t_total:num3} nats over {cost.d_t_updates:int} updates",
    r"needed \({cost.kl_min_total:num3} of the {cost.eta_d_t:num3} nats spent at the {cost.eta_updates:int} of "
    r"{cost.d_t_updates:int} updates η is read on",
    r"; {cost.d_t_total:num3} nats over all {cost.d_t_updates:int} updates",
    r"η = {cost.eta_run:pct} \[{cost.eta_run_interval.0:pct}, {cost.eta_run_interval.1:pct}\]",
    r"the movement is resolved from noise at {cost.kl_min_resolved:int} of {cost.kl_min_rows:int} updates",
    r"Single updates are too noisy for η \(median interval ±{books[id=cost].data.eta_headline.row_half_width:pct}\): "
    r"over windows of consecutive updates, each pooled until its interval is at most "
    r"±{books[id=cost].data.eta_headline.target:pct}, η is resolved from 0 at "
    r"{books[id=cost].data.eta_headline.windows_resolved:int} of",
    # templates/report/books/price.headline.j2
    r"{price.reward_per_nat:num3} ± {price.reward_per_nat_se:num3} reward units per nat of D_t "
    r"\({price.total_reward_change:+.3g} reward for {price.total_d:num3} nats over {price.rows:int} updates\)",
    r"the reward changes? of {price.rows_resolved:int} updates? (?:is|are) resolved",
    # templates/report/books/effect.headline.j2
    r"`{f:name}` {books[id=effect].data.drift[feature=$f].drift:+.3g} ",
    r"and {n:name} more \(first tenth of the steps to the last, resolved from noise over the {effect.features:int} "
    r"behaviours\)",
    r"one behaviour or more moved at {effect.rows_with_movement:int} of the {effect.rows:int} updates read",
    r"resolves it at {effect.rows_resolved:int}\)",
    r"{effect.cells_not_identified:int} times a behaviour was the same in every completion",
    # templates/report/books/cause.headline.j2
    r"At the {cause.rows_resolved:int} updates whose movement is resolved, {cause.fraction_along:pct} of what",
    # the findings' line above the card
    r"{findings_counts.clear:int} of {findings_counts.checked:int} checks clear",
)
SLOT = re.compile(r"\{([^{}:]+):([^{}]+)\}")
CAPTURE = {"pct": r"-?\d+ %|—", "int": r"\d+", "name": r"[\w.-]+"}
WRITE = {"num3": format_nats, "pct": percent, "int": lambda v: str(int(v))}


def _compile(entry: str) -> tuple[re.Pattern, list[tuple[str, str, str]]]:
    """The entry as a regular expression (one group a slot) and its slots (group, field, filter)."""
    slots, out, pos = [], [], 0
    for i, m in enumerate(SLOT.finditer(entry)):
        field, filt = m.group(1), m.group(2)
        for short, long in PREFIX.items():
            if field.startswith(short):
                field = long + field[len(short):]
        group = field if filt == "name" else f"s{i}"
        out.append(entry[pos:m.start()])
        out.append(f"(?P<{group}>{CAPTURE.get(filt, r'[-+]?[0-9][0-9.e+-]*')})")
        slots.append((group, field, filt))
        pos = m.end()
    out.append(entry[pos:])
    return re.compile("".join(out)), slots


def _field(data, path: str, names: dict[str, str]):
    """The value at ``path`` in report.json (KeyError/IndexError/StopIteration where it is not)."""
    for part in re.findall(r"[^.\[\]]+|\[[^\]]+\]", path):
        if part.startswith("["):
            key, value = part[1:-1].split("=", 1)
            value = names[value[1:]] if value.startswith("$") else value
            data = next(x for x in data if str(x.get(key)) == value)
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            data = data[part]
    return data


def _written(value, filt: str) -> str:
    return WRITE[filt](value) if filt in WRITE else format(value, filt)


def check_slots(text: str, data: dict) -> tuple[list[str], list[str]]:
    """(the entries that matched, a line for each slot whose number is not its field's)."""
    matched, wrong = [], []
    for entry in SLOTS:
        pattern, slots = _compile(entry)
        for m in pattern.finditer(text):
            matched.append(entry)
            names = {g: m.group(g) for g, _, f in slots if f == "name"}
            for group, field, filt in slots:
                if filt == "name":
                    continue
                try:
                    want = _written(_field(data, field, names), filt)
                except (KeyError, IndexError, StopIteration, TypeError, ValueError) as exc:
                    wrong.append(f"{m.group(0)!r}: {field} not in report.json ({exc!r})")
                    continue
                if m.group(group) != want:
                    wrong.append(f"{m.group(0)!r}: states {m.group(group)!r} where {field} is {want!r}")
    return matched, wrong


def _slot_text_md(md: str) -> str:
    """The first screen of the Markdown, code spans kept (a behaviour's name keys its slots)."""
    return md.split("\n## Run\n")[0]


def _slot_text_html(page: str) -> str:
    card = page.split('<section id="summary-card"', 1)[1].split("</section>", 1)[0]
    card = card.split('<figure id="headline-figure">')[0]
    table = page.split('<section id="book-status-table">', 1)[1].split("</section>", 1)[0]
    text = re.sub(r"<code>(.*?)</code>", r"`\1`", card + table)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


# the bundled examples (windowed: the tap's default budget, where windows of updates lead eta and the
# updates the tap left unmeasured are refused), and a hand-made record with a step of one rollout: the
# card's sentence about refused updates is mapped on both
EXAMPLE_NAMES = ["gamed", "task", "paired", "tapped", "long", "windowed", "one_rollout"]


_REPORTS: dict[str, object] = {}


def _report(name: str, tmp: Path):
    """The report of an example, built once for every test of this file (each takes seconds)."""
    if name not in _REPORTS:
        if name == "one_rollout":
            from tests.conftest import tiny_record, varied_completions

            steps = {s: varied_completions(s, n=12) for s in range(6)}
            steps[3] = steps[3][:1]
            rec = tiny_record(tmp / "one", steps, kl_to_previous={s: 50.0 for s in range(6)})
            _REPORTS[name] = build_report(open_run(rec))
        else:
            spec = example_features(name)
            _REPORTS[name] = build_report(open_run(example_record(name)),
                                          features=features_from(str(spec) if spec else None))
    return _REPORTS[name]


@pytest.fixture(scope="module", params=EXAMPLE_NAMES)
def page(request, tmp_path_factory):
    name = request.param
    report = _report(name, tmp_path_factory.mktemp(name))
    return name, report, json.loads(to_json(report)), to_markdown(report), to_html(report)


MATCHED: dict[str, set[str]] = {}


def test_each_mapped_sentence_states_its_own_field(page):
    name, _, data, md, page_html = page
    for view, text in (("md", _slot_text_md(md)), ("html", _slot_text_html(page_html))):
        matched, wrong = check_slots(text, data)
        MATCHED.setdefault(name, set()).update(matched)
        assert matched, (name, view, "no mapped sentence on the first screen")
        assert not wrong, (name, view, wrong)


def test_every_mapped_sentence_is_on_some_page(tmp_path):
    """Run after the test above on every example (pytest keeps file order): an entry that matches
    nowhere checks nothing -- its sentence was reworded or removed, and the map must follow."""
    for name in sorted(set(EXAMPLE_NAMES) - set(MATCHED)):  # those not read above (run on its own)
        report = _report(name, tmp_path)
        data = json.loads(to_json(report))
        for text in (_slot_text_md(to_markdown(report)), _slot_text_html(to_html(report))):
            MATCHED.setdefault(name, set()).update(check_slots(text, data)[0])
    seen = set().union(*MATCHED.values())
    assert not [e for e in SLOTS if e not in seen], [e for e in SLOTS if e not in seen]


def test_a_wrong_number_in_a_mapped_slot_fails():
    """The check on a page written here: the right numbers pass; one number replaced by another
    of report.json's (the pool check would let it through) fails, naming the field."""
    data = {"glance": {"d_t_median": 0.0327, "d_t_updates": 99, "d_t_total": 4.82, "eta_run": 0.09,
                       "eta_run_interval": [-0.03, 0.2], "shares": [{"feature": "correct", "share": 0.78},
                                                                   {"feature": "format_ok", "share": 0.11}]},
            "books": [{"id": "cost", "data": {"summary": {"eta_run": 0.09, "eta_run_interval": [-0.03, 0.2]}}}]}
    right = ("Each update moved the policy by a median of 0.0327 nats; over the 99 updates measured, 4.82 nats in "
             "all. η = 9 % [-3 %, 20 %], the share. Of it, `correct` took 78 % and `format_ok` took 11 %.")
    matched, wrong = check_slots(right, data)
    assert len(matched) == 6 and not wrong, (matched, wrong)  # the interval is the card's and the cost book's
    for bad, field in ((right.replace("`format_ok` took 11 %", "`format_ok` took 78 %"), "glance.shares[feature=$f]"),
                       (right.replace("over the 99 updates", "over the 78 updates"), "glance.d_t_updates"),
                       (right.replace("[-3 %, 20 %]", "[-3 %, 9 %]"), "glance.eta_run_interval.1")):
        _, wrong = check_slots(bad, data)
        assert wrong and all(field in w or "cost" in w for w in wrong) and any(field in w for w in wrong), wrong


@pytest.mark.parametrize("name", ["gamed", "task", "paired", "tapped", "long", "windowed"])
def test_every_number_on_the_first_screen_is_in_report_json(name, tmp_path):
    report = _report(name, tmp_path)
    data = json.loads(to_json(report))
    allowed = _leaves(data, set()) | CONSTANTS
    # the findings cite their literature (years, a formula's constants): quoted, not the run's numbers
    allowed |= {n for f in data["findings"] for n in NUMBER.findall(f.get("reference") or "")}
    for view, text in (("md", _first_screen_md(to_markdown(report))), ("html", _first_screen_html(to_html(report)))):
        found = [m.group(0) for m in NUMBER.finditer(text)]
        stray = sorted({n for n in found if n not in allowed and n.lstrip("+") not in allowed})
        assert found and not stray, (name, view, stray)
