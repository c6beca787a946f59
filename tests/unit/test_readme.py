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
    for name in ("long", "short", "tapped"):
        (path,) = (REPO / "reports" / "runs").glob(f"{name}-*/report.json")
        s = json.loads(path.read_text())["books"][0]["cost"]["summary"]
        row = next(l for l in README.splitlines() if l.startswith(f"| {name} ("))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == str(s["kl_min_rows"]) and cells[4] == str(s["clear_noise_floor"])
        assert cells[5] == f"{s['median_kl_min']:.2f} / {s['median_noise_floor']:.2f}"
        refused = s["refused_pairs"]
        if s["efficiency_rows"]:
            assert f"η for {s['efficiency_rows']} step pairs (median {s['median_efficiency']:.3f})" in cells[2]
            assert f"for {refused}" in cells[2]
        else:
            assert f"for {refused} step pairs" in cells[2]
