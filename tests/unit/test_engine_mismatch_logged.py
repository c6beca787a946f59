"""`engine_mismatch` without a tap: from the metrics a framework logs (veRL `rollout_corr/*` and
`training/rollout_probs_diff_*`, TRL `sampling/*`), each read as what it is -- an estimate of the
per-token KL, or bounds on it -- on fixtures their own code wrote, with the rule's lines worked by
hand, a clean run clear, and a run that logs none of them not evaluated by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from reward_lens import cli
from reward_lens.findings import FindingData, evaluate_one
from reward_lens.measure.mismatch import LoggedMismatch, logged_mismatch, logged_step
from reward_lens_spec import load_findings

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SPEC = load_findings()["engine_mismatch"]
RULE = dict(share=0.1, critical=1.0, warn_token=0.01, critical_token=0.1, persist=2, min_steps=2)


def _check(tmp_path: Path, source: Path, framework: str | None) -> dict:
    """`reward-lens check` on a record imported from ``source`` (or on ``source`` itself, a TRL
    output folder, where ``framework`` is None): its engine_mismatch finding."""
    target = source
    if framework is not None:
        target = tmp_path / "rec"
        assert cli.main(["import", framework, str(source), str(target)]) == 0
    out = tmp_path / "check.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(["check", str(target), "--format", "json", "--fail-on", "never"])
    out.write_text(buf.getvalue())
    found = json.loads(buf.getvalue())
    found = found["findings"] if isinstance(found, dict) else found
    return next(f for f in found if f["id"] == "engine_mismatch")


# ------------------------------------------------------------------ the rule, worked by hand
def test_each_logged_metric_is_read_as_what_it_is():
    # an estimate is its own bounds
    k3 = logged_step(0, {"sampler_kl_token": 0.02, "sampler_kl_token_estimator": "k3"})
    assert (k3.low, k3.high, k3.estimator, k3.estimate) == (0.02, 0.02, "k3", True)
    # veRL logs both: the k3 is read, the k1 only where no k3 is logged
    assert logged_step(0, {"sampler_kl_token": 0.02, "sampler_kl_token_k1": 0.5}).low == 0.02
    assert logged_step(0, {"sampler_kl_token_k1": 0.5}).estimator == "k1"
    # TRL's mean |log-ratio| m = 0.2: KL between exp(-0.2) - 1 + 0.2 = 0.018730753... and 0.2
    m = logged_step(0, {"sampler_logp_diff_mean": 0.2})
    assert m.low == pytest.approx(0.0187307531, abs=1e-9) and m.high == 0.2 and not m.estimate
    # veRL's mean |p_t - p_sampler| q = 0.15: KL at least 0.15^2 / 2 = 0.01125, no upper bound
    q = logged_step(0, {"sampler_prob_diff_mean": 0.15})
    assert q.low == pytest.approx(0.01125) and q.high is None
    # NeMo-RL's mean exp|log-ratio| r = 1.01: KL at most log 1.01 = 0.00995033...
    r = logged_step(0, {"sampler_token_prob_error": 1.01})
    assert r.low == 0.0 and r.high == pytest.approx(0.0099503309, abs=1e-9)
    # two bounds together: the tighter of each end
    both = logged_step(0, {"sampler_logp_diff_mean": 0.2, "sampler_prob_diff_mean": 0.25})
    assert both.low == pytest.approx(0.03125) and both.high == 0.2
    assert logged_step(0, {"sampler_logp_diff_mean": float("nan")}) is None


def _series(**by_step) -> dict:
    return {int(k[1:]): v for k, v in by_step.items()}


def _est(step: int, kl: float, tokens: float | None = None) -> LoggedMismatch:
    return LoggedMismatch(step, kl, kl, "sampler_kl_token", kl, "k3", tokens)


def test_the_line_is_crossed_at_two_steps_in_a_row_and_the_onset_is_the_final_stretch():
    kl = [0.001, 0.02, 0.001, 0.0, 0.012, 0.03, 0.05]  # one step over (1) then back: not a finding
    e = logged_mismatch({s: _est(s, k) for s, k in enumerate(kl)}, **RULE)
    assert e["judged"] and e["holds"] and e["onset"] == 4 and e["severity"] == "warn"
    e = logged_mismatch({s: _est(s, k) for s, k in enumerate(kl[:4] + [0.05])}, **RULE)
    assert e["judged"] and not e["holds"]  # the last step alone over the line
    e = logged_mismatch({s: _est(s, k) for s, k in enumerate([0.0, 0.2, 0.11])}, **RULE)
    assert e["holds"] and e["severity"] == "critical" and e["critical_from"] == 1


def test_bounds_that_straddle_the_line_judge_nothing():
    # m = 0.1: the KL is between 0.00484 and 0.1 -- either side of 0.01: no step decides
    e = logged_mismatch({s: logged_step(s, {"sampler_logp_diff_mean": 0.1}) for s in range(5)}, **RULE)
    assert not e["judged"] and e["straddle"] == 5
    # m = 0.009 < 0.01: the KL is below the line whatever it is; m = 0.2: above it (0.0187)
    e = logged_mismatch({s: logged_step(s, {"sampler_logp_diff_mean": 0.009}) for s in range(3)}, **RULE)
    assert e["judged"] and not e["holds"]
    e = logged_mismatch({s: logged_step(s, {"sampler_logp_diff_mean": 0.2}) for s in range(3)}, **RULE)
    assert e["holds"] and e["onset"] == 0 and e["severity"] == "warn"  # 0.0187 is under the critical 0.1


def test_with_d_t_and_completion_lengths_the_line_is_the_tap_paths():
    # 0.002 nats/token x 50 tokens = 0.1 nats/seq against D_t = 0.5: over a tenth of D_t (0.05),
    # though under the absolute 0.01 per token; without the length it is judged per token only
    with_len = {s: _est(s, 0.002, tokens=50.0) for s in range(3)}
    e = logged_mismatch(with_len, {s: 0.5 for s in range(3)}, **RULE)
    assert e["holds"] and e["basis"] == "d_t" and e["n_d_t"] == 3 and e["d_t"] == 0.5
    e = logged_mismatch({s: _est(s, 0.002) for s in range(3)}, {s: 0.5 for s in range(3)}, **RULE)
    assert not e["holds"] and e["basis"] == "absolute" and e["d_t_no_length"] == 3
    # critical where the per-sequence value reaches D_t: 0.012 x 50 = 0.6 > 0.5
    e = logged_mismatch({s: _est(s, 0.012, tokens=50.0) for s in range(3)}, {s: 0.5 for s in range(3)}, **RULE)
    assert e["severity"] == "critical"


def test_the_finding_words_name_the_source_and_what_it_is():
    data = FindingData({}, logged=({s: logged_step(s, {"sampler_logp_diff_mean": m}) for s, m in
                                    enumerate([0.001, 0.002, 0.3, 0.25])}, "trl"))
    f = evaluate_one(SPEC, data, [])
    assert f.status == "holds" and f.onset == 2 and f.severity == "warn"
    assert "TRL's `sampling/sampling_logp_difference/mean`, a mean |log-ratio| per token, not a KL" in f.evidence
    assert "at least 0.0288 nats per token" in f.evidence  # exp(-0.25) - 1 + 0.25 = 0.0288007... at step 3
    data = FindingData({}, logged=({s: logged_step(s, {"sampler_logp_diff_mean": 0.05}) for s in range(4)}, "trl"))
    f = evaluate_one(SPEC, data, [])
    assert f.status == "not_evaluated" and "bracket the KL" in f.evidence and f.missing


# ------------------------------------------------------------------ veRL: its own code wrote the logs
def test_verl_rollout_corr_log_holds_from_the_engines_onset_labelled_as_veRLs_k3(tmp_path):
    truth = json.loads((FIX / "verl" / "engine_mismatch" / "truth.json").read_text())
    f = _check(tmp_path, FIX / "verl" / "engine_mismatch", "verl")
    assert f["status"] == "holds" and f["severity"] == "warn"
    assert f["onset"] == truth["onset"] - 1  # veRL's global_steps 5 is the record's t = 4
    assert "from veRL's `rollout_corr/k3_kl`, a k3 estimate of KL(pi_sampler || pi_t) per token" in f["evidence"]
    # what was read is veRL's estimate of the simulation's exact per-token KL (0.041 from step 5)
    assert f["values"]["low"] == pytest.approx(truth["kl_token"][str(f["values"]["last_step"] + 1)], rel=0.25)


def test_verl_clean_log_is_clear(tmp_path):
    f = _check(tmp_path, FIX / "verl" / "engine_clean", "verl")
    assert f["status"] == "clear" and f["values"]["steps"] == 10 and f["values"]["low"] < 1e-4
    assert "veRL's `rollout_corr/k3_kl`" in f["evidence"]


def test_verl_probs_diff_alone_is_read_as_a_lower_bound(tmp_path):
    """A veRL run with calculate_log_probs but rollout_corr/* dropped: training/rollout_probs_diff_mean
    (a probability gap) bounds the KL from below only, so it can hold the finding, never clear it."""
    src = FIX / "verl" / "engine_mismatch"
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text((src / ".hydra" / "config.yaml").read_text())
    lines = []
    for line in (src / "verl_grpo" / "mismatch.jsonl").read_text().splitlines():
        obj = json.loads(line)
        obj["data"] = {k: v for k, v in obj["data"].items() if not k.startswith("rollout_corr/")}
        lines.append(json.dumps(obj))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    f = _check(tmp_path, run, "verl")
    # q ~ 0.035 from step 5: KL >= q^2 / 2 ~ 6e-4, under the 0.01 line, and no upper bound: undecided
    assert f["status"] == "not_evaluated" and "half its square is a lower bound" in f["evidence"]
    assert "`training/rollout_probs_diff_mean`" in f["evidence"]


def test_a_run_that_logs_no_mismatch_metric_is_not_evaluated_by_name(tmp_path):
    f = _check(tmp_path, FIX / "verl" / "legacy_grpo", "verl")
    assert f["status"] == "not_evaluated" and f["missing"]
    assert any("logp_sampler" in m or "sampler_kl_token" in m for m in f["missing"])


# ------------------------------------------------------------------ TRL: an output folder
def _trl_sampling(tmp_path: Path, means: list[float]) -> Path:
    from tests.unit.test_importer import _trl_output

    out = _trl_output(tmp_path / "trl", steps=len(means))
    state = json.loads((out / "trainer_state.json").read_text())
    for e, m in zip(state["log_history"][:-1], means):
        e.update({"sampling/sampling_logp_difference/mean": m, "sampling/sampling_logp_difference/max": 5 * m,
                  "sampling/importance_sampling_ratio/min": 0.0, "sampling/importance_sampling_ratio/mean": 0.98,
                  "sampling/importance_sampling_ratio/max": 2.9})
    (out / "trainer_state.json").write_text(json.dumps(state))
    return out


def test_a_trl_folder_with_sampling_metrics_is_judged_from_them(tmp_path):
    f = _check(tmp_path, _trl_sampling(tmp_path, [0.001, 0.3, 0.4]), None)
    assert f["status"] == "holds" and f["onset"] == 1
    assert "TRL's `sampling/sampling_logp_difference/mean`, a mean |log-ratio| per token, not a KL" in f["evidence"]
    assert f["values"]["low"] == pytest.approx(math.expm1(-0.4) + 0.4)


@pytest.mark.parametrize("name,status", [("engine_mismatch", "holds"), ("engine_clean", "clear")])
def test_trl_folders_written_by_grpotrainer(tmp_path, name, status):
    """tools/make_trl_sampling_fixtures.py: a tiny GRPOTrainer on TRL's vLLM path, the engine
    stood in; every `sampling/*` number is TRL's own."""
    folder = FIX / "trl_sampling" / name
    if not folder.exists():
        pytest.fail(f"{folder} missing: run tools/make_trl_sampling_fixtures.py")
    f = _check(tmp_path, folder, None)
    assert f["status"] == status, f["evidence"]
    assert "TRL's `sampling/sampling_logp_difference/mean`, a mean |log-ratio| per token, not a KL" in f["evidence"]
    if status == "holds":  # the engine samples top-p 0.7 from TRL's step 4: the record's t = 3
        assert f["onset"] == 3 and f["severity"] == "warn" and f["values"]["low"] > 0.01
    else:  # float64 against float32: m ~ 2e-7, an upper bound on the KL far under the line
        assert f["values"]["high"] < 1e-5


def test_the_fields_map_each_frameworks_key_by_meaning():
    from reward_lens_spec import load_fields

    fields = load_fields()
    verl = fields.framework_keys("verl")
    assert verl["rollout_corr/k3_kl"] == "sampler_kl_token" and verl["rollout_corr/kl"] == "sampler_kl_token_k1"
    assert {verl[f"training/rollout_probs_diff_{s}"] for s in ("mean", "max", "std")} == {
        "sampler_prob_diff_mean", "sampler_prob_diff_max", "sampler_prob_diff_std"}
    for name in ("sampler_prob_diff_mean", "sampler_prob_diff_max", "sampler_prob_diff_std"):
        assert "not a KL" in fields.fields[name].meaning and fields.fields[name].frameworks["verl"].nan
    assert fields.fields["sampler_kl_token_k1"].unit == "nats_per_token"


def test_nemo_rl_rollouts_without_d_t_are_judged_from_gen_kl_error(tmp_path):
    """NeMo-RL's dumps give the rollouts the engine's log-probabilities, but no D_t: the tap path
    cannot judge a step, so its logged `train/gen_kl_error` (k3) does."""
    f = _check(tmp_path, FIX / "nemo_rl" / "exp_001", "nemo-rl")
    assert f["status"] == "clear"
    assert "from NeMo-RL's `train/gen_kl_error`, a k3 estimate of KL(pi_sampler || pi_t) per token" in f["evidence"]


def test_verl_console_log_reads_as_the_file_log(tmp_path):
    """The same run's console output (Ray-prefixed, `np.float64`-free floats from .item()) gives the
    same mismatch series as its file logger's JSON lines."""
    from reward_lens.record import open_run

    src = FIX / "verl" / "engine_mismatch"
    assert cli.main(["import", "verl", str(src / "console.log"), str(tmp_path / "c"), "--quiet"]) == 0
    assert cli.main(["import", "verl", str(src / "verl_grpo" / "mismatch.jsonl"), str(tmp_path / "f"), "--quiet"]) == 0
    for name in ("sampler_kl_token", "sampler_kl_token_k1", "sampler_prob_diff_mean"):
        c, f = open_run(tmp_path / "c").telemetry_column(name), open_run(tmp_path / "f").telemetry_column(name)
        assert c.keys() == f.keys() == set(range(10)) and all(c[s] == pytest.approx(f[s], rel=1e-12) for s in c)


def test_the_audit_says_a_framework_that_logs_the_mismatch_will_evaluate_it(tmp_path):
    from reward_lens.audit import audit

    base = "num_generations: 8\nper_device_train_batch_size: 16\nlogging_steps: 1\nmax_steps: 50\n"
    verdict = {}
    for name, extra in (("plain", ""), ("vllm", "use_vllm: true\n"),
                        ("uncorrected", "use_vllm: true\nvllm_importance_sampling_correction: false\n")):
        (tmp_path / f"{name}.yaml").write_text(base + extra)
        verdict[name] = {f.finding: f for f in audit(tmp_path / f"{name}.yaml", framework="trl").findings}
    assert verdict["vllm"]["engine_mismatch"].verdict == "will evaluate"  # from TRL's sampling/* metrics
    assert verdict["plain"]["engine_mismatch"].verdict != "will evaluate"  # no engine
    assert verdict["uncorrected"]["engine_mismatch"].verdict != "will evaluate"  # TRL logs no sampling/* then
    verl = tmp_path / "verl.yaml"
    for on in (True, False):
        verl.write_text("algorithm: {adv_estimator: grpo}\nactor_rollout_ref:\n  rollout: {n: 4, calculate_log_probs: "
                        f"{str(on).lower()}}}\ntrainer: {{total_training_steps: 10}}\n")
        got = {f.finding: f for f in audit(verl, framework="verl").findings}["engine_mismatch"].verdict
        assert (got == "will evaluate") is on


def test_a_verl_config_that_leaves_calculate_log_probs_to_the_default_reads_091s_default(tmp_path):
    """veRL 0.9.1 defaults actor_rollout_ref.rollout.calculate_log_probs to true (its
    trainer/config/rollout/rollout.yaml:237; 0.4.1's ppo_trainer.yaml:548 had False): a partial
    config without the key will evaluate engine_mismatch, and the audit says the default is 0.9.1's
    and that an older veRL must set it."""
    from reward_lens.audit import audit

    verl = tmp_path / "verl.yaml"
    verl.write_text("algorithm: {adv_estimator: grpo}\nactor_rollout_ref:\n  rollout: {n: 4}\n"
                    "trainer: {total_training_steps: 10}\n")
    got = audit(verl, framework="verl")
    assert {f.finding: f for f in got.findings}["engine_mismatch"].verdict == "will evaluate"
    said = [s.says for s in got.statements if s.key == "actor_rollout_ref.rollout.calculate_log_probs"]
    assert said and "(veRL default)" in said[0] and "earlier releases defaulted it to False" in said[0]
