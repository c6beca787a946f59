"""The remedy for a tapped record whose budget left step pairs unread names `budget=`, says what
this run's budget bought and what a larger one bought on the cost-precision curve -- never "record
`logp_pre` and `logp_prev` on every rollout" to someone already using the tap (issue 57, item 7).

The record (tests/fixtures/tap_floor/README.md) was written by the tap at a budget below its own
fixed cost: the budget's floor measured a quarter of the pairs after the first two, whole and
two-sided, and the rest are refused ``not_measured``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from reward_lens.measure.efficiency.section import larger_budgets
from reward_lens.record.reader import open_run
from reward_lens.record.schema import tap_floor
from reward_lens.report import build_report
from reward_lens.report.render import to_json
from reward_lens_spec.paths import specs_dir
from reward_lens_spec.render import first_sentence, percent

RECORD = Path(__file__).resolve().parents[1] / "fixtures" / "tap_floor" / "record"


def test_the_record_is_the_floor_s():
    t = open_run(RECORD).telemetry.to_pydict()
    later = range(2, 11)
    assert t["tap_budget"][0] == 1e-4 and [t["tap_probability"][i] for i in later] == [tap_floor(4)] * 9
    measured = [i for i in later if t["tap_groups"][i]]
    assert measured and all(t["tap_per_group"][i] == 4 and t["tap_groups"][i] == t["tap_groups_total"][i]
                            for i in measured)


def test_a_tapped_record_s_remedy_names_the_budget_and_what_it_bought():
    report = json.loads(to_json(build_report(open_run(RECORD))))
    cost = next(b for b in report["books"] if b["id"] == "cost")
    unread = [r for r in cost["refusals"] if r["context"].get("reason") == "not_measured"]
    assert len(unread) == 1
    r = unread[0]
    tap = cost["data"]["tap"]
    n = len(r["step_pairs"])
    assert n == tap["skipped"] == 11 - (tap["step_pairs"] - tap["skipped"])
    lead = first_sentence(r["remedy"])
    curve = yaml.safe_load((specs_dir() / "cost_precision.yaml").read_text())["rows"]
    larger = [c for c in curve if not c["own"] and (c["budget"] is None or c["budget"] > 1e-4)]
    assert lead.startswith("Raise the tap's `budget=`")
    assert f"at this run's `budget=0.0001` it measured {tap['step_pairs'] - tap['skipped']} of 11 step pairs" in lead
    assert f"left these {n} unread" in lead
    assert f"{larger[0]['eta_width']} wide at `budget={larger[0]['budget']}` ({percent(larger[0]['measured'])} of the pairs)" in lead
    assert f"{larger[-1]['eta_width']} at `budget=None` (100 %)" in lead
    assert "measured every pair" not in lead  # the curve's 0.25 measured a share of them (issue 62's budget)
    assert f"{tap['floored']} pairs were planned at the budget's floor" in r["remedy"]
    for c in larger:  # every larger budget's precision, as the curve has it
        assert f"D_t relative SE of {c['rel_se']} and a run-level η interval {c['eta_width']} wide" in r["remedy"]
    assert "logp_pre" not in r["remedy"]
    # the first screen leads with the same lever
    assert any(lead in line for line in report["card"])
    assert not any("logp_pre" in line for line in report["card"])


def test_a_larger_budget_is_larger():
    assert larger_budgets(None)["rows"] == []
    rows = larger_budgets(0.3)["rows"]
    assert [r["budget"] for r in rows] == [0.5, None]
    assert all(not r["own"] for r in larger_budgets(0.01)["rows"])


def test_pairs_the_budget_left_do_not_fail_the_default_gate(tmp_path):
    """The tap did what its budget told it: the record is whole, so `--fail-on incomplete` (the
    default) passes; `--fail-on refused` still counts the unread pairs."""
    from reward_lens import cli

    args = ["report", str(RECORD), "--format", "json", "--quiet"]
    assert cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "b"), "--fail-on", "refused"]) == 1
