"""The documentation: the site builds strictly (broken links and missing references fail), the
README fits on two screens and keeps its two commands, and every number a page quotes is the
output of the script that prints it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()


def _quote(path: Path, name: str) -> str:
    m = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", path.read_text(), re.S)
    assert m, f"{path.name} has no {name} block"
    return m.group(1)


def _fenced(text: str) -> str:
    return text.removeprefix("```\n").removesuffix("\n```")


def _block(name: str) -> str:
    m = re.search(rf"<!-- {name}:start -->\n```\n(.+?)\n```\n<!-- {name}:end -->", README, re.S)
    assert m, name
    return m.group(1)


def test_the_site_builds_strictly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    for page in ("index", "quickstart", "recording", "science", "books/cost", "cli", "reference/api"):
        assert (tmp_path / "site" / page / "index.html").is_file() or (tmp_path / "site" / f"{page}.html").is_file() \
            or (page == "index" and (tmp_path / "site" / "index.html").is_file()), page


def test_the_readme_fits_on_two_screens_and_keeps_its_two_commands():
    assert len(README.splitlines()) <= 150
    main, test = _block("main-command"), _block("test-command")
    assert "reward-lens report --example long" in main and "torch" not in main  # the core needs no torch
    assert "torch==2.13.0" in test and "pytest" in test
    assert "test-command:start" in (REPO / ".ci" / "run").read_text()
    assert (REPO / "docs" / "assets" / "first-screen.png").stat().st_size > 10_000  # the picture it shows


def test_the_readme_shows_the_task_reports_first_screen():
    from reward_lens.examples import example_features, example_record
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    report = build_report(open_run(example_record("task")), features=features_from(str(example_features("task"))))
    quoted = re.search(r"<!-- task-card:start -->\n(.*?)\n<!-- task-card:end -->", README, re.S).group(1)
    assert quoted == "\n\n".join(report.card)


def test_the_science_page_quotes_its_scripts():
    sys.path.insert(0, str(REPO / "tools"))
    import ledger_resolution
    import make_task_record
    import paired_vs_drift
    import reference_table

    science = DOCS / "science.md"
    paired = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    assert _quote(science, "ledger-table") == ledger_resolution.table(paired)
    assert _quote(science, "measured-table") == reference_table.table()
    task = make_task_record.summary_table() + "\n\n" + make_task_record.cost_table()
    assert _quote(science, "task-table") == task, "python tools/make_task_record.py --summary"
    assert _fenced(_quote(science, "drift-table")) == paired_vs_drift.text(
        "task", str(REPO / "examples" / "features" / "task.yaml"))
    assert _fenced(_quote(science, "drift-paired-table")) == paired_vs_drift.text("paired")


def test_the_findings_table_is_the_specs():
    from reward_lens.findings import findings_table

    assert _quote(DOCS / "findings.md", "findings-table") == findings_table()
    assert _quote(REPO / "README.md", "findings-table") == findings_table()


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_no_page_quotes_a_number_no_script_prints(page):
    """Numbers of runs live only in quoted blocks, which the tests above keep equal to their
    scripts: outside them a page states definitions and constants (q = 0.05, 95 %, 3 SE, ...)."""
    text = (DOCS / page).read_text()
    text = re.sub(r"<!-- ([a-z-]+):start -->.*?<!-- \1:end -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands and code
    decimals = set(re.findall(r"(?<![\w.])\d+\.\d{2,}(?![\w.])", text))
    from reward_lens.measure.cause import COLLINEAR_R

    allowed = {"0.05", str(COLLINEAR_R)}  # the false discovery rate of every decision; the cause book's constant
    assert not decimals - allowed - _whitebox_numbers(), (page, sorted(decimals - allowed - _whitebox_numbers()))


def _whitebox_numbers() -> set[str]:
    text = (DOCS / "science.md").read_text()
    table = text.split("## When the denominator exists")[1].split("## Known limits")[0]
    return set(re.findall(r"\d+\.\d+", table))
