"""Make ``tests/fixtures/grpo_run/windowed``: 64 rollouts a step recorded by the tap at its DEFAULT budget.

Run it from the repository root, with the ``trl`` extra installed::

    python tools/make_window_record.py                 # train, write the record
    python tools/make_window_record.py --out /tmp/w --steps 6   # a smoke run

The recipe is the truth harness's *moderate* regime (tools/truth.py), on another seed: the reference
tiny Qwen3 built in code (tools/make_reference_records.py: hidden 8, 2 layers, 260-token byte
vocabulary, random init), TRL ``GRPOTrainer`` with 8 prompts x 8 generations a step, AdamW at a
constant lr 1e-2, beta 0, completions capped at 32 tokens, two rewards (the lowercase fraction and
``nospace``, 1 - the whitespace fraction), recorded by ``RewardLensTap`` at its default budget (no
``budget=`` argument: 0.1 of an untapped step). It is the kind of run issue 62 measured: at that
budget the tap reads a share of the step pairs, and few single updates resolve from noise, so the
report's first screen leads with windows of consecutive updates
(``measure/decisions.py``, ``headline_of``); tests/acceptance/test_window_headline.py reads it.
It trains in about 9 minutes on 2 shared CPU cores (80 steps, measured here under load).

The committed record was made at stop 66, when a measured pair became the pair ``budget=None``
measures (4 + 4 over every group) on a share of the pairs: here 12 of 79 pairs priced, 4 of them
resolved on their own, and the first screen leads with 2 windows, one of which resolves eta from 0.
At stop 65 the record was 40 steps of the budget as it then was (2 + 2 on a subset of the groups
or on a share of the pairs), which resolved no single update; at stop 66's budget 40 steps of this
recipe price about 6 pairs (the truth harness's moderate run, seed 31, priced 6 of 39), too few for
a window to reach the headline's precision, hence 80 steps.

The budget sizes each pair's measurement from timing, so which groups and pairs are measured differ
from run to run and machine to machine: the committed record is one such run, not reproducible bit
for bit (the test asserts on what the record holds, not on a rerun). No checkpoint is saved.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

SEED = 37  # not the truth harness's moderate seed (31): another run of the same recipe
STEPS = 80  # at stop 66's budget (an eighth to a seventh of the pairs priced): 12 pairs
PROMPTS_PER_STEP, GENERATIONS = 8, 8
LEARNING_RATE = 1e-2
CAP = 32


def train(dest: Path, steps: int = STEPS) -> None:
    import torch
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from make_reference_records import build_model, build_tokenizer, lowercase
    from reward_lens.taps.trl import RewardLensTap
    from truth import nospace

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = build_tokenizer()
        model = build_model(len(tok), SEED, tok)
        initial = work / "initial"
        model.save_pretrained(initial)
        tok.save_pretrained(initial)
        torch.manual_seed(SEED)
        args = GRPOConfig(
            output_dir=str(work / "out"), max_steps=steps, per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
            num_generations=GENERATIONS, max_completion_length=CAP, learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=1.0, logging_steps=1,
            log_completions=False, bf16=False, report_to="none", use_cpu=True, seed=SEED, save_strategy="no",
            disable_tqdm=True)
        prompts = [f"{w} {i}" for i in range(16) for w in ("Note", "Item", "Line", "Word")]
        trainer = GRPOTrainer(model=str(initial), reward_funcs=[lowercase, nospace], args=args,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
        trainer.remove_callback(PrinterCallback)
        staging = work / "record"
        RewardLensTap.attach(trainer, staging, flush_every=10, overwrite=True,
                             model_description=f"tiny Qwen3 (hidden 8, 2 layers, 260-token byte vocabulary), "
                                               f"random init, torch seed {SEED}")
        trainer.train()
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(staging, dest)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "grpo_run" / "windowed")
    p.add_argument("--steps", type=int, default=STEPS)
    a = p.parse_args(argv)
    train(a.out, a.steps)
    from reward_lens.record.reader import open_run

    print(f"windowed: {a.out} {open_run(a.out).run_id}")


if __name__ == "__main__":
    main()
