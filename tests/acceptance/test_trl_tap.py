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
           budget=None, engine=False, **tap_settings):
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
    if engine:
        trainer.vllm_generation = _StandInEngine(trainer)
        trainer.use_vllm, trainer.vllm_mode, trainer._last_loaded_step = True, "colocate", -1
    # budget=None: every step pair measured whole, so that what is recorded does not depend on timing
    tap = RewardLensTap.attach(trainer, tmp / "rec", estimator=estimator, heldout=heldout, n_exact=n_exact,
                               flush_every=flush_every, save_initial_checkpoint=True, budget=budget, **tap_settings)
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


class _StandInEngine:
    """Stands in for TRL's ``VLLMGeneration`` at its boundary (``sync_weights``, ``generate``): a
    copy of the policy, loaded only when TRL syncs the weights (before each generation), sampled
    from at the trainer's temperature, its per-token log-probabilities handed back as vLLM's are.
    vLLM itself was not run: this tests the order of weight sync and draw, and the data path."""

    def __init__(self, trainer):
        import copy

        self.trainer, self.model = trainer, copy.deepcopy(trainer.model).eval()
        self.loaded, self.calls = None, []

    def sync_weights(self):
        self.model.load_state_dict(self.trainer.model.state_dict())
        self.loaded = self.trainer.state.global_step

    def generate(self, prompts, images, num_generations, profiler=None):
        tr = self.trainer
        self.calls.append((tr.state.global_step, self.loaded, len(prompts)))
        eos = tr.processing_class.eos_token_id
        completions, logprobs = [], []
        for p in prompts:
            ids, out, lps = list(p), [], []
            for _ in range(tr.max_completion_length):
                with torch.no_grad():
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].double() / tr.temperature
                probs = torch.softmax(logits, -1)
                y = int(torch.multinomial(probs, 1))
                out.append(y)
                lps.append([float(torch.log(probs[y]))])
                ids.append(y)
                if y == eos:
                    break
            completions.append(out)
            logprobs.append(lps)
        return prompts, completions, logprobs, None


def test_under_an_engine_the_extra_completions_are_its_samples_with_the_weights_it_holds(tmp_path):
    """With vLLM (a stand-in at its client boundary), the tap's extra completions ride in the
    engine's own call, after TRL has synced that generation's weights: pi_t's at step t's
    generation (side a), pi_{t+1}'s at the next (side b). Their engine log-probabilities are
    recorded as logp_sampler, equal to the drawing policy's own; the drawing policy's side is
    scored by a forward pass (an engine hands over no hidden states)."""
    run, tap, _ = _train(tmp_path, steps=3, batch=16, engine=True)
    engine = tap.trainer.vllm_generation
    assert not tap.core.captured
    # one engine call per generation, after the sync of that step; 16 rows + 2 groups x 4 a side
    assert engine.calls == [(0, 0, 16 + 8), (1, 1, 16 + 16), (2, 2, 16 + 16)]
    held = run.heldout().read_rollouts(["logp_pre", "logp_prev", "logp_sampler", "drawn_by_step"]).to_pylist()
    assert len(held) == 2 * 16
    for x in held:
        own = x["logp_pre"] if x["drawn_by_step"] == x["step"] else x["logp_prev"]
        assert x["logp_sampler"] == pytest.approx(own, abs=1e-4)
    assert sorted(run.telemetry_column("kl_to_previous")) == [0, 1]


def _as_if_an_engine_sampled(trainer, shift: float) -> None:
    """Make TRL's ``_generate_single_turn`` hand over per-token sampling log-probabilities, as it
    does with vLLM (which TRL pads into ``sampling_per_token_logps``): the policy's own
    log-probabilities at the sampling temperature, plus ``shift`` nats per token (an engine that
    departs from the policy). Patched before the tap attaches, so the tap's extra completions,
    which ride in the same call, get them too, as they would from vLLM. vLLM itself cannot run
    here; this is its data path."""
    original = trainer._generate_single_turn
    trainer.fed_sampler = []

    def _generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *a, **kw):
        completion_ids, logprobs = original(prompt_ids, images, multimodal_fields, num_generations, *a, **kw)
        assert logprobs is None  # the trainer's own generation hands none over
        fed = []
        with torch.no_grad():
            for p, c in zip(prompt_ids, completion_ids):
                ids = torch.tensor([list(p) + list(c)])
                logits = trainer.model(input_ids=ids).logits[0, len(p) - 1:-1].double() / trainer.temperature
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(c))[:, None])[:, 0]
                fed.append([float(x) + shift for x in lp])
        trainer.fed_sampler.append((len(prompt_ids), fed))
        return completion_ids, fed

    trainer._generate_single_turn = _generate_single_turn


def test_an_engines_log_probabilities_are_recorded_and_a_departing_engine_is_refused(tmp_path):
    """vLLM's data path (issue 30, issue 38): the engine's per-token log-probabilities are
    recorded, summed, as logp_sampler on the rollouts and on the tap's extra completions (which the
    engine draws in the same call), and the paired ledger reads KL(pi_sampler || pi) along both
    sides of each step pair. An engine equal to the policy passes; one that puts 0.3 nats more per
    token on its samples than the policy (about 5 nats a sequence, far above a tenth of D_t) has
    every step pair refused by name in every book that reads dz."""
    same_run, same_tap, _ = _train(tmp_path / "same", steps=3, batch=16, sampler_shift=0.0)
    rows = same_run.read_rollouts(["logp_pre", "logp_sampler"]).to_pylist()
    assert len(rows) == 3 * 16
    assert [x["logp_sampler"] for x in rows] == pytest.approx([x["logp_pre"] for x in rows], abs=1e-4)
    held = same_run.heldout().read_rollouts(["logp_pre", "logp_prev", "logp_sampler", "drawn_by_step"]).to_pylist()
    assert held and all(x["logp_sampler"] is not None for x in held)
    for x in held:  # the engine's numbers are those of the policy that drew the row
        own = x["logp_pre"] if x["drawn_by_step"] == x["step"] else x["logp_prev"]
        assert x["logp_sampler"] == pytest.approx(own, abs=1e-4)
    assert any("sampled by an inference engine" in n for n in same_run.manifest.notes)
    from reward_lens.measure.efficiency.of_run import paired_samples, price_run
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
    sides = {s.step: s for s in paired_samples(steps_from_run(off_run, SurfaceFeatures()))}
    for (_, t), lg in ledgers.items():  # 0.3 nats a token along either side's rows, by hand
        assert lg.sampler_kl > 0.1 * lg.d_t
        assert lg.sampler_kl_within  # groups of several completions: the SE within them, pooled as such
        rows = [x for x in off_run.heldout().read_rollouts(["completion_ids", "drawn_by_step"]).to_pylist()
                if x["step"] == t]
        by_side = [0.3 * np.mean([len(x["completion_ids"]) for x in rows if (x["drawn_by_step"] == t) == b])
                   for b in (False, True)]  # equal groups: the mean over groups is the mean over rows
        assert any(lg.sampler_kl == pytest.approx(v, rel=1e-4) for v in by_side), (lg.sampler_kl, by_side)
        assert sides[t].drawn_by is not None  # priced on the extra completions
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
        # two-sided, the step pairs are measured on the tap's extra completions, not on the rollouts
        assert x["logp_prev"] is None
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
    """What the tap measured for the step pair (1, 2), recomputed from pi_1 and pi_2 alone: the
    extra completions filed under step 2 -- 4 drawn by pi_1 in step 1's generation, 4 by pi_2 in
    step 2's, for step 1's prompt, never trained on -- each have logp_pre = log pi_2(y),
    logp_prev = log pi_1(y) (the drawing policy's side taken from its own generation, the other's
    from a forward pass) and kl_prev = the token KL(pi_2 || pi_1) summed along y; D_1 is their
    balance-heuristic combination; their rewards are the reward function's."""
    from transformers import AutoModelForCausalLM

    run, tap, tok = plain
    m1 = AutoModelForCausalLM.from_pretrained(run.path / run.manifest.checkpoints[0].path).eval()
    m2 = AutoModelForCausalLM.from_pretrained(run.path / run.manifest.checkpoints[0].path).eval()
    m1.load_state_dict(tap.policies[1])
    m2.load_state_dict(tap.policies[2])
    cols = ["prompt", "completion", "completion_ids", "reward", "advantage", "logp_pre", "logp_prev", "kl_prev",
            "logp_prev_step", "drawn_by_step", "group_id"]
    held = [x for x in run.heldout().read_rollouts(cols).to_pylist() if x["step"] == 2]
    assert sorted(x["drawn_by_step"] for x in held) == [1] * 4 + [2] * 4
    assert all(x["advantage"] is None and x["logp_prev_step"] == 1 and x["group_id"] == "2:h0" for x in held)
    step_1_prompt = {x["prompt"] for x in run.read_rollouts(["prompt"]).to_pylist() if x["step"] == 1}
    assert {x["prompt"] for x in held} == step_1_prompt
    q = []
    for x in held:
        prompt = tok(x["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + x["completion_ids"]])
        with torch.no_grad():
            lp2 = torch.log_softmax(m2(input_ids=ids).logits[0, :-1].double(), -1)[len(prompt) - 1:]
            lp1 = torch.log_softmax(m1(input_ids=ids).logits[0, :-1].double(), -1)[len(prompt) - 1:]
        tgt = ids[0, len(prompt):, None]
        assert x["logp_pre"] == pytest.approx(lp2.gather(-1, tgt).sum().item(), abs=1e-4)
        assert x["logp_prev"] == pytest.approx(lp1.gather(-1, tgt).sum().item(), abs=1e-4)
        assert x["kl_prev"] == pytest.approx((lp2.exp() * (lp2 - lp1)).sum().item(), rel=1e-4, abs=1e-7)
        assert x["reward"] == pytest.approx(gen.lowercase([x["completion"]])[0], rel=1e-6)
        r = x["logp_pre"] - x["logp_prev"]
        q.append((1.0 / (4 * math.exp(-r) + 4), x["kl_prev"]))  # n_a = n_b = 4
    w = np.array([a for a, _ in q])
    d_1 = float((w / w.sum()) @ np.array([b for _, b in q]))
    assert run.telemetry_column("kl_to_previous")[1] == pytest.approx(d_1, rel=1e-9)


def test_the_extra_completions_are_never_trained_on(plain):
    """The tap's extra completions ride in TRL's generation and leave the batch before anything
    trains on them: every micro-batch TRL's loss saw holds the step's own 8 rollouts (the global
    batch), the record's rollouts are those, and the telemetry says what each pair was measured on."""
    run, tap, _ = plain
    assert np.unique(run.rollout_steps, return_counts=True)[1].tolist() == [8, 8, 8, 8]
    t = run.telemetry.to_pydict()
    assert t["tap_groups"] == [1, 1, 1, 1] and t["tap_per_group"] == [4, 4, 4, 4]
    assert t["tap_groups_total"] == [1, 1, 1, 1] and t["tap_probability"] == [1.0] * 4
    assert all(x is not None and x >= 0 for x in t["tap_seconds"])
    assert all(a >= b for a, b in zip(t["step_seconds"], t["tap_seconds"]))
    assert t["tap_budget"] == [None] * 4
    held = run.heldout().read_rollouts(["completion_ids"]).to_pylist()
    assert len(held) == 3 * 8  # the last generation's side a has no next generation: not written


def test_beta_and_gradient_accumulation(tmp_path):
    run, tap, _ = _train(tmp_path, steps=3, beta=0.04, ga=2)
    kl = run.telemetry_column("kl_to_ref")
    assert sorted(kl) == [0, 1, 2] and all(v >= 0 for v in kl.values())
    assert set(run.telemetry_column("beta").values()) == {0.04}
    steps, counts = np.unique(run.rollout_steps, return_counts=True)
    assert steps.tolist() == [0, 1, 2] and set(counts) == {16}  # the whole generation batch, once
    # both prompt groups measured, 4 completions per group from each policy
    assert all(tap.estimates[t]["independent_two_sided"].n == 2 * 2 * 4 for t in range(2))


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
    assert np.unique(run.rollout_steps).tolist() == [0, 2, 4]
    t = run.heldout().read_rollouts(["logp_prev", "logp_prev_step", "kl_prev", "drawn_by_step"]).to_pydict()
    by_step = {}
    for s, p, ps, d in zip(t["step"], t["logp_prev"], t["logp_prev_step"], t["drawn_by_step"]):
        by_step.setdefault(s, set()).add((ps if p is not None else None, d))
    # pi_0's completions drawn in step 0's generation and pi_2's in step 2's, for step 0's prompts, ...
    assert by_step == {2: {(0, 0), (0, 2)}, 4: {(2, 2), (2, 4)}}
    samples = steps_from_run(run, SurfaceFeatures())
    assert {s.step: s.heldout.n for s in samples if s.heldout is not None} == {2: 8, 4: 8}
    assert {s.step: s.fresh.n for s in samples if s.fresh is not None} == {2: 8, 4: 8}
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
    """loss_forward=True (the default): the rollouts' log pi_{t+1} and entropy come from the hidden
    states of TRL's own loss forward, and each extra completion's drawing policy's side from the
    hidden states of the generation that drew it, so the tap's own forward passes cover one side of
    each extra completion only: the live policy's for pi_t's, the kept pi_t's for pi_{t+1}'s. The
    same run with loss_forward=False (a pass of the tap's own over the rollouts) records the same
    numbers."""
    from reward_lens.taps.core import TapCore

    run, tap, _ = plain
    assert tap.loss_forward and tap.core.captured
    counted = {"live": 0, "kept": 0}
    original = TapCore._forward

    def counting(self, params, ids, mask, **kw):
        counted["live" if params is None else "kept"] += int(ids.shape[0])
        return original(self, params, ids, mask, **kw)

    TapCore._forward = counting
    try:
        own_run, own_tap, _ = _train(tmp_path / "own", loss_forward=False)
        own_counts = dict(counted)
        counted.update(live=0, kept=0)
        fused_run, fused_tap, _ = _train(tmp_path / "fused")
    finally:
        TapCore._forward = original
    assert not own_tap.loss_forward and fused_tap.loss_forward
    rollouts, side = 4 * 8, 3 * 4  # 8 rollouts a step; 4 extra rows a side for each of 3 pairs
    assert own_counts == {"live": rollouts + side, "kept": side}
    assert counted == {"live": side, "kept": side}
    for col in ("kl_to_previous", "kl_to_previous_se", "entropy"):
        a, b = own_run.telemetry_column(col), fused_run.telemetry_column(col)
        assert a.keys() == b.keys() and [a[k] for k in a] == pytest.approx([b[k] for k in a], rel=1e-6), col
    cols = ["logp_pre", "logp_prev", "kl_prev"]
    for a_run, b_run in ((own_run, fused_run), (own_run.heldout(), fused_run.heldout())):
        xa, xb = a_run.read_rollouts(cols).to_pylist(), b_run.read_rollouts(cols).to_pylist()
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
