"""Issue 61, item 1 and 9: what an adapter hands the tap core is checked at the call (a
TapCallError naming the call, the argument and the step), and a value that is not a finite number
is recorded as data (null, and an entry of the manifest's ``non_finite`` list) in a record that
``report`` and ``check`` read."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from tests.unit import tap_driver as d


def _ready(tmp_path, **settings):
    model = d.TinyPolicy()
    return d.core_for(tmp_path / "rec", model, **settings), model, torch.optim.SGD(model.parameters(), lr=0.05)


def _generate(core, t, rng, **override):
    batch = d.generation(t, rng, **override)
    extra = core.extra_requests(t, [p.tolist() for p in batch.prompt_ids], batch.prompts, group_size=batch.group_size)
    core.extras_generated(d.sample(rng, len(extra)))
    return batch


def _raises(fn, call, argument, step):
    from reward_lens.taps.calls import TapCallError

    with pytest.raises(TapCallError) as err:
        fn()
    e = err.value
    assert (e.call, e.argument, e.step) == (call, argument, step), str(e)
    assert call in str(e) and f"`{argument}`" in str(e) and (step is None or f"step={step}" in str(e))
    return str(e)


def test_steps_handed_over_out_of_order_are_refused_at_the_call(tmp_path):
    core, model, opt = _ready(tmp_path)
    rng = np.random.default_rng(0)
    for t in (0, 2):
        batch = _generate(core, t, rng)
        core.on_generation(batch)
        d.optimizer_step(core, model, opt, t, batch)
    msg = _raises(lambda: core.extra_requests(1, [[2, 3]], ["x"], group_size=1), "extra_requests", "step", 1)
    assert "after step 2" in msg
    _raises(lambda: core.on_generation(d.generation(1, rng)), "on_generation", "step", 1)
    _raises(lambda: core.before_optimizer_step(1, learning_rate=0.1, grad_norm_unclipped=None, max_grad_norm=None),
            "before_optimizer_step", "step", 1)
    _raises(lambda: core.end_step(1), "end_step", "step", 1)
    # the same optimizer step twice is refused too (a generation may come in several batches of one step)
    _raises(lambda: core.before_optimizer_step(2, learning_rate=0.1, grad_norm_unclipped=None, max_grad_norm=None),
            "before_optimizer_step", "step", 2)
    core.end(3)
    from reward_lens import cli

    assert cli.main(["check", str(tmp_path / "rec"), "--quiet", "--fail-on", "never"]) == 0


def test_after_without_before_names_the_call(tmp_path):
    core, model, opt = _ready(tmp_path)
    msg = _raises(lambda: core.after_optimizer_step(0), "after_optimizer_step", "step", 0)
    assert "before_optimizer_step" in msg
    core.before_optimizer_step(0, learning_rate=0.1, grad_norm_unclipped=None, max_grad_norm=None)
    _raises(lambda: core.after_optimizer_step(1), "after_optimizer_step", "step", 1)
    _raises(lambda: core.end_step(0), "end_step", "step", 0)


@pytest.mark.parametrize("override, argument, words", [
    ({"completion_ids": [torch.tensor([[3, 4]])] * 8}, "completion_ids[0]", "1-D"),
    ({"completion_ids": [torch.tensor([3, d.VOCAB + 5])] * 8}, "completion_ids[0]", "past the vocabulary"),
    ({"prompt_ids": [torch.tensor([-1, 3])] * 8}, "prompt_ids[0]", ">= 0"),
    ({"completion_ids": [torch.tensor([3.0, 4.0])] * 8}, "completion_ids[0]", "integer"),
    ({"completion_ids": [[True, False]] * 8}, "completion_ids[0]", "integer"),
    ({"advantages": [0.0] * 7}, "advantages", "7 entries for 8 rows"),
    ({"rewards": np.zeros((8, 2))}, "rewards", "shape"),
    ({"rewards": np.zeros(8)}, "rewards", "shape"),
    ({"reward_weights": np.array([np.inf])}, "reward_weights", "finite"),
    ({"group_size": 0}, "group_size", "at least 1"),
    ({"group_size": True}, "group_size", "integer"),
    ({"advantages": ["high"] * 8}, "advantages[0]", "real number"),
    ({"logp_sampler": [0.0] * 3}, "logp_sampler", "3 entries"),
    ({"step": 2.0}, "step", "integer"),
    ({"step": -1}, "step", "[0, 2**63)"),
])
def test_a_wrong_generation_is_refused_at_the_call_and_nothing_of_it_kept(tmp_path, override, argument, words):
    core, model, opt = _ready(tmp_path)
    rng = np.random.default_rng(0)
    batch = _generate(core, 0, rng)
    bad = dataclasses.replace(d.generation(0, rng), **override)
    msg = _raises(lambda: core.on_generation(bad), "on_generation", argument,
                  None if argument == "step" and not isinstance(override.get("step"), int) else
                  override.get("step", 0))
    assert words in msg
    assert not core._pending  # nothing of the refused batch was kept
    core.on_generation(batch)  # the right batch is still taken
    d.optimizer_step(core, model, opt, 0, batch)
    core.end(1)


def test_extras_and_the_optimizer_step_are_checked_too(tmp_path):
    core, model, opt = _ready(tmp_path)
    rng = np.random.default_rng(0)
    batch = d.generation(0, rng)
    _raises(lambda: core.extra_requests(0, [[2, 99]], ["x"], group_size=1), "extra_requests", "prompt_ids[0]", 0)
    _raises(lambda: core.extra_requests(0, [[2, 3]], ["x", "y"], group_size=1), "extra_requests", "prompts", 0)
    extra = core.extra_requests(0, [p.tolist() for p in batch.prompt_ids], batch.prompts, group_size=4)
    assert extra
    _raises(lambda: core.extras_generated(d.sample(rng, len(extra) - 1)), "extras_generated", "completions", 0)
    _raises(lambda: core.extras_generated([[2, 3, 40]] * len(extra)), "extras_generated", "completions[0]", 0)
    core.extras_generated(d.sample(rng, len(extra)))
    core.on_generation(batch)
    _raises(lambda: core.before_optimizer_step(0, learning_rate="fast", grad_norm_unclipped=None, max_grad_norm=None),
            "before_optimizer_step", "learning_rate", 0)


def test_a_seed_past_its_range_names_seed():
    from reward_lens.taps.settings import tap_settings

    for bad in (2**80, -1, True):
        with pytest.raises(ValueError, match=r"RewardLensTap: seed:"):
            tap_settings(seed=bad)


def test_non_finite_values_are_recorded_as_data_in_a_record_report_and_check_read(tmp_path):
    from reward_lens import cli
    from reward_lens.record import open_run

    r = np.full((8, 1), 0.5)
    r[2, 0] = np.inf
    d.run_loop(tmp_path / "rec", steps=4, generations={
        1: {"advantages": [float("nan")] + [0.5] * 7},
        2: {"rewards": r, "all_rewards": r, "logp_sampler": [float("nan")] + [-1.0] * 7}})
    run = open_run(tmp_path / "rec")
    got = {(e.step, e.field, e.value, e.source) for e in run.manifest.non_finite}
    assert got == {(1, "advantage", "nan", "on_generation(advantages)"),
                   (2, "reward", "+inf", "on_generation(rewards)"),
                   (2, "rewards", "+inf", "on_generation(rewards) [even]"),
                   (2, "reward_mean", "+inf", "on_generation(all_rewards)"),
                   (2, "logp_sampler", "nan", "on_generation(logp_sampler)")}
    rows = run.read_rollouts(["advantage", "reward", "logp_sampler"]).to_pylist()
    at = [x for x in rows if x["step"] == 1]
    assert at[0]["advantage"] is None and all(x["advantage"] == 0.5 for x in at[1:])
    at2 = [x for x in rows if x["step"] == 2]
    assert at2[2]["reward"] is None and at2[0]["logp_sampler"] is None and at2[1]["logp_sampler"] == -1.0
    assert run.telemetry_column("reward_mean").get(2) is None
    out = tmp_path / "rep"
    assert cli.main(["report", str(tmp_path / "rec"), "--out", str(out), "--format", "json", "--quiet",
                     "--fail-on", "never"]) == 0
    report = json.loads((out / "report.json").read_text())
    price = next(b for b in report["books"] if b["id"] == "price")
    assert "nan" not in price["headline"]  # the step with a null reward has no stated mean, never a NaN one
    rows = {tuple(r["step_pair"]): r["reward_change"] for r in price["data"]["rows"]}
    assert rows.get((1, 2)) is None and rows.get((2, 3)) is None and rows.get((0, 1)) is not None
    assert cli.main(["check", str(tmp_path / "rec"), "--quiet"]) in (0, 1)


def test_a_diverged_gradient_is_recorded_not_refused(tmp_path):
    from reward_lens.record import open_run

    core, model, opt = _ready(tmp_path)
    rng = np.random.default_rng(0)
    batch = _generate(core, 0, rng)
    core.on_generation(batch)
    d.optimizer_step(core, model, opt, 0, batch, grad_norm_unclipped=float("inf"), max_grad_norm=1.0)
    core.end(1)
    run = open_run(tmp_path / "rec")
    assert [(e.field, e.value) for e in run.manifest.non_finite] == [("grad_norm_unclipped", "+inf")]
    assert run.telemetry_column("grad_norm_unclipped") == {}


def test_a_diverged_policy_is_recorded_as_data_and_the_record_reads(tmp_path):
    """NaN weights after step 1: every number the tap computes from the policy (its scores, D_t,
    the update's norm) is NaN from there; each is null with a non_finite entry, and report reads."""
    from reward_lens import cli
    from reward_lens.record import open_run

    core, model, opt = _ready(tmp_path, heldout=2)
    rng = np.random.default_rng(0)
    core.begin()
    for t in range(4):
        batch = _generate(core, t, rng)
        core.on_generation(batch)
        if t == 1:
            model(torch.tensor([[2, 3]])).logits.sum().backward()
            core.before_optimizer_step(t, learning_rate=0.05, grad_norm_unclipped=None, max_grad_norm=None)
            with torch.no_grad():
                model.mix.weight.fill_(float("nan"))
            core.after_optimizer_step(t)
            core.end_step(t)
        else:
            d.optimizer_step(core, model, opt, t, batch)
    with np.errstate(all="ignore"):
        core.end(4)
    run = open_run(tmp_path / "rec")
    got = {(e.step, e.field) for e in run.manifest.non_finite}
    assert {(1, "update_norm"), (2, "logp_pre"), (3, "logp_prev")} <= got, got
    assert cli.main(["report", str(tmp_path / "rec"), "--out", str(tmp_path / "rep"), "--quiet",
                     "--format", "json"]) in (0, 1)
