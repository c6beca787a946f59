"""One set of numbers per record (issue 57, item 5): D_t, its total and the updates it is over
are the run's decisions', read on no feature, so every bundled example read in two bases quotes
the same total over the same updates on the card, in the cost book and in the price book, in the
JSON, the Markdown and the HTML alike. A book that can use only part of the updates (the cost
book's eta: where a named behaviour varies) says "of the X nats spent at the N of M updates", never
another "X nats over N updates".
"""

from __future__ import annotations

import html
import json
import re

import pytest
import yaml

from reward_lens.examples import example_features, example_names, example_record
from reward_lens.measure.ledger.features import SurfaceFeatures, features_from
from reward_lens.record.reader import open_run
from reward_lens.report import build_report
from reward_lens.report.render import to_html, to_json, to_markdown
from reward_lens_spec.paths import specs_dir

# Every sentence that quotes a total of D_t says "X nats over N updates" (or "over all N
# updates"), or "over the N updates measured, X nats in all" (the card).
TOTAL = re.compile(r"([0-9][0-9.e+-]*) nats over (?:all )?([0-9]+) updates")
CARD = re.compile(r"over the ([0-9]+) updates measured, ([0-9][0-9.e+-]*) nats in all")


def _narrow_basis(tmp_path):
    """A second basis for a record without its own: three of the surface features, so the
    features that vary (and the updates that price something) differ from the surface basis'."""
    surface = yaml.safe_load((specs_dir() / "features" / "surface.yaml").read_text())
    keep = [d for d in surface["features"] if d["name"] in ("n_lines", "frac_upper", "frac_digit")]
    path = tmp_path / "narrow.yaml"
    path.write_text(yaml.safe_dump({"name": "narrow", "features": keep}))
    return features_from(path)


def _bases(name, tmp_path):
    own = example_features(name)
    return [SurfaceFeatures(), features_from(own) if own is not None else _narrow_basis(tmp_path)]


def _quoted(text: str) -> set[tuple[str, str]]:
    return {(x, n) for x, n in TOTAL.findall(text)} | {(x, n) for n, x in CARD.findall(text)}


def _pages(name, features):
    report = build_report(open_run(example_record(name)), features=features)
    return report, json.loads(to_json(report)), to_markdown(report), html.unescape(to_html(report))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "tapped" else pytest.mark.slow)
                                  for n in example_names()])
def test_every_page_quotes_one_spend_in_every_basis(name, tmp_path):
    seen = []
    for features in _bases(name, tmp_path):
        report, data, md, page = _pages(name, features)
        g = data["glance"]
        books = {b["id"]: b for b in data["books"]}
        cost = (books["cost"].get("data") or {}).get("summary") or {}
        price = (books["price"].get("data") or {}).get("summary") or {}
        total, updates = g["d_t_total"], g["d_t_updates"]
        # the JSON: the card's numbers, the cost book's and the price book's are one
        if total is None:
            assert updates == 0
            assert cost.get("d_t_total") is None and not price
            assert not TOTAL.findall(md) and not CARD.findall(md), "a page quotes a D_t total the run does not have"
        else:
            assert cost["d_t_total"] == total and cost["d_t_updates"] == updates
            assert price["d_t_total"] == total and price["d_t_updates"] == updates
            if price["rows"] == updates:
                assert price["total_d"] == pytest.approx(total, rel=1e-12)
            # eta's own denominator is part of the total, over part of the updates, and says so
            assert cost["eta_updates"] <= updates and cost["eta_d_t"] <= total * (1 + 1e-12)
            # the pages: every quoted total is the one total over the same updates
            words = {(f"{total:.3g}", str(updates))}
            for text in (md, page, " ".join(data["card"]), books["cost"]["headline"], books["price"]["headline"]):
                quoted = _quoted(text)
                assert quoted <= words, (quoted, words)
            assert _quoted(md) == words and _quoted(page) == words
            # the first screen's curve of what was spent ends at the same total
            fig = report.headline_figure
            spent = [x for p in fig.panels for x in p.series if x.label == "spent: Σ D_t"]
            assert len(spent) == 1 and len(spent[0].y) == updates
            assert spent[0].y[-1] == pytest.approx(total, rel=1e-12)
        seen.append((total, updates))
    assert seen[0] == seen[1], f"{name}: D_t total and updates differ by basis: {seen}"


def test_the_task_record_reads_every_update_in_both_bases():
    """The case the issue found: the task record in its own basis said 99 updates and 4.82 nats,
    in the surface basis 89 and 4.35 (the 10 updates where no surface feature varies within a
    prompt group were left out of the total)."""
    run = open_run(example_record("task"))
    kl = run.telemetry_column("kl_to_previous")
    from reward_lens.measure.books import RunContext

    for features in (features_from(example_features("task")), SurfaceFeatures()):
        d = RunContext(run, features).decisions
        assert d.d_t_updates == len(kl) == 99
        assert d.d_t_total == pytest.approx(sum(kl.values()), rel=1e-12)
