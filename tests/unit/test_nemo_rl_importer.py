"""NeMo-RL's log folder (tools/make_nemo_rl_fixtures.py, written to NeMo-RL's dumping code):
rollouts with both log-probabilities summed per sequence, GRPO advantages, metrics mapped by
meaning, validation kept apart from held-out, a diverged run read as data, a bad line named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from reward_lens.cli import main
from reward_lens.record import RecordError, open_run
from reward_lens.record.importers.nemo_rl import import_nemo_rl

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl"
RUN = FIX / "exp_001"


def _dump(step: int) -> list[dict]:
    return [json.loads(line) for line in (RUN / f"train_data_step{step}.jsonl").read_text().splitlines()]


def test_rollouts_carry_both_log_probabilities_per_sequence(tmp_path):
    m = import_nemo_rl(RUN, tmp_path / "rec", framework_version="0.5.0")
    run = open_run(tmp_path / "rec", m.run_id)
    assert run.steps.tolist() == list(range(10))  # train_data_step{N}: t = N - 1
    rows = run.read_rollouts(["step", "group_id", "prompt", "completion", "completion_ids", "num_tokens", "reward",
                              "advantage", "logp_pre", "logp_sampler"]).to_pylist()
    assert len(rows) == 160
    for t in (0, 6):
        lines, mine = _dump(t + 1), [r for r in rows if r["step"] == t]
        assert len(mine) == len(lines) == 16
        for r, x in zip(mine, lines):
            # the plain definition: sums over the trained tokens within the rollout's length
            n = x["input_lengths"][0]
            mask = [i for i in range(n) if x["token_loss_mask"][0][i] == 1]
            assert r["logp_sampler"] == pytest.approx(sum(x["generation_logprobs"][0][i] for i in mask), abs=1e-12)
            assert r["logp_pre"] == pytest.approx(sum(x["prev_logprobs"][0][i] for i in mask), abs=1e-12)
            assert r["completion_ids"] == [x["token_ids"][0][i] for i in mask] and r["num_tokens"] == len(mask)
            assert r["prompt"] == x["content"][0][0] and r["completion"] == x["content"][0][1]
            assert r["reward"] == x["rewards"][0] and r["advantage"] == x["advantages"][0][mask[0]]
        # GRPO groups: four rollouts of each prompt, in a row
        assert [r["group_id"] for r in mine] == [f"{t}:{g}" for g in range(4) for _ in range(4)]
        # the engine and the trainer differ a little on every rollout: the mismatch is measurable
        assert all(r["logp_sampler"] != r["logp_pre"] for r in mine)


def test_advantages_are_grpos_leave_one_out_normalised_ones(tmp_path):
    """What NeMo-RL's GRPOAdvantageEstimator computes (advantage_estimator.py:69-98), written out."""
    import_nemo_rl(RUN, tmp_path / "rec")
    rows = open_run(tmp_path / "rec").read_rollouts(["group_id", "reward", "advantage"]).to_pylist()
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    spread = 0
    for g in groups.values():
        rew = np.array([r["reward"] for r in g])
        k = len(rew)
        base = (rew.sum() - rew) / (k - 1)
        sq = ((rew ** 2).sum() - rew ** 2) / (k - 1)
        std = np.sqrt(np.maximum((sq - base ** 2) * (k - 1) / (k - 2), 0))
        want = np.where(std > 0, (rew - base) / (std + 1e-6), rew - base)
        assert [r["advantage"] for r in g] == pytest.approx(want.tolist(), abs=1e-5)
        spread += bool(np.ptp(rew))
    assert spread > 10  # the check compares something


def test_metrics_map_by_meaning_and_validation_is_not_heldout(tmp_path):
    m = import_nemo_rl(RUN, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    rollouts = run.read_rollouts(["reward"]).to_pylist()
    reward_mean = run.telemetry_column("reward_mean")
    assert reward_mean[3] == pytest.approx(np.mean([r["reward"] for r in rollouts if r["step"] == 3]), rel=1e-6)
    assert run.telemetry_column("learning_rate")[0] == pytest.approx(1e-6)
    assert set(run.telemetry_column("grad_norm_unclipped")) == set(range(10))
    assert run.telemetry_column("kl_to_previous") == {} and run.telemetry_column("ppo_kl") == {}
    kl = run.telemetry_column("sampler_kl_token")
    assert set(run.telemetry_column("sampler_kl_token_estimator").values()) == {"k3"}
    assert all(0 < v < 1e-3 for v in kl.values())  # a bf16-sized engine error, per token
    assert all(v > 1 for v in run.telemetry_column("sampler_token_prob_error").values())
    # validation: the policy after N updates is step N; the final policy's is a note, never held-out rows
    val = run.telemetry_column("validation_reward_mean")
    assert sorted(val) == [0, 5]
    lines = [json.loads(x) for x in (RUN / "val_data_step5.jsonl").read_text().splitlines()]
    assert val[5] == pytest.approx(np.mean([x["rewards"][0] for x in lines]))
    assert any("final policy (after 10 updates)" in n for n in m.notes)
    assert run.heldout() is None and "heldout.parquet" not in m.files


def test_a_diverged_run_is_read_with_its_nan_kept_as_data(tmp_path):
    m = import_nemo_rl(FIX / "diverged", tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    nf = {(v.step, v.field) for v in m.non_finite}
    assert {(2, "grad_norm_unclipped"), (2, "sampler_kl_token"), (2, "train/loss"), (2, "rollout.logp_pre")} <= nf
    assert all(v.value == "nan" for v in m.non_finite)
    assert 2 not in run.telemetry_column("grad_norm_unclipped") and 1 in run.telemetry_column("grad_norm_unclipped")
    bad = [v for v in m.non_finite if v.field == "rollout.logp_pre"][0]
    assert bad.source == "train_data_step3.jsonl:6: `prev_logprobs`"
    rows = run.read_rollouts(["logp_pre"]).to_pylist()
    assert [r["logp_pre"] is None for r in rows if r["step"] == 2].count(True) == 1
    assert any("NaN or infinite" in n for n in m.notes)


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "exp"
    shutil.copytree(RUN, dst)
    return dst


def _rewrite(path: Path, line: int, change) -> None:
    lines = path.read_text().splitlines()
    new = change(json.loads(lines[line - 1]))
    lines[line - 1] = new if isinstance(new, str) else json.dumps(new)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("change, match", [
    (lambda o: "{\"content\": [[", r"train_data_step2\.jsonl:3: not valid JSON"),
    (lambda o: {k: v for k, v in o.items() if k != "prev_logprobs"}, r"train_data_step2\.jsonl:3: field `prev_logprobs`"),
    (lambda o: {**o, "rewards": o["rewards"][0]}, r"train_data_step2\.jsonl:3: field `rewards`: `rewards` is .*one-row"),
    (lambda o: {**o, "rewards": ["high"]}, r"train_data_step2\.jsonl:3: field `rewards`: `rewards` is 'high', not a number"),
    (lambda o: {**o, "prev_logprobs": [o["prev_logprobs"][0][:-1]]}, r":3: field `prev_logprobs`: .* positions"),
    (lambda o: {**o, "token_loss_mask": [[1] + o["token_loss_mask"][0][1:]]}, r":3: field `token_loss_mask`: .*multi-turn"),
    (lambda o: {**o, "token_ids": [[10 ** 30] + o["token_ids"][0][1:]]}, r":3: field `token_ids`: .*whole numbers"),
    (lambda o: {**o, "input_lengths": [10 ** 6]}, r":3: field `input_lengths`: `input_lengths` is 1000000"),
])
def test_a_malformed_line_is_refused_by_file_line_and_key(tmp_path, change, match):
    run = _copy(tmp_path)
    _rewrite(run / "train_data_step2.jsonl", 3, change)
    with pytest.raises(RecordError, match=match):
        import_nemo_rl(run, tmp_path / "rec")
    assert not (tmp_path / "rec").exists()


def test_a_misnamed_dump_and_an_empty_folder_are_refused(tmp_path):
    run = _copy(tmp_path)
    shutil.copy(run / "train_data_step2.jsonl", run / "train_data_step02.jsonl")
    with pytest.raises(RecordError, match=r"train_data_step02\.jsonl: is named like a NeMo-RL dump"):
        import_nemo_rl(run, tmp_path / "rec")
    (run / "train_data_step02.jsonl").unlink()
    os.mkfifo(run / "train_data_step11.jsonl")  # never opened: a FIFO would block the import
    with pytest.raises(RecordError, match=r"train_data_step11\.jsonl: .*FIFO"):
        import_nemo_rl(run, tmp_path / "rec")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="not a NeMo-RL GRPO run's log folder"):
        import_nemo_rl(tmp_path / "empty", tmp_path / "rec")
    assert not (tmp_path / "rec").exists()


def test_without_tensorboard_the_dumps_alone_import(tmp_path):
    run = _copy(tmp_path)
    shutil.rmtree(run / "tensorboard")
    m = import_nemo_rl(run, tmp_path / "rec")
    r = open_run(tmp_path / "rec")
    assert r.n_rollouts == 160 and r.telemetry_column("learning_rate") == {}
    assert sorted(r.telemetry_column("validation_reward_mean")) == [0, 5]
    assert any("no tensorboard/ folder" in n for n in m.notes)


def test_cli_imports_and_report_and_check_read_it(tmp_path, capsys):
    rec = tmp_path / "rec"
    assert main(["import", "nemo-rl", str(RUN), str(rec), "--quiet"]) == 0
    assert main(["check", str(rec), "--format", "json", "--quiet", "--fail-on", "never"]) == 0
    found = {f["id"]: f["status"] for f in json.loads(capsys.readouterr().out)["findings"]}
    # GRPO rollouts with advantages, entropy and ten steps: these are judged, not skipped
    for fid in ("advantage_collapse", "entropy_collapse", "length_drift", "collateral_behaviour"):
        assert found[fid] != "not_evaluated", fid
    assert main(["report", str(rec), "--out", str(tmp_path / "rep"), "--format", "json", "--quiet",
                 "--fail-on", "never"]) == 0
    assert (tmp_path / "rep" / "report.json").is_file()
    # a bad line: exit 2, nothing written
    run = _copy(tmp_path)
    _rewrite(run / "train_data_step2.jsonl", 3, lambda o: {**o, "rewards": ["high"]})
    assert main(["import", "nemo-rl", str(run), str(tmp_path / "rec2"), "--quiet"]) == 2
    assert not (tmp_path / "rec2").exists()
    assert "train_data_step2.jsonl:3" in capsys.readouterr().err
    assert main(["import", "nemo-rl", str(RUN), str(tmp_path / "rec3"), "--rollouts", str(RUN)]) == 2
    assert "--rollouts are not read by `import nemo-rl`" in capsys.readouterr().err


def test_import_help_says_what_it_reads_and_where(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["import", "nemo-rl", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "train_data_step{N}.jsonl" in out and "val_data_step{N}.jsonl" in out and "logger.log_dir" in out
    assert "tensorboard_enabled" in out


def test_the_audit_of_a_nemo_rl_config_says_what_the_import_will_find(tmp_path):
    """examples/configs/nemo_rl_grpo.yaml (NeMo-RL's grpo_math_1B.yaml, TensorBoard on): the same
    fields the import reads from such a run, and what no switch gives."""
    import yaml

    from reward_lens.audit import audit

    cfg = Path(__file__).resolve().parents[2] / "examples" / "configs" / "nemo_rl_grpo.yaml"
    res = audit(cfg)
    assert res.framework == "nemo_rl"
    found = {f.finding: f.verdict for f in res.findings}
    assert found["entropy_collapse"] == found["advantage_collapse"] == "will evaluate"
    assert found["kl_spikes"] == "will not evaluate"  # no D_t: the import finds none either
    assert {b.book: b.verdict for b in res.books} == {"agreement": "will compute", "cause": "will compute",
                                                      "effect": "will compute", "cost": "will refuse",
                                                      "price": "will refuse"}
    # the fields the audit projects are the ones the import of such a run fills
    import_nemo_rl(RUN, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    have = {c for c in ("learning_rate", "grad_norm_unclipped", "reward_mean", "entropy", "sampler_kl_token",
                        "sampler_token_prob_error", "kl_to_previous", "update_norm", "max_grad_norm")
            if run.telemetry_column(c)}
    assert have == {f for f in res.fields if "." not in f}
    cols = run.read_rollouts(["advantage", "logp_pre", "logp_sampler", "completion_ids", "num_tokens"]).to_pylist()
    assert all(all(v is not None for v in r.values()) for r in cols)
    assert {"rollout.advantage", "rollout.logp_pre", "rollout.logp_sampler", "rollout.completion_ids"} <= set(res.fields)
    # TensorBoard off: the audit says what is lost, and entropy collapse will not be evaluated
    off = yaml.safe_load(cfg.read_text())
    off["logger"]["tensorboard_enabled"] = False
    (tmp_path / "off.yaml").write_text(yaml.safe_dump(off))
    res = audit(tmp_path / "off.yaml")
    assert any(s.key == "logger.tensorboard_enabled" and "set it to true" in s.says for s in res.statements)
    assert {f.finding: f.verdict for f in res.findings}["entropy_collapse"] == "will not evaluate"
