"""Write a record atomically.

Everything is written into a temporary sibling directory, checksummed, fsynced, and only
then renamed into place: a crash at any point leaves either no record or the previous one,
never half of one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from reward_lens import __version__
from reward_lens.record.errors import RecordError
from reward_lens.record.schema import (
    HELDOUT_FILE,
    MANIFEST_FILE,
    ROLLOUTS_FILE,
    TELEMETRY_FILE,
    VALIDATION_FILE,
    CheckpointEntry,
    FileEntry,
    NonFiniteValue,
    OptimizerTelemetry,
    Rollout,
    RunManifest,
    arrow_schema,
    content_run_id,
)

# Rollouts are sorted by step and written in row groups of about this many rows, so that a
# book reading a window of steps touches only the row groups whose step statistics overlap.
ROLLOUT_ROW_GROUP = 4096


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_entry(path: Path, rows: int | None = None) -> FileEntry:
    return FileEntry(sha256=sha256_file(path), bytes=path.stat().st_size, rows=rows)


def _telemetry_table(rows: Iterable[OptimizerTelemetry]) -> pa.Table:
    schema = arrow_schema("telemetry")
    data = sorted((r.model_dump() for r in rows), key=lambda d: d["step"])
    return pa.Table.from_pylist(data, schema=schema)


def _rollouts_table(rows: Iterable[Rollout] | pa.Table) -> pa.Table:
    schema = arrow_schema("rollouts")
    if isinstance(rows, pa.Table):
        table = rows.select([f.name for f in schema if f.name in rows.column_names])
        for f in schema:
            if f.name not in table.column_names:
                table = table.append_column(f, pa.nulls(table.num_rows, f.type))
        table = table.select(schema.names).cast(schema)
    else:
        data = [r.model_dump() for r in rows]
        for d in data:
            for key in ("rewards", "targets"):
                if d[key] is not None:
                    d[key] = list(d[key].items())
        table = pa.Table.from_pylist(data, schema=schema)
    # Stable sort keeps the within-step order the trainer produced.
    return table.take(pa.compute.sort_indices(table, sort_keys=[("step", "ascending")]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_manifest(directory: Path, manifest: RunManifest) -> RunManifest:
    """Stamp ``manifest`` with its content run_id and write it into ``directory`` by
    temp file + fsync + rename: the manifest is a record's commit point."""
    manifest = manifest.model_copy(update={"run_id": content_run_id(manifest)})
    fd, tmp_name = tempfile.mkstemp(prefix=".manifest.", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(manifest.model_dump_json(indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, directory / MANIFEST_FILE)
    return manifest


_RENAME_EXCHANGE = 2  # linux/fs.h: atomically exchange two paths


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``). False where the system or file system does not support it."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_into_place(tmp: Path, dest: Path, keep_foreign: bool = False) -> None:
    """Put the finished directory ``tmp`` at ``dest``. An existing ``dest`` is exchanged with
    ``tmp`` in one atomic rename and then removed, so a kill at any moment leaves the old
    directory or the new one at ``dest``, never neither. Where the exchange is not
    supported, the old directory is moved aside first and ``recover_swap`` puts it back if
    the process dies between the two renames."""
    if dest.exists():
        if _exchange(tmp, dest):
            if keep_foreign:
                _carry_over(tmp, dest)  # tmp now holds the old directory
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.rename(dest, old / dest.name)
            os.rename(tmp, dest)
            if keep_foreign:
                _carry_over(old / dest.name, dest)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)
    _fsync_dir(dest.parent)


def recover_swap(dest: Path) -> None:
    """Where a fallback swap was killed between its renames, put the old ``dest`` back."""
    if dest.exists():
        return
    for old in sorted(dest.parent.glob(f".{dest.name}.old-*")):
        if (old / dest.name).is_dir():
            os.rename(old / dest.name, dest)
            shutil.rmtree(old, ignore_errors=True)
            return


_RECORD_FILE = re.compile(r"^\.?(manifest\.json|(telemetry|rollouts|heldout)(-\d{5})?\.parquet|validation\.parquet)"
                          r"(\.tmp)?$")


def record_file_name(name: str) -> bool:
    """A name reward-lens writes in a record directory (its manifest, its Parquet files, their
    temporary names). Anything else there is someone else's: never removed or replaced."""
    return bool(_RECORD_FILE.match(name))


def _carry_over(old: Path, new: Path) -> None:
    """Move what is not reward-lens's from the replaced record ``old`` into the new one: a
    user's notes, a README, their own folders. ``checkpoints/`` is the record's own only where
    the old manifest listed checkpoints."""
    from reward_lens_spec.files import read_text

    try:
        listed = json.loads(read_text(old / MANIFEST_FILE)).get("checkpoints") or []
    except (OSError, ValueError, AttributeError, RecursionError):
        listed = []
    for p in old.iterdir():
        if record_file_name(p.name) or (p.name == "checkpoints" and listed) or (new / p.name).exists():
            continue
        os.rename(p, new / p.name)


def _is_our_record(path: Path) -> bool:
    from reward_lens_spec.files import read_text

    try:
        data = json.loads(read_text(path / MANIFEST_FILE))  # a FIFO in its place is refused, not waited on
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and str(data.get("created_by", "")).startswith("reward-lens")


def write_run(
    path: str | Path,
    *,
    framework: Mapping[str, Any],
    model: Mapping[str, Any],
    telemetry: Iterable[OptimizerTelemetry],
    rollouts: Iterable[Rollout] | pa.Table,
    optimizer: str | None = None,
    trainer_config: Mapping[str, Any] | None = None,
    telemetry_per_step: bool = True,
    logging_steps: int = 1,
    notes: Iterable[str] = (),
    checkpoints: Mapping[int, str | Path] | None = None,
    overwrite: bool = False,
    heldout: Iterable[Rollout] | pa.Table | None = None,
    non_finite: Iterable[NonFiniteValue] = (),
    validation: Iterable[Rollout] | pa.Table | None = None,
    targets: Iterable[Any] = (),
) -> RunManifest:
    """Write a record directory at ``path`` and return its manifest.

    ``checkpoints`` maps a step to a directory (safetensors + config + tokenizer files) that
    is copied into ``checkpoints/step-<step>/``. ``heldout``: held-out completions of pi_t
    (rows of the rollouts schema), written to ``heldout.parquet``. ``non_finite``: the values the
    run logged as NaN or infinite, stored as null in their columns (``RunManifest.non_finite``).
    ``validation``: completions of held-out *prompts* the trainer drew to validate pi_step (veRL's
    ``validation_data_dir``), rows of the rollouts schema written to ``validation.parquet``: apart
    from ``heldout`` (the same prompts' draws the paired ledger reads) and from the rollouts.
    ``targets``: what the user declared they want (``TargetDecl`` or its mapping), the manifest's
    ``targets``.
    """
    dest = Path(path)
    recover_swap(dest)
    if dest.exists() and not overwrite:
        raise RecordError(dest, "a record already exists here (pass overwrite=True to replace it)")
    if dest.exists() and not _is_our_record(dest):
        raise RecordError(dest, "exists and is not a record reward-lens wrote (no manifest.json of ours); "
                          "overwrite replaces only a record, never another folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tel = _telemetry_table(telemetry)
        rol = _rollouts_table(rollouts)
        pq.write_table(tel, tmp / TELEMETRY_FILE, compression="zstd")
        pq.write_table(rol, tmp / ROLLOUTS_FILE, compression="zstd", row_group_size=ROLLOUT_ROW_GROUP)
        files = {
            TELEMETRY_FILE: _file_entry(tmp / TELEMETRY_FILE, tel.num_rows),
            ROLLOUTS_FILE: _file_entry(tmp / ROLLOUTS_FILE, rol.num_rows),
        }
        if heldout is not None:
            ho = _rollouts_table(heldout)
            pq.write_table(ho, tmp / HELDOUT_FILE, compression="zstd", row_group_size=ROLLOUT_ROW_GROUP)
            files[HELDOUT_FILE] = _file_entry(tmp / HELDOUT_FILE, ho.num_rows)
        if validation is not None:
            va = _rollouts_table(validation)
            pq.write_table(va, tmp / VALIDATION_FILE, compression="zstd", row_group_size=ROLLOUT_ROW_GROUP)
            files[VALIDATION_FILE] = _file_entry(tmp / VALIDATION_FILE, va.num_rows)
        ckpts = []
        for step, src in sorted((checkpoints or {}).items()):
            rel = f"checkpoints/step-{int(step)}"
            shutil.copytree(src, tmp / rel)
            entries = {p.relative_to(tmp / rel).as_posix(): _file_entry(p)
                       for p in sorted((tmp / rel).rglob("*")) if p.is_file()}
            ckpts.append(CheckpointEntry(step=int(step), path=rel, files=entries))
        manifest = RunManifest(
            framework=dict(framework), model=dict(model), optimizer=optimizer,
            trainer_config=dict(trainer_config or {}), telemetry_per_step=telemetry_per_step,
            logging_steps=logging_steps, created_by=f"reward-lens {__version__}", notes=list(notes),
            files=files, checkpoints=ckpts, non_finite=list(non_finite), targets=list(targets),
        )
        manifest = commit_manifest(tmp, manifest)
        # mkdtemp makes the directory 0700; a record is data to share, so give it the
        # permissions a plain mkdir would have had.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        _fsync_dir(tmp)
        swap_into_place(tmp, dest, keep_foreign=True)  # a user's own files in the folder stay
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
