"""The findings on a real collapsing run: the task recipe at lr 3e-3 (tools/findings_runs.py),
trained with TRL and the tap. `check` names `correct` moving against the reward and advantage
collapse, `--fail-on warn` exits 1, the live findings reach the trainer's own logs, and with
``stop_on="critical"`` the tap halts the run on the book-grounded finding at the first step at
which `check`, on the record of the steps so far, reports it. Healthy runs and the hacking modes
are tools/labelled_runs.py's benchmark (tests/acceptance/test_labelled_runs.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
TASK = REPO / "examples" / "features" / "task.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory):
    import findings_runs

    return findings_runs.train(findings_runs.COLLAPSE, tmp_path_factory.mktemp("collapse"), features=str(TASK))


def test_check_names_the_collapse_and_its_onset(collapsed, capsys):
    from reward_lens import cli

    code = cli.main(["check", str(collapsed.record), "--features", str(TASK), "--format", "json", "--quiet",
                     "--fail-on", "warn"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    by = {f["id"]: f for f in out["findings"]}
    against = by["moving_against_reward"]
    assert against["status"] == "holds" and against["severity"] == "critical"
    assert "correct" in [f["feature"] for f in against["values"]["features"]]
    assert against["onset"] is not None and against["onset"] <= 3  # correctness collapses at the first updates
    assert by["advantage_collapse"]["status"] == "holds"
    assert by["entropy_collapse"]["status"] == "clear"  # it collapses in correctness, not in entropy (the spec says so)
    assert by["proxy_gaming"]["status"] == "clear"  # the reward fell with it: not gamed, collapsed


def test_the_live_findings_reach_the_trainers_logs(collapsed):
    import findings_runs

    after = {f.id: f for f in findings_runs.check(collapsed.record)}
    for fid in ("advantage_collapse", "moving_against_reward"):
        live = [e["step"] for e in collapsed.log_history if e.get(f"reward_lens/finding/{fid}", 0) > 0]
        assert live, f"no reward_lens/finding/{fid} in trainer.state.log_history"
        # log_history's step is TRL's global_step after the update (record step + 1)
        assert min(live) - 1 <= after[fid].onset + 5


def test_the_tap_halts_a_collapsing_run_on_a_book_grounded_finding(tmp_path):
    """stop_on="critical" with the task basis: the run stops at the step at which
    moving_against_reward first holds live, and that is the first prefix of the record at which
    `check` reports it, naming an onset at or before the halt."""
    import dataclasses

    import findings_runs
    from labelled_runs import check_prefixes

    regime = dataclasses.replace(findings_runs.COLLAPSE, steps=20)
    trained = findings_runs.train(regime, tmp_path / "run", stop_on="critical", features=str(TASK))
    steps = [e["step"] - 1 for e in trained.log_history if "loss" in e]  # record steps
    halted = max(steps)
    assert halted < 19  # stopped before max_steps
    live = [e["step"] - 1 for e in trained.log_history if e.get("reward_lens/finding/moving_against_reward", 0) > 0]
    assert live and min(live) == halted  # halted at the step it first held, on it
    by_prefix = check_prefixes(trained.record, tmp_path)
    first = min(k for k, found in by_prefix.items()
                for f in found if f.id == "moving_against_reward" and f.status == "holds")
    assert halted == first  # not after check would have said it
    onset = next(f for f in by_prefix[halted] if f.id == "moving_against_reward").onset
    assert onset is not None and onset <= halted
    print(f"halted after step {halted}; check reports it first on the prefix 0..{first}, from step {onset}")
