"""Every number on a report's first screen -- the summary card and each book's headline, in
Markdown and HTML -- is a number of report.json, written by one of the page's formats: no
sentence recounts or rounds on its own, so two sentences cannot disagree."""

from __future__ import annotations

import html
import json
import re

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


def _first_screen_md(md: str) -> str:
    """The summary (card and book table) of the Markdown report, code spans removed."""
    head = md.split("\n## Run\n")[0]
    return re.sub(r"`[^`]*`", "", head)


def _first_screen_html(page: str) -> str:
    card = page.split('<section id="summary-card"', 1)[1].split("</section>", 1)[0]
    card = card.split('<figure id="headline-figure">')[0]  # the figure's axis ticks are drawn, not stated
    table = page.split('<section id="book-status-table">', 1)[1].split("</section>", 1)[0]
    text = re.sub(r"<code>.*?</code>", "", card + table)
    return html.unescape(re.sub(r"<[^>]+>", " ", text))


@pytest.mark.parametrize("name", ["gamed", "task", "paired", "tapped", "long"])
def test_every_number_on_the_first_screen_is_in_report_json(name):
    spec = example_features(name)
    report = build_report(open_run(example_record(name)), features=features_from(str(spec) if spec else None))
    data = json.loads(to_json(report))
    allowed = _leaves(data, set()) | CONSTANTS
    # the findings cite their literature (years, a formula's constants): quoted, not the run's numbers
    allowed |= {n for f in data["findings"] for n in NUMBER.findall(f.get("reference") or "")}
    for view, text in (("md", _first_screen_md(to_markdown(report))), ("html", _first_screen_html(to_html(report)))):
        found = [m.group(0) for m in NUMBER.finditer(text)]
        stray = sorted({n for n in found if n not in allowed and n.lstrip("+") not in allowed})
        assert found and not stray, (name, view, stray)
