"""The wheel carries specs/, templates/ and the example records, and an installed copy
finds them from outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, capture_output=True)
    (whl,) = out.glob("reward_lens_rl-*.whl")  # the distribution's name (pyproject.toml); the packages keep theirs
    return whl


def test_wheel_contains_specs_templates_and_examples(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("reward_lens_spec/_data/specs/fields.yaml", "reward_lens_spec/_data/specs/books/cost.yaml",
                     "reward_lens_spec/_data/specs/refusal_codes.yaml", "reward_lens_spec/_data/specs/frameworks/trl.yaml",
                     "reward_lens_spec/_data/templates/refusals/RECORD_INCOMPLETE/cost.remedy.j2",
                     "reward_lens_spec/_data/templates/report/report.html.j2",
                     "reward_lens/_examples/grpo_run/long/manifest.json",
                     "reward_lens/_examples/grpo_run/long/rollouts.parquet",
                     "reward_lens/_examples/grpo_run/task/manifest.json",
                     "reward_lens/_examples/features/task.yaml",
                     # the README's main command's example, with its own basis
                     "reward_lens/_examples/grpo_run/gamed/manifest.json",
                     "reward_lens/_examples/features/gamed.yaml",
                     "reward_lens_spec/_data/specs/features/surface.yaml",
                     "reward_lens_spec/_data/specs/taps/trl.yaml",
                     "reward_lens/cli.py"):
        assert required in names, required
    assert not any(n.startswith("tests/") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "Name: reward-lens-rl" in zipfile.ZipFile(wheel).read(meta).decode()
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "reward-lens = reward_lens.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_copy_loads_its_specs_outside_the_repo(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = (
        "import reward_lens_spec, reward_lens, sys;"
        "from reward_lens_spec.paths import specs_dir, templates_dir;"
        "from reward_lens_spec import load_books;"
        f"assert reward_lens_spec.__file__.startswith({str(target)!r}), reward_lens_spec.__file__;"
        f"assert str(specs_dir()).startswith({str(target)!r}) and str(templates_dir()).startswith({str(target)!r});"
        "assert 'cost' in load_books();"
        "from reward_lens.cli import main;"
        "sys.exit(main(['report', '--example', 'long', '--out', 'out', '--quiet', '--fail-on', 'violated']))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "RECORD_INCOMPLETE" in (tmp_path / "out" / "report.md").read_text()
    # the task example is read in its own basis, shipped beside it
    code = ("import sys; from reward_lens.cli import main;"
            "sys.exit(main(['report', '--example', 'task', '--out', 'task', '--quiet', '--format', 'json']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    import json

    assert json.loads((tmp_path / "task" / "report.json").read_text())["basis"]["name"] == "task"


def test_modules_have_one_name_each_and_say_what_they_own():
    """No two modules under reward_lens/ share a basename, and each opens with what it owns."""
    import ast
    from collections import Counter

    root = Path(__file__).resolve().parents[2]
    mods = [p for pkg in ("reward_lens", "reward_lens_spec") for p in (root / pkg).rglob("*.py")]
    names = Counter(p.name for p in mods if p.name != "__init__.py" and (root / "reward_lens") in p.parents)
    assert not [n for n, c in names.items() if c > 1], names.most_common(3)
    assert not [str(p) for p in mods if not ast.get_docstring(ast.parse(p.read_text()))]


def test_the_seeds_import_paths_are_the_contract():
    from reward_lens.measure.efficiency import cost_series, kl_min_series, metric_g  # noqa: F401
    from reward_lens.measure.ledger.features import SurfaceFeatures  # noqa: F401
    from reward_lens.measure.ledger.price import ledger_series, learning_rates, steps_from_run, whole_run  # noqa: F401
    from reward_lens.record.reader import open_run  # noqa: F401
    from reward_lens.taps.trl import RewardLensTap  # noqa: F401
