"""`reward-lens diff`: two runs' books side by side, only in one feature basis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reward_lens.measure.ledger.basis import load_basis
from reward_lens.measure.ledger.features import SurfaceFeatures

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "grpo_run"
CLI = [str(Path(sys.executable).with_name("reward-lens"))]


def _cli(*args):
    return subprocess.run(CLI + list(args), capture_output=True, text=True)


def test_two_records_side_by_side(tmp_path):
    r = _cli("diff", str(FIX / "paired"), str(FIX / "tapped"), "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert data["status"] == "compared" and data["basis"] == [SurfaceFeatures().basis_id] * 2
    assert [b["id"] for b in data["books"]] == ["agreement", "effect", "cause", "cost", "price"]
    md = (tmp_path / "d" / "diff.md").read_text()
    assert "| `frac_lower` |" in md and "η (median over resolved rows, debiased)" in md
    html = (tmp_path / "d" / "diff.html").read_text()
    assert 'id="diff-books"' in html and "<script" not in html


def test_different_bases_are_refused_naming_both(tmp_path):
    assert _cli("report", str(FIX / "short"), "--out", str(tmp_path / "short"), "--quiet").returncode in (0, 1)
    task = load_basis(REPO / "examples" / "features" / "task.yaml")
    r = _cli("diff", str(tmp_path / "short"), str(FIX / "task"), "--features", str(REPO / "examples" / "features" /
                                                                                     "task.yaml"),
             "--out", str(tmp_path / "d"))
    assert r.returncode == 1
    assert "UNIT_MISMATCH" in r.stdout and SurfaceFeatures().basis_id in r.stdout and task.basis_id in r.stdout
    data = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert data["status"] == "refused" and data["books"] == []


def test_bad_input_is_named(tmp_path):
    r = _cli("diff", str(tmp_path / "nope"), str(FIX / "short"), "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "nope" in r.stderr and not (tmp_path / "d").exists()
