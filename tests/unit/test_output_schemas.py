"""Every JSON reward-lens writes validates against the schema file it names, read as JSON Schema
by an independent validator (jsonschema), not by the pydantic models that generate both: a
field the output leaves out, or a type it writes that the schema does not allow, fails here
(issue 42: diff.json never validated against diff.schema.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from reward_lens import cli
from reward_lens.report.diff import diff_json, diff_reports, read_report

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "specs" / "schemas"


def _validate(instance, schema_path: Path) -> None:
    schema = json.loads(schema_path.read_text())
    Draft202012Validator.check_schema(schema)
    errors = sorted(Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, f"{schema_path.name}: " + "; ".join(
        f"{'/'.join(map(str, e.path))}: {e.message[:200]}" for e in errors[:5])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = {}
    for name in ("short", "tapped"):
        d = tmp_path_factory.mktemp(name) / "report"
        assert cli.main(["report", "--example", name, "--out", str(d), "--quiet", "--format", "json",
                         "--fail-on", "never"]) == 0
        out[name] = d
    return out


@pytest.mark.parametrize("name", ["short", "tapped"])
def test_report_json_and_every_books_data_validate(reports, name):
    data = json.loads((reports[name] / "report.json").read_text())
    _validate(data, REPO / "reports" / "report.schema.json")
    for book in data["books"]:
        if book["data"] is not None:
            _validate(book["data"], SCHEMAS / "books" / f"{book['id']}.schema.json")


def test_diff_json_validates_compared_and_refused(reports, tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["diff", str(reports["short"]), str(reports["tapped"]), "--out", str(out), "--quiet",
                     "--format", "json"]) == 0
    compared = json.loads((out / "diff.json").read_text())
    assert compared["status"] == "compared" and compared["books"]
    _validate(compared, SCHEMAS / "diff.schema.json")
    a, b = read_report(reports["short"]), read_report(reports["tapped"])
    other = b.model_copy(update={"basis": b.basis.model_copy(update={"id": "basis:000000000000"})})
    refused = json.loads(diff_json(diff_reports(a, other, ("a", "b"))))
    assert refused["status"] == "refused"
    _validate(refused, SCHEMAS / "diff.schema.json")


@pytest.mark.parametrize("source", ["config", "record"])
def test_audit_json_validates(tmp_path, capsys, source):
    if source == "config":
        path = tmp_path / "c.yaml"
        path.write_text("num_generations: 8\nlogging_steps: 1\nlog_completions: true\nmax_steps: 20\nbeta: 0.04\n")
    else:
        path = REPO / "tests" / "fixtures" / "grpo_run" / "short"
    cli.main(["audit", str(path), "--format", "json"])
    _validate(json.loads(capsys.readouterr().out), SCHEMAS / "audit.schema.json")


@pytest.mark.parametrize("example", ["short", "tapped"])
def test_check_json_validates(capsys, example):
    cli.main(["check", "--example", example, "--format", "json", "--quiet"])
    data = json.loads(capsys.readouterr().out)
    assert data["counts"]["checked"] == len(data["findings"]) > 0
    _validate(data, SCHEMAS / "check.schema.json")


def test_a_diff_json_with_a_books_data_would_fail_its_schema(reports, tmp_path):
    """The validator is not vacuous: an output the schema does not describe is caught."""
    a, b = read_report(reports["short"]), read_report(reports["tapped"])
    data = json.loads(diff_json(diff_reports(a, b, ("a", "b"))))
    data["books"][0]["data"] = [None, None]
    with pytest.raises(AssertionError, match="data"):
        _validate(data, SCHEMAS / "diff.schema.json")
