"""The tap's forward passes over the rollouts at a size where forward passes dominate, in
forward-pass equivalents (issue 30's target: at most 1.1 per rollout beyond what the trainer
already does, the held-out draw measured separately).

A Qwen3 of about 31M parameters built from a config in code (10 layers, hidden 512, the
reference records' 260-token byte vocabulary; seeded, nothing downloaded), trained by TRL's
GRPOTrainer on 64 rollouts a step (8 prompts x 8) of up to 64 tokens, on the CPU. In one
process, interleaved over ``--rounds`` rounds, each round trains once per configuration:

* untapped;
* the tap with ``heldout=0`` and ``loss_forward=True`` (the default way of scoring the
  rollouts: pi_{t+1}'s side from TRL's own loss forward, pi_t's by one pass of the tap);
* the same with ``loss_forward=False`` (a pass of the tap's own for each policy);
* the tap with ``heldout=4`` (the default), for the held-out draw's cost.

Two numbers per configuration: the wall ratio to the untapped step of the same round, and
the time spent inside the tap's methods per step divided by the time of one no-gradient
forward pass over the step's 64 rollouts, measured in the same process on the same batch
shape (a "forward-pass equivalent"). The first step of each training is dropped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import make_reference_records as gen  # noqa: E402
from tap_overhead import TAP_METHODS, Timer, _time_inside  # noqa: E402

PROMPTS = ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")
COMPLETION = 64


def build_model(tok, seed: int = 1):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                         max_position_embeddings=256, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id)
    return Qwen3ForCausalLM(config)


def forward_pass_seconds(model, tok, repeats: int = 3) -> float:
    """One no-gradient forward pass over 64 sequences of a 2-token prompt and 64 tokens."""
    import torch

    ids = torch.randint(0, len(tok) - 8, (len(PROMPTS) * 8, 2 + COMPLETION))
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def training(init: Path, tok, steps: int, tap: dict | None) -> tuple[float, float]:
    """Median seconds per step (first dropped) and median seconds inside the tap per step."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.taps.trl import RewardLensTap

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=str(Path(tmp) / "out"), max_steps=steps, per_device_train_batch_size=64,
                          num_generations=8, max_completion_length=COMPLETION, learning_rate=1e-5, logging_steps=1,
                          bf16=False, report_to="none", use_cpu=True, seed=1, save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=str(init), reward_funcs=[gen.lowercase], args=args,
                              train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}), processing_class=tok)
        timer, spent = Timer(), [0.0]
        if tap is not None:
            t = RewardLensTap.attach(trainer, Path(tmp) / "rec", flush_every=100, **tap)
            for name in TAP_METHODS:
                _time_inside(t, name, spent)
        trainer.add_callback(timer)
        timer.spent = spent
        trainer.train()
        return statistics.median(timer.times[1:]), statistics.median(timer.own[1:])


CONFIGS = {"untapped": None,
           "tap heldout=0, loss_forward (default scoring)": {"heldout": 0},
           "tap heldout=0, a pass of its own per policy": {"heldout": 0, "loss_forward": False},
           "tap heldout=4 (default)": {"heldout": 4}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = gen.build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init"
        model = build_model(tok)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(init)
        tok.save_pretrained(init)
        fwd = forward_pass_seconds(model, tok)
        names = list(CONFIGS)
        step: dict[str, list[float]] = {n: [] for n in names}
        inside: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                s, own = training(init, tok, a.steps, CONFIGS[n])
                step[n].append(s)
                inside[n].append(own)
        fwd_after = forward_pass_seconds(model, tok)
    unit = statistics.median([fwd, fwd_after])
    base = step["untapped"]
    print(f"Qwen3 {n_params / 1e6:.1f}M parameters, 64 rollouts x up to {COMPLETION} tokens a step, "
          f"{a.rounds} interleaved rounds of {a.steps} steps (first dropped)")
    print(f"one no-gradient forward pass over the step's rollouts: {unit:.2f} s (before {fwd:.2f}, after "
          f"{fwd_after:.2f}); untapped step: median {statistics.median(base):.1f} s "
          f"({min(base):.1f}-{max(base):.1f})")
    for n in names[1:]:
        ratios = [s / b for s, b in zip(step[n], base)]
        own = statistics.median(inside[n])
        print(f"{n:48s}: wall ratio {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
              f"inside the tap {own:.2f} s a step = {own / unit:.2f} forward-pass equivalents")


if __name__ == "__main__":
    main()
