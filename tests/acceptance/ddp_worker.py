"""One rank of a real data-parallel TRL GRPO run with the reward-lens tap (launched by
``torchrun --nproc_per_node 2`` from ``test_trl_tap_distributed.py``; gloo on CPUs): DDP, or
with ``fsdp2`` FSDP2 -- the model loaded by transformers with ``distributed_config`` (its
``fully_shard`` plan: every parameter a DTensor holding half of it on each rank), which TRL
trains as it is (accelerate does not wrap a model transformers already sharded).

Each rank writes what its reward function saw (``seen-RANK.jsonl``: one line per generation
call) and what the tap estimated (``estimates-RANK.json``), so the test can check the record
against what every process actually generated. TRL saves a checkpoint after every step, so
the test can recompute D_t from the weights alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import make_reference_records as gen  # noqa: E402


def main(tmp: Path, steps: int, estimator: str = "independent", ga: int = 1, fsdp2: bool = False) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.taps.trl import RewardLensTap

    rank = int(os.environ["RANK"])
    seen = open(tmp / f"seen-{rank}.jsonl", "w")
    held = open(tmp / f"heldout-{rank}.jsonl", "w")  # the tap's held-out completions, scored by the same function

    def lowercase(completions, prompts=None, **kw):
        name = "heldout" if kw.get("reward_lens_heldout") else "seen"
        (held if name == "heldout" else seen).write(json.dumps({"prompts": list(prompts),
                                                                "completions": list(completions)}) + "\n")
        (held if name == "heldout" else seen).flush()
        return gen.lowercase(completions)

    tok = gen.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=steps, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=16, learning_rate=1e-2, beta=0.0, logging_steps=1, bf16=False,
                      report_to="none", use_cpu=True, seed=3, save_strategy="steps", save_steps=1,
                      save_only_model=True, disable_tqdm=True, gradient_accumulation_steps=ga)
    if rank == 0:
        model = gen.build_model(len(tok), 3, tok)
        model.save_pretrained(tmp / "init")
        tok.save_pretrained(tmp / "init")
    dist.barrier()
    model = str(tmp / "init")
    if fsdp2:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(tmp / "init", dtype=torch.float32,
                                                     distributed_config=DistributedConfig(fsdp_size=2))
        args.save_strategy = "no"  # the full weights of every step are gathered by the callback below
    trainer = GRPOTrainer(model=model, reward_funcs=[lowercase], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]}), processing_class=tok)
    tap = RewardLensTap.attach(trainer, tmp / "rec", flush_every=2, estimator=estimator, n_exact=16, budget=None)
    if fsdp2:
        trainer.add_callback(FullWeights(trainer, tmp, rank))
    trainer.train()
    if fsdp2:
        (tmp / f"snapshot-{rank}.json").write_text(json.dumps({"bytes": tap.snapshot_bytes}))
    (tmp / f"estimates-{rank}.json").write_text(json.dumps(
        {t: {k: {"mean": e.mean, "se": e.se, "n": e.n} for k, e in est.items()} for t, est in tap.estimates.items()}))
    seen.close()
    held.close()
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception"); everything is written, so leave without it
    os._exit(0)


class FullWeights(TrainerCallback):
    """Under FSDP2, at the start of every step and at the end: how each parameter is laid out on
    this rank (DTensor or not, local and global sizes), and pi_t's full weights gathered from the
    shards (every rank takes part; rank 0 saves them), to recompute D_t and the update norm from
    the weights alone."""

    def __init__(self, trainer, tmp, rank):
        self.trainer, self.tmp, self.rank = trainer, tmp, rank
        self.layout = {}

    def _keep(self, step):
        import torch

        named = dict(self.trainer.model.named_parameters())
        self.layout[step] = {n: [type(p).__name__, p.to_local().numel() if hasattr(p, "to_local") else p.numel(),
                                 p.numel()] for n, p in named.items()}
        full = {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                for n, p in named.items()}
        if self.rank == 0:
            torch.save(full, self.tmp / f"full-{step}.pt")
        (self.tmp / f"layout-{self.rank}.json").write_text(json.dumps(self.layout))

    def on_step_begin(self, args, state, control, **kw):
        self._keep(state.global_step)

    def on_train_end(self, args, state, control, **kw):
        self._keep(state.global_step)


def fsdp_on_cpu(tmp: Path, version: int | None) -> None:
    """TRL's own run of a config with `fsdp` (and ``fsdp_config.fsdp_version`` = ``version``
    where given) and `use_cpu`, no tap: "trained", or what it raised, written to
    ``fsdp-cpu-RANK.txt`` (what the audit says of these configs; this is the check)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rank = int(os.environ["RANK"])
    tok = gen.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
                      save_strategy="no", disable_tqdm=True, fsdp="full_shard",
                      fsdp_config=None if version is None else {"fsdp_version": version})
    if rank == 0:
        gen.build_model(len(tok), 3, tok).save_pretrained(tmp / "init")
    dist.barrier()
    outcome = "trained"
    try:  # (an error at the trainer's creation, too)
        GRPOTrainer(model=str(tmp / "init"), reward_funcs=[gen.lowercase], args=args, processing_class=tok,
                    train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]})).train()
    except Exception as e:  # the outcome is what the test reads
        outcome = f"{type(e).__name__}: {e}"
    (tmp / f"fsdp-cpu-{rank}.txt").write_text(outcome)
    os._exit(0)


if __name__ == "__main__":
    # ddp_worker.py TMP STEPS [ESTIMATOR [GRADIENT_ACCUMULATION [fsdp2]]]; ddp_worker.py TMP fsdp-on-cpu VERSION|none
    args = sys.argv[1:]
    if args[1] == "fsdp-on-cpu":
        fsdp_on_cpu(Path(args[0]), None if args[2] == "none" else int(args[2]))
    else:
        main(Path(args[0]), int(args[1]), args[2] if len(args) > 2 else "independent",
             int(args[3]) if len(args) > 3 else 1, len(args) > 4 and args[4] == "fsdp2")
