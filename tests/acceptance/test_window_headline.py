"""Issue 62's acceptance line: on a run of 64 rollouts a step recorded by the tap at its default
budget (tests/fixtures/grpo_run/windowed, tools/make_window_record.py), the first screen states eta
over windows that resolve, with their span; the cost book leads with the same windows; per-update
rows stay as detail, labelled unresolved where they are; the run-level interval stays; and
Markdown, HTML and report.json agree."""

from __future__ import annotations

import html
import json
import re

import pytest

from reward_lens.examples import example_record
from reward_lens.record import open_run
from reward_lens.report import build_report, to_html, to_json, to_markdown
from reward_lens_spec.render import percent


@pytest.fixture(scope="module")
def pages():
    run = open_run(example_record("windowed"))
    report = build_report(run)
    return run, report, json.loads(to_json(report)), to_markdown(report), to_html(report)


def test_the_record_is_what_the_acceptance_line_names(pages):
    run, _, data, _, _ = pages
    m = run.manifest
    assert m.trainer_config["per_device_train_batch_size"] == 64 and m.trainer_config["num_generations"] == 8
    # the tap at its default budget: 0.1 of an untapped step, measuring whole pairs (as budget=None
    # measures one: every group, 4 + 4) on a share of the steps and leaving the rest
    assert set(run.telemetry_column("tap_budget").values()) == {0.1}
    tap = next(b for b in data["books"] if b["id"] == "cost")["data"]["tap"]
    assert tap["budget"] == 0.1 and tap["groups"] == tap["groups_total"] and tap["per_group"] == 4
    assert tap["skipped"] > tap["step_pairs"] / 2


def test_few_single_updates_resolve_and_windows_lead(pages):
    from reward_lens.measure.decisions import ROWS_RESOLVED_SHARE

    _, _, data, _, _ = pages
    g = data["glance"]
    # per update: fewer resolved from noise than would let the rows lead
    assert g["priced"] > 0 and g["resolved"] < ROWS_RESOLVED_SHARE * g["priced"]
    h = g["eta_headline"]
    assert h["lead"] == "windows" and h["windows_resolved"] >= 1
    assert h["row_half_width"] > h["target"]
    for w in h["windows"]:
        assert w["last"] > w["first"] and w["span"] == w["last"] - w["first"] and 1 <= w["updates"] <= w["span"]
        assert w["resolved"] == (w["interval"] is not None and w["interval"][0] > 0)
    # the windows partition the updates eta is read on, in step order
    assert sum(w["updates"] for w in h["windows"]) == g["eta_updates"]
    assert all(a["last"] <= b["first"] for a, b in zip(h["windows"], h["windows"][1:]))
    # the run-level interval stays, and the cost book reads the same decision
    assert g["eta_run_interval"] is not None
    cost = next(b for b in data["books"] if b["id"] == "cost")["data"]
    assert cost["eta_headline"] == h


def _card_text_md(md: str) -> str:
    return md.split("\n## Run\n")[0]


def _card_text_html(page: str) -> str:
    card = page.split('<section id="summary-card"', 1)[1].split("</section>", 1)[0]
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", card)))


def test_the_first_screen_states_eta_over_the_resolved_windows_with_their_span(pages):
    _, _, data, md, page = pages
    h = data["glance"]["eta_headline"]
    for text in (_card_text_md(md), _card_text_html(page)):
        assert f"read over {len(h['windows'])} windows of consecutive updates" in text
        assert f"{h['windows_resolved']} resolve it from 0 — " in text
        for w in [w for w in h["windows"] if w["resolved"]][:3]:
            lo, hi = w["interval"]
            span = (f"{w['updates']} of the {w['span']} updates in its span" if w["updates"] < w["span"]
                    else f"{w['updates']} updates")
            stated = (f"{percent(w['eta'])} [{percent(lo)}, {percent(hi)}] over steps {w['first']}–{w['last']} "
                      f"({span}")
            assert stated in text, (stated, text)
        # the run's own eta and interval are still there
        lo, hi = data["glance"]["eta_run_interval"]
        assert f"η = {percent(data['glance']['eta_run'])} [{percent(lo)}, {percent(hi)}]" in text


def test_the_cost_book_leads_with_the_windows_and_keeps_each_update_as_detail(pages):
    _, report, data, md, page = pages
    cost = next(b for b in data["books"] if b["id"] == "cost")
    h = cost["data"]["eta_headline"]
    assert f"η is resolved from 0 at {h['windows_resolved']} of {len(h['windows'])} windows" in cost["headline"]
    # the windows table comes before the per-update table, one row per window, in md and html
    assert md.index("### η over windows of consecutive updates") < md.index("### Efficiency per step pair")
    assert page.index('id="cost-windows"') < page.index('id="cost-efficiency"')
    for w in h["windows"]:
        assert f"| {w['first']}–{w['last']} | {w['updates']}" in md
        assert f"<td>{w['first']}–{w['last']}</td>" in page
    # every per-update row is there, labelled with its status (a few resolved here, most not)
    eff = cost["data"]["efficiency"]
    assert set(eff["status"]) <= {"resolved", "unresolved"} and "unresolved" in eff["status"]
    body = md.split("### Efficiency per step pair", 1)[1].split("###", 1)[0]
    for status in ("resolved", "unresolved"):
        assert body.count(f"| {status} |") == eff["status"].count(status)
