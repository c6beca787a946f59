"""The TRL tap on real (tiny) GRPOTrainer runs: what it records, under accumulation,
beta > 0, reuse across iterations, a kill mid-run, and the agreement of its two D_t
estimators."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from reward_lens.record import open_run

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import make_reference_records as gen  # noqa: E402

sys.path.pop(0)


def _train(tmp: Path, *, steps=4, beta=0.0, ga=1, iterations=1, lr=1e-2, estimator="rollout", n_exact=16,
           flush_every=2, seed=3, batch=8):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.taps.trl import RewardLensTap

    tok = gen.build_tokenizer()
    model = gen.build_model(len(tok), seed, tok)
    model.save_pretrained(tmp / "init")
    tok.save_pretrained(tmp / "init")
    args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=steps, per_device_train_batch_size=batch,
                      num_generations=8, max_completion_length=16, learning_rate=lr, beta=beta, logging_steps=1,
                      bf16=False, report_to="none", use_cpu=True, seed=seed, save_strategy="no", disable_tqdm=True,
                      gradient_accumulation_steps=ga, num_iterations=iterations)
    trainer = GRPOTrainer(model=str(tmp / "init"), reward_funcs=[gen.lowercase], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]}), processing_class=tok)
    tap = RewardLensTap.attach(trainer, tmp / "rec", estimator=estimator, n_exact=n_exact, flush_every=flush_every,
                               save_initial_checkpoint=True)
    trainer.train()
    tap.log_history = trainer.state.log_history
    return open_run(tmp / "rec"), tap, tok


def test_the_tap_reports_into_the_trainers_own_logs(plain):
    """reward_lens/* metrics go through Trainer.log, so W&B / TensorBoard / report_to see them."""
    run, tap, _ = plain
    logged = [h for h in tap.log_history if "reward_lens/kl_to_previous" in h]
    assert len(logged) == len(run.steps)  # logging_steps=1: one per step
    d_t = run.telemetry_column("kl_to_previous")
    upd = run.telemetry_column("update_norm")
    clipped = run.telemetry_column("grad_norm")
    for h in logged:
        t = h["step"] - 1  # transformers logs the 1-based global step after the update
        assert h["reward_lens/kl_to_previous"] == pytest.approx(d_t[t])
        assert h["reward_lens/update_norm"] == pytest.approx(upd[t])
        assert h["reward_lens/grad_norm_clipped"] == pytest.approx(clipped[t])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"))


def test_telemetry_is_measured_per_step(plain):
    run, tap, _ = plain
    t = run.telemetry.to_pydict()
    assert t["step"] == [0, 1, 2, 3]
    for f in ("learning_rate", "grad_norm", "grad_norm_unclipped", "max_grad_norm", "update_norm", "kl_to_previous",
              "kl_to_previous_se", "kl_to_previous_estimator", "beta"):
        assert all(v is not None for v in t[f]), f
    # The learning rate the optimizer used: TRL's linear schedule from 1e-2 over 4 steps.
    assert t["learning_rate"] == pytest.approx([1e-2 * (1 - s / 4) for s in range(4)])
    # The applied norm is measured after clipping; torch's clip coefficient predicts it.
    for pre, post in zip(t["grad_norm_unclipped"], t["grad_norm"]):
        assert post == pytest.approx(pre * min(1.0, 1.0 / (pre + 1e-6)), rel=1e-5)
    assert all(u > 0 for u in t["update_norm"]) and set(t["kl_to_previous_estimator"]) == {"rollout"}
    assert all(k > 0 for k in t["kl_to_previous"])
    assert run.manifest.optimizer == "adamw_torch_fused" and run.manifest.framework.name == "trl"


def test_rollouts_carry_exact_ids_rewards_and_log_probs(plain):
    run, tap, tok = plain
    r = run.read_rollouts(["prompt", "completion", "completion_ids", "num_tokens", "reward", "rewards",
                           "advantage", "logp_pre", "logp_post"]).to_pylist()
    assert len(r) == 32 and [x["step"] for x in r] == [s for s in range(4) for _ in range(8)]
    for x in r:
        assert tok.decode(x["completion_ids"], skip_special_tokens=True) == x["completion"]
        assert x["num_tokens"] == len(x["completion_ids"])
        assert x["reward"] == pytest.approx(gen.lowercase([x["completion"]])[0], rel=1e-6)
        assert dict(x["rewards"]) == {"lowercase": pytest.approx(x["reward"])}
        assert math.isfinite(x["logp_pre"]) and math.isfinite(x["logp_post"])
    # log pi_0(y) of a step-0 rollout, recomputed independently from the saved checkpoint.
    from transformers import AutoModelForCausalLM

    m0 = AutoModelForCausalLM.from_pretrained(run.path / run.manifest.checkpoints[0].path)
    x = r[0]
    prompt = tok(x["prompt"], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + x["completion_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(m0(input_ids=ids).logits[0, :-1].double(), -1)
    own = lp[len(prompt) - 1:, :].gather(-1, ids[0, len(prompt):, None]).sum().item()
    assert own == pytest.approx(x["logp_pre"], abs=1e-4)


def test_cost_book_from_the_tapped_record_alone(plain):
    from reward_lens.measure.efficiency import cost_series, metric_g
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import ledger_series, steps_from_run

    run, _, _ = plain
    samples = steps_from_run(run, SurfaceFeatures())
    book = cost_series(ledger_series(samples), metric_g(samples), run_=run)
    assert "RECORD_INCOMPLETE" not in {r.code for r in book.refusals}
    assert len(book.rows) + sum(len(r.subject.step_pairs) for r in book.refusals) == 3
    assert all(0 <= r.efficiency <= 1 and r.kl_spent_source.startswith("record kl_to_previous (rollout")
               for r in book.rows)


def test_beta_and_gradient_accumulation(tmp_path):
    run, tap, _ = _train(tmp_path, steps=3, beta=0.04, ga=2)
    kl = run.telemetry_column("kl_to_ref")
    assert sorted(kl) == [0, 1, 2] and all(v >= 0 for v in kl.values())
    assert set(run.telemetry_column("beta").values()) == {0.04}
    steps, counts = np.unique(run.rollout_steps, return_counts=True)
    assert steps.tolist() == [0, 1, 2] and set(counts) == {16}  # the whole generation batch, once
    assert all(tap.estimates[t]["rollout"].n == 16 for t in range(3))  # every micro-batch's rollouts


def test_reuse_across_iterations(tmp_path):
    run, tap, _ = _train(tmp_path, steps=4, iterations=2)
    assert np.unique(run.rollout_steps).tolist() == [0, 2]  # sampled by pi_0 and pi_2 only
    est = run.telemetry_column("kl_to_previous_estimator")
    assert est == {0: "rollout", 1: "rollout_stale", 2: "rollout", 3: "rollout_stale"}


def test_paired_scoring_with_reused_rollouts_prices_the_window_between_generations(tmp_path):
    """num_iterations = 2: generations at steps 0, 2, 4; each is scored under the policy of the
    previous generation step, and the paired ledger prices the two-step windows."""
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run

    run, _, _ = _train(tmp_path, steps=6, iterations=2, batch=16)
    t = run.read_rollouts(["logp_prev", "logp_prev_step", "kl_prev"]).to_pydict()
    by_step = {}
    for s, p, ps in zip(t["step"], t["logp_prev"], t["logp_prev_step"]):
        by_step.setdefault(s, set()).add(ps if p is not None else None)
    assert by_step == {0: {None}, 2: {0}, 4: {2}}
    priced = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="paired")
    assert [r.step_pair for r in priced.book.kl_min.rows] == [(0, 2), (2, 4)]
    rows = priced.book.rows
    assert all(r.steps == 2 and "between generations" in r.kl_spent_source for r in rows)
    assert all("record" not in r.d_t_checks for r in rows)  # a one-step D_t is not the window's


def test_estimators_agree_for_small_steps(tmp_path):
    _, tap, _ = _train(tmp_path, steps=3, lr=1e-3, estimator="both", n_exact=48)
    for t, e in tap.estimates.items():
        a, b = e["exact"], e["rollout"]
        assert a.mean > 0 and b.mean > 0
        assert abs(a.mean - b.mean) <= 3 * math.sqrt(a.se ** 2 + b.se ** 2), (t, a.mean, b.mean)


KILL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from tests.acceptance.test_trl_tap import _train
_train(Path(sys.argv[1]), steps=400, flush_every=1)
"""


def test_killed_run_leaves_a_readable_record(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(REPO)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    manifest = tmp_path / "rec" / "manifest.json"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            files = json.loads(manifest.read_text())["files"] if manifest.is_file() else {}
            if any(n.startswith("telemetry") and e["rows"] >= 3 for n, e in files.items()):
                break
            assert proc.poll() is None, "the training process ended before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("no flushed steps within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    run = open_run(tmp_path / "rec")
    steps = run.steps.tolist()
    assert len(steps) >= 3 and steps == list(range(len(steps))) and len(steps) < 400
    assert set(np.unique(run.rollout_steps).tolist()) <= set(steps)
    run.read_rollouts(["completion", "logp_pre"])  # every listed segment reads


def test_attach_refuses_unknown_estimators(tmp_path):
    from reward_lens.taps.trl import RewardLensTap

    with pytest.raises(ValueError, match="estimator must be one of"):
        RewardLensTap(object(), tmp_path / "r", estimator="cheap")


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP"])
def test_sharded_training_is_refused_at_attach(kind):
    """Sharded parameters: no rank can evaluate pi_t alone, so the tap refuses by name."""
    from types import SimpleNamespace

    from reward_lens.taps.trl import RewardLensTap

    trainer = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=f"DistributedType.{kind}", num_processes=2,
                                                          process_index=0))
    with pytest.raises(ValueError, match=kind):
        RewardLensTap(trainer, "never-written")
    assert not Path("never-written").exists()
