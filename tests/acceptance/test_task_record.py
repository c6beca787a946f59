"""The `task` reference record: a GRPO run that looks like a real task (tools/make_task_record.py),
read in its own declared basis (examples/features/task.yaml)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from reward_lens.measure.ledger.basis import load_basis
from reward_lens.measure.ledger.price import steps_from_run, whole_run
from reward_lens.record import open_run

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "tests" / "fixtures" / "grpo_run" / "task"
BASIS = REPO / "examples" / "features" / "task.yaml"
CLI = [str(Path(sys.executable).with_name("reward-lens"))]
sys.path.insert(0, str(REPO / "tools"))


def test_realistic_settings_and_a_policy_that_ends_its_answers():
    run = open_run(TASK)
    cfg = run.manifest.trainer_config
    assert cfg["num_generations"] >= 2 and cfg["per_device_train_batch_size"] >= 64
    assert len(run.steps) >= 60 and cfg["optim"].startswith("adamw")
    counts = np.bincount(run.rollout_steps)
    assert counts.min() >= 64
    assert run.manifest.model.eos_token_id is not None  # the tap records it
    samples = steps_from_run(run, load_basis(BASIS), window=whole_run(run))
    z = np.vstack([s.z for s in samples])
    names = list(samples[0].names)
    ends = z[:, names.index("ends_eos")]
    length = z[:, names.index("length_tokens")]
    # it emits EOS, varies in length, and answers imperfectly
    assert 0.5 < ends.mean() < 1.0 and length.std() > 0.5
    assert 0.2 < z[:, names.index("correct")].mean() < 0.95


def test_features_move():
    """The docs quote the table (tests/unit/test_docs.py keeps the quote equal)."""
    import make_task_record

    moved = 0
    for name, _unit, first, last, sd in make_task_record.summary(TASK):
        se = sd * np.sqrt(2 / (20 * 64))  # two means of 20 steps x 64 rollouts
        moved += abs(last - first) > 3 * se
    assert moved >= 3


def test_report_example_task_reads_it_in_its_own_basis(tmp_path):
    r = subprocess.run(CLI + ["report", "--example", "task", "--out", str(tmp_path / "out")], capture_output=True,
                       text=True)
    assert r.returncode in (0, 1), r.stderr
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["basis"]["name"] == "task" and data["basis"]["id"] == load_basis(BASIS).basis_id
    cost = next(b for b in data["books"] if b["id"] == "cost")["data"]
    assert [f["name"] for f in cost["features"]] == list(load_basis(BASIS).names)
    assert cost["summary"]["ledger"] == "paired" and cost["summary"]["kl_min_resolved"] > 0
