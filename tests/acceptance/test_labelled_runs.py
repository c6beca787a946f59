"""The labelled benchmark (tools/labelled_runs.py) on its reported seeds, which set no threshold:
each failure run (collapse, length-paying, format-only, a wrong answer key) gets its right finding
at warn or above within 3 steps of its ground-truth onset, and no healthy seed has a warning at any
prefix; `check` itself is run on every prefix of every run. About 4-8 minutes on 2 CPU cores."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import labelled_runs  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_seeds_that_report_set_nothing():
    for mode in labelled_runs.MODES:
        assert not set(labelled_runs.TUNING_SEEDS[mode]) & set(labelled_runs.REPORTED_SEEDS[mode]), mode
    assert len(labelled_runs.REPORTED_SEEDS["healthy"]) >= 5
    assert set(labelled_runs.FAILURES) == set(labelled_runs.RIGHT) and len(labelled_runs.FAILURES) >= 4


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    rows = labelled_runs.reported(tmp_path_factory.mktemp("labelled"), progress=lambda *_: None)
    print()
    print(labelled_runs.table(rows))
    print(labelled_runs.summary(rows))
    return rows


# Measured on the reported seeds (docs/findings.md's table): the format-only run's proxy gaming holds
# 4 steps after its ground-truth onset (correctness falls by a quarter at step 8; the finding needs a
# fall of 0.4 of its spread with the reward holding up, reached at step 12). A known miss, said so in
# the report of issue #39; strict, so the day it passes this mark must go.
LATE = {"format_only": "proxy gaming holds 4 steps after the ground-truth onset on seed 3001 (measured)"}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=LATE[m])) if m in LATE
                                  else m for m in labelled_runs.FAILURES])
def test_each_failure_run_gets_its_right_finding_on_time(scored, mode):
    for r in scored:
        if r.mode != mode:
            continue
        assert r.truth.onset is not None, (r.mode, r.truth)  # the run failed as labelled
        assert r.detected, (r.mode, r.seed, r.truth.onset, r.first)
        right = labelled_runs.RIGHT[r.mode]
        assert right not in r.false_alarms, (r.mode, r.alarms[right])  # not before the failure began


@pytest.mark.parametrize("mode", sorted(LATE))
def test_a_late_run_is_late_by_no_more_than_measured(scored, mode):
    """The strict xfail above covers a whole labelled case: a run whose finding never held, or held
    before its failure began, would fail it too and stay hidden. The miss as measured, a bound
    that fails if exceeded: the right finding holds, 4 steps after the ground-truth onset at most
    (LATE's words), never before the failure began."""
    rows = [r for r in scored if r.mode == mode]
    assert rows, mode
    for r in rows:
        assert r.truth.onset is not None, (r.mode, r.truth)
        assert r.delay is not None and 0 <= r.delay <= 4, (r.mode, r.seed, r.truth.onset, r.first)
        assert labelled_runs.RIGHT[r.mode] not in r.false_alarms, (r.mode, r.alarms[labelled_runs.RIGHT[r.mode]])


def test_no_healthy_seed_warns_at_any_prefix(scored):
    healthy = [r for r in scored if r.mode == "healthy"]
    assert len(healthy) >= 5
    for r in healthy:
        assert not r.alarms, (r.seed, r.alarms)


def test_the_rates_the_docs_quote_are_the_scripts():
    text = (REPO / "docs" / "findings.md").read_text()
    block = re.search(r"<!-- findings-rates:start -->\n```\n(.*?)\n```\n<!-- findings-rates:end -->", text, re.S)
    assert block and block.group(1) == labelled_runs.rates(), "python tools/labelled_runs.py --rates"
