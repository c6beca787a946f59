"""The tap's price at a size where forward passes and decoding dominate: its wall-time ratio to
an untapped step, and its own time as a share of one, per cost budget (issue 38's targets: the
default tap at most 1.10x an untapped step, its own time at most 0.10 of one).

A Qwen3 of about 31.7M parameters built from a config in code (10 layers, hidden 512, the
reference records' 260-token byte vocabulary; seeded, nothing downloaded), trained by TRL's
GRPOTrainer on 64 rollouts a step (8 prompts x 8) of up to 64 tokens, on the CPU. In one process,
interleaved over ``--rounds`` rounds (each round trains every configuration once, in a rotated
order):

* untapped;
* the tap with its default budget (0.10 of an untapped step);
* the tap with ``budget=None`` (every step pair measured whole: 4 completions per prompt group
  from each policy);
* the tap with two other budgets (0.05 and 0.25).

Per configuration: the median over rounds of (mean tapped step / mean untapped step of the
same round), with its range; the tap's own time per step, its mean over the timed steps (the
core's clock, recorded in the telemetry as ``tap_seconds``: its callbacks, its scoring, and the
extra completions' marginal share of the trainer's generation) as a share of the untapped step
and in forward-pass equivalents (one no-gradient forward pass over the step's 64 rollouts, timed
in the same process); and what the budget bought: the step pairs it measured of those timed, and
a measured pair's shape (prompt groups of 8, completions per group and policy). Means, not
medians: since stop 66 a budget measures whole pairs on a share of the steps, so its cost lands
on some steps and not others, and a median step is an unmeasured one. The timed window must then
hold several measured pairs: at the default about one step in seven is measured, so 30 timed
steps hold four or five. The first ``--skip`` steps of each training are dropped: warm-up, and
the first two step pairs, which the tap measures whole to learn its unit costs.

    python bench/tap_forward.py --rounds 2 --steps 33 --save   # also writes bench/results/tap_forward.txt
    python bench/tap_forward.py --configs untapped default everything   # a subset, by the names' first words
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

import make_reference_records as gen  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

PROMPTS = ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")
COMPLETION = 64
RESULTS = REPO / "bench" / "results" / "tap_forward.txt"


class Timer(TrainerCallback):
    """Each optimizer step's wall time (on_step_begin to on_step_end: generation included)."""

    def __init__(self):
        self.times: list[float] = []
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)


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


def training(init: Path, tok, steps: int, skip: int, tap: dict | None) -> dict:
    """Mean seconds per step after ``skip``; with the tap, the mean of its recorded tap_seconds
    over the same steps, the step pairs it measured among them, and a measured pair's shape."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.record import open_run
    from reward_lens.taps.trl import RewardLensTap

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=str(Path(tmp) / "out"), max_steps=steps, per_device_train_batch_size=64,
                          num_generations=8, max_completion_length=COMPLETION, learning_rate=1e-5, logging_steps=1,
                          bf16=False, report_to="none", use_cpu=True, seed=1, save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=str(init), reward_funcs=[gen.lowercase], args=args,
                              train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}), processing_class=tok)
        timer = Timer()
        if tap is not None:
            RewardLensTap.attach(trainer, Path(tmp) / "rec", flush_every=100, **tap)
        trainer.add_callback(timer)
        trainer.train()
        out = {"step": statistics.fmean(timer.times[skip:])}
        if tap is not None:
            t = open_run(Path(tmp) / "rec").telemetry.to_pydict()
            rows = [i for i, s in enumerate(t["step"]) if skip <= s < steps - 1]  # the last pair never completes
            measured = [i for i in rows if (t["tap_groups"][i] or 0) > 0]
            out["tap"] = statistics.fmean(t["tap_seconds"][i] or 0.0 for i in rows)
            out["pairs"], out["rows"] = len(measured), len(rows)
            out["groups"] = statistics.median(t["tap_groups"][i] for i in measured) if measured else 0
            out["per_group"] = statistics.median(t["tap_per_group"][i] or 0 for i in measured) if measured else 0
        return out


CONFIGS = {"untapped": None,
           "tap, default budget (0.10)": {},
           "tap, budget=None (everything)": {"budget": None},
           "tap, budget=0.05": {"budget": 0.05},
           "tap, budget=0.25": {"budget": 0.25}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=33)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--configs", nargs="*", help="only these, by the first word after 'tap, ' (untapped, default, "
                    "budget=None is 'everything', budget=0.05, budget=0.25); untapped always runs")
    ap.add_argument("--save", action="store_true", help=f"also write the output to {RESULTS.relative_to(REPO)}")
    a = ap.parse_args()
    tok = gen.build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init"
        model = build_model(tok)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(init)
        tok.save_pretrained(init)
        fwd = forward_pass_seconds(model, tok)
        names = [n for n in CONFIGS if n == "untapped" or not a.configs or any(c in n for c in a.configs)]
        got: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                got[n].append(training(init, tok, a.steps, a.skip, CONFIGS[n]))
        fwd_after = forward_pass_seconds(model, tok)
    unit = statistics.median([fwd, fwd_after])
    base = [x["step"] for x in got["untapped"]]
    lines = [f"Qwen3 {n_params / 1e6:.1f}M parameters, 64 rollouts x up to {COMPLETION} tokens a step, "
             f"{a.rounds} interleaved rounds of {a.steps} steps (first {a.skip} dropped)",
             f"one no-gradient forward pass over the step's rollouts: {unit:.2f} s; untapped step: mean "
             f"{statistics.median(base):.1f} s (rounds {min(base):.1f}-{max(base):.1f})"]
    for n in names[1:]:
        ratios = [x["step"] / b for x, b in zip(got[n], base)]
        share = [x["tap"] / b for x, b in zip(got[n], base)]
        own = statistics.median(x["tap"] for x in got[n])  # each round's mean over its timed steps
        pairs, rows = sum(x["pairs"] for x in got[n]), sum(x["rows"] for x in got[n])
        shaped = [x for x in got[n] if x["pairs"]]
        groups = statistics.median(x["groups"] for x in shaped) if shaped else 0
        k = statistics.median(x["per_group"] for x in shaped) if shaped else 0
        lines.append(f"{n:32s}: wall ratio {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
                     f"the tap's own time {statistics.median(share):.3f} of an untapped step "
                     f"({own:.2f} s = {own / unit:.2f} forward-pass equivalents); measured {pairs} of {rows} step "
                     f"pairs timed ({100 * pairs / max(rows, 1):.0f} %)" + (
                         f", a measured pair {groups:g} of 8 groups x {k:g} completions per group and policy" if shaped
                         else ": the window holds no measured pair, so this is not the budget's cost"))
    text = "\n".join(lines)
    print(text)
    if a.save:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text + "\n")


if __name__ == "__main__":
    main()
