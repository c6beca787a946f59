"""The TRL tap's cost per optimizer step at the reference records' tiny size, as a ratio to the
untapped step, per estimator, budget and number of extra completions.

Runs the same tiny GRPO training (the reference records' tiny Qwen3, 260-token byte
vocabulary, 8 completions of 32 tokens per step) without the tap and with it for each D_t
estimator, in one process. Two measurements, because a single training per configuration
is at the mercy of the machine (repeated, the untapped step ranged 0.98-1.52x itself):

* **interleaved wall time**: ``--reps`` rounds (default 5), each training every
  configuration once in a rotated order; per round, each tapped configuration's median step
  time is divided by that round's untapped median. Prints the median ratio and its range.
* **the tap's own time**: its core's clock per step (the record's ``tap_seconds``: its
  callbacks, its scoring, and the extra completions' marginal share of the generation), divided
  by the untapped step: what the tap adds, whatever else the machine does.

The first steps of each run are dropped (warm-up).
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
                   tap: dict | None = None, own: list[float] | None = None) -> float:
    """Median seconds per step (after WARMUP) of a tiny GRPO training, with the tap attached
    with ``tap`` as its keyword arguments, or without the tap when ``tap`` is None. With
    ``own``, the tap's own seconds per step (its core's clock, the record's ``tap_seconds``) are
    appended."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.record import open_run
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
        if own is not None and tap is not None:
            own.extend(open_run(tmp / "rec").telemetry.column("tap_seconds").to_pylist()[WARMUP:])
        return statistics.median(timer.times[WARMUP:])


CONFIGS = {"untapped": None,
           "tap, no estimator": {"estimator": None},
           "tap, default budget (0.10)": {},
           "tap, budget=None, one-sided (heldout=0)": {"budget": None, "heldout": 0},
           "tap, budget=None, heldout=2": {"budget": None, "heldout": 2},
           "tap, budget=None, heldout=4": {"budget": None, "heldout": 4},
           "tap, exact": {"estimator": "exact", "heldout": 0, "budget": None}}


def run(name: str, own: list[float] | None = None) -> float:
    if name == "untapped":
        return timed_training()
    return timed_training(tap={**CONFIGS[name], "n_exact": 8, "flush_every": 8}, own=own)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--save", action="store_true", help="also write the output to bench/results/tap_overhead.txt")
    a = ap.parse_args()
    run("untapped")  # throwaway: the first training in a process pays one-off initialisation
    names = list(CONFIGS)
    times: dict[str, list[float]] = {n: [] for n in names}
    own: dict[str, list[float]] = {n: [] for n in names if n != "untapped"}
    for rep in range(a.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotated: no configuration always first
        for n in order:
            times[n].append(run(n, own.get(n)))
    base = times["untapped"]
    lines = [f"untapped step: median {statistics.median(base) * 1e3:.0f} ms over {a.reps} interleaved rounds "
             f"(round medians {min(base) * 1e3:.0f}-{max(base) * 1e3:.0f} ms)"]
    for n in names[1:]:
        ratios = [t / b for t, b in zip(times[n], base)]
        inside = statistics.median(own[n]) / statistics.median(base)
        lines.append(f"{n:40s}: wall ratio median {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-"
                     f"{max(ratios):.2f}x); the tap's own time {statistics.median(own[n]) * 1e3:.0f} ms per step = "
                     f"{inside:.2f} of an untapped step")
    text = "\n".join(lines)
    print(text)
    if a.save:
        out = REPO / "bench" / "results" / "tap_overhead.txt"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
