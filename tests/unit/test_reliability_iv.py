"""Issue 61 (the fourth hostile corpus): one test per item not covered by test_tap_calls.py and
test_tap_call_property.py. Each row of docs/reliability.md's issue-61 table names its test here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT = REPO / "tests" / "fixtures" / "grpo_run" / "short"


def _wide_basis(path: Path, k: int) -> Path:
    lines = ["name: wide", "features:"]
    for i in range(k):
        lines += [f"  - name: f{i}", "    kind: regex", f'    pattern: "{chr(97 + i)}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_item12_a_basis_past_the_exact_shapley_limit_is_refused_through_report(tmp_path):
    from reward_lens import cli
    from reward_lens.measure.efficiency import EXACT_MAX_FEATURES

    basis = _wide_basis(tmp_path / "wide.yaml", EXACT_MAX_FEATURES + 1)
    out = tmp_path / "rep"
    code = cli.main(["report", str(SHORT), "--features", str(basis), "--out", str(out), "--format", "json", "--quiet"])
    assert code == 1  # a refused book, not a crash (3) and not bad input (2)
    report = json.loads((out / "report.json").read_text())
    cost = next(b for b in report["books"] if b["id"] == "cost")
    assert cost["status"] == "refused"
    assert [r["code"] for r in cost["refusals"]] == ["LIMIT_EXCEEDED"]
    assert str(EXACT_MAX_FEATURES) in json.dumps(cost["refusals"][0])
