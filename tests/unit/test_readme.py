"""README's promises: the two commands are where .ci/run looks, and its numbers are the
published reports' numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _block(name: str) -> str:
    m = re.search(rf"<!-- {name}:start -->\n```\n(.+?)\n```\n<!-- {name}:end -->", README, re.S)
    assert m, name
    return m.group(1)


def test_two_commands_exist_and_pin_torch_where_torch_is_installed():
    main, test = _block("main-command"), _block("test-command")
    assert "reward-lens report --example long" in main and "torch" not in main  # the core needs no torch
    assert "torch==2.13.0" in test and "pytest" in test
    assert "test-command:start" in (REPO / ".ci" / "run").read_text()


def test_measured_table_matches_the_published_reports():
    for name in ("long", "short", "tapped", "paired"):
        (path,) = (REPO / "reports" / "runs").glob(f"{name}-*/report.json")
        book = next(b for b in json.loads(path.read_text())["books"] if b["id"] == "cost")
        s = book["data"]["summary"]
        row = next(l for l in README.splitlines() if l.startswith(f"| {name} ("))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].split(",")[0] == s["ledger"]
        if s["eta_median"] is not None:
            lo, hi = s["eta_interval"]
            assert cells[3] == f"η = {s['eta_median']:.2f} [{lo:.2f}, {hi:.2f}]"
        assert cells[4] == " / ".join(str(s[k]) for k in ("rows_resolved", "rows_unresolved", "rows_refused",
                                                           "rows_nothing_priced"))
        assert cells[5] == f"{s['kl_min_resolved']} of {s['kl_min_rows']}"


def test_ledger_table_is_the_scripts_output():
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from ledger_resolution import resolution, table

    m = re.search(r"<!-- ledger-table:start -->\n(.+?)\n<!-- ledger-table:end -->", README, re.S)
    record = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    res = resolution(record)
    assert m and m.group(1) == table(record, res)
    # The paired ledger resolves at least as much of the run as the unpaired one at every W.
    for w in (1, 4, 8):
        assert res["paired"][w]["resolved"] >= res["unpaired"][w]["resolved"]
    assert res["paired"][1]["resolved"] > 0
