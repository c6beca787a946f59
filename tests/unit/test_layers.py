"""The layers import downward only (ARCHITECTURE.md): the record layer imports nothing above it,
the findings read no importer, and reward_lens_spec knows nothing of reward_lens. Every import
is read, the ones inside functions included (a deferred import is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABOVE_RECORD = ("reward_lens.audit", "reward_lens.findings", "reward_lens.measure", "reward_lens.taps",
                "reward_lens.report", "reward_lens.cli", "reward_lens.examples")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _offenders(folder: str, banned: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for f in sorted((ROOT / folder).rglob("*.py")):
        hits = sorted(m for m in _imports(f) if m.startswith(banned))
        if hits:
            bad[f.relative_to(ROOT).as_posix()] = hits
    return bad


def test_record_layer_imports_nothing_above_it():
    assert _offenders("reward_lens/record", ABOVE_RECORD) == {}


def test_findings_and_audit_read_no_importer_module_above_the_package():
    # the findings read notes from reward_lens.record.notes, never an importer
    assert not [m for m in _imports(ROOT / "reward_lens/findings.py") if m.startswith("reward_lens.record.importers")]


def test_spec_layer_knows_nothing_of_reward_lens():
    assert _offenders("reward_lens_spec", ("reward_lens.",)) == {}


def test_the_books_import_no_finding_audit_tap_report_or_cli():
    # the books circle (measure -> findings/report -> measure) stays out
    assert _offenders("reward_lens/measure", ("reward_lens.audit", "reward_lens.findings", "reward_lens.taps",
                                              "reward_lens.report", "reward_lens.cli")) == {}


def test_the_audit_and_findings_import_no_tap():
    # the audit validates a `reward_lens:` section with the tap's settings model, which lives in the
    # spec layer (reward_lens_spec/tap_settings.py) so that the audit needs nothing from the taps
    for f in ("reward_lens/audit.py", "reward_lens/findings.py", "reward_lens/power.py"):
        assert not [m for m in _imports(ROOT / f) if m.startswith("reward_lens.taps")], f
