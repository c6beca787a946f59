"""The tap core's adapter interface, driven by a second adapter: a hand-written GRPO loop in
plain torch, no TRL (examples/plain_torch_tap.py). What it records, the books read."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("plain_torch_tap", REPO / "examples" / "plain_torch_tap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_plain_torch_loop_records_a_run_the_books_read(tmp_path):
    from reward_lens import cli
    from reward_lens.record import open_run

    ex = _example()
    core = ex.train(tmp_path / "rec", steps=4, budget=None)
    run = open_run(tmp_path / "rec")
    assert run.manifest.framework.name == "plain-torch"
    assert run.steps.tolist() == [0, 1, 2, 3]
    d_t = run.telemetry_column("kl_to_previous")
    assert sorted(d_t) == [0, 1, 2] and all(v > 0 for v in d_t.values())
    assert set(run.telemetry_column("kl_to_previous_estimator").values()) == {"independent_two_sided"}
    held = run.heldout().read_rollouts(["drawn_by_step", "logp_prev_step", "reward"]).to_pylist()
    # 4 groups x 4 completions from each policy, for each of 3 pairs
    assert len(held) == 3 * 2 * 4 * 4 and all(x["reward"] is not None for x in held)
    assert {(x["step"], x["logp_prev_step"], x["drawn_by_step"]) for x in held} == {
        (t, t - 1, d) for t in (1, 2, 3) for d in (t - 1, t)}
    assert set(core.estimates) == {0, 1, 2}
    out = tmp_path / "rep"
    assert cli.main(["report", str(tmp_path / "rec"), "--out", str(out), "--format", "json", "--quiet",
                     "--fail-on", "never"]) == 0
    report = json.loads((out / "report.json").read_text())
    summary = next(b for b in report["books"] if b["id"] == "cost")["data"]["summary"]
    # the cost book priced every step pair on the paired ledger, two-sided, with the tap's D_t
    assert summary["ledger"] == "paired" and summary["step_pairs"] == 3 and summary["two_sided"] == 3
    # and its ledgers' D_t is the tap's, recomputed from the record's rows
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run

    priced = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="paired")
    assert {lg.step_pair[0]: lg.d_t for lg in priced.ledgers} == pytest.approx(d_t, rel=1e-9)


def _tap_sentence(tmp_path, rec) -> str:
    from reward_lens import cli

    out = tmp_path / "rep"
    assert cli.main(["report", str(rec), "--out", str(out), "--format", "json", "--quiet", "--fail-on", "never"]) == 0
    report = json.loads((out / "report.json").read_text())
    return next(b for b in report["books"] if b["id"] == "cost")["data"]["tap"]["sentence"]


def test_one_sided_and_unmeasured_pairs_are_said_by_name(tmp_path):
    """Nothing is silently lost: a tap that draws no extra completions measures one-sided, and a
    budget too small for any measurement leaves pairs unmeasured; the record and the report's
    cost section say which, by name."""
    from reward_lens.record import open_run

    ex = _example()
    ex.train(tmp_path / "one", steps=4, budget=None, heldout=0)
    t = open_run(tmp_path / "one").telemetry.to_pydict()
    assert t["kl_to_previous_estimator"][:3] == ["independent_next"] * 3 and t["tap_per_group"][:3] == [0, 0, 0]
    said = _tap_sentence(tmp_path / "a", tmp_path / "one")
    assert "one-sided on 3 pairs" in said and "no extra completions" in said

    # a budget of a ten-thousandth of a step covers less than the tap's fixed cost: after the
    # two pairs measured whole to learn the costs, the budget's floor measures an eighth of the
    # rest (a spend: a quarter's worth of 2 + 2 sampling at 4 + 4), two-sided over every group (it
    # used to leave every one unmeasured: a starved run)
    from reward_lens.record.schema import tap_floor

    ex.train(tmp_path / "tiny", steps=12, budget=1e-4)
    t = open_run(tmp_path / "tiny").telemetry.to_pydict()
    assert t["tap_groups"][:2] == [4, 4]
    later = range(2, 11)  # pairs 2->3 .. 10->11 (step 11 has no next generation)
    assert tap_floor(4) == 0.125 and [t["tap_probability"][i] for i in later] == [0.125] * 9
    measured = [i for i in later if t["tap_groups"][i]]
    # systematic sampling of 9 pairs at an eighth: 1 or 2 of them, each over all 4 groups, two-sided
    assert len(measured) in (1, 2)
    assert all(t["tap_groups"][i] == 4 and t["tap_per_group"][i] == 4 for i in measured)  # as budget=None
    assert all(t["kl_to_previous"][i] is None for i in later if i not in measured)
    assert all(t["kl_to_previous"][i] is not None for i in measured)
    said = _tap_sentence(tmp_path / "b", tmp_path / "tiny")
    assert f"The tap measured {2 + len(measured)} of 11 step pairs" in said
    assert f"{9 - len(measured)} pairs not measured" in said and "measured 12.5 % of them anyway" in said
