"""``reward-lens publish``: a static site of run reports, relative links only."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.record.reader import Run
from reward_lens.report.build import build_report
from reward_lens.report.model import Report
from reward_lens.report.output import replace_dir_atomically
from reward_lens.report.render import environment, to_html, to_json, to_markdown
from reward_lens_spec.paths import templates_dir


def run_slug(run: Run) -> str:
    """A stable folder name: the record directory's name and 8 hex digits of its id."""
    return f"{run.path.name}-{run.run_id[4:12]}"


def site_files(runs: Sequence[Run], progress: Callable[[str], None] | None = None, *, ledger: str = "auto",
               window: int | str = 1, features: FeatureBasis | None = None) -> dict[str, str]:
    """Every run's report (``build_report`` with the same ``ledger``, ``window`` and feature
    basis for all of them, so their pages compare like with like) and the index."""
    files: dict[str, str] = {}
    entries = []
    for run in runs:
        report: Report = build_report(run, progress, ledger=ledger, window=window, features=features)
        slug = run_slug(run)
        files[f"runs/{slug}/report.html"] = to_html(report)
        files[f"runs/{slug}/report.md"] = to_markdown(report)
        files[f"runs/{slug}/report.json"] = to_json(report)
        entries.append({"slug": slug, "report": report})
    slugs = [e["slug"] for e in entries]
    if len(set(slugs)) != len(slugs):
        raise ValueError(f"two runs would publish to the same folder: {slugs}")
    env_html, env_md = environment(str(templates_dir()), True), environment(str(templates_dir()), False)
    files["index.html"] = env_html.get_template("report/index.html.j2").render(entries=entries)
    files["index.md"] = env_md.get_template("report/index.md.j2").render(entries=entries)
    files["report.schema.json"] = json.dumps(Report.model_json_schema(), indent=2, sort_keys=True) + "\n"
    return files


def publish(runs: Sequence[Run], site: Path, progress: Callable[[str], None] | None = None, **options) -> dict[str, str]:
    files = site_files(runs, progress, **options)
    replace_dir_atomically(site, files, kind="site")
    return files
