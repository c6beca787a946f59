"""Write the NeMo-RL fixtures: a GRPO run's log folder as NeMo-RL's own code writes it.

NeMo-RL does not install on CPU (its index package is a placeholder; it needs Ray, vLLM and
Megatron/DTensor workers), so its writers are written out here against its source
(github.com/NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909):

* nemo_rl/algorithms/grpo.py:3630-3653 (``grpo_train``): every step,
  ``logger.log_batched_dict_as_jsonl(log_data, f"train_data_step{total_steps + 1}.jsonl")`` with
  ``log_data`` = content (``flat_messages["content"]``: each rollout's message contents, the prompt
  messages then the completion), rewards, input_lengths, token_ids, token_loss_mask,
  sample_loss_mask, advantages, generation_logprobs and prev_logprobs, every tensor
  ``.tolist()``-ed over the padded batch (right padding, ``make_sequence_length_divisible_by``:
  nemo_rl/data/llm_message_utils.py:257-360).
* nemo_rl/utils/logger.py:1071-1098 (``log_batched_dict_as_jsonl``): the dict is a
  ``BatchedDataDict``, iterated with ``make_microbatch_iterator(1)`` (batched_data_dict.py:885-906,
  1006-1015: each key sliced ``[i:i+1]``, so every value is a one-row list), and each line is
  ``json.dumps({**sample, "idx": i}, default=str)``, into ``logger.log_dir``.
* grpo.py:4016-4021 (``validate``): ``val_data_step{step}.jsonl`` with content (the message logs
  as ``{"role", "content"}`` dicts: get_keys_from_message_log) and rewards (``total_reward``).
* The advantages: GRPOAdvantageEstimator.compute_advantage (advantage_estimator.py:69-98) with
  calculate_baseline_and_std_per_prompt (nemo_rl/algorithms/utils.py:104-197): a leave-one-out
  baseline and the std, expanded to every position of the sequence.
* generation_logprobs are 0 on the prompt tokens (add_grpo_token_loss_masks_and_generation_logprobs)
  and the engine's on the completion; prev_logprobs are the trainer's (policy.get_logprobs) on
  every position, the first 0. The loss reads both shifted together ([:, 1:], loss_functions.py:381-391).
* The metrics: TensorboardLogger (logger.py:134-190): ``SummaryWriter(log_dir=<log_dir>/tensorboard)``
  (logger.py:997-1003), ``add_scalar(f"{prefix}/{name}", value, step)``; train metrics with
  prefix ``train`` at ``total_steps + 1`` (grpo.py:3762), validation ones with ``validation`` at
  the validated step (grpo.py:3398-3403). gen_kl_error and token_mult_prob_error are computed
  here as ClippedPGLossFn does (loss_functions.py:404-428, k3 by default), from the same
  log-probabilities the dump holds.

The model is a toy: a fixed categorical over a small vocabulary per prompt, the "engine" a
slightly perturbed copy (a real cause of mismatch: its log-probabilities differ by a
bfloat16-sized error); rewards follow from whether the completion ends its answer. The diverged
copy logs NaN metrics from step 3 and one NaN trainer log-probability, as a blown-up run does.

Run: ``python tools/make_nemo_rl_fixtures.py`` (needs torch and tensorboard).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nemo_rl"
PROMPTS = ["What is 12 + 7?", "Solve x + 10 = 15.", "How many legs do 3 spiders have?", "Is 91 prime?"]
WORDS = ["the", "answer", "is", "so", "we", "add", "then", "check", "\\boxed{19}", "\\boxed{5}", "\\boxed{24}",
         "\\boxed{no}", "<|im_end|>"]
PAD = 151643  # Qwen2.5's pad token id
DIVISIBLE_BY = 8  # policy.make_sequence_length_divisible_by


def chat_prompt(question: str) -> str:
    """The user message's content as NeMo-RL's math data processor leaves it: the chat template
    applied (Qwen2.5 style), ending where the assistant's turn begins."""
    return (f"<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}.<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def baseline_and_std(prompts: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool = True):
    """calculate_baseline_and_std_per_prompt (nemo_rl/algorithms/utils.py:104-197), all valid."""
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for p in torch.unique(prompts):
        idx = torch.nonzero(prompts == p).flatten()
        m = (1 - torch.eye(len(idx))) if leave_one_out else torch.ones(len(idx), len(idx))
        n = len(idx) - int(leave_one_out)
        b = m @ rewards[idx] / n
        sq = m @ rewards[idx].pow(2) / n
        baseline[idx] = b
        std[idx] = ((sq - b.square()) * (n / (n - 1))).sqrt().nan_to_num(0)
    return baseline, std


def write_jsonl(path: Path, log_data: dict) -> None:
    """Logger.log_batched_dict_as_jsonl (logger.py:1071-1098): one-row slices, plus idx."""
    size = len(next(iter(log_data.values())))
    with open(path, "w") as f:
        for i in range(size):
            sample = {k: v[i:i + 1] for k, v in log_data.items()}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")


def train_step(rng: np.random.Generator, step: int, gens: int, nan_logp: bool):
    rows = []
    for pi, q in enumerate(PROMPTS):
        prompt = chat_prompt(q)
        prompt_ids = [int(x) for x in rng.integers(1000, 5000, size=10 + pi)]
        for g in range(gens):
            n = int(rng.integers(4, 11))
            words = [WORDS[int(k)] for k in rng.integers(0, 8, size=n - 2)]
            solved = rng.random() < 0.2 + 0.06 * step + 0.1 * (pi % 2)
            words += [WORDS[8 + pi] if solved else WORDS[int(rng.integers(0, 8))], WORDS[12]]
            completion = " ".join(words[:-1]) + words[-1]
            ids = [int(x) for x in rng.integers(5000, 9000, size=n)]
            # the trainer's log-probabilities under pi_t; the engine's differ by a bf16-sized error
            train_lp = -np.abs(rng.normal(0.9 - 0.05 * step, 0.5, size=n))
            gen_lp = train_lp + rng.normal(0, 0.004, size=n)
            rows.append({"prompt": prompt, "pid": pi, "prompt_ids": prompt_ids, "completion": completion,
                         "ids": ids, "train_lp": train_lp, "gen_lp": gen_lp, "reward": 1.0 if solved else 0.0,
                         "prompt_lp": -np.abs(rng.normal(2.0, 1.0, size=len(prompt_ids)))})
    L = max(len(r["prompt_ids"]) + len(r["ids"]) for r in rows)
    L = -(-L // DIVISIBLE_BY) * DIVISIBLE_BY
    rewards = torch.tensor([r["reward"] for r in rows])
    base, std = baseline_and_std(torch.tensor([r["pid"] for r in rows]), rewards)
    adv = (rewards - base).unsqueeze(-1)
    nz = std > 0
    adv[nz] = adv[nz] / (std.unsqueeze(-1)[nz] + 1e-6)  # normalize_rewards: true
    token_ids, token_mask, gen_lps, prev_lps, lengths = [], [], [], [], []
    for r in rows:
        p, c = len(r["prompt_ids"]), len(r["ids"])
        pad = L - p - c
        token_ids.append(r["prompt_ids"] + r["ids"] + [PAD] * pad)
        token_mask.append([0] * p + [1] * c + [0] * pad)
        gen_lps.append([0.0] * p + r["gen_lp"].tolist() + [0.0] * pad)
        prev = [0.0] + r["prompt_lp"][1:].tolist() + r["train_lp"].tolist() + [0.0] * pad
        prev_lps.append(prev)
        lengths.append(p + c)
    if nan_logp:
        prev_lps[5][len(rows[5]["prompt_ids"]) + 1] = math.nan
    log_data = {
        "content": [[r["prompt"], r["completion"]] for r in rows],
        "rewards": rewards.tolist(),
        "input_lengths": lengths,
        "token_ids": token_ids,
        "token_loss_mask": token_mask,
        "sample_loss_mask": [1.0] * len(rows),
        "advantages": adv.expand(len(rows), L).tolist(),
        "generation_logprobs": gen_lps,
        "prev_logprobs": prev_lps,
    }
    # the loss function's mismatch metrics, over every completion token of the step
    gen = np.concatenate([r["gen_lp"] for r in rows])
    prev = np.concatenate([r["train_lp"] for r in rows])
    logr = prev - gen
    metrics = {
        "loss": float(rng.normal(0, 0.01)),
        "grad_norm": float(abs(rng.normal(0.3, 0.05))),
        "lr": 1e-6,
        "wd": 0.01,
        "reward": float(rewards.mean()),
        "mean_prompt_length": float(np.mean([len(r["prompt_ids"]) for r in rows])),
        "gen_kl_error": float(np.mean(np.exp(logr) - 1 - logr)),
        "token_mult_prob_error": float(np.mean(np.exp(np.abs(gen - prev)))),
        "approx_entropy": float(-np.mean(np.exp(prev - gen) * prev)),
        "probs_ratio": 1.0,
        "global_valid_toks": float(len(gen)),
    }
    return log_data, metrics


def validate(rng: np.random.Generator, step: int) -> dict:
    content, rewards = [], []
    for q in PROMPTS * 2:
        solved = rng.random() < 0.3 + 0.04 * step
        content.append([{"role": "user", "content": chat_prompt(q)},
                        {"role": "assistant", "content": ("\\boxed{19}" if solved else "I am not sure") + "<|im_end|>"}])
        rewards.append(1.0 if solved else 0.0)
    return {"content": content, "rewards": rewards}


def write_run(folder: Path, steps: int, diverged_at: int | None = None, seed: int = 0) -> None:
    from torch.utils.tensorboard import SummaryWriter

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    writer = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def log_metrics(metrics: dict, step: int, prefix: str) -> None:
        for name, value in metrics.items():
            writer.add_scalar(f"{prefix}/{name}" if prefix else name, value, step)

    val_period = 5
    v = validate(rng, 0)  # val_at_start: true
    write_jsonl(folder / "val_data_step0.jsonl", v)
    log_metrics({"accuracy": float(np.mean(v["rewards"])), "avg_length": 9.0}, 0, "validation")
    for total_steps in range(steps):
        step = total_steps + 1
        diverged = diverged_at is not None and step >= diverged_at
        log_data, metrics = train_step(rng, total_steps, gens=4, nan_logp=diverged)
        if diverged:
            metrics.update(loss=math.nan, grad_norm=math.nan, gen_kl_error=math.nan)
        if step % val_period == 0 or step == steps:  # val_period, val_at_end
            v = validate(rng, step)
            write_jsonl(folder / f"val_data_step{step}.jsonl", v)
            log_metrics({"accuracy": float(np.mean(v["rewards"])), "avg_length": 9.0}, step, "validation")
        write_jsonl(folder / f"train_data_step{step}.jsonl", log_data)
        log_metrics(metrics, step, "train")
        log_metrics({"total_step_time": 41.5}, step, "timing/train")
    writer.close()


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    write_run(OUT / "exp_001", steps=10)
    write_run(OUT / "diverged", steps=4, diverged_at=3, seed=1)
    for f in sorted(OUT.rglob("*")):
        if f.is_file():
            print(f.relative_to(OUT), f.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
