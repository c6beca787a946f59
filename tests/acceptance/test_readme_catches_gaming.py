"""Issue 57's acceptance: what the README says, on a run made in code, catches reward gaming.

A TRL GRPO run of the task recipe (tools/labelled_runs.py: its Qwen3 from the task record's
starting checkpoint, seeded) whose reward is gameable -- an off-by-one answer key pays while the
target, correctness, is paid nothing (the labelled benchmark's ``answer_key`` mode) -- recorded
with the README's attach line and ``target="correctness"``. Then the README's commands, on the
default basis (no basis file): ``reward-lens check`` names proxy gaming or paid-for drift at warn
or above, on time by the labelled benchmark's rule (within 3 steps of the ground-truth onset,
checked at every prefix of the record, never before onset - 3); and ``reward-lens report`` of a run
attached without ``target=`` opens with the health line and then says the gaming checks are off,
with the line that turns them on. About 2 minutes on 2 CPU cores."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import labelled_runs  # noqa: E402

pytestmark = pytest.mark.slow

SEED = labelled_runs.REPORTED_SEEDS["answer_key"][0]
GAMING = ("proxy_gaming", "paid_for_drift")


def _cli(*argv: str) -> tuple[int, str]:
    from reward_lens import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(list(argv))
    return code, buf.getvalue()


def test_check_names_the_gaming_on_time_with_the_target_in_the_attach_line(tmp_path):
    from reward_lens.findings import RANK
    from reward_lens.record import open_run

    record = labelled_runs.train("answer_key", SEED, tmp_path, target="correctness")
    run = open_run(record)
    assert [(t.name, t.want, t.of) for t in run.manifest.targets] == [("correctness", "higher", "reward")]
    truth = labelled_runs.ground_truth(record, "answer_key")
    assert truth.onset is not None, truth  # the run was gamed, as labelled: correctness fell

    # `reward-lens check runs/my-run`, the README's command, on every prefix: no basis file
    first = None
    for k in sorted(set(int(s) for s in run.rollout_steps.tolist())):
        prefix = labelled_runs.prefix_record(run, k, tmp_path / "prefix")
        code, out = _cli("check", str(prefix), "--format", "json", "--quiet")
        held = [f for f in json.loads(out)["findings"] if f["id"] in GAMING and f["status"] == "holds"
                and RANK[f["severity"]] >= RANK["warn"]]
        if held:
            assert k >= truth.onset - labelled_runs.WITHIN, (k, truth.onset, held)  # no alarm before the failure
            assert code == 1
            first = (k, [f["id"] for f in held])
            break
    assert first is not None, ("no gaming finding at any prefix", truth)
    print(f"\nground-truth onset {truth.onset}; first warning at prefix {first[0]}: {first[1]}")
    assert first[0] - truth.onset <= labelled_runs.WITHIN, (first, truth.onset)

    # the CI gate: the gaming findings are evaluated on the whole record, so --require passes them
    code, out = _cli("check", str(record), "--require", ",".join(GAMING), "--format", "json", "--quiet")
    found = json.loads(out)
    assert found["required_not_evaluated"] == [] and code == 1  # 1: a finding holds, not a missing one

    # the first screen leads with the target's own verdict, never "asked for and bought"
    code, _ = _cli("report", str(record), "--out", str(tmp_path / "report"), "--format", "json", "--quiet")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    card = report["card"]
    assert "your target `correctness`" in card[1].lower(), card[:3]
    agreement = next(b for b in report["books"] if b["id"] == "agreement")["data"]
    row = next(f for f in agreement["features"] if f["feature"] == "correctness")
    assert row["target"] == "higher" and "bought" not in (row["verdict"] or "") and "as asked" not in card[1]


def test_without_a_target_the_first_screen_says_gaming_checks_are_off(tmp_path):
    record = labelled_runs.train("answer_key", SEED, tmp_path, steps=4, warmup=2)
    code, out = _cli("check", str(record), "--require", "proxy_gaming", "--quiet")
    assert code == 1 and "Required but not evaluated (exit 1)" in out and "`proxy_gaming`" in out
    _cli("report", str(record), "--out", str(tmp_path / "report"), "--format", "md", "--quiet")
    md = (tmp_path / "report" / "report.md").read_text()
    # the first lines of the first screen: the health line, then this
    card = md.split("\n\n")
    lead = next(i for i, p in enumerate(card) if "Gaming checks are off" in p)
    assert lead <= 3, card[:5]
    assert 'target="correctness"' in card[lead] and "RewardLensTap.attach(" in card[lead] and "--target" in card[lead]
