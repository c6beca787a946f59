"""OpenRLHF's TensorBoard scalars (real event files, tools/make_openrlhf_fixtures.py, with the tags
OpenRLHF's TensorboardLogger writes): mapped by meaning, the learning rate shifted to the step that
used it, a diverged run read as data, a damaged event file refused by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from reward_lens.cli import main
from reward_lens.record import RecordError, open_run
from reward_lens.record.importers.openrlhf import import_openrlhf
from reward_lens.record.importers.tensorboard import read_scalars

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "openrlhf"
RUN = FIX / "run" / "grpo_qwen"


def test_scalars_map_by_meaning(tmp_path):
    m = import_openrlhf(FIX / "run", tmp_path / "rec", framework_version="0.9.2")  # the tensorboard_dir: one run
    run = open_run(tmp_path / "rec", m.run_id)
    raw = read_scalars(RUN, "").values
    assert run.steps.tolist() == [0, 1, 2, 3, 4]  # global_step 1..5
    assert run.telemetry_column("grad_norm_unclipped") == {s - 1: v for s, (v, _) in raw["train/actor_grad_norm"].items()}
    assert run.telemetry_column("ppo_kl") == {s - 1: v for s, (v, _) in raw["train/ppo_kl"].items()}
    assert run.telemetry_column("kl_to_ref") == {s - 1: v for s, (v, _) in raw["train/kl"].items()}
    assert run.telemetry_column("reward_mean") == {s - 1: v for s, (v, _) in raw["train/rollout/reward_mean"].items()}
    assert run.telemetry_column("sampler_kl_token") == {s - 1: v for s, (v, _) in raw["train/vllm_kl"].items()}
    assert set(run.telemetry_column("sampler_kl_token_estimator").values()) == {"k1"}
    # actor_lr is read after the optimizer step: step t used what step t-1 logged; the first is unknown
    lr = raw["train/actor_lr"]
    assert run.telemetry_column("learning_rate") == {t: lr[t][0] for t in (1, 2, 3, 4)}
    for absent in ("kl_to_previous", "grad_norm", "entropy", "validation_reward_mean"):
        assert run.telemetry_column(absent) == {}
    assert run.n_rollouts == 0 and "no rollouts" in m.notes[0]
    assert any("eval/eval_gsm8k_pass1" in n for n in m.notes)  # not mapped, and said so


def test_a_diverged_run_is_read_with_its_nan_kept_as_data(tmp_path):
    m = import_openrlhf(FIX / "diverged", tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    nf = {(v.step, v.field) for v in m.non_finite}
    assert {(3, "grad_norm_unclipped"), (3, "kl_to_ref"), (3, "ppo_kl"), (3, "train/policy_loss")} <= nf
    assert min(v.step for v in m.non_finite) == 3 and all(v.value == "nan" for v in m.non_finite)
    assert all("`train/" in v.source and "record" in v.source for v in m.non_finite)
    assert sorted(run.telemetry_column("grad_norm_unclipped")) == [0, 1, 2]
    assert run.steps.tolist() == [0, 1, 2, 3, 4]  # the diverged steps are rows, with nulls
    assert any("the first at global_step 4" in n for n in m.notes)


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "tb" / "grpo_qwen"
    shutil.copytree(RUN, dst)
    return dst


def test_a_damaged_event_file_is_refused_by_name(tmp_path):
    run = _copy(tmp_path)
    f = next(run.iterdir())
    data = f.read_bytes()
    f.write_bytes(data[:3000])  # cut short inside a record
    with pytest.raises(RecordError, match=rf"{f.name}: record \d+: damaged \(has truncated record"):
        import_openrlhf(run, tmp_path / "rec")
    f.write_bytes(data[:2000] + bytes(200) + data[2200:])  # corrupted in the middle
    with pytest.raises(RecordError, match=rf"{f.name}: record \d+: damaged \(failed (header|event) crc32 check"):
        import_openrlhf(run, tmp_path / "rec")
    fifo = run / "events.out.tfevents.1.host.1.0"
    os.mkfifo(fifo)  # never opened: a FIFO would block the import
    with pytest.raises(RecordError, match=r"events\.out\.tfevents\.1\.host\.1\.0: .*FIFO"):
        import_openrlhf(run, tmp_path / "rec")
    fifo.unlink()
    f.write_text("step,actor/ppo_kl\n1,0.1\n")
    with pytest.raises(RecordError, match=rf"{f.name}: record 1: damaged"):
        import_openrlhf(run, tmp_path / "rec")
    assert not (tmp_path / "rec").exists()


def test_folders_that_are_not_one_run_are_refused(tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(RecordError, match="no TensorBoard event files"):
        import_openrlhf(tmp_path / "none", tmp_path / "rec")
    two = tmp_path / "two"
    shutil.copytree(FIX / "run", two)
    shutil.copytree(FIX / "diverged", two, dirs_exist_ok=True)
    with pytest.raises(RecordError, match="holds the event files of 2 runs .*name one run's folder"):
        import_openrlhf(two, tmp_path / "rec")
    assert not (tmp_path / "rec").exists()


def test_a_resumed_run_keeps_the_later_files_values(tmp_path):
    run = _copy(tmp_path)
    f = next(run.iterdir())
    stamp = int(f.name.split(".")[3])
    later = run / f.name.replace(str(stamp), str(stamp + 60))
    shutil.copy(FIX / "diverged" / "grpo_qwen_lr1e-4" / next((FIX / "diverged" / "grpo_qwen_lr1e-4").iterdir()).name,
                later)
    m = import_openrlhf(run, tmp_path / "rec")
    assert any("logged again by a later event file" in n for n in m.notes)
    assert len(m.non_finite) > 0  # the later (diverged) file's values won


def test_cli_imports_and_report_and_check_read_it(tmp_path, capsys):
    rec = tmp_path / "rec"
    assert main(["import", "openrlhf", str(RUN), str(rec), "--quiet"]) == 0
    assert main(["check", str(rec), "--format", "json", "--quiet", "--fail-on", "never"]) == 0
    out = json.loads(capsys.readouterr().out)
    status = {f["id"]: f["status"] for f in out["findings"]}
    # every logged value was finite: run_diverged is judged (clear); the rest need what scalars lack
    assert status.pop("run_diverged") == "clear"
    # train/vllm_kl, OpenRLHF's k1 estimate of the engine mismatch per token, judges engine_mismatch (issue 59)
    assert status.pop("engine_mismatch") == "clear"
    mismatch = next(f for f in out["findings"] if f["id"] == "engine_mismatch")
    assert "from OpenRLHF's `train/vllm_kl`, a k1 estimate of KL(pi_sampler || pi_t) per token" in mismatch["evidence"]
    assert set(status.values()) == {"not_evaluated"}  # scalars alone: nothing else judged as clear
    assert main(["report", str(rec), "--out", str(tmp_path / "rep"), "--format", "json", "--quiet",
                 "--fail-on", "never"]) == 0
    assert (tmp_path / "rep" / "report.json").is_file()
    assert main(["import", "openrlhf", str(RUN), str(tmp_path / "r2"), "--config", "x.yaml"]) == 2
    assert "--config are not read by `import openrlhf`" in capsys.readouterr().err


def test_import_help_says_what_it_reads_and_where(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["import", "openrlhf", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--logger.tensorboard_dir" in out and "train/vllm_kl" in out and "events.out.tfevents" in out
