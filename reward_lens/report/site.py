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


def kept_entries(site: Path, replaced: set[str]) -> tuple[dict[str, str], list[dict]]:
    """The runs a site already holds that this publication does not replace: their files, and
    their index entries (read back from each report.json; a report of another schema is
    listed without numbers, to be published again)."""
    files: dict[str, str] = {}
    entries = []
    runs = site / "runs"
    if not runs.is_dir():
        return files, entries
    for d in sorted(p for p in runs.iterdir() if p.is_dir() and p.name not in replaced):
        parts = {f"runs/{d.name}/{f.name}": f for f in d.iterdir() if f.is_file() and f.suffix in (".html", ".md", ".json")}
        if not parts:
            continue
        for rel, f in parts.items():
            files[rel] = f.read_text(encoding="utf-8")
        report = None
        try:
            data = json.loads(files.get(f"runs/{d.name}/report.json", "null"))
            if isinstance(data, dict) and data.get("schema_version") == Report.model_fields["schema_version"].default:
                report = Report.model_validate(data)
        except (ValueError, TypeError):
            report = None
        entries.append({"slug": d.name, "report": report, "kept": True})
    return files, entries


def site_files(runs: Sequence[Run], progress: Callable[[str], None] | None = None, *, ledger: str = "auto",
               window: int | str = 1, features: FeatureBasis | None = None,
               keep: tuple[dict[str, str], list[dict]] | None = None) -> dict[str, str]:
    """Every run's report (``build_report`` with the same ``ledger``, ``window`` and feature
    basis for all of them, so their pages compare like with like) and the index; ``keep``: the
    files and entries of runs already on the site that stay there (``kept_entries``)."""
    files: dict[str, str] = dict(keep[0]) if keep else {}
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
    entries += list(keep[1]) if keep else []
    env_html, env_md = environment(str(templates_dir()), True), environment(str(templates_dir()), False)
    files["index.html"] = env_html.get_template("report/index.html.j2").render(entries=entries)
    files["index.md"] = env_md.get_template("report/index.md.j2").render(entries=entries)
    files["report.schema.json"] = json.dumps(Report.model_json_schema(), indent=2, sort_keys=True) + "\n"
    return files


def publish(runs: Sequence[Run], site: Path, progress: Callable[[str], None] | None = None, *, prune: bool = False,
            **options) -> tuple[dict[str, str], list[str]]:
    """Write the site; the runs it already holds stay listed unless ``prune``. Returns the
    files and the slugs kept from before."""
    keep = ({}, []) if prune else kept_entries(site, {run_slug(r) for r in runs})
    files = site_files(runs, progress, keep=keep, **options)
    replace_dir_atomically(site, files, kind="site")
    return files, [e["slug"] for e in keep[1]]
