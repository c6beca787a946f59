"""The labelled benchmark (tools/labelled_runs.py) on its reported seeds, which set no threshold:
each failure run (collapse, length-paying, format-only, a wrong answer key) gets its right finding
at warn or above within 4 steps of its ground-truth onset at 8 prompt groups x 8 completions a step
(issue #60's ruling: at this batch 3 steps is a limit of power), never more than 3 steps before it,
and no healthy seed has a warning at any prefix; `check` itself is run on every prefix of every
run. About 4-8 minutes on 2 CPU cores. The larger batch (32 x 8, within 3 steps) runs outside CI:
`python tools/labelled_runs.py --groups 32`, its result saved in bench/results/labelled_delays.json."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import labelled_runs  # noqa: E402

slow = pytest.mark.slow
DELAYS = REPO / "bench" / "results" / "labelled_delays.json"


def test_the_seeds_that_report_set_nothing():
    for mode in labelled_runs.MODES:
        assert not set(labelled_runs.TUNING_SEEDS[mode]) & set(labelled_runs.REPORTED_SEEDS[mode]), mode
    assert len(labelled_runs.REPORTED_SEEDS["healthy"]) >= 5
    assert set(labelled_runs.FAILURES) == set(labelled_runs.RIGHT) and len(labelled_runs.FAILURES) >= 4
    for mode, seeds in labelled_runs.REPORTED_SEEDS_LARGE.items():
        assert not set(labelled_runs.TUNING_SEEDS[mode]) & set(seeds), mode


def test_the_ruling_is_the_tools():
    """Issue #60's ruling: at 8 x 8 the right finding within 4 steps of the onset; at 32 x 8 within 3;
    a warning more than 3 steps before the onset is false at either batch."""
    assert labelled_runs.WITHIN_AT == {8: 4, 32: 3} and labelled_runs.EARLY == 3


def test_the_saved_delays_are_the_rules_read_on_their_own_series():
    """bench/results/labelled_delays.json (`--both --json`, read by tools/power_vs_labelled.py): both
    batches, every run's keys, and each onset is the ground-truth rule worked again here on the
    run's own saved per-step means, so a file whose onsets or series were edited apart fails."""
    runs = json.loads(DELAYS.read_text())
    assert {r["batch"] for r in runs} == {"8x8", "32x8"}
    for r in runs:
        assert {"batch", "groups", "completions", "mode", "seed", "onset", "detected_step", "finding", "series",
                "steps"} <= set(r), r.keys()
        assert r["batch"] == f"{r['groups']}x{r['completions']}" and r["completions"] == 8, r["batch"]
        assert {"correct", "length_tokens", "reward"} <= set(r["series"]), (r["mode"], r["seed"])
        assert all(len(v) == r["steps"] == labelled_runs.STEPS for v in r["series"].values()), (r["mode"], r["seed"])
        onsets = {}
        for rule, (feature, direction, fraction) in labelled_runs.RULES.items():
            x = r["series"][feature]
            base = sum(x[:3]) / 3
            bad = [direction * (v - fraction * base) > 0 for v in x]
            onsets[rule] = next((t for t in range(3, len(x) - 2) if bad[t] and bad[t + 1] and bad[t + 2]), None)
        if r["mode"] == "healthy":
            assert r["onset"] is None, (r["seed"], onsets)
        else:
            assert r["onset"] == onsets[labelled_runs.RULE_OF[r["mode"]]], (r["mode"], r["seed"], r["onset"], onsets)
            assert r["finding"] == labelled_runs.RIGHT[r["mode"]], r
        seeds = labelled_runs.REPORTED_SEEDS if r["groups"] == 8 else labelled_runs.REPORTED_SEEDS_LARGE
        assert r["seed"] in seeds[r["mode"]], (r["mode"], r["seed"])  # reported seeds only: none set a threshold


def test_the_docs_quote_the_saved_runs():
    """docs/findings.md's labelled block and the saved delays come from the same runs: each table
    row's onset and first warning are the file's."""
    text = (REPO / "docs" / "findings.md").read_text()
    block = re.search(r"<!-- labelled-table:start -->\n(.*?)<!-- labelled-table:end -->", text, re.S).group(1)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()
            if re.match(r"\| \d+ x 8 \|", line)]
    runs = {(f"{r['groups']} x 8", r["mode"], str(r["seed"])): r for r in json.loads(DELAYS.read_text())}
    assert len(rows) == len(runs)
    for batch, mode, seed, onset, _, first, *_ in rows:
        r = runs[(batch, mode, seed)]
        assert onset == ("—" if r["onset"] is None else str(r["onset"])), (batch, mode, seed)
        if mode != "healthy":
            assert first == "none" if r["detected_step"] is None else first.startswith(f"step {r['detected_step']} "), \
                (batch, mode, seed, first)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    rows = labelled_runs.reported(tmp_path_factory.mktemp("labelled"), progress=lambda *_: None)
    print()
    print(labelled_runs.table(rows))
    print(labelled_runs.summary(rows))
    return rows


@slow
@pytest.mark.parametrize("mode", labelled_runs.FAILURES)
def test_each_failure_run_gets_its_right_finding_on_time(scored, mode):
    rows = [r for r in scored if r.mode == mode]
    assert rows, mode
    for r in rows:
        assert r.groups == 8 and r.within == 4, (r.groups, r.within)
        assert r.truth.onset is not None, (r.mode, r.truth)  # the run failed as labelled
        assert r.detected, (r.mode, r.seed, r.truth.onset, r.first)
        assert r.delay <= 4, (r.mode, r.seed, r.truth.onset, r.first)
        right = labelled_runs.RIGHT[r.mode]
        assert right not in r.false_alarms, (r.mode, r.alarms[right])  # not before the failure began


@slow
def test_no_healthy_seed_warns_at_any_prefix(scored):
    healthy = [r for r in scored if r.mode == "healthy"]
    assert len(healthy) >= 5
    for r in healthy:
        assert not r.alarms, (r.seed, r.alarms)


@slow
def test_the_rates_the_docs_quote_are_the_scripts():
    text = (REPO / "docs" / "findings.md").read_text()
    block = re.search(r"<!-- findings-rates:start -->\n```\n(.*?)\n```\n<!-- findings-rates:end -->", text, re.S)
    assert block and block.group(1) == labelled_runs.rates(), "python tools/labelled_runs.py --rates"
