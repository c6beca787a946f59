"""Where specs/ and templates/ live.

In a built wheel they are shipped as ``reward_lens_spec/_data/{specs,templates}`` (see
pyproject's force-include); in a source checkout (editable install, tests) they sit at the
repository root, one level above this package. The installed copy wins when both exist.
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"reward-lens cannot find its `{name}/` directory (looked in {_PKG / '_data' / name} "
        f"and {_PKG.parent / name}); the installation is incomplete"
    )


def specs_dir() -> Path:
    return _find("specs")


def templates_dir() -> Path:
    return _find("templates")
