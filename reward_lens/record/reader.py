"""Open and validate a record.

``open_run`` checks what can be checked without reading the data: the manifest parses,
its run_id is the hash of its content, every file it lists exists with the recorded size
(a truncated file fails here), every Parquet footer parses and every column has the type
``specs/fields.yaml`` declares. Telemetry (one row per step) is small and is validated in
full: unique increasing steps, finite and non-negative values where the unit demands it.
Rollouts can be large; their values are validated when a book reads them, column by column
and row group by row group, and every error names the file, the field and the steps.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import ValidationError

from reward_lens.record.errors import RecordError
from reward_lens.record.schema import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    D_T_FIELDS,
    HELDOUT_FILE,
    VALIDATION_FILE,
    IN_SAMPLE_ESTIMATORS,
    ROLLOUTS_FILE,
    TELEMETRY_FILE,
    RunManifest,
    arrow_type,
    content_run_id,
    telemetry_name,
)
from reward_lens.record.writer import sha256_file
from reward_lens_spec import Presence, load_fields
from reward_lens_spec.files import UnreadableFile, is_regular, read_bytes, read_text, require_regular
from reward_lens_spec.models import FieldSpec


def _manifest_bytes(root: Path) -> bytes | None:
    try:
        return read_bytes(root / MANIFEST_FILE)  # a FIFO in its place is never waited on
    except (OSError, UnreadableFile):
        return None


def _regular(path: Path, what: str = "listed in manifest.json") -> os.stat_result:
    """``stat`` of a file the record lists, checked to be a regular file before anything opens
    it (a FIFO would block the reader for ever)."""
    try:
        return require_regular(path)
    except FileNotFoundError:
        raise RecordError(path, f"{what} but missing") from None
    except UnreadableFile as exc:
        raise RecordError(path, f"{what}, but {exc.problem}") from None


def open_run(path: str | Path, run_id: str | None = None) -> Run:
    """Open the record at ``path``; if ``run_id`` is given (in full or as a prefix of at
    least ``run:`` + 8 hex digits), it must name this record.

    A record being written (the tap flushing while a report reads) is opened as the snapshot of
    one committed manifest: every file it lists is opened before this returns (an open file
    stays readable after the writer removes it), and when a listed file disappears because a
    new manifest was committed meanwhile, the new manifest is opened instead."""
    root = Path(path)
    for attempt in range(8):
        before = _manifest_bytes(root)
        try:
            return _open_once(root, run_id)
        except RecordError:
            if attempt == 7 or before is None or _manifest_bytes(root) == before:
                raise  # the record itself is at fault, not a writer committing meanwhile
    raise AssertionError("unreachable")


def _open_once(root: Path, run_id: str | None) -> Run:
    if not root.is_dir():
        raise RecordError(root, "no record here (not a directory)")
    manifest = _read_manifest(root)
    # The telemetry file is the one file a writer removes (a generation after a newer manifest
    # lists another): open it first, while this manifest is current; an open file stays readable.
    telemetry = _open_listed(root, manifest)
    expected = content_run_id(manifest)
    if manifest.run_id != expected:
        raise RecordError(root / MANIFEST_FILE, f"run_id {manifest.run_id!r} does not match the content hash "
                          f"{expected!r}: the manifest was edited or its files were replaced after the record was "
                          "written (the run id names that content, so any edit breaks it); restore the manifest "
                          "as written, or write the record again (the tap, or reward-lens import)", field="run_id")
    if run_id is not None:
        if len(run_id) < 12 or not manifest.run_id.startswith(run_id.rstrip(".")):
            raise RecordError(root / MANIFEST_FILE, f"this record is {manifest.run_id}, not {run_id}", field="run_id")
    for name, entry in manifest.files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or len(parts) != 1:
            raise RecordError(root / MANIFEST_FILE, f"lists {name!r}: a record's files are plain names inside its "
                              "own directory", field="files")
        f = _inside(root, name, root / MANIFEST_FILE, f"files[{name!r}]")  # no link out of the record either
        if telemetry is not None and telemetry_name(name):
            size = telemetry.size()  # opened above: removed since by a writer or not, this is its size
        else:
            size = _regular(f).st_size
        if size != entry.bytes:
            raise RecordError(f, f"is {size} bytes but manifest.json records {entry.bytes}: truncated or replaced")
    telemetry_file(manifest, root)
    _check_checkpoints(root, manifest)
    if not rollout_segments(manifest, root):
        raise RecordError(root / MANIFEST_FILE, f"does not list `{ROLLOUTS_FILE}` (or rollouts-NNNNN.parquet "
                          "segments)", field="files")
    run = Run(root, manifest, telemetry)
    run._validate_telemetry()
    run._validate_rollout_steps()
    return run


# Schema metadata key under which ``iter_rollouts`` names the file a table was read from.
SOURCE_KEY = b"reward_lens_source"


def table_source(table: pa.Table, default: str | Path) -> str:
    """The file ``iter_rollouts`` read ``table`` from, or ``default``."""
    meta = table.schema.metadata or {}
    return meta[SOURCE_KEY].decode() if SOURCE_KEY in meta else str(default)


_SEGMENT = {"rollouts": re.compile(r"^rollouts-(\d{5})\.parquet$"),
            "heldout": re.compile(r"^heldout-(\d{5})\.parquet$"),
            "validation": re.compile(r"^validation-(\d{5})\.parquet$")}
_WHOLE = {"rollouts": ROLLOUTS_FILE, "heldout": HELDOUT_FILE, "validation": VALIDATION_FILE}


def rollout_segments(manifest: RunManifest, root: Path | None = None, kind: str = "rollouts") -> list[str]:
    """The rollout files of a record in step order: ``rollouts.parquet`` for a record
    written at once, or ``rollouts-00001.parquet``, ... for one streamed while training.
    ``kind="heldout"``: the held-out completions' files, named alike (none in most records)."""
    segments = sorted(n for n in manifest.files if _SEGMENT[kind].match(n))
    whole = _WHOLE[kind]
    if whole in manifest.files:
        if segments:
            raise RecordError((root or Path(".")) / MANIFEST_FILE, f"lists both `{whole}` and {len(segments)} {kind} "
                              f"segment(s) ({segments[0]}, ...): a record has one or the other", field="files")
        return [whole]
    return segments


def telemetry_file(manifest: RunManifest, root: Path) -> str:
    """The one telemetry file the manifest lists (``telemetry.parquet``, or a streamed
    record's ``telemetry-NNNNN.parquet``)."""
    names = [n for n in manifest.files if telemetry_name(n)]
    if len(names) != 1:
        what = "does not list" if not names else f"lists {len(names)} telemetry files ({', '.join(names)}), not one:"
        raise RecordError(root / MANIFEST_FILE, f"{what} `{TELEMETRY_FILE}`", field="files")
    return names[0]


def _open_listed(root: Path, manifest: RunManifest) -> pa.NativeFile | None:
    """The manifest's telemetry file, opened (None when it lists none usable: named later)."""
    names = [n for n in manifest.files if telemetry_name(n)]
    if len(names) != 1 or len(Path(names[0]).parts) != 1:
        return None
    _regular(root / names[0])  # before opening: a FIFO would block the open
    try:
        return pa.OSFile(str(root / names[0]), "r")
    except OSError:
        raise RecordError(root / names[0], "listed in manifest.json but missing") from None


def _inside(root: Path, rel: str, where: Path, field: str) -> Path:
    """``root / rel``, checked to stay inside the record: ``rel`` is relative, has no ``..``,
    and, links resolved, still lands under ``root`` (a symlink cannot lead out)."""
    p = Path(rel)
    if not rel or p.is_absolute() or ".." in p.parts:
        raise RecordError(where, f"{rel!r} is {'absolute' if p.is_absolute() else 'not a path inside the record'}: "
                          "every path a manifest names stays inside the record directory", field=field)
    target = root / p
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(target)]) != real_root:
        raise RecordError(where, f"{rel!r} leads out of the record through a symbolic link (to "
                          f"{os.path.realpath(target)}): every path a manifest names stays inside the record "
                          "directory", field=field)
    return target


def _check_checkpoints(root: Path, manifest: RunManifest) -> None:
    """Every checkpoint directory and file the manifest names resolves inside the record, and
    every file in a checkpoint directory too (a policy loader reads the whole folder): nothing
    the whitebox loads or ``verify`` hashes lies outside it."""
    where = root / MANIFEST_FILE
    for i, ck in enumerate(manifest.checkpoints):
        folder = _inside(root, ck.path, where, f"checkpoints[{i}].path")
        for name in ck.files:
            _inside(root, f"{ck.path}/{name}", where, f"checkpoints[{i}].files[{name!r}]")
        if folder.is_dir():
            for dirpath, dirnames, filenames in os.walk(folder):
                for n in dirnames + filenames:
                    rel = Path(dirpath, n).relative_to(root).as_posix()
                    _inside(root, rel, where, f"checkpoints[{i}].path")
                for n in filenames:  # a policy loader opens them all: none may be a FIFO
                    _regular(Path(dirpath, n), f"in checkpoint {ck.path}")


def _sha256_handle(handle: pa.NativeFile) -> str:
    import hashlib

    h = hashlib.sha256()
    pos = 0
    size = handle.size()
    while pos < size:
        chunk = handle.read_at(min(1 << 20, size - pos), pos)
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest()


def _read_manifest(root: Path) -> RunManifest:
    path = root / MANIFEST_FILE
    if not path.exists():
        if (root / "trainer_state.json").exists() or any(root.glob("checkpoint-*/trainer_state.json")):
            raise RecordError(path, f"missing: this looks like a TRL output directory, not a reward-lens record; "
                              f"convert it first: reward-lens import trl {root} RECORD_DIR")
        raise RecordError(path, "missing: a record directory needs manifest.json")
    try:
        data = json.loads(read_text(path))  # its type checked first: a FIFO is never opened blocking
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    except OSError as exc:
        raise RecordError(path, f"cannot be read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise RecordError(path, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise RecordError(path, "JSON nested too deeply to be a manifest") from None
    if isinstance(data, dict) and data.get("format_version") not in (None, FORMAT_VERSION):
        raise RecordError(path, f"format_version {data.get('format_version')!r} is not supported "
                          f"(this reward-lens reads {FORMAT_VERSION})", field="format_version")
    try:
        return RunManifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise RecordError(path, err["msg"], field=".".join(str(p) for p in err["loc"])) from None


# Rows read per call when streaming rollouts (several small row groups at once).
ROWS_PER_READ = 1 << 16


@dataclass(frozen=True)
class Window:
    """A closed range of steps [start, stop]."""

    start: int
    stop: int

    def __contains__(self, step: int) -> bool:
        return self.start <= step <= self.stop


class Run:
    """An opened, validated record. Data is read lazily, by column."""

    def __init__(self, root: Path, manifest: RunManifest, telemetry: pa.NativeFile | None = None):
        self.path = root
        self.manifest = manifest
        self._fields_spec = load_fields()
        self.telemetry_name = telemetry_file(manifest, root)
        self._telemetry_handle = telemetry
        self._telemetry_file = self._open_parquet(self.telemetry_name, "telemetry", telemetry)
        self._segments = [(name, self._open_parquet(name, "rollouts")) for name in rollout_segments(manifest, root)]
        self._heldout_segments = [(name, self._open_parquet(name, "rollouts"))
                                  for name in rollout_segments(manifest, root, "heldout")]
        self._validation_segments = [(name, self._open_parquet(name, "rollouts"))
                                     for name in rollout_segments(manifest, root, "validation")]
        for name, pf in [(self.telemetry_name, self._telemetry_file), *self._segments, *self._heldout_segments,
                         *self._validation_segments]:
            rows = manifest.files[name].rows
            if rows is not None and pf.metadata.num_rows != rows:
                raise RecordError(root / name, f"has {pf.metadata.num_rows} rows but manifest.json records {rows}",
                                  field="rows")
        for segments in (self._segments, self._heldout_segments):
            names = segments[0][1].schema_arrow.names if segments else []
            for name, pf in segments[1:]:
                if pf.schema_arrow.names != names:
                    raise RecordError(root / name, f"has columns {pf.schema_arrow.names}, the first segment {names}")

    def heldout(self) -> Run | None:
        """The record's held-out completions of pi_t, as a run whose rollouts they are (the same
        telemetry and manifest), or None when the record has none: every rollout reader
        (``iter_rollouts``, ``steps_from_run``) reads them through this view, never mixed in."""
        if not self._heldout_segments:
            return None
        view = object.__new__(type(self))
        view.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_telemetry_columns")
                              and k not in ("rollout_steps", "rollout_step_values", "_presence")})
        view._segments, view._heldout_segments = self._heldout_segments, []
        view._validation_segments = []
        view._validate_rollout_steps()
        return view

    def validation(self) -> Run | None:
        """The record's validation completions (other prompts than the run trained on, drawn by
        pi_step: veRL's ``validation_data_dir``), as a run whose rollouts they are, or None when
        the record has none. Their steps are policies (0: before any update, up to the last step
        + 1), not optimizer steps, so they are not checked against the telemetry's."""
        if not self._validation_segments:
            return None
        view = object.__new__(type(self))
        view.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_telemetry_columns")
                              and k not in ("rollout_steps", "rollout_step_values", "_presence")})
        view._segments, view._heldout_segments = self._validation_segments, []
        view._validation_segments = []
        return view

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, {self.short_id})"

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    @property
    def short_id(self) -> str:
        return self.run_id[:12] + "..."

    # ------------------------------------------------------------------ files and types
    def _open_parquet(self, name: str, source: str, handle: pa.NativeFile | None = None) -> pq.ParquetFile:
        path = self.path / name
        if handle is None:
            _regular(path)
        try:
            pf = pq.ParquetFile(handle if handle is not None else path)
        except (pa.ArrowInvalid, OSError) as exc:
            entry = self.manifest.files.get(name)
            if entry is not None and is_regular(path) and sha256_file(path) != entry.sha256:
                # a committed file that no longer parses: say first that it is not the file committed
                raise RecordError(path, f"sha256 differs from manifest.json: the file was changed, and it is not a "
                                  f"readable Parquet file ({exc})") from None
            raise RecordError(path, f"not a readable Parquet file ({exc})") from None
        schema = pf.schema_arrow
        for spec in self._fields_spec.by_source(source).values():
            col = spec.column
            if col not in schema.names:
                if spec.constraints.required:
                    raise RecordError(path, "required column is missing", field=col)
                continue
            actual = schema.field(col).type
            if not _type_ok(actual, arrow_type(spec.dtype)):
                raise RecordError(path, f"has type {actual}, expected {arrow_type(spec.dtype)} "
                                  f"({spec.unit}, per specs/fields.yaml)", field=col)
        return pf

    def _read(self, pf: pq.ParquetFile, name: str, columns: Sequence[str], row_groups: Sequence[int] | None = None) -> pa.Table:
        present = [c for c in columns if c in pf.schema_arrow.names]
        try:
            if row_groups is None:
                return pf.read(columns=present)
            return pf.read_row_groups(list(row_groups), columns=present)
        except (pa.ArrowInvalid, OSError) as exc:
            raise RecordError(self.path / name, f"cannot be read ({exc}): corrupt or truncated") from None

    # ------------------------------------------------------------------ telemetry
    @cached_property
    def telemetry(self) -> pa.Table:
        """All telemetry rows (one per step; small)."""
        return self._read(self._telemetry_file, self.telemetry_name, self._telemetry_file.schema_arrow.names)

    @cached_property
    def steps(self) -> np.ndarray:
        return self.telemetry.column("step").to_numpy()

    def telemetry_column(self, field: str) -> Mapping[int, float | str]:
        """``{step: value}`` for the steps where ``field`` is present (absent steps are left out).
        Read once per field and shared, read-only: a caller may look up one step per row.
        D_t (``kl_to_previous`` and its SE) is left out at steps whose estimator is in-sample
        (``in_sample_d_t_steps``): no book reads a D_t measured on the rollouts the step trained on."""
        cache = self.__dict__.setdefault("_telemetry_columns", {})
        if field not in cache:
            if field not in self.telemetry.column_names:
                cache[field] = MappingProxyType({})
            else:
                values = self.telemetry.column(field).to_pylist()
                skip = self.in_sample_d_t_steps if field in D_T_FIELDS else frozenset()
                cache[field] = MappingProxyType({int(s): v for s, v in zip(self.steps.tolist(), values)
                                                 if v is not None and int(s) not in skip})
        return cache[field]

    @cached_property
    def in_sample_d_t_steps(self) -> frozenset[int]:
        """The steps whose recorded ``kl_to_previous`` was estimated in-sample (an earlier tap's
        ``rollout`` estimator): kept in the file, never read as D_t."""
        if "kl_to_previous_estimator" not in self.telemetry.column_names:
            return frozenset()
        est = self.telemetry.column("kl_to_previous_estimator").to_pylist()
        return frozenset(int(s) for s, e in zip(self.steps.tolist(), est) if e in IN_SAMPLE_ESTIMATORS)

    def _validate_telemetry(self) -> None:
        path = self.path / self.telemetry_name
        steps = self.steps
        if len(steps):
            dup = np.unique(steps[np.r_[False, np.diff(steps) == 0]])
            if len(dup):
                raise RecordError(path, "duplicate steps", field="step", steps=dup)
            back = steps[1:][np.diff(steps) < 0]
            if len(back):
                raise RecordError(path, "steps are not increasing", field="step", steps=back)
        for spec in self._fields_spec.by_source("telemetry").values():
            if spec.column in self.telemetry.column_names:
                _check_values(self.telemetry.column(spec.column), spec, steps, path)

    # ------------------------------------------------------------------ rollouts
    @property
    def n_rollouts(self) -> int:
        return sum(pf.metadata.num_rows for _, pf in self._segments)

    @cached_property
    def rollout_steps(self) -> np.ndarray:
        """The step of every rollout row, in file order (non-decreasing)."""
        return np.concatenate([self._read(pf, name, ["step"]).column("step").to_numpy() for name, pf in self._segments])

    @cached_property
    def rollout_step_values(self) -> np.ndarray:
        """The distinct steps that have rollouts, ascending (``np.unique(rollout_steps)``, which
        is sorted once opened: the steps are checked non-decreasing)."""
        steps = self.rollout_steps
        return steps[np.r_[True, steps[1:] != steps[:-1]]] if len(steps) else steps

    def _segment_of(self, row: int) -> Path:
        """The file holding rollout row ``row`` (in file order over the segments)."""
        ends = np.cumsum([pf.metadata.num_rows for _, pf in self._segments])
        i = min(int(np.searchsorted(ends, row, side="right")), len(self._segments) - 1)
        return self.path / self._segments[i][0]

    def _validate_rollout_steps(self) -> None:
        steps = self.rollout_steps
        top = self._fields_spec.fields["rollout.step"].constraints.maximum
        if len(steps) and top is not None and steps.max() > top:
            first = int(np.flatnonzero(steps > top)[0])
            raise RecordError(self._segment_of(first), f"step {int(steps.max())} above {int(top)} "
                              f"({self._fields_spec.fields['rollout.step'].constraints.maximum_why})", field="step")
        if len(steps) and steps.min() < 0:
            first = int(np.flatnonzero(steps < 0)[0])
            raise RecordError(self._segment_of(first), "negative step", field="step",
                              steps=np.unique(steps[steps < 0]))
        back = np.flatnonzero(np.diff(steps) < 0)
        if len(back):
            ends = np.cumsum([pf.metadata.num_rows for _, pf in self._segments])
            at = self._segment_of(int(back[0]) + 1)
            where = ("rows are not sorted by step (the writer sorts them; the file was altered)"
                     if int(back[0]) + 1 not in set(ends.tolist()) else
                     "starts at an earlier step than the segment before it ends (segments are written in step order; "
                     "a segment was replaced or renamed)")
            raise RecordError(at, where, field="step", steps=steps[back + 1])

    def rollout_columns(self) -> list[str]:
        return list(self._segments[0][1].schema_arrow.names)

    def read_rollouts(self, columns: Sequence[str], window: Window | None = None) -> pa.Table:
        """Rollout columns for the steps in ``window``, validated against specs/fields.yaml.

        Only row groups whose step statistics overlap the window are read.
        """
        parts = list(self.iter_rollouts(columns, window))
        if parts:
            return pa.concat_tables(parts)
        name, pf = self._segments[0]
        return self._read(pf, name, ["step", *[c for c in columns if c != "step"]]).slice(0, 0)

    def iter_rollouts(self, columns: Sequence[str], window: Window | None = None, *,
                      steps: Sequence[int] | None = None) -> Iterator[pa.Table]:
        """Yield the requested columns (plus ``step``) a few row groups at a time: consecutive
        row groups are read together up to ``ROWS_PER_READ`` rows (a writer's small row groups
        would otherwise cost a read call each), so memory stays bounded by that, not the file.
        ``steps``: only those steps' rows, and only row groups whose step range holds one."""
        wanted = np.unique(np.asarray(steps, dtype=np.int64)) if steps is not None else None
        cols = ["step", *[c for c in columns if c != "step"]]
        for c in cols:
            if c not in self.rollout_columns():
                raise RecordError(self.path / self._segments[0][0], "the book needs this column and the record "
                                  "does not have it", field=c)
        for name, pf in self._segments:
            path = self.path / name
            meta = pf.metadata
            step_idx = pf.schema_arrow.get_field_index("step")
            batches: list[list[int]] = []
            inside: set[int] = set()  # row groups whose every step is in the window: no filter to apply
            rows = 0
            for rg in range(meta.num_row_groups):
                stats = meta.row_group(rg).column(step_idx).statistics
                if window is not None and stats is not None and stats.has_min_max:
                    if stats.max < window.start or stats.min > window.stop:
                        continue
                    if window.start <= stats.min and stats.max <= window.stop:
                        inside.add(rg)
                if wanted is not None and stats is not None and stats.has_min_max:
                    i = np.searchsorted(wanted, stats.min)
                    if i == len(wanted) or wanted[i] > stats.max:  # no wanted step in [min, max]
                        continue
                n = meta.row_group(rg).num_rows
                if not batches or rows + n > ROWS_PER_READ or batches[-1][-1] != rg - 1:
                    batches.append([])
                    rows = 0
                batches[-1].append(rg)
                rows += n
            for batch in batches:
                table = self._read(pf, name, cols, batch)
                if window is not None and not inside.issuperset(batch):
                    s = table.column("step")
                    table = table.filter(pc.and_(pc.greater_equal(s, window.start), pc.less_equal(s, window.stop)))
                if wanted is not None:
                    table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(wanted)))
                step_np = table.column("step").to_numpy()
                for c in cols:
                    spec = self._fields_spec.fields.get(f"rollout.{c}")
                    if spec is not None:
                        _check_values(table.column(c), spec, step_np, path)
                # The file it came from travels with the table, so that a later error (a feature
                # that cannot be computed) names this segment, not the first one.
                yield table.replace_schema_metadata({SOURCE_KEY: str(path).encode()})

    # ------------------------------------------------------------------ presence
    def fields(self) -> dict[str, Presence]:
        """Which record fields are present, and on how many steps: the resolver's input (worked
        out once per opened record; each call gets its own dict). Worked out by one thread at a
        time (a report asks for it on several): ``cached_property`` no longer locks from Python
        3.12. The lock keeps calls of ``fields`` apart, not ``fields`` from the record's other
        reads: a report asks for it on its watch thread only after the samples' read."""
        with _PRESENCE_LOCK:
            return dict(self._presence)

    @cached_property
    def _presence(self) -> dict[str, Presence]:
        tel_steps = self.steps
        all_steps = np.union1d(tel_steps, self.rollout_step_values)
        n = len(all_steps)
        out: dict[str, Presence] = {}
        for name, spec in self._fields_spec.by_source("telemetry").items():
            if name == "step" or spec.column not in self.telemetry.column_names:
                continue
            count = self.telemetry.num_rows - self.telemetry.column(spec.column).null_count
            if spec.column in D_T_FIELDS:
                # D_t belongs to a step pair (t, t+1): the last step has none to carry, so it is
                # counted over the steps that have a next one
                last = int(all_steps[-1]) if n else None
                count = sum(1 for s in self.telemetry_column(spec.column) if s != last)
                if count:
                    out[name] = Presence(int(count), max(n - 1, 1))
                continue
            if count:
                out[name] = Presence(int(count), n)
        roll_steps = self.rollout_step_values
        # With one generation feeding R optimizer steps, rollouts exist on every R-th step by
        # design: a rollout field present on each generation step is present throughout.
        r = self.generation_reuse
        n_roll = -(-n // r) if r > 1 else n
        for name, spec in self._fields_spec.by_source("rollouts").items():
            if spec.column not in self.rollout_columns() or not len(roll_steps):
                continue
            counts = [_null_count(pf.metadata, spec.column) for _, pf in self._segments]
            if all(c == 0 for c in counts):
                out[name] = Presence(min(len(roll_steps), n_roll), n_roll)
            elif any(c is None or c < pf.metadata.num_rows for c, (_, pf) in zip(counts, self._segments)):
                steps_with = set()
                for seg, pf in self._segments:
                    col = self._read(pf, seg, ["step", spec.column])
                    valid = pc.is_valid(col.column(spec.column)).to_numpy(zero_copy_only=False)
                    steps_with.update(_distinct(col.column("step").to_numpy()[valid]).tolist())
                if steps_with:
                    # scores under the previous policy belong to a step pair: the first
                    # generation has no earlier policy to be scored under
                    first = spec.column in PREVIOUS_POLICY_COLUMNS and int(roll_steps[0]) not in steps_with
                    of = n_roll - 1 if first and n_roll > 1 else n_roll
                    out[name] = Presence(min(len(steps_with), of), of)
        if self.manifest.optimizer:
            out["optimizer"] = Presence(n, n)
        if self._heldout_segments:
            ho = np.concatenate([self._read(pf, name, ["step"]).column("step").to_numpy()
                                 for name, pf in self._heldout_segments])
            if len(ho):
                # held-out rows belong to a step pair, filed under its later generation: the first
                # generation has none, and with one generation feeding R steps one in R has them
                of = max(n_roll - 1, 1)
                out["heldout"] = Presence(min(len(_distinct(ho)), of), of)
        if self.manifest.checkpoints:
            ck = {c.step for c in self.manifest.checkpoints}
            out["checkpoints"] = Presence(len(ck), n)
        return out

    @cached_property
    def generation_reuse(self) -> int:
        """How many optimizer steps one generation batch feeds, from the trainer config the
        manifest keeps (TRL: num_iterations x steps_per_generation / gradient_accumulation_steps;
        1 where it does not say)."""
        cfg = self.manifest.trainer_config or {}
        try:
            iters = int(cfg.get("num_iterations") or 1)
            ga = int(cfg.get("gradient_accumulation_steps") or 1)
            spg = int(cfg.get("steps_per_generation") or ga)
        except (TypeError, ValueError):
            return 1
        return max(1, iters) * max(1, spg // max(1, ga))

    def verify(self) -> None:
        """Re-hash every data file against the manifest (reads everything; not done on open)."""
        for name, entry in self.manifest.files.items():
            if name == self.telemetry_name and self._telemetry_handle is not None:
                digest = _sha256_handle(self._telemetry_handle)  # the file this snapshot opened
            else:
                _regular(self.path / name)
                digest = sha256_file(self.path / name)
            if digest != entry.sha256:
                raise RecordError(self.path / name, "sha256 differs from manifest.json: the file was changed")
        for ck in self.manifest.checkpoints:
            for name, entry in ck.files.items():
                p = self.path / ck.path / name
                if not is_regular(p) or sha256_file(p) != entry.sha256:
                    raise RecordError(p, "checkpoint file missing or changed since the record was written")


_PRESENCE_LOCK = threading.RLock()


def _distinct(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)``: without its sort where ``a`` is already in order (a writer's rows are in
    step order: a sort of 640,000 steps a column was a tenth of a second of every report)."""
    if len(a) < 2 or (a[1:] < a[:-1]).any():
        return np.unique(a)
    return a[np.r_[True, a[1:] != a[:-1]]]


# Rollout columns that score a rollout under the policy before its step's: absent on the first
# generation by design (there is no earlier policy), so counted over the generations after it.
PREVIOUS_POLICY_COLUMNS = frozenset({"logp_prev", "kl_prev", "logp_prev_step"})


def _null_count(meta: pq.FileMetaData, column: str) -> int | None:
    """Nulls in ``column`` over the file's row groups, from their statistics (None where a
    row group has none). The column's index is found once, not per row group."""
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    index = next((i for i, path in enumerate(paths) if path.split(".")[0] == column), None)
    if index is None:
        return 0
    total = 0
    for rg in range(meta.num_row_groups):
        st = meta.row_group(rg).column(index).statistics
        if st is None or not st.has_null_count:
            return None
        total += st.null_count
    return total


def _type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual.equals(expected):
        return True
    # Parquet round-trips may turn string into large_string or int32 lists; accept the
    # lossless widenings, nothing else.
    if pa.types.is_string(expected) and pa.types.is_large_string(actual):
        return True
    if pa.types.is_list(expected) and (pa.types.is_list(actual) or pa.types.is_large_list(actual)):
        return pa.types.is_integer(actual.value_type)
    if pa.types.is_map(expected) and pa.types.is_map(actual):
        return pa.types.is_floating(actual.item_type)
    return False


def _check_utf8(column: pa.ChunkedArray, spec: FieldSpec, steps: np.ndarray, path: Path) -> None:
    """Parquet strings are UTF-8; a writer that stored other bytes made a corrupt record."""
    offset = 0
    for chunk in column.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            bad = []
            for i, v in enumerate(chunk.cast(pa.binary()).to_pylist()):  # the error path only
                if v is not None:
                    try:
                        v.decode("utf-8")
                    except UnicodeDecodeError:
                        bad.append(offset + i)
            raise RecordError(path, "invalid UTF-8 in the text (Parquet strings are UTF-8)", field=spec.column,
                              steps=np.unique(steps[bad]) if bad else None) from None
        offset += len(chunk)


def _check_values(column: pa.ChunkedArray, spec: FieldSpec, steps: np.ndarray, path: Path) -> None:
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        _check_utf8(column, spec, steps, path)
        return
    if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)):
        return
    values = column.to_numpy(zero_copy_only=False).astype(float)  # nulls become NaN here
    valid = pc.is_valid(column).to_numpy(zero_copy_only=False)
    nan_ok = not spec.constraints.finite
    if pa.types.is_floating(column.type):
        bad = valid & ~np.isfinite(values)
        if bad.any():
            kind = "NaN" if np.isnan(values[bad]).any() else "infinite"
            if not nan_ok or kind == "NaN":
                raise RecordError(path, f"{kind} value (absent must be stored as null, and {spec.unit} values "
                                  "must be finite)", field=spec.column, steps=np.unique(steps[bad]))
    if spec.constraints.nonnegative:
        bad = valid & (values < 0)
        if bad.any():
            raise RecordError(path, f"negative value; a {spec.unit} quantity cannot be negative",
                              field=spec.column, steps=np.unique(steps[bad]))
    if spec.constraints.maximum is not None:
        bad = valid & (values > spec.constraints.maximum)
        if bad.any():
            integral = pa.types.is_integer(column.type)
            top = int(pc.max(column).as_py()) if integral else values[bad].max()
            shown = f"{top}" if integral else f"{top:.3g}"
            limit = f"{int(spec.constraints.maximum)}" if integral else f"{spec.constraints.maximum:g}"
            raise RecordError(path, f"value {shown} above {limit} {spec.unit}"
                              f"{' (' + spec.constraints.maximum_why + ')' if spec.constraints.maximum_why else ''}",
                              field=spec.column, steps=np.unique(steps[bad]))
    _check_magnitude(values, valid, spec, steps, path)


def _check_magnitude(values: np.ndarray, valid: np.ndarray, spec: FieldSpec, steps: np.ndarray, path: Path) -> None:
    """No number beyond the catalogue's magnitude limit (specs/fields.yaml, ``magnitude``)."""
    mag = load_fields().magnitude
    if mag is None:
        return
    with np.errstate(invalid="ignore"):
        bad = valid & (np.abs(values) > mag.limit)
    if bad.any():
        raise RecordError(path, f"value {values[bad][0]:.3g} beyond ±{mag.limit:g}: {mag.why}", field=spec.column,
                          steps=np.unique(steps[bad]))
