"""The documentation: the site builds strictly (broken links and missing references fail), the
README fits on two screens and keeps its two commands, and every number a page quotes is the
output of the script that prints it."""

from __future__ import annotations

import json
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
    # the main command runs the example that shows the product (reward gaming named on time, with D_t,
    # eta, the price, shares and verdicts resolved: the gamed run, recorded by the tap), and exits 0
    # without a flag to make it
    assert main.endswith("reward-lens report --example gamed --out reward-lens-report") and "torch" not in main
    assert "--fail-on" not in main
    assert "torch==2.13.0" in test and "pytest" in test
    assert "test-command:start" in (REPO / ".ci" / "run").read_text()
    assert (REPO / "docs" / "assets" / "first-screen.png").stat().st_size > 10_000  # the picture it shows


def test_the_readme_says_how_to_install_the_distribution_it_names():
    """The PyPI name `reward-lens` belongs to another project (3.1.0, an unrelated tool with the same
    import package); this one is distributed as `reward-lens-rl` (free on PyPI when chosen:
    https://pypi.org/pypi/reward-lens-rl/json answered 404), with the `reward-lens` command and
    the `reward_lens` import paths kept."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "reward-lens-rl"
    assert project["scripts"] == {"reward-lens": "reward_lens.cli:main"}
    assert "The distribution is `reward-lens-rl`" in README and "`pip install reward-lens` installs an" in README
    assert "pip install ." in README


def test_the_quick_starts_python_runs_from_any_directory(tmp_path):
    """docs/quickstart.md's Python block, run as written from a folder outside the repository."""
    text = (DOCS / "quickstart.md").read_text()
    code = re.search(r"## From Python.*?```python\n(.*?)```", text, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RECORD_INCOMPLETE" in r.stdout


def test_the_readme_shows_the_task_reports_first_screen():
    from reward_lens.examples import example_features, example_record
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    report = build_report(open_run(example_record("task")), features=features_from(str(example_features("task"))))
    quoted = re.search(r"<!-- task-card:start -->\n(.*?)\n<!-- task-card:end -->", README, re.S).group(1)
    assert quoted == "\n\n".join(report.card)


def test_the_hero_image_is_not_older_than_what_it_shows():
    """docs/assets/first-screen.png is made by tools/screenshot.py, which stores beside it a hash of
    what the first screen shows as the templates, specs, fixtures and code then rendered it; the
    same hash now must match, else the picture is stale."""
    sys.path.insert(0, str(REPO / "tools"))
    import screenshot

    image = REPO / "docs" / "assets" / "first-screen.png"
    stamp = json.loads(screenshot.stamp_path(image).read_text())
    # the picture is of the example the README's main command reports
    example = re.search(r"reward-lens report --example (\S+)", _block("main-command")).group(1)
    assert screenshot.main_example() == example
    assert stamp["example"] == example and stamp["viewport"] == list(screenshot.VIEWPORT), (
        "docs/assets/first-screen.png is not of the main command's example: .venv/bin/python tools/screenshot.py")
    assert stamp["first_screen_sha256"] == screenshot.first_screen_hash(example), (
        "docs/assets/first-screen.png is stale: .venv/bin/python tools/screenshot.py")
    assert "](docs/assets/first-screen.png)" in README


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


def test_the_findings_page_says_what_a_trl_folder_evaluates():
    sys.path.insert(0, str(REPO / "tools"))
    import trl_findings

    assert _quote(DOCS / "findings.md", "trl-findings") == trl_findings.text(), "python tools/trl_findings.py"


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


def test_benchmark_quotes_are_what_their_scripts_saved():
    """The tap's benchmarks take minutes to tens of minutes, so no test reruns them: each script's
    ``--save`` writes what it printed to bench/results/, and the pages quote that verbatim
    (``python tools/bench_quotes.py`` copies it)."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_quotes

    for page, block, saved, fenced in bench_quotes.QUOTES:
        assert _quote(REPO / page, block) == bench_quotes.quoted(saved, fenced), (page, block)
