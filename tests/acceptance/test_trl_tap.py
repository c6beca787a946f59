"""The TRL tap on real (tiny) GRPOTrainer runs: what it records (checked against TRL's own
numbers and against the policies recomputed from checkpoints), under accumulation, beta > 0,
reuse across iterations, a kill mid-run, and the agreement of its two D_t estimators."""

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


def _train(tmp: Path, *, steps=4, beta=0.0, ga=1, iterations=1, lr=1e-2, estimator="independent", heldout=4, n_exact=16,
           flush_every=2, seed=3, batch=8, keep=False, prompts=("ab", "cd", "ef", "gh"), sampler_shift=None,
           **tap_settings):
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
                          train_dataset=Dataset.from_dict({"prompt": list(prompts)}), processing_class=tok)
    if sampler_shift is not None:
        _as_if_an_engine_sampled(trainer, sampler_shift)
    tap = RewardLensTap.attach(trainer, tmp / "rec", estimator=estimator, heldout=heldout, n_exact=n_exact,
                               flush_every=flush_every, save_initial_checkpoint=True, **tap_settings)
    tap.policies = {}
    if keep:  # every pi_t, to recompute what the tap measured from the weights alone
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def on_step_begin(self, args_, state, control, **kw):
                tap.policies[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

            def on_train_end(self, args_, state, control, **kw):
                tap.policies[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

        trainer.add_callback(Keep())
    trainer.train()
    tap.log_history = trainer.state.log_history
    return open_run(tmp / "rec"), tap, tok


def _as_if_an_engine_sampled(trainer, shift: float) -> None:
    """Make TRL's own ``_generate`` hand over per-token sampling log-probabilities, as it does
    with vLLM (its 5th return value, which TRL pads into ``sampling_per_token_logps``): the
    policy's own log-probabilities at the sampling temperature, plus ``shift`` nats per token (an
    engine that departs from the policy). vLLM itself cannot run here; this is its data path."""
    original = trainer._generate
    trainer.fed_sampler = []

    def _generate(prompts):
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = original(prompts)
        assert logprobs is None  # the trainer's own generation hands none over
        fed = []
        with torch.no_grad():
            for p, c in zip(prompt_ids, completion_ids):
                ids = torch.tensor([list(p) + list(c)])
                logits = trainer.model(input_ids=ids).logits[0, len(p) - 1:-1].double() / trainer.temperature
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(c))[:, None])[:, 0]
                fed.append([float(x) + shift for x in lp])
        trainer.fed_sampler.extend(fed)
        return prompt_ids, completion_ids, tool_mask, completions, fed, extra, images, tool_images

    trainer._generate = _generate


def test_an_engines_log_probabilities_are_recorded_and_a_departing_engine_is_refused(tmp_path):
    """vLLM's data path (issue 30): TRL hands over the sampler's per-token log-probabilities;
    the tap records their sum per rollout as logp_sampler, and the paired ledger reads
    KL(pi_sampler || pi_{t+1}) along the rollouts. An engine equal to the policy passes; one
    that puts 0.3 nats more per token on its samples than the policy (about 5 nats a sequence,
    far above a tenth of D_t) has every step pair refused by name in every book that reads dz."""
    same_run, same_tap, _ = _train(tmp_path / "same", steps=3, batch=16, sampler_shift=0.0)
    rows = same_run.read_rollouts(["logp_pre", "logp_sampler"]).to_pylist()
    assert len(rows) == len(same_tap.trainer.fed_sampler) == 3 * 16
    assert [x["logp_sampler"] for x in rows] == pytest.approx([sum(f) for f in same_tap.trainer.fed_sampler])
    assert [x["logp_sampler"] for x in rows] == pytest.approx([x["logp_pre"] for x in rows], abs=1e-4)
    assert all(x["logp_sampler"] is None for x in same_run.heldout().read_rollouts(["logp_sampler"]).to_pylist())
    assert any("sampled by an inference engine" in n for n in same_run.manifest.notes)
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run

    def premises(run):
        priced = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="paired")
        return priced.book.kl_min.premises, {tuple(lg.step_pair): lg for lg in priced.ledgers}

    failed, ledgers = premises(same_run)
    assert "sampler_mismatch" not in failed.values()
    assert all(abs(lg.sampler_kl) < 1e-4 for lg in ledgers.values())

    off_run, off_tap, _ = _train(tmp_path / "off", steps=3, batch=16, sampler_shift=0.3)
    failed, ledgers = premises(off_run)
    assert failed == {(0, 1): "sampler_mismatch", (1, 2): "sampler_mismatch"}
    tokens = [len(x) for x in off_tap.trainer.fed_sampler]
    for (_, t), lg in ledgers.items():  # 0.3 nats a token along step t's rollouts, by hand (groups of equal size)
        assert lg.sampler_kl > 0.1 * lg.d_t
        assert lg.sampler_kl == pytest.approx(0.3 * np.mean(tokens[16 * t:16 * (t + 1)]), rel=1e-4)
    out = tmp_path / "rep"
    from reward_lens import cli

    assert cli.main(["report", str(tmp_path / "off" / "rec"), "--out", str(out), "--format", "json", "--quiet",
                     "--fail-on", "never"]) == 0
    report = json.loads((out / "report.json").read_text())
    for book in ("cost", "effect"):
        (ref,) = [r for r in next(b for b in report["books"] if b["id"] == book)["refusals"]
                  if r["code"] == "PREMISE_FAILED"]
        assert "not sampled from the policy" in ref["detail"] and "0->1" in ref["detail"], book
        assert "use_vllm: false" in ref["remedy"]


def test_the_tap_reports_into_the_trainers_own_logs(plain):
    """reward_lens/* metrics go through Trainer.log, so W&B / TensorBoard / report_to see them."""
    run, tap, _ = plain
    logged = [h for h in tap.log_history if "reward_lens/update_norm" in h]
    assert len(logged) == len(run.steps)  # logging_steps=1: one per step
    d_t = run.telemetry_column("kl_to_previous")
    upd = run.telemetry_column("update_norm")
    clipped = run.telemetry_column("grad_norm")
    for h in logged:
        t = h["step"] - 1  # transformers logs the 1-based global step after the update
        assert h["reward_lens/update_norm"] == pytest.approx(upd[t])
        assert h["reward_lens/grad_norm_clipped"] == pytest.approx(clipped[t])
        # the tap's token entropy of pi_t along its rollouts is TRL's own `entropy` of the same batch
        assert h["reward_lens/entropy"] == pytest.approx(h["entropy"], rel=1e-5)
        # D_t of step t is measured at step t+1's generation, so it is logged one step later
        if t >= 1:
            assert h["reward_lens/kl_to_previous"] == pytest.approx(d_t[t - 1])
        else:
            assert "reward_lens/kl_to_previous" not in h


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"), keep=True)


def test_telemetry_is_measured_per_step(plain):
    run, tap, _ = plain
    t = run.telemetry.to_pydict()
    assert t["step"] == [0, 1, 2, 3]
    for f in ("learning_rate", "grad_norm", "grad_norm_unclipped", "max_grad_norm", "update_norm", "entropy", "beta"):
        assert all(v is not None for v in t[f]), f
    # D_t of a step is measured on the next step's generation: the last step has none
    for f in ("kl_to_previous", "kl_to_previous_se", "kl_to_previous_estimator"):
        assert all(v is not None for v in t[f][:-1]) and t[f][-1] is None, f
    # The learning rate the optimizer used: TRL's linear schedule from 1e-2 over 4 steps.
    assert t["learning_rate"] == pytest.approx([1e-2 * (1 - s / 4) for s in range(4)])
    # The applied norm is measured after clipping; torch's clip coefficient predicts it.
    for pre, post in zip(t["grad_norm_unclipped"], t["grad_norm"]):
        assert post == pytest.approx(pre * min(1.0, 1.0 / (pre + 1e-6)), rel=1e-5)
    assert all(u > 0 for u in t["update_norm"]) and set(t["kl_to_previous_estimator"][:-1]) == {"independent_two_sided"}
    assert all(k > 0 for k in t["kl_to_previous"][:-1])
    assert run.manifest.optimizer == "adamw_torch_fused" and run.manifest.framework.name == "trl"


def test_rollouts_carry_exact_ids_rewards_and_log_probs(plain):
    run, tap, tok = plain
    r = run.read_rollouts(["prompt", "completion", "completion_ids", "num_tokens", "reward", "rewards",
                           "advantage", "logp_pre", "logp_post", "logp_prev"]).to_pylist()
    assert len(r) == 32 and [x["step"] for x in r] == [s for s in range(4) for _ in range(8)]
    for x in r:
        assert tok.decode(x["completion_ids"], skip_special_tokens=True) == x["completion"]
        assert x["num_tokens"] == len(x["completion_ids"])
        assert x["reward"] == pytest.approx(gen.lowercase([x["completion"]])[0], rel=1e-6)
        assert dict(x["rewards"]) == {"lowercase": pytest.approx(x["reward"])}
        assert math.isfinite(x["logp_pre"]) and x["logp_post"] is None  # nothing in-sample is recorded
        assert (x["logp_prev"] is None) == (x["step"] == 0)
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
    assert len(book.rows) + sum(len(r.subject.step_pairs) for r in book.refusals) == 3
    assert all(0 <= r.efficiency <= 1 and r.kl_spent_source.startswith("record kl_to_previous (independent")
               for r in book.rows)


def test_d_t_and_the_scores_are_the_policies_own(plain):
    """What the tap measured for the step pair (1, 2), recomputed from pi_1 and pi_2 alone: each
    rollout of step 2 and each held-out completion filed under it has logp_pre = log pi_2(y),
    logp_prev = log pi_1(y) and kl_prev = the token KL(pi_2 || pi_1) summed along y; D_1 is their
    balance-heuristic combination; the held-out completions' rewards are the reward function's."""
    from transformers import AutoModelForCausalLM

    run, tap, tok = plain
    m1 = AutoModelForCausalLM.from_pretrained(run.path / run.manifest.checkpoints[0].path).eval()
    m2 = AutoModelForCausalLM.from_pretrained(run.path / run.manifest.checkpoints[0].path).eval()
    m1.load_state_dict(tap.policies[1])
    m2.load_state_dict(tap.policies[2])
    cols = ["prompt", "completion", "completion_ids", "reward", "advantage", "logp_pre", "logp_prev", "kl_prev",
            "logp_prev_step"]
    rows = [(x, False) for x in run.read_rollouts(cols).to_pylist() if x["step"] == 2]
    held = [x for x in run.heldout().read_rollouts(cols).to_pylist() if x["step"] == 2]
    assert len(held) == 4 and all(x["advantage"] is None and x["logp_prev_step"] == 1 for x in held)
    rows += [(x, True) for x in held]
    q = []
    for x, is_held in rows:
        prompt = tok(x["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + x["completion_ids"]])
        with torch.no_grad():
            lp2 = torch.log_softmax(m2(input_ids=ids).logits[0, :-1].double(), -1)[len(prompt) - 1:]
            lp1 = torch.log_softmax(m1(input_ids=ids).logits[0, :-1].double(), -1)[len(prompt) - 1:]
        tgt = ids[0, len(prompt):, None]
        assert x["logp_pre"] == pytest.approx(lp2.gather(-1, tgt).sum().item(), abs=1e-4)
        assert x["logp_prev"] == pytest.approx(lp1.gather(-1, tgt).sum().item(), abs=1e-4)
        assert x["kl_prev"] == pytest.approx((lp2.exp() * (lp2 - lp1)).sum().item(), rel=1e-4, abs=1e-7)
        if is_held:
            assert x["reward"] == pytest.approx(gen.lowercase([x["completion"]])[0], rel=1e-6)
        r = x["logp_pre"] - x["logp_prev"]
        q.append((1.0 / (4 * math.exp(-r) + 8), x["kl_prev"]))
    w = np.array([a for a, _ in q])
    d_1 = float((w / w.sum()) @ np.array([b for _, b in q]))
    assert run.telemetry_column("kl_to_previous")[1] == pytest.approx(d_1, rel=1e-9)


def test_held_out_completions_are_drawn_from_the_previous_policy(plain):
    """Replaying the tap's draws from pi_{t-1} itself -- the same sampler and seed, the weights
    recomputed from the kept policies -- gives exactly the held-out completions the record holds
    at every step; replaying them from pi_t does not."""
    from transformers import AutoModelForCausalLM

    from reward_lens.measure.whitebox.policy import sample_prompts

    run, tap, tok = plain
    model = AutoModelForCausalLM.from_pretrained(run.path / run.manifest.checkpoints[0].path).eval()
    rollouts = run.read_rollouts(["prompt", "group_id"]).to_pylist()
    held = run.heldout().read_rollouts(["completion_ids"]).to_pylist()

    def replay(offset: int) -> list[list[int]]:
        gen_ = torch.Generator().manual_seed(0 * 1_000_003 + 7)  # the tap's seed 0, rank 0
        out = []
        for t in range(1, 4):
            model.load_state_dict(tap.policies[t - 1 + offset])
            prompts = list(dict.fromkeys(x["prompt"] for x in rollouts if x["step"] == t))
            ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
            out += sample_prompts(model, ids, 4, 16, tok.eos_token_id, tok.pad_token_id, gen_)
        return out

    assert [x["completion_ids"] for x in held] == replay(0)
    assert [x["completion_ids"] for x in held] != replay(1)


def test_beta_and_gradient_accumulation(tmp_path):
    run, tap, _ = _train(tmp_path, steps=3, beta=0.04, ga=2)
    kl = run.telemetry_column("kl_to_ref")
    assert sorted(kl) == [0, 1, 2] and all(v >= 0 for v in kl.values())
    assert set(run.telemetry_column("beta").values()) == {0.04}
    steps, counts = np.unique(run.rollout_steps, return_counts=True)
    assert steps.tolist() == [0, 1, 2] and set(counts) == {16}  # the whole generation batch, once
    # every micro-batch's rollouts enter the next estimate, with 4 held-out per prompt group
    assert all(tap.estimates[t]["independent_two_sided"].n == 16 + 2 * 4 for t in range(2))


def test_reuse_across_iterations(tmp_path):
    """One generation feeds two steps: no per-step D_t is recorded (the paired ledger prices the
    window between generations instead)."""
    run, tap, _ = _train(tmp_path, steps=4, iterations=2)
    assert np.unique(run.rollout_steps).tolist() == [0, 2]  # sampled by pi_0 and pi_2 only
    assert run.telemetry_column("kl_to_previous") == {}
    assert np.unique(run.heldout().rollout_steps).tolist() == [2]


def test_paired_scoring_with_reused_rollouts_prices_the_window_between_generations(tmp_path):
    """num_iterations = 2: generations at steps 0, 2, 4; each is scored under the policy of the
    previous generation step, with held-out completions of that policy, and the paired ledger
    prices the two-step windows."""
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run

    run, _, _ = _train(tmp_path, steps=6, iterations=2, batch=16)
    t = run.read_rollouts(["logp_prev", "logp_prev_step", "kl_prev"]).to_pydict()
    by_step = {}
    for s, p, ps in zip(t["step"], t["logp_prev"], t["logp_prev_step"]):
        by_step.setdefault(s, set()).add(ps if p is not None else None)
    assert by_step == {0: {None}, 2: {0}, 4: {2}}
    samples = steps_from_run(run, SurfaceFeatures())
    assert {s.step: s.heldout.n for s in samples if s.heldout is not None} == {2: 8, 4: 8}
    priced = price_run(run, samples, ledger="paired")
    assert [r.step_pair for r in priced.book.kl_min.rows] == [(0, 2), (2, 4)]
    assert all(lg.n_heldout == 8 for lg in priced.ledgers)
    rows = priced.book.rows
    assert all(r.steps == 2 and "between generations" in r.kl_spent_source for r in rows)
    assert all("record" not in r.d_t_checks for r in rows)  # a one-step D_t is not the window's


def test_estimators_agree_for_small_steps(tmp_path):
    """The independent estimate (the next generation and held-out completions) and the exact
    one (fresh samples of pi_{t+1}) measure the same D_t. D_t depends on the prompts (the
    independent estimate reads the next step's, the exact one step t's), so every step here
    sees the same prompt."""
    _, tap, _ = _train(tmp_path, steps=3, lr=1e-3, estimator="exact", n_exact=48, batch=16, prompts=("ab",) * 4)
    for t in (0, 1):
        a, b = tap.estimates[t]["exact"], tap.estimates[t]["independent_two_sided"]
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


def test_a_snapshot_in_host_memory_measures_what_one_beside_the_model_does(plain, tmp_path):
    """snapshot='cpu' keeps pi_t on the host and copies it into the model for each scoring pass
    and back (the path a CUDA run takes to hold no second copy on the accelerator; here the copy
    path itself is exercised): the same run records the same D_t, scores and held-out draws, the
    kept tensors are separate host copies of the trainable parameters, and the record's notes
    state their bytes."""
    run, tap, _ = plain
    host_run, host_tap, _ = _train(tmp_path, snapshot="cpu")
    assert host_tap._host and not tap._host
    n_bytes = sum(p.numel() * p.element_size() for p in host_tap.trainer.model.parameters() if p.requires_grad)
    assert host_tap.snapshot_bytes == tap.snapshot_bytes == n_bytes
    notes = " ".join(host_run.manifest.notes)
    assert "kept in host memory" in notes and f"{n_bytes / 2**30:.3g} GiB" in notes
    assert "kept on cpu beside the model" in " ".join(run.manifest.notes)
    for col in ("kl_to_previous", "kl_to_previous_se", "update_norm", "grad_norm", "entropy"):
        a, b = run.telemetry_column(col), host_run.telemetry_column(col)
        assert a.keys() == b.keys() and a, col
        assert [a[k] for k in a] == pytest.approx([b[k] for k in a], rel=1e-6, abs=1e-9), col
    assert len(run.telemetry_column("kl_to_previous")) == len(run.steps) - 1  # every step with a next one
    cols = ["completion", "logp_pre", "logp_prev", "kl_prev"]
    for side_a, side_b in ((run, host_run), (run.heldout(), host_run.heldout())):
        xa, xb = side_a.read_rollouts(cols).to_pylist(), side_b.read_rollouts(cols).to_pylist()
        assert len(xa) == len(xb) > 0
        assert [x["completion"] for x in xa] == [x["completion"] for x in xb]
        for col in cols[1:]:
            va = [np.nan if x[col] is None else x[col] for x in xa]
            vb = [np.nan if x[col] is None else x[col] for x in xb]
            assert np.allclose(va, vb, rtol=1e-6, atol=1e-8, equal_nan=True), col


def test_the_loss_forward_gives_the_rollouts_pi_t_plus_1_side(plain, tmp_path):
    """loss_forward=True (the default): the rollouts' log pi_{t+1}, entropy and pi_{t+1}'s side of
    their token KL come from the hidden states of TRL's own loss forward, so the tap's own forward
    passes under the live policy cover the held-out rows only (one pass per rollout remains: pi_t's).
    The same run with loss_forward=False (a pass of the tap's own) records the same numbers."""
    from reward_lens.taps.trl import RewardLensTap

    run, tap, _ = plain
    assert tap.loss_forward
    counted = {"live": 0, "kept": 0}
    original = RewardLensTap._forward

    def counting(self, params, ids, mask, **kw):
        counted["live" if params is None else "kept"] += int(ids.shape[0])
        return original(self, params, ids, mask, **kw)

    RewardLensTap._forward = counting
    try:
        own_run, own_tap, _ = _train(tmp_path / "own", loss_forward=False)
        own_counts = dict(counted)
        counted.update(live=0, kept=0)
        fused_run, fused_tap, _ = _train(tmp_path / "fused")
    finally:
        RewardLensTap._forward = original
    assert not own_tap.loss_forward and fused_tap.loss_forward
    rollouts, held = 4 * 8, 3 * 4  # 8 rollouts a step; 4 held-out rows at each of 3 generations after the first
    assert own_counts == {"live": rollouts + held, "kept": (rollouts - 8) + held}
    assert counted == {"live": held, "kept": (rollouts - 8) + held}
    for col in ("kl_to_previous", "kl_to_previous_se", "entropy"):
        a, b = own_run.telemetry_column(col), fused_run.telemetry_column(col)
        assert a.keys() == b.keys() and [a[k] for k in a] == pytest.approx([b[k] for k in a], rel=1e-6), col
    cols = ["logp_pre", "logp_prev", "kl_prev"]
    xa, xb = own_run.read_rollouts(cols).to_pylist(), fused_run.read_rollouts(cols).to_pylist()
    for col in cols:
        va = [np.nan if x[col] is None else x[col] for x in xa]
        vb = [np.nan if x[col] is None else x[col] for x in xb]
        assert np.allclose(va, vb, rtol=1e-6, atol=1e-8, equal_nan=True), col


def test_the_snapshot_plan_says_the_bytes_and_refuses_what_cannot_fit():
    from reward_lens.taps.trl import snapshot_plan

    seven_b = 7 * 10**9 * 4
    assert "26.1 GiB" in snapshot_plan(seven_b, "device", "cuda:0", 80 * 2**30)
    with pytest.raises(ValueError, match=r"takes 26.1 GiB .* 10 GiB is free .* snapshot='cpu'"):
        snapshot_plan(seven_b, "device", "cuda:0", 10 * 2**30)
    said = snapshot_plan(seven_b, "cpu", "cuda:0", None)
    assert "host memory, pinned (26.1 GiB" in said and "no second copy on cuda:0" in said
    assert "pinned" not in snapshot_plan(seven_b, "cpu", "cpu", None)


def test_attach_refuses_unknown_estimators_and_bad_settings(tmp_path):
    from reward_lens.taps.trl import RewardLensTap

    with pytest.raises(ValueError, match="estimator: Input should be 'independent' or 'exact'"):
        RewardLensTap(object(), tmp_path / "r", estimator="cheap")
    with pytest.raises(ValueError, match="'rollout' is retired: it summed the token KL along the rollouts the step"):
        RewardLensTap(object(), tmp_path / "r", estimator="rollout")
    for bad in ({"heldout": -1}, {"heldout": 2.5}, {"flush_every": 0}, {"flush_every": "ten"}, {"paired": "no"},
                {"paired": False}, {"snapshot": "disk"}, {"snapshot": True}):
        with pytest.raises(ValueError):
            RewardLensTap(object(), tmp_path / "r", **bad)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP"])
def test_sharded_training_is_refused_at_attach(kind):
    """DeepSpeed and FSDP1 shard in ways the tap cannot keep pi_t under: refused by name, and
    the refusal names FSDP2, the sharding it records (tests/acceptance/test_trl_tap_distributed.py)."""
    from types import SimpleNamespace

    from reward_lens.taps.trl import RewardLensTap

    trainer = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=f"DistributedType.{kind}", num_processes=2,
                                                          process_index=0))
    with pytest.raises(ValueError, match=kind) as err:
        RewardLensTap(trainer, "never-written")
    assert "fsdp_version': 2" in str(err.value) and "DistributedConfig(fsdp_size=N)" in str(err.value)
    assert not Path("never-written").exists()
