"""Write a record while training runs, so that a run killed mid-way leaves a readable one.

Layout of a streamed record: ``telemetry-NNNNN.parquet`` (one row per step, small; each
flush writes a *new* file with every step so far), ``rollouts-00001.parquet``,
``rollouts-00002.parquet``, ... (one segment per flush, never rewritten) and
``manifest.json``. Each flush writes its new files under new names, then replaces the
manifest by rename, and only then removes the telemetry file of the manifest *before* the old
one: the previous generation stays, so a reader that has just read the previous manifest can
still open what it lists (and ``open_run`` reopens on a manifest change if it is slower still).
No file a committed manifest lists is ever modified, so a crash at any moment -- including
between the data and the manifest -- leaves the record of the last completed flush, with
every size and checksum as its manifest records them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from reward_lens import __version__
from reward_lens.record.errors import RecordError
from reward_lens.record.schema import (
    MANIFEST_FILE,
    CheckpointEntry,
    FileEntry,
    NonFiniteValue,
    OptimizerTelemetry,
    Rollout,
    RunManifest,
    arrow_schema,
    telemetry_name,
)
from reward_lens.record.writer import _file_entry, _rollouts_table, _telemetry_table, commit_manifest, record_file_name


def _replace(tmp: Path, dest: Path) -> None:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dest)


class RecordStream:
    """Append telemetry rows and rollouts; ``flush()`` makes them durable and readable."""

    def __init__(self, path: str | Path, *, framework: Mapping[str, Any], model: Mapping[str, Any],
                 optimizer: str | None = None, trainer_config: Mapping[str, Any] | None = None,
                 notes: list[str] | None = None, overwrite: bool = False, targets: list | None = None):
        self.path = Path(path)
        if self.path.exists():
            if not overwrite:
                raise RecordError(self.path, "a record already exists here (pass overwrite=True to replace it)")
            for p in self.path.iterdir():  # only the files a record is made of: never a user's own
                if p.is_file() and not p.is_symlink() and record_file_name(p.name):
                    p.unlink()
        self.path.mkdir(parents=True, exist_ok=True)
        self._base = dict(framework=dict(framework), model=dict(model), optimizer=optimizer,
                          trainer_config=dict(trainer_config or {}), created_by=f"reward-lens {__version__}",
                          notes=list(notes or []), targets=list(targets or []))
        self._telemetry: dict[int, OptimizerTelemetry] = {}
        self._pending: list[Rollout] = []
        self._pending_heldout: list[Rollout] = []
        self._files: dict[str, FileEntry] = {}
        self._checkpoints: list[CheckpointEntry] = []
        self._non_finite: list[NonFiniteValue] = []
        self._segment = 0
        self.flushes = 0
        self._retired: list[str] = []  # telemetry of the previous manifest: removed one flush later

    def set_telemetry(self, row: OptimizerTelemetry) -> None:
        """Add or replace the telemetry of one step (later fields merge into earlier ones)."""
        old = self._telemetry.get(row.step)
        if old is not None:
            row = old.model_copy(update={k: v for k, v in row.model_dump().items() if v is not None})
        self._telemetry[row.step] = row

    def add_rollouts(self, rows: list[Rollout]) -> None:
        self._pending.extend(rows)

    def add_heldout(self, rows: list[Rollout]) -> None:
        """Held-out completions of pi_t (never in the loss), filed under the step whose prompts
        they answer; written to ``heldout-NNNNN.parquet`` segments beside the rollouts."""
        self._pending_heldout.extend(rows)

    def add_non_finite(self, entry: NonFiniteValue) -> None:
        """A NaN or infinite value the run produced, stored as null in its field: kept in the
        manifest's ``non_finite`` list (what it was, where it came from) from the next flush on."""
        if entry not in self._non_finite:
            self._non_finite.append(entry)

    def add_note(self, note: str) -> None:
        if note not in self._base["notes"]:
            self._base["notes"].append(note)

    def add_checkpoint(self, step: int, directory: Path) -> None:
        rel = f"checkpoints/step-{step}"
        entries = {p.relative_to(directory).as_posix(): _file_entry(p) for p in sorted(directory.rglob("*"))
                   if p.is_file()}
        self._checkpoints.append(CheckpointEntry(step=step, path=rel, files=entries))

    def flush(self) -> RunManifest:
        for kind, pending in (("rollouts", self._pending), ("heldout", self._pending_heldout)):
            if pending:
                self._segment += 1
                name = f"{kind}-{self._segment:05d}.parquet"
                table = _rollouts_table(pending)
                tmp = self.path / f".{name}.tmp"
                pq.write_table(table, tmp, compression="zstd")
                _replace(tmp, self.path / name)
                self._files[name] = _file_entry(self.path / name, table.num_rows)
        self._pending, self._pending_heldout = [], []
        tel = _telemetry_table(self._telemetry.values())
        previous = [n for n in self._files if telemetry_name(n)]
        name = f"telemetry-{self.flushes + 1:05d}.parquet"
        tmp = self.path / f".{name}.tmp"
        pq.write_table(tel, tmp, compression="zstd")
        _replace(tmp, self.path / name)
        for old in previous:
            del self._files[old]
        self._files[name] = _file_entry(self.path / name, tel.num_rows)
        if not any(n.startswith("rollouts") for n in self._files):
            # A record always has a rollouts file; before the first rollouts it is an empty segment.
            self._segment += 1
            name = f"rollouts-{self._segment:05d}.parquet"
            pq.write_table(pa.Table.from_pylist([], schema=arrow_schema("rollouts")), self.path / name)
            self._files[name] = _file_entry(self.path / name, 0)
        manifest = commit_manifest(self.path, RunManifest(**self._base, files=dict(self._files),
                                                          checkpoints=list(self._checkpoints),
                                                          non_finite=list(self._non_finite)))
        for old in self._retired:  # neither the committed manifest nor the one before lists it
            (self.path / old).unlink(missing_ok=True)
        self._retired = previous
        self.flushes += 1
        return manifest
