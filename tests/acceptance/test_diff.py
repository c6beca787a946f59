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
    assert "| frac\\_lower |" in md and "η of the run (ratio of sums) [95 %]" in md
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
    # issue 61 item 13: the refusal is the answer; no diff.* files are written
    assert not (tmp_path / "d").exists()


def test_bad_input_is_named(tmp_path):
    r = _cli("diff", str(tmp_path / "nope"), str(FIX / "short"), "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "nope" in r.stderr and not (tmp_path / "d").exists()


def _report_dir(tmp_path, name="a"):
    out = tmp_path / name
    assert _cli("report", str(FIX / "paired"), "--out", str(out), "--quiet", "--fail-on", "never").returncode == 0
    return out


def test_markup_in_a_report_json_is_escaped_in_every_format(tmp_path):
    """A report directory is data someone may send: nothing from it becomes markup (issue 31)."""
    a, b = _report_dir(tmp_path, "a"), _report_dir(tmp_path, "b")
    tag = '<img src=x onerror=alert(1)>'
    data = json.loads((b / "report.json").read_text())
    data["run"]["run_id"] = tag + "`|"
    for book in data["books"]:
        if book["id"] == "agreement" and book["data"]:
            for f in book["data"]["features"]:
                f["verdict"] = tag
        if book["id"] == "cost" and book["data"]:
            book["data"]["summary"]["ledger_fallback"] = tag  # text where text belongs (a count refuses: typed)
        book["status"] = book["status"]
    (b / "report.json").write_text(json.dumps(data))
    r = _cli("diff", str(a), str(b), "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    for name in ("diff.md", "diff.html"):
        text = (tmp_path / "d" / name).read_text()
        assert "<img" not in text, name
    assert "&lt;img" in (tmp_path / "d" / "diff.md").read_text()


def test_a_report_json_of_the_wrong_shape_is_bad_input_naming_it(tmp_path):
    a, b = _report_dir(tmp_path, "a"), _report_dir(tmp_path, "b")
    data = json.loads((b / "report.json").read_text())
    for book in data["books"]:
        if book["id"] == "agreement":
            book["data"]["features"] = book["data"]["features"][:2]  # a shortened feature list
    (b / "report.json").write_text(json.dumps(data))
    r = _cli("diff", str(a), str(b), "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "report.json" in r.stderr and "agreement" in r.stderr, r.stderr
    data = json.loads((a / "report.json").read_text())
    for book in data["books"]:
        if book["id"] == "cost":
            book["data"]["kl_min"] = "a string"  # a wrong type inside a book
    (b / "report.json").write_text(json.dumps(data))
    r = _cli("diff", str(a), str(b), "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "report.json" in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()


def test_diff_never_writes_over_an_input(tmp_path):
    a = _report_dir(tmp_path, "a")
    before = {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()}
    for out in (a, a / "sub"):
        r = _cli("diff", str(a), str(FIX / "paired"), "--out", str(out))
        assert r.returncode == 2 and "--out" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()} == before


def test_features_that_apply_to_neither_input_are_refused(tmp_path):
    a, b = _report_dir(tmp_path, "a"), _report_dir(tmp_path, "b")
    r = _cli("diff", str(a), str(b), "--features", str(REPO / "examples" / "features" / "task.yaml"),
             "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "--features" in r.stderr and "neither" in r.stderr, r.stderr
