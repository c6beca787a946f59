"""``reward-lens diff RUN_A RUN_B``: the books of two runs side by side.

Each side is a record directory (its report is computed in the basis given) or a report
directory written by ``reward-lens report`` (its ``report.json`` is read as it is). Results in
different feature bases are never compared: the diff refuses UNIT_MISMATCH naming both basis
ids. Per book: the status and the headline of each run, and, where a book has a diff template
(``templates/report/books/<book>.diff.{md,html}.j2``), its own side-by-side table.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from reward_lens.report.model import SCHEMA_VERSION, Report
from reward_lens_spec.files import UnreadableFile, read_text
from reward_lens_spec.paths import templates_dir

DIFF_SCHEMA_VERSION = "1.0"


class BookPair(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    title: str
    status: tuple[str | None, str | None]
    headline: tuple[str | None, str | None]
    data: tuple[dict | None, dict | None] = Field(exclude=True)


class Diff(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: str = DIFF_SCHEMA_VERSION
    status: str = Field(description="'compared', or 'refused' (UNIT_MISMATCH: different feature bases)")
    runs: tuple[str, str]
    labels: tuple[str, str]
    basis: tuple[str, str]
    refusal: str | None = None
    books: list[BookPair] = Field(default_factory=list)


def _there(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def is_report_dir(path: Path) -> bool:
    return _there(path / "report.json") and not _there(path / "manifest.json")


def read_report(path: Path) -> Report:
    """``report.json`` of a report directory, validated whole: its ``schema_version`` is this
    reward-lens's (a report of another version is refused by name: its books may mean other
    things), then the report's model, every book's data against the model its spec names, and
    the books' feature lists against the report's basis. A report directory is data someone may
    have sent: it is never trusted further."""
    where = path / "report.json"
    try:
        text = read_text(where)  # a FIFO is refused unopened
        data = json.loads(text)
    except UnreadableFile as exc:
        raise ValueError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise ValueError(f"{where}: not valid JSON ({msg})") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        from reward_lens.record.importers import shown

        said = "has no `schema_version`" if version is None else f"is of schema_version {shown(version)}"
        raise ValueError(f"{where}: {said}, and this reward-lens reads reports of {SCHEMA_VERSION} only (books of "
                         "another version may mean other things): compute it again with this version (reward-lens "
                         "report on its record), or diff the two record directories")
    try:
        report = Report.model_validate(data)
        books = [b.model_copy(update={"data": b.typed()}) for b in report.books]  # each book's own model
    except ValueError as exc:
        msg = " ".join(str(exc).split())[:200]
        raise ValueError(f"{where}: not a reward-lens report of this version ({msg})") from None
    names = [f.name for f in report.basis.features]
    for b in books:
        feats = getattr(b.data, "features", None)
        listed = ([f if isinstance(f, str) else getattr(f, "feature", getattr(f, "name", None)) for f in feats]
                  if isinstance(feats, list) else None)
        if listed is not None and listed and listed != names:
            raise ValueError(f"{where}: book {b.id!r} lists features {listed[:5]} but the report's basis "
                             f"{report.basis.id} has {names[:5]}: the report was edited or cut short")
    return report.model_copy(update={"books": books})


def load_side(path: Path, features) -> tuple[Report, str]:
    """A report for one side: read from a report directory, or built from a record."""
    from reward_lens.record.reader import open_run
    from reward_lens.report.build import build_report

    if is_report_dir(path):
        return read_report(path), path.name
    run = open_run(path)
    run.verify()
    return build_report(run, features=features), path.name


def diff_reports(a: Report, b: Report, labels: tuple[str, str]) -> Diff:
    runs = (a.run.run_id, b.run.run_id)
    basis = (a.basis.id, b.basis.id)
    if a.basis.id != b.basis.id:
        return Diff(status="refused", runs=runs, labels=labels, basis=basis, refusal=(
            f"UNIT_MISMATCH: {labels[0]} is in feature basis {a.basis.id} ({a.basis.name}) and {labels[1]} in "
            f"{b.basis.id} ({b.basis.name}); books in different bases are not compared. Compute both in one "
            "basis: give the record directories and the same --features FILE."))
    ids = list(dict.fromkeys([x.id for x in a.books] + [x.id for x in b.books]))
    ba, bb = {x.id: x for x in a.books}, {x.id: x for x in b.books}
    books = []
    for i in ids:
        x, y = ba.get(i), bb.get(i)
        books.append(BookPair(id=i, title=(x or y).title, status=(x.status if x else None, y.status if y else None),
                              headline=(x.headline if x else None, y.headline if y else None),
                              data=(x.data_dict() if x else None, y.data_dict() if y else None)))
    return Diff(status="compared", runs=runs, labels=labels, basis=basis, books=books)


def _has(name: str) -> bool:
    return (templates_dir() / name).is_file()


def diff_markdown(d: Diff) -> str:
    from reward_lens.report.render import environment

    env = environment(str(templates_dir()), False)
    return env.get_template("report/diff.md.j2").render(d=d, has=_has)


def diff_html(d: Diff) -> str:
    from reward_lens.report.render import environment

    env = environment(str(templates_dir()), True)
    return env.get_template("report/diff.html.j2").render(d=d, has=_has)


def diff_json(d: Diff) -> str:
    return json.dumps(d.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":")) + "\n"
