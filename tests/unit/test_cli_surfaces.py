"""The command line's promises (docs/cli.md), issue 42 and the CLI items of issue 40: a closed
stdout keeps every command's exit code, whatever it prints; the flags messages name are the
real ones; ``diff --example``; the site's index says each run's health; an imported run says
its framework's version, or that it is unknown; the help reads as text."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reward_lens import cli
from tests.conftest import SHORT
from tests.unit.test_importer import _trl_output

REPO = Path(__file__).resolve().parents[2]

# Runs the command with fd 1 a pipe whose reader is already gone: every write to stdout fails
# with EPIPE, deterministically (what `| true` and `| head -1` do by chance).
_CLOSED = textwrap.dedent("""
    import os, sys
    r, w = os.pipe()
    os.close(r)
    os.dup2(w, 1)
    os.close(w)
    from reward_lens import cli
    code = cli.main(sys.argv[1:])
    sys.exit(code)
""")


def _closed_stdout(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CLOSED, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def _cases(tmp: Path) -> list[tuple[str, list[str], int]]:
    trl = _trl_output(tmp / "trl")
    (tmp / "c.yaml").write_text("num_generations: 8\nlogging_steps: 1\nlog_completions: true\nmax_steps: 20\n")
    return [
        ("report, summary lines", ["report", "--example", "short", "--out", str(tmp / "r1")], 1),
        ("report --quiet", ["report", "--example", "short", "--out", str(tmp / "r2"), "--quiet"], 1),
        ("check md", ["check", "--example", "short", "--quiet"], 1),
        ("check json", ["check", "--example", "short", "--format", "md,json"], 1),
        ("check --list", ["check", "--list"], 0),
        ("check a TRL folder", ["check", str(trl), "--fail-on", "never"], 0),
        ("audit table", ["audit", str(tmp / "c.yaml"), "--fail-on", "never"], 0),
        ("audit json", ["audit", str(tmp / "c.yaml"), "--format", "json", "--fail-on", "never"], 0),
        ("diff", ["diff", "--example", "short", "--example", "tapped", "--out", str(tmp / "d")], 0),
        ("publish", ["publish", str(SHORT), "--site", str(tmp / "site")], 0),
        ("import", ["import", "trl", str(trl), str(tmp / "rec")], 0),
        ("help", ["--help"], 0),
    ]


def test_a_closed_stdout_keeps_every_commands_exit_code(tmp_path):
    for label, argv, code in _cases(tmp_path):
        r = _closed_stdout(*argv, cwd=tmp_path)
        assert r.returncode == code, (label, r.returncode, r.stderr[-600:])
        assert "Broken pipe" not in r.stderr and "Exception ignored" not in r.stderr, (label, r.stderr[-600:])
    assert (tmp_path / "r1" / "report.md").is_file() and (tmp_path / "rec" / "manifest.json").is_file()


def _head_1(argv: list[str], tries: int) -> list[int]:
    """Exit codes of `reward-lens ARGV | head -1`, run ``tries`` times through a real shell."""
    exe = shutil.which("reward-lens", path=str(Path(sys.executable).parent))
    script = f'"{exe}" {" ".join(argv)} | head -1 >/dev/null; echo ${{PIPESTATUS[0]}}'
    return [int(subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120).stdout.strip())
            for _ in range(tries)]


def test_check_list_into_head_exits_0():
    assert _head_1(["check", "--list"], 5) == [0] * 5


@pytest.mark.slow
def test_check_list_into_head_exits_0_fifty_times_of_fifty():
    assert _head_1(["check", "--list"], 50) == [0] * 50


def test_reimport_names_the_real_flag(tmp_path, capsys):
    trl = _trl_output(tmp_path / "trl")
    assert cli.main(["import", "trl", str(trl), str(tmp_path / "rec"), "--quiet"]) == 0
    assert cli.main(["import", "trl", str(trl), str(tmp_path / "rec"), "--quiet"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert cli.main(["import", "trl", str(trl), str(tmp_path / "rec"), "--quiet", "--overwrite"]) == 0


def test_diff_takes_examples_like_report(tmp_path, capsys):
    assert cli.main(["diff", "--example", "short", "--example", "tapped", "--out", str(tmp_path / "d")]) == 0
    data = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert data["labels"] == ["short", "tapped"] and data["status"] == "compared"
    assert cli.main(["diff", "--example", "short", "--out", str(tmp_path / "e")]) == cli.EXIT_BAD_INPUT
    assert "two of RUN_A, RUN_B and --example" in capsys.readouterr().err


def test_the_site_index_has_a_health_column_from_the_reports_counts(tmp_path):
    from reward_lens.report.model import Report

    site = tmp_path / "site"
    assert cli.main(["publish", str(SHORT), str(SHORT.parent / "tapped"), "--site", str(site), "--quiet"]) == 0
    index_md, index_html = (site / "index.md").read_text(), (site / "index.html").read_text()
    assert "| health (findings) |" in index_md and "<th>health (findings)</th>" in index_html
    for slug in ("short", "tapped"):
        (page,) = site.glob(f"runs/{slug}-*/report.json")
        n = Report.model_validate_json(page.read_text()).findings_counts
        row = next(line for line in index_md.splitlines() if line.startswith(f"| [{slug}-"))
        held = f"{n['holds']} hold" if n["holds"] else "none holds"
        assert f"{held}" in row and f"{n['clear']} clear · {n['not_evaluated']} not evaluated" in row, row


def test_an_imported_run_says_its_trl_version_or_that_it_is_unknown(tmp_path):
    from reward_lens.record import open_run
    from reward_lens.report import build_report, to_markdown

    trl = _trl_output(tmp_path / "trl")
    cli.main(["import", "trl", str(trl), str(tmp_path / "unknown"), "--quiet"])
    run = open_run(tmp_path / "unknown")
    assert run.manifest.framework.version is None and any("TRL version unknown" in n for n in run.manifest.notes)
    assert "| framework | trl (version unknown) |" in to_markdown(build_report(run))
    # the model card TRL writes into the output directory (trl/templates/lm_model_card.md)
    (trl / "README.md").write_text("---\nlibrary_name: transformers\n---\n\n### Framework versions\n\n"
                                   "- TRL: 1.16.0\n- Transformers: 5.24.0\n- Pytorch: 2.13.0\n")
    cli.main(["import", "trl", str(trl), str(tmp_path / "known"), "--quiet"])
    assert open_run(tmp_path / "known").manifest.framework.version == "1.16.0"
    cli.main(["import", "trl", str(trl), str(tmp_path / "given"), "--quiet", "--framework-version", "1.15.2"])
    assert open_run(tmp_path / "given").manifest.framework.version == "1.15.2"  # what the user says wins


def test_the_help_reads_as_text_not_rst(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert "``" not in out and description.startswith("reward-lens: ")
