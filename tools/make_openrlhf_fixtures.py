"""Write the OpenRLHF fixtures: real TensorBoard event files, as OpenRLHF's own logger writes them.

OpenRLHF does not install on CPU (it needs flash-attn and deepspeed), and it logs its metrics to
TensorBoard or W&B only. So the writer here is OpenRLHF's ``TensorboardLogger`` written out against
its source (github.com/OpenRLHF/OpenRLHF at 3c3be6234e0cb353e76bb8019947db9dfe99fca7):

* openrlhf/utils/logging_utils.py:112-138 -- ``torch.utils.tensorboard.SummaryWriter`` at
  ``os.path.join(args.logger.tensorboard_dir, args.logger.wandb.run_name)`` (line 119);
  ``log_train`` writes every non-None value of the step's status as ``train/{k}`` with
  ``add_scalar`` at ``global_step`` (line 130), and ``generated_samples`` as text (line 128);
  ``log_eval`` writes ``eval/{k}`` (line 135).
* openrlhf/trainer/ppo_trainer.py:383-389 -- logged when ``global_step % logging_steps == 0``;
  ``global_step`` counts rollout batches from 1 (``train_step`` returns ``global_step + 1``,
  line 263, logged after it, line 556).
* The status keys: ppo_trainer.py:256-263 (timing/*, generated_samples), 412-427
  (``rollout/reward_mean`` ...); openrlhf/trainer/ray/ppo_actor.py:306-405 (``policy_loss``,
  ``actor_lr``, ``actor_grad_norm``, and every ``experience.info`` entry: ``ppo_clip_ratio``,
  ``ppo_kl``, ``vllm_kl``, ``kl``, ``logprobs_diff``, ``reward``, ``return``,
  ``response_length``, ``total_length``); openrlhf/models/loss.py:195-230 (what ``ppo_kl`` and
  ``vllm_kl`` are).

The values are a small GRPO run's, drawn from a fixed seed; the diverged run turns NaN at
global step 4, as a run whose loss blew up logs it (``add_scalar`` writes NaN as it is).

Run: ``python tools/make_openrlhf_fixtures.py`` (needs ``tensorboard``: the ``openrlhf`` extra).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "openrlhf"


class TensorboardLogger:
    """OpenRLHF's logger (logging_utils.py:112-138), its writes verbatim."""

    def __init__(self, tensorboard_dir: Path, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(tensorboard_dir / run_name))

    def log_train(self, global_step: int, logs_dict: dict) -> None:
        generated_samples = logs_dict.get("generated_samples")
        for k, v in logs_dict.items():
            if k == "generated_samples" and v is not None:
                text, reward = generated_samples
                formatted_text = f"Sample:\\n{text}\\n\\nReward: {reward:.4f}"
                self.writer.add_text("train/generated_samples", formatted_text, global_step)
            elif v is not None:
                self.writer.add_scalar(f"train/{k}", v, global_step)

    def log_eval(self, global_step: int, logs_dict: dict) -> None:
        for k, v in logs_dict.items():
            if v is not None:
                self.writer.add_scalar(f"eval/{k}", v, global_step)

    def close(self) -> None:
        self.writer.close()


def status(rng: np.random.Generator, step: int, lr: float, diverged_at: int | None) -> dict:
    """One global step's status dict as PPOTrainer.train_step returns it (GRPO, vLLM IS on,
    --algo.kl.use_loss, actor_lr after the scheduler's step)."""
    nan = diverged_at is not None and step >= diverged_at
    reward = float(np.clip(0.30 + 0.06 * step + rng.normal(0, 0.02), 0, 1))
    s = {
        "policy_loss": math.nan if nan else float(rng.normal(0, 0.01)),
        "actor_lr": lr,
        "actor_grad_norm": math.nan if nan else float(abs(rng.normal(0.4, 0.05))),
        "ppo_clip_ratio": float(abs(rng.normal(0.002, 0.001))),
        "ppo_kl": math.nan if nan else float(rng.normal(0.0, 2e-4)),
        "vllm_kl": float(abs(rng.normal(2e-3, 3e-4))),
        "kl": math.nan if nan else float(abs(rng.normal(1e-3 * step, 2e-4))),
        "logprobs_diff": float(rng.normal(0, 1e-3)),
        "reward": reward,
        "return": reward,
        "response_length": float(180 + 8 * step + rng.normal(0, 5)),
        "total_length": float(260 + 8 * step + rng.normal(0, 5)),
        "timing/make_experience": 12.5,
        "timing/ppo_train": 30.25,
        "timing/broadcast": 1.5,
        "rollout/reward_mean": reward,
        "rollout/reward_std": 0.41,
        "rollout/response_length_mean": float(180 + 8 * step),
        "rollout/truncated_rate": 0.0,
        "rollout/num_samples": 128.0,
        "generated_samples": ["Question: 2 + 3 = ? Answer: 5", reward],
        "timing/generation": 20.0,
        "timing/step_total": 64.25,
    }
    return s


def write_run(folder: Path, run_name: str, steps: int, diverged_at: int | None = None, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    logger = TensorboardLogger(folder, run_name)
    # cosine decay after a 2-step warmup; get_last_lr() after the step is the next step's rate
    peak = 1e-6
    rates = [peak * min(1.0, (i + 1) / 2) * (0.5 * (1 + math.cos(math.pi * i / (steps + 1)))) for i in range(steps + 1)]
    for global_step in range(1, steps + 1):
        logger.log_train(global_step, status(rng, global_step, rates[global_step], diverged_at))
        if global_step % 2 == 0:  # --eval.steps 2
            logger.log_eval(global_step, {"eval_gsm8k_pass1": 0.40 + 0.02 * global_step, "eval_gsm8k_pass4": 0.61})
    logger.close()


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    write_run(OUT / "run", "grpo_qwen", steps=5)
    write_run(OUT / "diverged", "grpo_qwen_lr1e-4", steps=5, diverged_at=4, seed=1)
    for f in sorted(OUT.rglob("events.out.tfevents.*")):
        print(f.relative_to(OUT), f.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
