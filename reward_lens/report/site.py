"""``reward-lens publish``: a static site of run reports, relative links only."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.record.reader import Run
from reward_lens.report.build import build_report
from reward_lens.report.model import Report
from reward_lens.record.importers import shown
from reward_lens.report.output import OutputRefused, replace_dir_atomically
from reward_lens.report.render import environment, to_html, to_json, to_markdown
from reward_lens_spec.files import UnreadableFile, kind_of, read_text
from reward_lens_spec.paths import templates_dir


def run_slug(run: Run) -> str:
    """A stable folder name: the record directory's name and 8 hex digits of its id."""
    return f"{run.path.name}-{run.run_id[4:12]}"


_VERSION = re.compile(r"^\d{1,4}\.\d{1,4}$")
_KEPT_SUFFIXES = (".html", ".md", ".json")


def _real_dir(path: Path) -> bool:
    """A directory itself, not a link to one (``lstat``)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def kept_entries(site: Path, replaced: set[str]) -> tuple[dict[str, str], list[dict]]:
    """The runs a site already holds that this publication does not replace: their files, and
    their index entries (read back from each report.json).

    Nothing inside the site is followed: ``runs/`` and each run's folder must be directories
    themselves, and each kept file a regular file the site holds (opened with ``O_NOFOLLOW``);
    a link, a FIFO or anything else is refused by name before anything changes, so a publication
    never copies a file from outside the site into it. A report of an earlier schema version is
    listed without numbers (``entry["schema"]`` says which); one with no version, a version that
    is not one, or a newer one, or the current one that does not validate, is refused by name."""
    files: dict[str, str] = {}
    entries = []
    runs = site / "runs"
    if not (runs.exists() or runs.is_symlink()):
        return files, entries
    if not _real_dir(runs):
        raise OutputRefused(f"{runs}: is {'a symbolic link' if runs.is_symlink() else 'not a folder'}; the site's runs "
                            "folder is one reward-lens wrote (it follows no link inside a site; nothing was changed)")
    current = Report.model_fields["schema_version"].default
    for d in sorted(runs.iterdir()):
        if d.name in replaced:
            continue
        if not _real_dir(d):
            raise OutputRefused(f"{d}: is {kind_of(os.lstat(d).st_mode)} where the site keeps a run's folder; "
                                "reward-lens follows no link inside a site (nothing was changed)")
        parts = {}
        for f in sorted(d.iterdir()):
            if f.suffix not in _KEPT_SUFFIXES:
                continue
            rel = f"runs/{d.name}/{f.name}"
            try:
                parts[rel] = read_text(f, follow_links=False)
            except UnreadableFile as exc:
                raise OutputRefused(f"{exc}; a kept file must be one the site wrote (nothing was changed)") from None
        if not parts:
            continue
        files.update(parts)
        entries.append({"slug": d.name, "report": None, "kept": True,
                        "schema": _kept_report(parts.get(f"runs/{d.name}/report.json"), d / "report.json", current)})
        if entries[-1]["schema"] is None:
            entries[-1]["report"] = Report.model_validate_json(parts[f"runs/{d.name}/report.json"])
    return files, entries


def _kept_report(text: str | None, path: Path, current: str) -> str | None:
    """The schema version of a kept run's report.json when it is an earlier one (listed without
    numbers), None when it is the current one and validates; OutputRefused otherwise."""
    if text is None:
        raise OutputRefused(f"{path}: missing from a run the site keeps; publish that run again or --prune it "
                            "(nothing was changed)")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise OutputRefused(f"{path}: not valid JSON; publish that run again or --prune it (nothing was changed)") \
            from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, str) or not _VERSION.match(version):
        raise OutputRefused(f"{path}: schema_version {shown(version)} is not a reward-lens report version; publish that "
                            "run again or --prune it (nothing was changed)")
    if version == current:
        try:
            Report.model_validate(data)
        except ValueError as exc:
            msg = " ".join(str(exc).split())[:160]
            raise OutputRefused(f"{path}: a report of schema {version} that does not validate ({msg}); publish that run "
                                "again or --prune it (nothing was changed)") from None
        return None
    if tuple(map(int, version.split("."))) > tuple(map(int, current.split("."))):
        raise OutputRefused(f"{path}: schema_version {version} is newer than this reward-lens writes ({current}); "
                            "publish with that version, or --prune the run (nothing was changed)")
    return version


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
            **options) -> tuple[dict[str, str], list[str], list[tuple[str, str]]]:
    """Write the site; the runs it already holds stay listed unless ``prune``. Returns the
    files, the slugs kept from before, and (slug, schema version) of the kept ones whose
    report is of an earlier schema (listed without numbers)."""
    keep = ({}, []) if prune else kept_entries(site, {run_slug(r) for r in runs})
    files = site_files(runs, progress, keep=keep, **options)
    replace_dir_atomically(site, files, kind="site")
    return files, [e["slug"] for e in keep[1]], [(e["slug"], e["schema"]) for e in keep[1] if e.get("schema")]
