"""The TRL tap's cost per optimizer step, as a ratio to the untapped step, per estimator.

Runs the same tiny GRPO training (the reference records' tiny Qwen3, 260-token byte
vocabulary, 8 completions of 32 tokens per step) without the tap and with it for each D_t
estimator, in one process, and prints median seconds per step and the ratios. The first
steps of each run are dropped (warm-up).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

import make_reference_records as gen  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

STEPS, WARMUP = 24, 4


class Timer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self.t0 = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)


def timed_training(*, batch: int = 8, prompts=("ab", "cd"), lr: float = 1e-3, steps: int = STEPS,
                   tap: dict | None = None) -> float:
    """Median seconds per step (after WARMUP) of a tiny GRPO training, with the tap attached
    with ``tap`` as its keyword arguments, or without the tap when ``tap`` is None."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.taps.trl import RewardLensTap

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = gen.build_tokenizer()
        model = gen.build_model(len(tok), 1, tok)
        model.save_pretrained(tmp / "init")
        tok.save_pretrained(tmp / "init")
        args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=steps, per_device_train_batch_size=batch,
                          num_generations=8, max_completion_length=32, learning_rate=lr, logging_steps=1,
                          bf16=False, report_to="none", use_cpu=True, seed=1, save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=str(tmp / "init"), reward_funcs=[gen.lowercase], args=args,
                              train_dataset=Dataset.from_dict({"prompt": list(prompts)}), processing_class=tok)
        timer = Timer()
        if tap is not None:
            RewardLensTap.attach(trainer, tmp / "rec", **tap)
        trainer.add_callback(timer)  # after the tap: its on_step_end (flushes) runs inside the timing
        trainer.train()
        return statistics.median(timer.times[WARMUP:])


def run(estimator: str | None, tap: bool) -> float:
    return timed_training(tap={"estimator": estimator, "n_exact": 8, "flush_every": 8} if tap else None)


def main() -> None:
    run(None, tap=False)  # throwaway: the first training in a process pays one-off initialisation
    base = run(None, tap=False)
    print(f"untapped step: {base * 1e3:.0f} ms (median of {STEPS - WARMUP} steps)")
    for est in (None, "rollout", "exact"):
        t = run(est, tap=True)
        print(f"tap, estimator={est!s:8s}: {t * 1e3:.0f} ms per step, ratio {t / base:.2f}x")


if __name__ == "__main__":
    main()
