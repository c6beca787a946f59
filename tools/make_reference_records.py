"""Make the reference GRPO records in ``tests/fixtures/grpo_run/`` with a real TRL run.

Run it from the repository root, with the ``trl`` extra installed::

    python tools/make_reference_records.py            # both records (~1 min on 2 cores)
    python tools/make_reference_records.py --only short --steps 4 --out /tmp/x   # a smoke run

What it does, for each record:

1. Builds a tiny Qwen3 policy **in code** (no hub download): the shape of
   ``trl-internal-testing/tiny-Qwen3ForCausalLM`` (hidden 8, intermediate 32, 2 layers,
   4 attention heads, 2 KV heads, head_dim 128, untied embeddings) with a 260-token
   byte-level vocabulary instead of Qwen's 151,669 tokens (30,824 parameters instead of
   2,453,368), so a step takes ~0.1 s on 2 CPU cores instead of ~3 s. The tokenizer is a
   ByteLevel BPE with no merges plus four specials, built with ``tokenizers``. Weights are
   initialised with a fixed torch seed and saved with ``save_pretrained`` before TRL sees
   them (TRL rebuilds a reference model from the path when beta > 0).
2. Runs TRL's ``GRPOTrainer`` on the CPU with TRL's defaults for everything the cost book
   looks at: optimizer ``adamw_torch_fused`` (transformers' default with torch >= 2.8),
   ``beta = 0.0`` (so TRL computes no KL at all), gradient clipping at max_grad_norm 1.0;
   and ``logging_steps=1``, ``log_completions=True``, ``bf16=False``, ``report_to="none"``,
   8 generations per prompt, one prompt per step. The learning rate is raised to 1e-2 (``long``) and 5e-2 (``short``), with TRL's default
   linear decay to 0
   (TRL's default 1e-6 would move nothing in 200 steps).
3. Saves the trainer's arguments as ``grpo_config.json`` beside TRL's output (TRL itself
   writes them only as a pickle, ``training_args.bin``, which reward-lens does not load).
4. Converts TRL's output directory into a record with ``reward_lens.record.importers.trl_output``,
   the same path a user takes (``reward-lens import trl``), storing the starting
   checkpoint in the record.

The records differ in seed, prompts and reward: ``long`` (200 steps) rewards the fraction
of lowercase ASCII letters; ``short`` (60 steps) rewards the fraction of ASCII digits.

What moves. A random-initialised policy rarely emits EOS (p ~ 1/260 per token, so most
completions run to the 32-token cap), and TRL's completions table carries no token counts,
so length in tokens is not in the default feature basis. Random bytes decode to text in which invalid UTF-8 collapses to
U+FFFD, so the character length and the character-class fractions vary within a step.
Measured on the records as generated here (mean over the first 20 steps -> the last 20
steps; pooled within-step SD in brackets), printed by ``--summary``:

    long (lowercase reward)            short (digit reward)
    frac_lower     0.110 -> 0.903 (0.073)   frac_digit     0.074 -> 0.996 (0.053)
    frac_nonascii  0.468 -> 0.054 (0.086)   frac_nonascii  0.450 -> 0.001 (0.069)
    frac_punct     0.136 -> 0.012 (0.057)   frac_punct     0.136 -> 0.001 (0.063)
    frac_upper     0.106 -> 0.010 (0.048)   frac_lower     0.102 -> 0.001 (0.039)
    len_chars      29.1  -> 31.8  (4.6)     len_chars      27.8  -> 32.0  (3.8)

Every feature of the default basis varies within steps; at least five move by many
within-step SDs over each run. Re-measure after changing anything above.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VOCAB_SPECIALS = ["<|endoftext|>", "<|pad|>", "<|bos|>", "<|unk|>"]

RECORDS = {
    "long": dict(seed=1234, steps=200, reward="lowercase", learning_rate=1e-2, prompts=[
        "The quick brown fox", "Once upon a time", "In the beginning", "Dear diary,",
        "Hello, world", "It was a dark and stormy night", "Call me Ishmael.", "To be or not",
    ]),
    "short": dict(seed=777, steps=60, reward="digits", learning_rate=5e-2, prompts=[
        "Count: ", "Numbers follow", "The year was", "Phone:", "Total =", "Room no.",
    ]),
    # Written by the reward-lens TRL tap while training (not imported): 256 rollouts per step
    # (32 prompts x 8) and a constant learning rate, so that features move by several
    # standard errors per step and the cost book can be computed from the record alone.
    "tapped": dict(seed=4242, steps=30, reward="lowercase", learning_rate=5e-2, batch=256,
                   lr_scheduler_type="constant", tap=True,
                   prompts=[f"{w} {i}" for i in range(8) for w in ("Note", "Item", "Line", "Word")]),
    # The paired ledger's reference: realistic settings -- 64 rollouts per step as 8 prompts x
    # 8 generations, AdamW at a constant 1e-2 (moves the features without collapsing them in
    # 80 steps), written by the tap, which scores each step's rollouts under the previous
    # policy too (logp_prev, kl_prev).
    "paired": dict(seed=2024, steps=80, reward="lowercase", learning_rate=1e-2, batch=64,
                   lr_scheduler_type="constant", tap=True,
                   prompts=[f"{w} {i}" for i in range(16) for w in ("Note", "Item", "Line", "Word")]),
}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(VOCAB_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   bos_token="<|bos|>", unk_token="<|unk|>")


def build_model(vocab_size: int, seed: int, tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=8, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return Qwen3ForCausalLM(config)


def lowercase(completions, **_):
    return [sum(c.isascii() and c.islower() for c in s) / max(len(s), 1) for s in completions]


def digits(completions, **_):
    return [sum(c.isascii() and c.isdigit() for c in s) / max(len(s), 1) for s in completions]


REWARDS = {"lowercase": lowercase, "digits": digits}


def train(workdir: Path, *, seed: int, steps: int, reward: str, prompts: list[str],
          learning_rate: float = 1e-2, max_completion_length: int = 32, beta: float = 0.0, batch: int = 8,
          lr_scheduler_type: str = "linear", tap: bool = False, record: Path | None = None) -> tuple[Path, Path]:
    """Run TRL GRPO; return (TRL output dir, starting checkpoint dir). With ``tap``, the
    reward-lens TRL tap writes the record at ``record`` while training."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed, tokenizer)
    initial = workdir / "initial"
    model.save_pretrained(initial)
    tokenizer.save_pretrained(initial)
    out = workdir / "trl_output"
    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, num_generations=8,
        max_completion_length=max_completion_length, learning_rate=learning_rate, beta=beta,
        logging_steps=1, log_completions=True, num_completions_to_print=0, bf16=False,
        report_to="none", use_cpu=True, seed=seed, save_strategy="no", disable_tqdm=True,
        lr_scheduler_type=lr_scheduler_type, warmup_steps=0,
    )
    dataset = Dataset.from_dict({"prompt": prompts})
    trainer = GRPOTrainer(model=str(initial), reward_funcs=[REWARDS[reward]], args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    if tap:
        from reward_lens.taps.trl import RewardLensTap

        RewardLensTap.attach(trainer, record, flush_every=10, save_initial_checkpoint=True, budget=None,
                             overwrite=True, model_description=f"tiny Qwen3 (hidden 8, 2 layers, 260-token byte "
                                                               f"vocabulary), random init, torch seed {seed}")
    trainer.train()
    trainer.save_state()  # trainer_state.json with log_history
    (out / "grpo_config.json").write_text(json.dumps(args.to_dict(), indent=2, default=str))
    return out, initial


def make(name: str, dest: Path, steps: int | None = None) -> None:
    import trl

    from reward_lens.record.importers.trl_output import import_trl

    spec = dict(RECORDS[name])
    if steps is not None:
        spec["steps"] = steps
    if spec.get("tap"):
        from reward_lens.record.reader import open_run

        with tempfile.TemporaryDirectory() as tmp:
            staging = Path(tmp) / "record"
            train(Path(tmp), record=staging, **spec)
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(staging, dest)
        print(f"{name}: {dest} {open_run(dest).run_id}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        out, initial = train(Path(tmp), **spec)
        manifest = import_trl(out, dest, checkpoint=initial, overwrite=True, framework_version=trl.__version__,
                              model_description=f"tiny Qwen3 (hidden 8, 2 layers, 260-token byte vocabulary), "
                                                f"random init, torch seed {spec['seed']}")
    print(f"{name}: {dest} {manifest.run_id}")


def summary(path: Path) -> None:
    import numpy as np

    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run, whole_run
    from reward_lens.record.reader import open_run

    run = open_run(path)
    samples = steps_from_run(run, SurfaceFeatures(), window=whole_run(run))
    z = [s.z for s in samples]
    k = min(20, len(z) // 2)
    first, last = np.vstack(z[:k]), np.vstack(z[-k:])
    sd = np.sqrt(np.mean([s.z.var(axis=0, ddof=1) for s in samples], axis=0))
    for i, n in enumerate(samples[0].names):
        print(f"    {n:14s} {first[:, i].mean():.3g} -> {last[:, i].mean():.3g}   ({sd[i]:.2g})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=sorted(RECORDS))
    p.add_argument("--steps", type=int, help="override the number of steps (smoke runs)")
    p.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "grpo_run")
    p.add_argument("--summary", action="store_true", help="print which features move, per record")
    a = p.parse_args(argv)
    names = [a.only] if a.only else sorted(RECORDS)
    for name in names:
        if a.summary:
            print(name)
            summary(a.out / name)
        else:
            make(name, a.out / name, a.steps)


if __name__ == "__main__":
    main()
