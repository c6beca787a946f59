"""The findings on a real collapsing run: the task recipe at lr 3e-3 (tools/findings_runs.py),
trained with TRL and the tap. `check` names `correct` moving against the reward with an onset in
the first ten steps and advantage collapse, `--fail-on warn` exits 1, and the live findings reach
the trainer's own logs within five steps of the onset. The healthy side (the task recipe at its
own rate) is the bundled task record (tests/unit/test_findings.py) and, over five seeds,
tools/findings_runs.py --healthy-seeds 5 (quoted in docs/findings.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory):
    import findings_runs

    return findings_runs.train(findings_runs.COLLAPSE, tmp_path_factory.mktemp("collapse"))


def test_check_names_the_collapse_and_its_onset(collapsed, capsys):
    from reward_lens import cli

    code = cli.main(["check", str(collapsed.record), "--features", str(REPO / "examples" / "features" / "task.yaml"),
                     "--format", "json", "--quiet", "--fail-on", "warn"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    by = {f["id"]: f for f in out["findings"]}
    against = by["moving_against_reward"]
    assert against["status"] == "holds" and against["severity"] == "critical"
    assert [f["feature"] for f in against["values"]["features"]] == ["correct"]
    assert against["onset"] is not None and against["onset"] <= 10
    assert by["advantage_collapse"]["status"] == "holds"
    assert by["entropy_collapse"]["status"] == "clear"  # it collapses in correctness, not in entropy (the spec says so)


def test_the_live_findings_reach_the_trainers_logs_near_the_onset(collapsed):
    import findings_runs

    after = {f.id: f for f in findings_runs.check(collapsed.record)}
    onset = after["advantage_collapse"].onset
    live = [e["step"] for e in collapsed.log_history if e.get("reward_lens/finding/advantage_collapse", 0) > 0]
    assert live, "no reward_lens/finding/advantage_collapse in trainer.state.log_history"
    # log_history's step is TRL's global_step after the update (record step + 1)
    assert min(live) - 1 <= onset + 5


def test_stop_on_stops_the_training_when_a_live_finding_holds(tmp_path):
    import dataclasses

    import findings_runs
    import truth

    regime = dataclasses.replace(findings_runs.COLLAPSE, name="collapse", steps=20)
    trained = truth.train(regime, tmp_path, check_every=1, stop_on="warn")
    steps = [e["step"] for e in trained.log_history if "loss" in e]
    assert max(steps) < 20  # stopped before max_steps
    held = [e["step"] for e in trained.log_history if e.get("reward_lens/finding/advantage_collapse", 0) > 0]
    assert held and max(steps) == min(held)  # at the step the finding first held
