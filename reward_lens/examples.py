"""The bundled reference records (``reward-lens report --example long``).

In a wheel they ship as ``reward_lens/_examples/grpo_run/<name>``; in a source checkout
they are the test fixtures, ``tests/fixtures/grpo_run/<name>``. A record with a feature basis
of its own (``task``, ``gamed``) has it as ``examples/features/<name>.yaml`` (in a wheel,
``reward_lens/_examples/features/<name>.yaml``), used unless ``--features`` names another.
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def examples_dir() -> Path:
    for candidate in (_PKG / "_examples" / "grpo_run", _PKG.parent / "tests" / "fixtures" / "grpo_run"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the bundled example records are missing from this installation")


def example_names() -> list[str]:
    return sorted(p.name for p in examples_dir().iterdir() if (p / "manifest.json").is_file())


def example_record(name: str) -> Path:
    path = examples_dir() / name
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(f"no bundled example {name!r}; available: {', '.join(example_names())}")
    return path


def example_features(name: str) -> Path | None:
    """The feature basis a bundled record is meant to be read with, if it has its own."""
    for candidate in (_PKG / "_examples" / "features", _PKG.parent / "examples" / "features"):
        path = candidate / f"{name}.yaml"
        if path.is_file():
            return path
    return None
