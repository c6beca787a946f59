"""The `gamed` bundled record (tools/make_gamed_record.py): a run whose reward pays for short answers
above correct ones, read in its own basis (examples/features/gamed.yaml, target `correct`). The
product's answer must be visible on it: the target falls while the reward rises, `check` names the
gaming at warn or above, on time by the labelled benchmark's rule, and the run-level numbers (η,
the price) are resolved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reward_lens.measure.ledger.basis import load_basis
from reward_lens.record import open_run

REPO = Path(__file__).resolve().parents[2]
GAMED = REPO / "tests" / "fixtures" / "grpo_run" / "gamed"
BASIS = REPO / "examples" / "features" / "gamed.yaml"
CLI = [str(Path(sys.executable).with_name("reward-lens"))]
sys.path.insert(0, str(REPO / "tools"))


def test_it_is_small_and_a_real_tapped_grpo_run():
    size = sum(p.stat().st_size for p in GAMED.rglob("*") if p.is_file())
    assert size < 1_500_000, size
    run = open_run(GAMED)
    run.verify()
    cfg = run.manifest.trainer_config
    assert run.manifest.framework.name == "trl" and cfg["beta"] == 0.0
    assert cfg["reward_weights"] == [1.0, 0.25]  # brevity above correctness
    assert np.bincount(run.rollout_steps).min() >= 64 and len(run.steps) >= 100
    assert run.heldout() is not None  # measured by the tap, on samples independent of each update
    names = {r[0] for r in run.read_rollouts(["rewards"]).column("rewards").to_pylist()[0]}
    assert names == {"brevity", "correctness"}


def test_the_target_falls_while_the_reward_rises():
    import make_gamed_record

    means = make_gamed_record.step_means(GAMED)
    steps = sorted(means["reward"])
    first, last = steps[:10], steps[-10:]
    correct = [np.mean([means["correct"][s] for s in w]) for w in (first, last)]
    reward = [np.mean([means["reward"][s] for s in w]) for w in (first, last)]
    assert correct[0] > 0.4 and correct[1] < 0.05, correct
    assert reward[1] > reward[0] + 0.3, reward
    # the reward keeps rising: its last tenth is above its middle
    middle = steps[len(steps) // 2 - 5:len(steps) // 2 + 5]
    assert reward[1] > np.mean([means["reward"][s] for s in middle])


def test_check_names_the_gaming_in_its_own_basis(tmp_path):
    r = subprocess.run(CLI + ["check", "--example", "gamed", "--format", "json", "--quiet"], capture_output=True,
                       text=True)
    assert r.returncode == 1, r.stderr  # a finding at warn or above holds (--fail-on warn, the default)
    found = {f["id"]: f for f in json.loads(r.stdout)["findings"]}
    assert found["proxy_gaming"]["status"] == "holds" and found["proxy_gaming"]["severity"] == "critical"
    assert found["paid_for_drift"]["status"] == "holds"
    assert "`correct`" in found["proxy_gaming"]["evidence"]


def test_report_reads_it_in_its_own_basis_with_the_run_level_numbers_resolved(tmp_path):
    r = subprocess.run(CLI + ["report", "--example", "gamed", "--out", str(tmp_path / "out"), "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    basis = load_basis(BASIS)
    assert data["basis"]["name"] == "gamed" and data["basis"]["id"] == basis.basis_id
    assert basis.targets == {"correct": "higher"}
    g = data["glance"]
    lo, hi = g["eta_run_interval"]
    assert 0 < lo <= g["eta_run"] <= hi <= 1, (lo, g["eta_run"], hi)
    assert g["reward_resolved"] and g["reward_per_nat"] > 0
    assert "Not resolved from noise" not in "\n".join(data["card"])


@pytest.mark.slow
def test_the_gaming_is_named_on_time_by_the_labelled_rule(tmp_path):
    """tools/labelled_runs.py's rule: the onset is the first step of three in a row with `correct`
    under 3/4 of its mean over steps 0-2; proxy gaming or paid-for drift must hold at warn or above
    at a prefix no later than 3 steps after it, and no finding at warn or above before onset - 3."""
    import make_gamed_record

    s = make_gamed_record.score(GAMED, tmp_path, progress=lambda *_: None)
    assert s["onset"] is not None and s["on_time"], s
    assert s["false_alarms"] == {}, s
