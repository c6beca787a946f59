"""Make ``tests/fixtures/grpo_run/task``: a reference run that looks like a real GRPO task.

Run it from the repository root, with the ``trl`` extra installed (about 2 minutes on 2 cores)::

    python tools/make_task_record.py                 # pretrain, GRPO, write the record
    python tools/make_task_record.py --summary       # what moved (the README's table)

What it does:

1. **A tokenizer and a policy built in code** (no hub download): the byte-level tokenizer of
   ``tools/make_reference_records.py`` (256 bytes + 4 specials, EOS = ``<|endoftext|>``) and a
   small Qwen3 (hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 256; 156,544 parameters),
   torch seed 11.
2. **Pretraining in code, on a synthetic corpus** (seed 12, 1,200 AdamW steps of 64 sequences,
   lr 3e-3 with warm-up and linear decay, about 75 s): prompts ``Q: a+b=`` with a, b in 0..49, completions teacher-
   forced on the completion only. The corpus is deliberately imperfect, so that the policy
   starts where GRPO has something to do: 70 % ``<answer>a+b</answer>``, 12 % a wrong sum in the
   tags, 10 % the bare sum without tags, 8 % the tagged answer repeated twice (which runs past
   the 24-token completion cap, so it never reaches EOS). Every completion ends with EOS.
3. **GRPO with TRL** (``GRPOTrainer``, seed 13) and two reward functions, ``correctness`` (1 if
   the number inside the first ``<answer>`` tags is a+b, else 0) and ``format`` (1 for exactly
   ``<answer>digits</answer>``, 0.5 for tags with anything around them, else 0): 100 steps of 64
   rollouts (8 prompts x 8 generations, each step new prompts), AdamW at a constant 5e-4,
   beta 0, temperature 1, max completion length 24, ``logging_steps=1``; recorded by
   ``RewardLensTap`` (its defaults: D_t from the next generation and 4 held-out completions per prompt).

What moves (``--summary`` prints it): the exact format rises and completions that start over
after ``</answer>`` (and so miss EOS) fall; correctness does *not* rise in this recording (it
drifts down between the first and the last 20 steps, within noise over the run: the report says
"asked for, not bought"). The policy does not collapse (correctness stays well inside (0, 1)
within steps). A trial with a noisier corpus and the rate 1e-3 saw correctness fall from 0.25 to
0.03 over 100 steps: that is why this corpus and 5e-4.

The basis to read it with is ``examples/features/task.yaml`` (format ok, correct, length in
tokens, ends with EOS, repetition, and the format reward); ``reward-lens report --example task``
uses it. What moves is printed by ``--summary`` (first 20 steps -> last 20 steps, pooled
within-step SD) and quoted in the README, where a test checks the quote against this output.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

DEST = REPO / "tests" / "fixtures" / "grpo_run" / "task"
BASIS = REPO / "examples" / "features" / "task.yaml"
CAP = 24
GEN = dict(steps=100, prompts_per_step=8, generations=8, learning_rate=5e-4, seed=13)
PRE = dict(steps=1200, batch=64, learning_rate=3e-3, seed=12)
MODEL_SEED = 11


def question(a: int, b: int) -> str:
    return f"Q: {a}+{b}="


def corpus_completion(rng: random.Random, a: int, b: int) -> str:
    s = a + b
    u = rng.random()
    if u < 0.70:
        return f"<answer>{s}</answer>"
    if u < 0.82:
        return f"<answer>{s + rng.choice([-3, -2, -1, 1, 2, 3])}</answer>"
    if u < 0.92:
        return f"{s}"
    return f"<answer>{s}</answer><answer>{s}</answer>"


_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_STRICT = re.compile(r"^<answer>\d+</answer>$")


def correctness(completions, answer, **_):
    out = []
    for c, a in zip(completions, answer):
        m = _ANSWER.search(c)
        out.append(1.0 if m and int(m.group(1)) == int(a) else 0.0)
    return out


def format(completions, **_):  # noqa: A001 -- TRL names a reward by its function's __name__
    return [1.0 if _STRICT.match(c) else 0.5 if _ANSWER.search(c) else 0.0 for c in completions]


def build_model(tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(MODEL_SEED)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return Qwen3ForCausalLM(config)


def pretrain(model, tokenizer) -> dict[str, float]:
    """Teacher-forced next-token training on the synthetic corpus (completion tokens only)."""
    import torch

    rng = random.Random(PRE["seed"])
    torch.manual_seed(PRE["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=PRE["learning_rate"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100) * max(0.05, 1 - i / PRE["steps"]))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.train()
    t0 = time.monotonic()
    for _ in range(PRE["steps"]):
        rows = []
        for _ in range(PRE["batch"]):
            a, b = rng.randrange(50), rng.randrange(50)
            p = tokenizer(question(a, b), add_special_tokens=False)["input_ids"]
            c = tokenizer(corpus_completion(rng, a, b), add_special_tokens=False)["input_ids"] + [eos]
            rows.append((p, c))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), pad)
        labels = torch.full((len(rows), width), -100)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
            att[i, :len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return {"loss": float(loss.detach()), "seconds": time.monotonic() - t0}


def prompts(n: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    qs, ans = [], []
    for _ in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        qs.append(question(a, b))
        ans.append(a + b)
    return qs, ans


def grpo(workdir: Path, record: Path, steps: int) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from make_reference_records import build_tokenizer
    from reward_lens.taps.trl import RewardLensTap

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    stats = pretrain(model, tokenizer)
    print(f"pretrained: loss {stats['loss']:.3f} in {stats['seconds']:.0f} s")
    initial = workdir / "pretrained"
    model.save_pretrained(initial)
    tokenizer.save_pretrained(initial)
    per_step = GEN["prompts_per_step"] * GEN["generations"]
    qs, ans = prompts(steps * GEN["prompts_per_step"], GEN["seed"])
    args = GRPOConfig(
        output_dir=str(workdir / "trl_output"), max_steps=steps, per_device_train_batch_size=per_step,
        num_generations=GEN["generations"], max_completion_length=CAP, learning_rate=GEN["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=1.0, logging_steps=1,
        log_completions=False, bf16=False, report_to="none", use_cpu=True, seed=GEN["seed"],
        save_strategy="no", disable_tqdm=True, shuffle_dataset=False,
    )
    torch.manual_seed(GEN["seed"])
    trainer = GRPOTrainer(model=str(initial), reward_funcs=[correctness, format], args=args,
                          train_dataset=Dataset.from_dict({"prompt": qs, "answer": ans}), processing_class=tokenizer)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # TRL's per-step metric dicts; the record has what matters
    RewardLensTap.attach(trainer, record, flush_every=10, save_initial_checkpoint=True, budget=None,
                         overwrite=True, model_description=(
                             "tiny Qwen3 (hidden 64, 2 layers, 260-token byte vocabulary), pretrained in code on "
                             "synthetic arithmetic (tools/make_task_record.py)"))
    t0 = time.monotonic()
    trainer.train()
    print(f"GRPO: {steps} steps in {time.monotonic() - t0:.0f} s")


def make(dest: Path, steps: int) -> None:
    from reward_lens.record.reader import open_run

    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "record"
        grpo(Path(tmp), staging, steps)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(staging, dest)
    print(f"task: {dest} {open_run(dest).run_id}")


def summary(path: Path, basis_path: Path = BASIS, k: int = 20) -> list[tuple[str, str, float, float, float]]:
    """Each feature's mean over the first k steps and the last k steps, and the pooled
    within-step SD: (name, unit, first, last, sd)."""
    import numpy as np

    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.price import steps_from_run, whole_run
    from reward_lens.record.reader import open_run

    run = open_run(path)
    basis = load_basis(basis_path)
    samples = steps_from_run(run, basis, window=whole_run(run))
    first = np.vstack([s.z for s in samples[:k]])
    last = np.vstack([s.z for s in samples[-k:]])
    sd = np.sqrt(np.mean([s.z.var(axis=0, ddof=1) for s in samples], axis=0))
    units = basis.units()
    return [(n, units[n], float(first[:, i].mean()), float(last[:, i].mean()), float(sd[i]))
            for i, n in enumerate(basis.names)]


def summary_table(path: Path = DEST) -> str:
    rows = ["| feature | unit | first 20 steps | last 20 steps | pooled within-step SD |", "|---|---|---|---|---|"]
    for n, unit, a, b, sd in summary(path):
        rows.append(f"| `{n}` | {unit} | {a:.3g} | {b:.3g} | {sd:.2g} |")
    return "\n".join(rows)


def cost_table(path: Path = DEST) -> str:
    """What the report says on the task record, read in the task basis: the cost book's
    headline, and each behaviour's share of KL_min over the updates whose movement is resolved
    (the report's first screen: ``Report.glance``)."""
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record.reader import open_run
    from reward_lens.report import build_report

    report = build_report(open_run(path), features=load_basis(BASIS))
    (book,) = [b for b in report.books if b.id == "cost"]
    g = report.glance
    shares = {s.feature: s.share for s in g.shares}
    units = {f.name: f.unit for f in report.basis.features}
    lines = [f"cost book: {book.headline}", "",
             f"| feature | unit | share of KL_min over the {g.resolved} resolved updates |", "|---|---|---|"]
    for name in units:
        lines.append(f"| `{name}` | {units[name]} | {round(100 * shares.get(name, 0.0))} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=GEN["steps"], help="GRPO steps (fewer for a smoke run)")
    p.add_argument("--out", type=Path, default=DEST)
    p.add_argument("--summary", action="store_true", help="print what moved (the README's table)")
    a = p.parse_args(argv)
    if a.summary:
        print(summary_table(a.out))
        print()
        print(cost_table(a.out))
    else:
        make(a.out, a.steps)


if __name__ == "__main__":
    main()
