"""Output folders that change as a whole, and only where reward-lens wrote them.

A report (``report.md``, ``report.html``, ``report.json``) and a site are *sets* of files
that must agree with each other, so neither is written file by file into place: the whole
folder is built beside its destination and exchanged with the old one in a single atomic
rename (``swap_into_place``). A kill at any moment leaves the old set or the new set, never
a mix, and never nothing.

Ownership. reward-lens writes a marker file, ``.reward-lens``, listing every file of the
folder it wrote. A destination that exists and is not empty is replaced only when its marker
lists everything in it; a folder holding anything else (a user's notes, the current
directory, a folder of records) is refused with one line naming what reward-lens did not
write. It never deletes what it did not write.

Concurrency. The check and the exchange happen under an exclusive ``flock`` of the parent
directory, so two writers to one destination take turns: each leaves a whole set, and the
last one wins. Temporary folders of writers that were killed (``.NAME.tmp-*`` holding a
reward-lens marker) are removed by the next writer under the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from reward_lens import __version__
from reward_lens.record.writer import recover_swap, swap_into_place
from reward_lens_spec.files import kind_of, read_text

MARKER = ".reward-lens"


class OutputRefused(ValueError):
    """The destination holds files reward-lens did not write (bad input: exit 2)."""


def _files_under(root: Path) -> set[str]:
    """Everything under ``root`` that is not a directory itself: files, links (to a folder too,
    never descended into), FIFOs, sockets. Each is either listed in the marker or foreign."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk does not follow links to folders
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(Path(dirpath, n).relative_to(root).as_posix())
    return out


def _named(root: Path, rel: str) -> str:
    """``rel`` as a refusal names it: with what it is, where it is not a regular file."""
    mode = os.lstat(root / rel).st_mode
    return rel if stat.S_ISREG(mode) else f"{rel} ({kind_of(mode)})"


def check_owned(dest: Path, kind: str) -> None:
    """Raise ``OutputRefused`` unless ``dest`` is absent, empty, or a folder whose marker
    lists every file in it."""
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_symlink():
        raise OutputRefused(f"{dest}: is a symbolic link (to {os.readlink(dest)}); reward-lens writes a {kind} only "
                            "into a folder itself, new or one it wrote before, never through a link: give the "
                            "folder's own path (nothing was changed)")
    if not dest.is_dir():
        raise OutputRefused(f"{dest}: exists and is not a folder; reward-lens writes a {kind} only into a new "
                            "folder or one it wrote before")
    present = _files_under(dest)
    if not present and not any(dest.iterdir()):
        return
    marker = dest / MARKER
    listed: set[str] = set()
    marker_ok = False
    try:
        data = json.loads(read_text(marker, follow_links=False, limit=1 << 24))  # never a FIFO, never a link
        listed = set(data.get("files", [])) if isinstance(data, dict) else set()
        marker_ok = True
    except (OSError, ValueError, RecursionError, TypeError):
        listed = set()
    foreign = sorted(present - listed - {MARKER})
    if not marker_ok or foreign:
        shown = ", ".join(_named(dest, f) for f in foreign[:3]) + (f" and {len(foreign) - 3} more"
                                                                  if len(foreign) > 3 else "")
        why = f"holds {shown}, which reward-lens did not write" if foreign else \
            "is not a folder reward-lens wrote (no .reward-lens marker)"
        raise OutputRefused(f"{dest}: {why}; choose a new or empty folder for the {kind} (nothing was changed)")


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(path, 0o644)


def _remove_stale_temporaries(parent: Path, name: str) -> None:
    """Folders ``.NAME.tmp-*`` / ``.NAME.old-*`` left by a killed writer. Called under the
    lock, so no live writer owns one; each is removed only if it is recognisably ours: empty
    (killed right after ``mkdtemp``) or holding our marker (written first)."""
    for p in parent.glob(f".{name}.tmp-*"):
        if p.is_dir() and ((p / MARKER).exists() or not any(p.iterdir())):
            shutil.rmtree(p, ignore_errors=True)
    if not (parent / name).exists():
        return
    for p in parent.glob(f".{name}.old-*"):
        inner = p / name
        if p.is_dir() and (not any(p.iterdir()) or (inner / MARKER).is_file()):
            shutil.rmtree(p, ignore_errors=True)


def replace_dir_atomically(dest: Path, files: Mapping[str, str], kind: str = "report") -> list[Path]:
    """Make ``dest`` hold exactly ``files`` (``{relative name: text}``) plus the marker, as one
    change. Returns the paths written."""
    dest = Path(os.path.abspath(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    check_owned(dest, kind)  # before any work: a refused destination costs nothing
    with _locked(dest.parent):
        recover_swap(dest)
        _remove_stale_temporaries(dest.parent, dest.name)
        check_owned(dest, kind)  # again, under the lock: another writer may have been first
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            # The marker goes first, so a killed writer's temporary is recognisable as ours.
            _write(tmp / MARKER, json.dumps({"written_by": f"reward-lens {__version__}", "kind": kind,
                                             "files": sorted(files)}, indent=1) + "\n")
            for rel, text in files.items():
                _write(tmp / rel, text)
            umask = os.umask(0)
            os.umask(umask)
            for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
                os.chmod(d, 0o777 & ~umask)
            swap_into_place(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return [dest / rel for rel in files]
