"""Atomic output: every file goes to a temporary sibling and is renamed into place, so an
interrupted run leaves the previous report (or site) intact."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from reward_lens.record.writer import swap_into_place


def write_files_atomically(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """Write ``{relative name: text}`` under ``out_dir``; each file appears whole or not at all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        dest = out_dir / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        written.append(dest)
    return written


def replace_dir_atomically(dest: Path, files: Mapping[str, str]) -> None:
    """Build a whole directory beside ``dest`` and swap it in (for a site: no mix of old and new)."""
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write_files_atomically(tmp, files)
        os.chmod(tmp, 0o755)
        swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
