"""The TRL importer on hand-made TRL output directories: the mapping by meaning, the step
shift, window-mean telemetry, and each error case named by file and step."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from reward_lens.record import RecordError, open_run
from reward_lens.record.importers.trl_output import import_trl

PROMPTS = ["a", "b"]


def _trl_output(root: Path, steps=3, group=4, beta=0.0, logging_steps=1, grad=(0.5, 2.0, 1.5)) -> Path:
    """A directory shaped like GRPOTrainer's output (trainer_state.json + completions)."""
    root.mkdir()
    (root / "completions").mkdir()
    history = []
    for s in range(1, steps + 1):
        e = {"step": s, "loss": 0.1, "grad_norm": grad[(s - 1) % len(grad)], "learning_rate": 0.01 * (1 - (s - 1) / steps),
             "rewards/lower/mean": 0.2, "rewards/lower/std": 0.1, "reward": 0.2, "epoch": s / steps}
        if beta:
            e["kl"] = 0.001 * s
        history.append(e)
        rows = [{"step": s, "prompt": PROMPTS[(s - 1) % 2], "completion": f"text {s} {i}", "lower": i / group,
                 "advantage": (i - (group - 1) / 2) / group} for i in range(group)]
        pd.DataFrame(rows).to_parquet(root / "completions" / f"completions_{s:05d}.parquet")
    history.append({"step": steps, "train_runtime": 1.0, "train_loss": 0.1, "epoch": 1.0})
    (root / "trainer_state.json").write_text(json.dumps({"log_history": history, "logging_steps": logging_steps}))
    (root / "grpo_config.json").write_text(json.dumps({  # reward_weights null: as trainer.args.to_dict() writes it
        "optim": "adamw_torch_fused", "beta": beta, "max_grad_norm": 1.0, "num_generations": group,
        "learning_rate": 0.01, "logging_steps": logging_steps, "seed": 1, "reward_weights": None}))
    return root


def test_mapping_by_meaning_and_step_shift(tmp_path):
    out = _trl_output(tmp_path / "trl", beta=0.04)
    m = import_trl(out, tmp_path / "rec", framework_version="1.16.0")
    run = open_run(tmp_path / "rec")
    assert run.steps.tolist() == [0, 1, 2]  # TRL's global_step s is our t = s - 1
    assert m.optimizer == "adamw_torch_fused" and m.framework.version == "1.16.0"
    pre = run.telemetry_column("grad_norm_unclipped")
    post = run.telemetry_column("grad_norm")
    assert pre == {0: 0.5, 1: 2.0, 2: 1.5}
    assert post[0] == 0.5  # below the threshold: not clipped
    assert post[1] == pytest.approx(2.0 * 1.0 / (2.0 + 1e-6), rel=1e-12)  # torch's clip coefficient
    assert run.telemetry_column("kl_to_ref") == {0: 0.001, 1: 0.002, 2: 0.003}
    assert run.telemetry_column("beta") == {0: 0.04, 1: 0.04, 2: 0.04}
    for absent in ("kl_to_previous", "update_norm", "ppo_kl"):
        assert run.telemetry_column(absent) == {}
    r = run.read_rollouts(["group_id", "reward", "rewards", "advantage"]).to_pylist()
    assert r[0]["step"] == 0 and r[0]["group_id"] == "0:0" and r[0]["rewards"] == [("lower", 0.0)]
    assert r[5]["reward"] == pytest.approx(0.25)
    assert m.telemetry_per_step and not m.notes


def test_beta_zero_leaves_kl_to_ref_absent(tmp_path):
    import_trl(_trl_output(tmp_path / "trl"), tmp_path / "rec")
    assert "kl_to_ref" not in open_run(tmp_path / "rec").fields()


def test_window_means_are_marked_not_per_step(tmp_path):
    out = _trl_output(tmp_path / "trl", logging_steps=5)
    m = import_trl(out, tmp_path / "rec")
    assert m.telemetry_per_step is False and m.logging_steps == 5
    assert "not per-step values" in m.notes[0]


def test_without_a_config_the_unknowns_are_said(tmp_path):
    out = _trl_output(tmp_path / "trl")
    (out / "grpo_config.json").unlink()
    m = import_trl(out, tmp_path / "rec")
    assert m.optimizer is None and "optimizer, beta, max_grad_norm" in m.notes[0]
    assert "grad_norm" not in open_run(tmp_path / "rec").fields()  # no threshold known: not derived


# ---------------------------------------------------------------- error cases, one each
def _fails(tmp_path, out, match):
    with pytest.raises(RecordError, match=match):
        import_trl(out, tmp_path / "rec")
    assert not (tmp_path / "rec").exists()  # nothing half-written
    assert not any(p.name.startswith(".rec") for p in tmp_path.iterdir())


def test_missing_trainer_state(tmp_path):
    out = _trl_output(tmp_path / "trl")
    (out / "trainer_state.json").unlink()
    _fails(tmp_path, out, r"trainer_state\.json: missing")


def test_truncated_trainer_state(tmp_path):
    out = _trl_output(tmp_path / "trl")
    p = out / "trainer_state.json"
    p.write_text(p.read_text()[:-40])
    _fails(tmp_path, out, r"trainer_state\.json: not valid JSON, truncated or corrupt")


def test_missing_completions(tmp_path):
    out = _trl_output(tmp_path / "trl")
    for f in (out / "completions").iterdir():
        f.unlink()
    _fails(tmp_path, out, r"completions: no completions_\*\.parquet files: run TRL with log_completions=True")


def test_truncated_completions_file(tmp_path):
    out = _trl_output(tmp_path / "trl")
    p = out / "completions" / "completions_00002.parquet"
    p.write_bytes(p.read_bytes()[:100])
    _fails(tmp_path, out, r"completions_00002\.parquet: not a readable Parquet file")


def test_completions_for_a_step_the_log_lacks(tmp_path):
    out = _trl_output(tmp_path / "trl")
    p = out / "trainer_state.json"
    state = json.loads(p.read_text())
    state["log_history"] = [e for e in state["log_history"] if e["step"] != 2 or "train_runtime" in e]
    p.write_text(json.dumps(state))
    _fails(tmp_path, out, r"completions_00002\.parquet: field `step` at `step` 2: completions for a step that "
                          r"trainer_state\.json never logged")


def test_mismatched_group_sizes(tmp_path):
    out = _trl_output(tmp_path / "trl")
    p = out / "completions" / "completions_00003.parquet"
    df = pd.read_parquet(p)
    df.loc[1, "prompt"] = "other"
    df.to_parquet(p)
    _fails(tmp_path, out, r"completions_00003\.parquet: field `prompt` at `step` 3: group sizes \[1, 1, 2\] do not "
                          r"match num_generations=4")


def test_a_non_finite_metric_in_the_log_is_kept_as_null_and_named(tmp_path):
    """A diverged run's NaN (transformers writes trainer_state.json with json.dumps, whose NaN is
    the literal `NaN`: trainer_callback.py TrainerState.save_to_json) is data, not a broken file."""
    out = _trl_output(tmp_path / "trl")
    p = out / "trainer_state.json"
    state = json.loads(p.read_text())
    state["log_history"][1]["grad_norm"] = float("nan")
    state["log_history"][2]["entropy"] = float("inf")
    p.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    m = import_trl(out, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert 1 not in run.telemetry_column("grad_norm_unclipped") and 0 in run.telemetry_column("grad_norm_unclipped")
    assert [(v.step, v.field, v.value) for v in m.non_finite] == [(1, "grad_norm_unclipped", "nan"),
                                                                 (2, "entropy", "+inf")]
    assert "log_history entry 1 (step 2) `grad_norm`" in m.non_finite[0].source
    from reward_lens.findings import evaluate

    (f,) = [f for f in evaluate(run) if f.id == "run_diverged"]
    assert f.status == "holds" and f.onset == 1 and "`grad_norm_unclipped` was nan" in f.evidence


def test_a_word_where_a_metric_belongs_is_still_refused(tmp_path):
    out = _trl_output(tmp_path / "trl")
    p = out / "trainer_state.json"
    p.write_text(p.read_text().replace('"grad_norm": 2.0', '"grad_norm": "lots"'))
    _fails(tmp_path, out, r"trainer_state\.json: field `grad_norm` at `step` 2: `grad_norm` is 'lots', not a number")
