"""veRL runs as veRL's own code writes them (tests/fixtures/verl/, tools/make_verl_fixtures.py:
veRL 0.9.1's Tracking console and file backends, both trainers' _write_generations, its own
trainer config saved as Hydra saves it): mapped by meaning, ppo_kl never D_t, a diverged run read
as data, a malformed file refused by file, line and key with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from reward_lens import cli
from reward_lens.record import RecordError, open_run
from reward_lens.record.importers.verl import grpo_advantages, import_verl
from reward_lens.report import build_report

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
LEGACY = FIX / "legacy_grpo"
FILE_LOG = LEGACY / "verl_grpo" / "arith.jsonl"


def _file_log(path: Path) -> dict[int, dict]:
    return {o["step"]: o["data"] for o in map(json.loads, path.read_text().splitlines())}


def _dump(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_legacy_run_folder_imports_with_every_part_read(tmp_path):
    m = import_verl(LEGACY, tmp_path / "rec", framework_version="0.9.1")
    run = open_run(tmp_path / "rec", m.run_id)
    log = _file_log(FILE_LOG)
    # step 0 is val_before_train's validation line, not an update: global_steps 1..12 are t = 0..11
    assert run.steps.tolist() == list(range(12))
    assert run.telemetry_column("ppo_kl") == {s - 1: log[s]["actor/ppo_kl"] for s in range(1, 13)}
    assert run.telemetry_column("kl_to_previous") == {}  # ppo_kl is not D_t
    assert run.telemetry_column("reward_mean") == {s - 1: log[s]["critic/score/mean"] for s in range(1, 13)}
    assert run.telemetry_column("entropy")[3] == log[4]["actor/entropy"]
    # grad_clip from the Hydra config: the threshold, and the applied norm as clip_grad_norm_ scales it
    pre = run.telemetry_column("grad_norm_unclipped")
    assert set(run.telemetry_column("max_grad_norm").values()) == {1.0}
    assert run.telemetry_column("grad_norm") == {t: g * min(1.0, 1.0 / (g + 1e-6)) for t, g in pre.items()}
    assert m.trainer_config["actor_rollout_ref.rollout.n"] == 4 and m.trainer_config["max_grad_norm"] == 1.0
    assert m.model.description == "Qwen/Qwen2.5-0.5B-Instruct"
    assert any("validation metrics only" in n for n in m.notes)
    assert any("known have no record field" in n for n in m.notes)
    # training/rollout_probs_diff_* are NaN by design without rollout log-probabilities: not a divergence
    assert m.non_finite == [] and any("not read as the run diverging" in n for n in m.notes)


def test_the_console_log_under_ray_reads_the_same_numbers_as_the_file_log(tmp_path):
    """`\\x1b[36m(TaskRunner pid=N)\\x1b[0m step:1 - actor/ppo_kl:np.float64(...)`: Ray's prefix and
    colour and numpy 2's repr, at full precision since veRL 0.5."""
    text = (LEGACY / "console.log").read_text()
    assert "\x1b[36m(TaskRunner pid=" in text and "np.float64(" in text
    a = import_verl(LEGACY / "console.log", tmp_path / "c")
    b = import_verl(FILE_LOG, tmp_path / "f")
    ra, rb = open_run(tmp_path / "c"), open_run(tmp_path / "f")
    for field in ("ppo_kl", "kl_to_ref", "grad_norm_unclipped", "entropy", "reward_mean", "learning_rate"):
        assert ra.telemetry_column(field) == rb.telemetry_column(field), field
    assert any("console logger" in n for n in a.notes) and not any("console logger" in n for n in b.notes)


def test_rollout_dumps_with_numpy_extras_as_strings_and_validation_dumps(tmp_path):
    m = import_verl(LEGACY, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    rows = run.read_rollouts(["step", "group_id", "prompt", "completion", "reward", "rewards", "advantage"]).to_pylist()
    assert run.n_rollouts == 12 * 16
    lines = _dump(LEGACY / "rollouts" / "3.jsonl")
    mine = [r for r in rows if r["step"] == 2]
    assert [r["completion"] for r in mine] == [x["output"] for x in lines]
    assert [r["reward"] for r in mine] == [x["score"] for x in lines]
    # the legacy trainer dumps numpy scalars with default=str: "0.0", "True"; `pred` ("6") stays text
    assert isinstance(lines[0]["format"], str) and lines[0]["acc"] in ("True", "False")
    assert [dict(r["rewards"]) for r in mine] == [{"acc": float(x["acc"] == "True"), "format": float(x["format"])}
                                                  for x in lines]
    assert any("['pred']" in n for n in m.notes)
    # groups: identical input within a step (the legacy dumps have no uid)
    groups: dict[str, set[str]] = {}
    for r in mine:
        groups.setdefault(r["group_id"], set()).add(r["prompt"])
    assert all(len(p) == 1 for p in groups.values()) and len(groups) == 4
    # validation: 0.jsonl (pi_0, before any update), 6 and 12, kept apart from the rollouts
    val = run.validation()
    assert val is not None and sorted(set(val.read_rollouts(["step"]).column("step").to_pylist())) == [0, 6, 12]
    assert run.heldout() is None
    assert any("validation.parquet" in n for n in m.notes)


def test_grpo_advantages_are_derived_as_verl_forms_them_and_labelled(tmp_path):
    m = import_verl(LEGACY, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    rows = run.read_rollouts(["step", "group_id", "reward", "advantage"]).to_pylist()
    for gid in {r["group_id"] for r in rows}:
        g = [r for r in rows if r["group_id"] == gid]
        x = np.array([r["reward"] for r in g])
        # core_algos.compute_grpo_outcome_advantage, written out: torch.std is Bessel-corrected, eps 1e-6
        want = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
        assert np.allclose([r["advantage"] for r in g], want, rtol=0, atol=1e-12)
    assert grpo_advantages([1.0], ["a"], True) == [1.0 / (1.0 + 1e-6)]  # a group of one: mean 0, std 1
    assert grpo_advantages([1.0, 0.0], ["a", "a"], False) == [0.5, -0.5]
    assert any(n.startswith("advantages derived") for n in m.notes)
    report = build_report(run)
    found = {f.id: f for f in report.findings}
    # advantage collapse and the selection findings are evaluated, on advantages said to be derived
    assert found["advantage_collapse"].status != "not_evaluated"
    for fid in ("moving_against_reward", "collateral_behaviour", "length_drift"):
        assert found[fid].status != "not_evaluated", (fid, found[fid].missing)
        assert "advantages the import derived" in found[fid].evidence
    assert "advantages the import derived" not in found["advantage_collapse"].evidence
    assert any(n.startswith("advantages derived") for n in report.run.notes)  # on every page's notes


def test_no_advantages_without_a_config_that_says_grpo(tmp_path):
    m = import_verl(FILE_LOG, tmp_path / "rec", rollouts=LEGACY / "rollouts")
    assert "rollout.advantage" not in open_run(tmp_path / "rec").fields()  # all null: absent
    assert any("advantages not derived: no config says" in n for n in m.notes)
    cfg = tmp_path / "config.yaml"
    cfg.write_text((LEGACY / ".hydra" / "config.yaml").read_text().replace("use_kl_in_reward: false",
                                                                          "use_kl_in_reward: true"))
    m = import_verl(FILE_LOG, tmp_path / "rec2", rollouts=LEGACY / "rollouts", config=cfg)
    assert any("use_kl_in_reward` is on" in n for n in m.notes)


def test_a_v1_run_resumed_groups_by_uid_and_reads_the_later_lines(tmp_path):
    d = FIX / "v1_resumed"
    m = import_verl(d, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert run.steps.tolist() == list(range(8))
    # step 5 was logged before the crash and again after the resume from step 4: the later line wins
    fifth = [line for line in (d / "console.log").read_text().splitlines() if " step:5 - " in line]
    assert len(fifth) == 2
    later = float(fifth[1].split("actor/ppo_kl:np.float64(")[1].split(")")[0])
    assert run.telemetry_column("ppo_kl")[4] == later
    assert any("a resumed run: step 5 is logged more than once" in n for n in m.notes)
    rows = run.read_rollouts(["step", "group_id", "prompt", "reward", "advantage"]).to_pylist()
    # step 2 holds one two-turn session: its first turn is left out, as GRPO reads the last turn only
    assert sum(r["step"] == 1 for r in rows) == 16 and any("multi-turn rows" in n for n in m.notes)
    for t in range(8):
        groups: dict[str, set[str]] = {}
        for r in rows:
            if r["step"] == t:
                groups.setdefault(r["group_id"], set()).add(r["prompt"])
        assert len(groups) == 4 and all(len(p) == 1 for p in groups.values())
    # norm_adv_by_std_in_grpo: false (Dr. GRPO): score minus the group mean
    for gid in {r["group_id"] for r in rows}:
        g = [r for r in rows if r["group_id"] == gid]
        x = np.array([r["reward"] for r in g])
        assert np.allclose([r["advantage"] for r in g], x - x.mean(), atol=1e-12)


def test_a_diverged_run_is_read_and_named(tmp_path):
    d = FIX / "diverged"
    m = import_verl(d, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    first = min(m.non_finite, key=lambda v: v.step)
    assert first.step == 4 and "arith.jsonl:6 (step 5)" in first.source and first.value == "nan"
    assert {v.field for v in m.non_finite if v.step == 4} >= {"grad_norm_unclipped", "entropy", "ppo_kl"}
    assert 4 not in run.telemetry_column("grad_norm_unclipped") and 3 in run.telemetry_column("grad_norm_unclipped")
    assert run.telemetry_column("reward_mean")[4] is not None  # the rest of the step is kept
    # the console log says `nan` for the same values: the same steps and fields
    c = import_verl(d / "console.log", tmp_path / "c")
    assert sorted((v.step, v.field) for v in c.non_finite) == sorted((v.step, v.field) for v in m.non_finite)
    report = build_report(run)
    (f,) = [f for f in report.findings if f.id == "run_diverged"]
    assert f.status == "holds" and f.onset == 4 and f.severity == "critical"
    assert "diverged at step 4" in f.evidence and "arith.jsonl:6" in f.evidence


@pytest.mark.parametrize("name", ["legacy_grpo", "v1_resumed", "diverged", "v04_console"])
def test_report_check_and_import_read_each_run_folder(tmp_path, capsys, name):
    d = FIX / name
    assert cli.main(["import", "verl", str(d), str(tmp_path / "rec"), "--quiet"]) == 0
    code = cli.main(["check", str(d), "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    diverged = name in ("diverged", "v04_console")  # both turn NaN at veRL step 5
    assert code == (1 if diverged else 0) and "a veRL run folder" in out["source"]
    held = {f["id"] for f in out["findings"] if f["status"] == "holds"}
    assert ("run_diverged" in held) == diverged
    assert cli.main(["report", str(d), "--out", str(tmp_path / "rep"), "--quiet", "--fail-on", "never"]) == 0
    page = (tmp_path / "rep" / "report.md").read_text()
    assert "advantages derived" in page  # the derived advantages are said on the page
    assert not (d / "report.md").exists() and not any(p.name.startswith(".") and "tmp" in p.name for p in d.iterdir())


def test_ray_prefixes_and_values_of_every_form(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "(TaskRunner pid=1, ip=10.0.0.2) step:1 - actor/ppo_kl:np.float64(0.25) - actor/lr:1e-06 - x/flag:True\n"
        "\x1b[2m\x1b[36m(TaskRunner pid=1)\x1b[0m step:2 - actor/ppo_kl:nan - actor/lr:np.float32(1e-06) - n:np.int64(3)\n"
        "(WorkerDict pid=9) unrelated output\n"
        "step:3 - actor/ppo_kl:-inf - actor/lr:1e-06\n")
    m = import_verl(log, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert run.telemetry_column("ppo_kl") == {0: 0.25}
    assert [(v.step, v.field, v.value) for v in m.non_finite] == [(1, "ppo_kl", "nan"), (2, "ppo_kl", "-inf")]
    assert "run.log:2 (step 2) `actor/ppo_kl`" in m.non_finite[0].source


def test_a_truncated_file_log_after_a_resume_is_said(tmp_path):
    lines = FILE_LOG.read_text().splitlines()
    log = tmp_path / "arith.jsonl"
    log.write_text("\n".join(lines[5:]) + "\n")  # FileLogger opens with "wb": the resumed run's steps only
    m = import_verl(log, tmp_path / "rec")
    assert open_run(tmp_path / "rec").steps.tolist()[0] == 4
    assert any("the log starts at step 5" in n for n in m.notes)


# ------------------------------------------------------------------------------ malformed files
def _copy(tmp_path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(LEGACY, d)
    return d


@pytest.mark.parametrize("mangle,words", [
    (lambda d: (d / "verl_grpo" / "arith.jsonl").write_text(
        FILE_LOG.read_text()[: len(FILE_LOG.read_text()) - 40]), ["arith.jsonl:13", "not valid JSON"]),
    (lambda d: (d / "verl_grpo" / "arith.jsonl").write_text(
        FILE_LOG.read_text().replace('"actor/ppo_kl":', '"actor/ppo_kl":"lots","x":', 1)),
     ["arith.jsonl:2", "`actor/ppo_kl`", "'lots', not a number"]),
    (lambda d: (d / "rollouts" / "4.jsonl").write_text(
        (d / "rollouts" / "4.jsonl").read_text().replace('"output": ', '"outptu": ', 1)),
     ["4.jsonl:1", "`output`", "missing ['output']"]),
    (lambda d: (d / "rollouts" / "4.jsonl").write_text(
        (d / "rollouts" / "4.jsonl").read_text().replace('"score": ', '"score": "high", "was": ', 1)),
     ["4.jsonl:1", "`score`", "'high', not a number"]),
    (lambda d: (d / ".hydra" / "config.yaml").write_text(
        (d / ".hydra" / "config.yaml").read_text().replace("grad_clip: 1.0", "grad_clip: lots", 1)),
     ["config.yaml", "`actor_rollout_ref.actor.grad_clip`", "'lots'"]),
], ids=["truncated-log", "word-in-log", "dump-key-missing", "dump-score-word", "config-type"])
def test_a_malformed_file_is_refused_by_name_and_nothing_is_written(tmp_path, capsys, mangle, words):
    d = _copy(tmp_path)
    mangle(d)
    assert cli.main(["import", "verl", str(d), str(tmp_path / "rec")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "rec").exists()
    assert cli.main(["check", str(d)]) == cli.EXIT_BAD_INPUT
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in LEGACY.iterdir())


def test_a_folder_without_a_verl_log_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="holds no veRL metric log"):
        import_verl(tmp_path / "empty", tmp_path / "rec")


@pytest.mark.parametrize("name", ["03.jsonl", "\u0663.jsonl", "\u00b2.jsonl"])
def test_a_dump_named_like_a_step_but_not_as_verl_names_it_is_named(tmp_path, name):
    """`03.jsonl` or an Arabic-Indic `٣.jsonl` beside `3.jsonl` used to replace it silently, and
    `².jsonl` failed in int() without the file (issue 31)."""
    d = _copy(tmp_path)
    (d / "rollouts" / name).write_text((d / "rollouts" / "3.jsonl").read_text())
    with pytest.raises(RecordError, match=r"named like a step's dump") as e:
        import_verl(d, tmp_path / "rec")
    assert name in str(e.value)
    assert not (tmp_path / "rec").exists()


def test_a_dump_for_a_step_the_log_lacks_is_named(tmp_path):
    d = _copy(tmp_path)
    shutil.copy(d / "rollouts" / "3.jsonl", d / "rollouts" / "40.jsonl")
    with pytest.raises(RecordError, match="a rollout dump for a step the metrics log does not have"):
        import_verl(d, tmp_path / "rec")
    with pytest.raises(RecordError, match="no such rollout dump directory"):
        import_verl(FILE_LOG, tmp_path / "rec", rollouts=tmp_path / "nope")


def test_a_fifo_named_as_a_dump_is_refused_without_blocking(tmp_path):
    import os

    d = _copy(tmp_path)
    (d / "rollouts" / "2.jsonl").unlink()
    os.mkfifo(d / "rollouts" / "2.jsonl")  # opening it would wait for a writer forever
    with pytest.raises(RecordError, match="not a regular file") as e:
        import_verl(d, tmp_path / "rec")
    assert "2.jsonl" in str(e.value)


@pytest.mark.parametrize("content,words", [
    (b'{"input": "q", "output": "\xff\xfe", "score": 1.0, "step": 2}\n', ["2.jsonl:1", "not UTF-8"]),
    (b'{"input": "q", "output": "a\\ud800b", "score": 1.0, "step": 2}\n', ["2.jsonl:1", "`output`", "lone surrogate"]),
    (b'{"input": "q", "output": "a", "score": "' + b"9" * 200_000 + b'x", "step": 2}\n',
     ["2.jsonl:1", "`score`", "200,003 characters"]),
])
def test_undecodable_or_huge_dump_values_are_named_in_one_short_line(tmp_path, capsys, content, words):
    d = _copy(tmp_path)
    (d / "rollouts" / "2.jsonl").write_bytes(content)
    code = cli.main(["import", "verl", str(d), str(tmp_path / "rec")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and len(err) < 600, err[:300]
    assert all(w in err for w in words), err[:300]
    assert not (tmp_path / "rec").exists()


def test_a_non_utf8_metrics_file_is_named(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_bytes(b'{"step": 1, "actor/pg_loss": 0.1}\n{"step": 2, "x\xff": 1}\n')
    with pytest.raises(RecordError, match=r"m\.jsonl:2: not UTF-8"):
        import_verl(bad, tmp_path / "rec")


def test_import_overwrite_keeps_the_users_files_in_the_record_folder(tmp_path):
    rec = tmp_path / "rec"
    assert cli.main(["import", "verl", str(LEGACY), str(rec), "--quiet"]) == 0
    (rec / "notes.txt").write_text("mine")
    assert cli.main(["import", "verl", str(LEGACY), str(rec), "--overwrite", "--quiet"]) == 0
    assert (rec / "notes.txt").read_text() == "mine"
    open_run(rec).verify()


def test_import_help_says_what_the_verl_import_reads(capsys):
    with pytest.raises(SystemExit):
        cli.main(["import", "verl", "--help"])
    out = capsys.readouterr().out
    for words in (".hydra/config.yaml", "trainer.rollout_data_dir", "trainer.validation_data_dir", "TaskRunner pid=N",
                  "<project_name>/<experiment_name>.jsonl"):
        assert words in out, words


def test_a_verl_04_console_rounded_to_three_decimals_is_read_as_rounded(tmp_path):
    """veRL 0.4.1's console printed f"{v:.3f}" (tests/fixtures/verl/v04_console, written by 0.4.1's
    own Tracking): the record says its values are rounded, and a value printed as 0.000 (a learning
    rate of 1e-6) is left null rather than recorded as zero."""
    d = FIX / "v04_console"
    assert "actor/lr:0.000" in (d / "console.log").read_text()
    m = import_verl(d, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert run.telemetry_column("learning_rate") == {}
    assert run.telemetry_column("grad_norm_unclipped")[0] == 1.11
    assert any("rounded every value to three decimals" in n and "learning_rate" in n for n in m.notes)
    assert min(v.step for v in m.non_finite) == 4  # `nan` from veRL step 5 on
    assert any(n.startswith("advantages derived") for n in m.notes)  # 0.4.1's GRPO: the same formula


def test_the_audit_reads_a_verl_configs_real_keys():
    """`grad_clip` is veRL's max_grad_norm, and GRPO's advantages follow from the dumps: the audit
    of examples/configs/verl_grpo.yaml says so, as the import does."""
    from reward_lens.audit import audit

    cfg = Path(__file__).resolve().parents[2] / "examples" / "configs" / "verl_grpo.yaml"
    out = audit(cfg)
    verdict = {f.finding: f.verdict for f in out.findings}
    assert verdict["clipping_saturation"] == "will evaluate"  # grad_clip: 1.0 supplies max_grad_norm
    assert verdict["moving_against_reward"] == "will evaluate" and verdict["run_diverged"] == "will evaluate"
    said = " ".join(s.says for s in out.statements)
    assert "`actor_rollout_ref.actor.grad_clip` = 1.0" in said and "derives GRPO's" in said


def test_a_run_folder_reads_the_console_where_the_file_log_lost_steps_to_a_resume(tmp_path):
    d = _copy(tmp_path)
    log = d / "verl_grpo" / "arith.jsonl"
    log.write_text("\n".join(log.read_text().splitlines()[7:]) + "\n")  # truncated by a resume at step 6
    m = import_verl(d, tmp_path / "rec")
    assert open_run(tmp_path / "rec").steps.tolist() == list(range(12))
    assert "metrics from console.log" in m.notes[0] and "verl_grpo/arith.jsonl" in m.notes[0]
    m = import_verl(LEGACY, tmp_path / "rec2")  # both whole: the file logger's exact values
    assert "metrics from verl_grpo/arith.jsonl" in m.notes[0]


def test_an_older_ray_prefix_with_rounded_nan_values(tmp_path):
    """The shape of a diverged run's console line under an older veRL, as a public report shows it
    (https://github.com/Jiayi-Pan/TinyZero/issues/101: `(main_task pid=N) step:N - ...:nan - ...`,
    three decimals); the values here are ours, not copied."""
    log = tmp_path / "train.log"
    log.write_text("(main_task pid=4242) step:1 - critic/score/mean:0.250 - actor/grad_norm:0.812 - actor/lr:0.000\n"
                   "(main_task pid=4242) step:2 - critic/score/mean:0.000 - actor/pg_loss:nan - actor/ppo_kl:nan - "
                   "actor/grad_norm:nan - actor/lr:0.000\n")
    m = import_verl(log, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert run.telemetry_column("grad_norm_unclipped") == {0: 0.812}
    # a key with no record field keeps veRL's own name in non_finite
    assert [(v.step, v.field) for v in m.non_finite] == [(1, "actor/pg_loss"), (1, "ppo_kl"), (1, "grad_norm_unclipped")]
    # 0.000 on a rounded line is |v| < 0.0005: unknown, null (the reward of step 2 too), said in a note
    assert run.telemetry_column("learning_rate") == {} and run.telemetry_column("reward_mean") == {0: 0.25}
