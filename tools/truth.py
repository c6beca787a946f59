"""The truth harness: every estimate of a tapped run against a truth measured another way.

    python tools/truth.py                       # both regimes (the README's table)
    python tools/truth.py --regime collapse     # one
    python tools/truth.py --cache /tmp/truth    # keep the trained runs and oracle pools there

Two regimes, each a real TRL ``GRPOTrainer`` run with the reward-lens tap attached and every
policy pi_t kept:

* **moderate** -- the reference tiny Qwen3 (built in code, random init), 8 prompts x 8
  generations a step, AdamW at a constant 1e-2, two rewards (lowercase fraction, no spaces),
  read in the surface basis;
* **collapse** -- the task recipe (``tools/make_task_record.py``: the Qwen3 pretrained on
  synthetic arithmetic, the record's own starting checkpoint) at lr 3e-3, where correctness
  collapses to 0 within ten steps and the policy sharpens; read in the task basis.

The oracle. For every step pair (t, t+1) of the run it draws ``n`` fresh completions per
prompt of step t+1 from pi_t *and* from pi_{t+1} (float64 sampling at the trainer's
temperature), scores each under both policies, sums the full-vocabulary token
KL(pi_{t+1} || pi_t) along it, and computes the features. The truth is then:

* dz = mean over prompts of (mean z under pi_{t+1} - mean z under pi_t), plain means;
* D_t = the mean over prompts of the token KL summed along pi_{t+1}'s samples (chain rule);
* KL_min = the I-projection with the book's own definition (one lambda for all prompts, the
  pooled mean constraint, a log-partition per prompt) on both samples combined (multiple
  importance sampling, balance heuristic); eta = KL_min / D_t.

Its own sampling error is reported (standard errors over its samples). The record's numbers
-- what ``reward-lens report`` reads from the tapped record -- are compared cell by cell, and
the estimator's bias and real spread are measured by replicates: the record's sampling
(m rollouts of pi_{t+1} and h held-out completions of pi_t per prompt) redrawn from the
oracle's own samples, the estimator applied to each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

TASK_BASIS = REPO / "examples" / "features" / "task.yaml"
TASK_START = REPO / "tests" / "fixtures" / "grpo_run" / "task" / "checkpoints" / "step-0"


@dataclass(frozen=True)
class Regime:
    name: str
    steps: int
    learning_rate: float
    seed: int
    cap: int  # max completion length
    prompts_per_step: int = 8
    generations: int = 8


REGIMES = {
    "moderate": Regime("moderate", steps=40, learning_rate=1e-2, seed=31, cap=32),
    "collapse": Regime("collapse", steps=60, learning_rate=3e-3, seed=13, cap=24),
}


def nospace(completions, **_):
    """1 - the fraction of ASCII whitespace characters (the moderate regime's second reward)."""
    return [1.0 - sum(c in " \t\n\r\f\v" for c in s) / max(len(s), 1) for s in completions]


@dataclass
class Trained:
    """A finished run: the record, every policy, and what each step's generation saw."""

    regime: Regime
    record: Path
    params: dict[int, dict]  # step -> state dict of pi_step (before step `step`'s update)
    prompts: dict[int, list[dict]]  # step -> one dict per prompt group: prompt_ids, prompt, and the dataset row
    seconds: float = 0.0


def _setup(regime: Regime):
    """Tokenizer, a fresh model builder, reward functions, the dataset and the basis of a regime."""
    from datasets import Dataset

    from make_reference_records import build_model as ref_model, build_tokenizer, lowercase
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.features import SurfaceFeatures

    tok = build_tokenizer()
    if regime.name == "moderate":
        def model():
            return ref_model(len(tok), regime.seed, tok)
        prompts = [f"{w} {i}" for i in range(16) for w in ("Note", "Item", "Line", "Word")]
        data = Dataset.from_dict({"prompt": prompts})
        return tok, model, [lowercase, nospace], data, SurfaceFeatures()
    from make_task_record import correctness, format as fmt, prompts as task_prompts
    from transformers import AutoModelForCausalLM

    def model():
        return AutoModelForCausalLM.from_pretrained(TASK_START)
    qs, ans = task_prompts(regime.steps * regime.prompts_per_step + 64, regime.seed)
    data = Dataset.from_dict({"prompt": qs, "answer": ans})
    return tok, model, [correctness, fmt], data, load_basis(TASK_BASIS)


def train(regime: Regime, workdir: Path, **tap_kwargs) -> Trained:
    """Run TRL GRPO with the tap; keep pi_t at every step and the prompts of every generation."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.taps.trl import RewardLensTap

    tok, build, rewards, data, _ = _setup(regime)
    initial = workdir / "initial"
    m = build()
    m.save_pretrained(initial)
    tok.save_pretrained(initial)
    torch.manual_seed(regime.seed)
    args = GRPOConfig(
        output_dir=str(workdir / "out"), max_steps=regime.steps,
        per_device_train_batch_size=regime.prompts_per_step * regime.generations,
        num_generations=regime.generations, max_completion_length=regime.cap,
        learning_rate=regime.learning_rate, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        temperature=1.0, logging_steps=1, log_completions=False, bf16=False, report_to="none", use_cpu=True,
        seed=regime.seed, save_strategy="no", disable_tqdm=True, shuffle_dataset=regime.name == "moderate")
    trainer = GRPOTrainer(model=str(initial), reward_funcs=rewards, args=args, train_dataset=data,
                          processing_class=tok)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    record = workdir / "record"
    RewardLensTap.attach(trainer, record, flush_every=1000, overwrite=True, **tap_kwargs)
    params: dict[int, dict] = {}
    prompts: dict[int, list[dict]] = {}
    gen = trainer._generate_and_score_completions  # the tap's wrapper: capture around it

    def capture(inputs, *a, **kw):
        out = gen(inputs, *a, **kw)
        g = regime.generations
        rows = []
        for i in range(0, len(inputs), g):
            ids = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
            rows.append({"prompt_ids": ids, **{k: v for k, v in inputs[i].items() if k != "prompt_ids"}})
        prompts[trainer.state.global_step] = rows
        return out

    trainer._generate_and_score_completions = capture

    class Keep(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            params[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

        def on_train_end(self, args_, state, control, **kw):
            params[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    trainer.add_callback(Keep())
    t0 = time.monotonic()
    trainer.train()
    return Trained(regime, record, params, prompts, time.monotonic() - t0)


@dataclass
class Pool:
    """The oracle's samples of one step pair (t, t+1), for the prompts of step t+1: side "a" drawn
    from pi_t, side "b" from pi_{t+1}, ``n`` per prompt each. Per sample: its prompt group, the
    features, log pi_t(y), log pi_{t+1}(y) and the summed token KL(pi_{t+1} || pi_t) along it."""

    step_pair: tuple[int, int]
    names: tuple[str, ...]
    groups: dict[str, "object"] = field(default_factory=dict)  # side -> (N,) int
    z: dict[str, "object"] = field(default_factory=dict)  # side -> (N, k)
    logp_t: dict[str, "object"] = field(default_factory=dict)
    logp_t1: dict[str, "object"] = field(default_factory=dict)
    kl: dict[str, "object"] = field(default_factory=dict)


def _score(pre, post, tok, basis, rewards, prompt: dict, n: int, cap: int, seed: int, policy):
    """n completions of one prompt from ``policy`` (pre or post), scored under both."""
    import numpy as np
    import pyarrow as pa
    import torch

    from reward_lens.measure.whitebox.kl import summed_kl_and_logps
    from reward_lens.measure.whitebox.policy import sample

    pids = prompt["prompt_ids"]
    seqs = sample(policy, pids, n, cap, tok.eos_token_id, tok.pad_token_id, seed)
    ids, mask = seqs.ids, seqs.completion_mask
    with torch.no_grad():
        new = post(input_ids=ids).logits[:, :-1]
        old = pre(input_ids=ids).logits[:, :-1]
    kl, lp_old, lp_new = summed_kl_and_logps(new, old, ids[:, 1:], mask[:, 1:])
    comp_ids = [ids[i, len(pids):][mask[i, len(pids):]].tolist() for i in range(len(ids))]
    texts = [tok.decode(c, skip_special_tokens=True) for c in comp_ids]
    extra = {k: [v] * n for k, v in prompt.items() if k not in ("prompt_ids", "prompt")}
    per_fn = {}
    for fn in rewards:
        per_fn[fn.__name__] = [float(x) for x in fn(prompts=[prompt.get("prompt", "")] * n, completions=texts,
                                                    completion_ids=comp_ids, **extra)]
    table = pa.table({
        "completion": texts, "completion_ids": pa.array(comp_ids, pa.list_(pa.int64())),
        "num_tokens": [len(c) for c in comp_ids],
        "rewards": pa.array([list({k: v[i] for k, v in per_fn.items()}.items()) for i in range(n)],
                            pa.map_(pa.string(), pa.float64())),
        "reward": [sum(v[i] for v in per_fn.values()) for i in range(n)]})
    z = basis.compute(table, context={"eos_token_id": tok.eos_token_id, "max_completion_length": cap})
    return z, np.asarray(lp_old), np.asarray(lp_new), np.asarray(kl)


def pools(trained: Trained, n: int, pairs=None, progress=print) -> dict[tuple[int, int], Pool]:
    """The oracle's samples of every step pair (or ``pairs``), ``n`` per prompt and policy."""
    import numpy as np

    tok, build, rewards, _, basis = _setup(trained.regime)
    pre, post = build(), build()
    pre.eval()
    post.eval()
    steps = sorted(trained.params)
    pairs = pairs or [(t, t + 1) for t in steps if t + 1 in trained.params and t + 1 in trained.prompts]
    out = {}
    t0 = time.monotonic()
    for t, t1 in pairs:
        pre.load_state_dict(trained.params[t])
        post.load_state_dict(trained.params[t1])
        pool = Pool((t, t1), tuple(basis.names))
        for side, policy in (("a", pre), ("b", post)):
            parts = []
            for g, prompt in enumerate(trained.prompts[t1]):
                seed = 7_000_003 * t + 1009 * g + (0 if side == "a" else 500_009)
                parts.append((g, *_score(pre, post, tok, basis, rewards, prompt, n, trained.regime.cap, seed, policy)))
            pool.groups[side] = np.concatenate([np.full(len(p[1]), p[0]) for p in parts])
            pool.z[side] = np.vstack([p[1] for p in parts])
            pool.logp_t[side] = np.concatenate([p[2] for p in parts])
            pool.logp_t1[side] = np.concatenate([p[3] for p in parts])
            pool.kl[side] = np.concatenate([p[4] for p in parts])
        out[(t, t1)] = pool
    progress(f"oracle: {len(pairs)} step pairs x {2 * n} samples per prompt in {time.monotonic() - t0:.0f} s")
    return out


def save_pools(pools_: dict, path: Path) -> None:
    import numpy as np

    arrays = {}
    for (t, t1), p in pools_.items():
        for side in ("a", "b"):
            for name in ("groups", "z", "logp_t", "logp_t1", "kl"):
                arrays[f"{t}_{t1}_{side}_{name}"] = getattr(p, name)[side]
    arrays["names"] = np.array(next(iter(pools_.values())).names)
    np.savez_compressed(path, **arrays)


def load_pools(path: Path) -> dict:
    import numpy as np

    data = np.load(path)
    names = tuple(data["names"].tolist())
    out = {}
    for key in data.files:
        if key == "names":
            continue
        t, t1, side, name = key.split("_", 3)
        pair = (int(t), int(t1))
        p = out.setdefault(pair, Pool(pair, names))
        getattr(p, name)[side] = data[key]
    return dict(sorted(out.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regime", choices=sorted(REGIMES), action="append")
    ap.add_argument("--cache", type=Path, help="keep the trained runs and the oracle's samples here")
    ap.add_argument("--n", type=int, default=256, help="oracle samples per prompt and policy")
    args = ap.parse_args(argv)
    import torch

    for name in args.regime or sorted(REGIMES):
        regime = REGIMES[name]
        with tempfile.TemporaryDirectory() as tmp:
            work = args.cache / name if args.cache else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            if (work / "pools.npz").exists():
                print(f"{name}: cached")
                continue
            trained = train(regime, work)
            print(f"{name}: trained {regime.steps} steps in {trained.seconds:.0f} s")
            torch.save({"params": trained.params, "prompts": trained.prompts}, work / "trained.pt")
            ps = pools(trained, args.n)
            save_pools(ps, work / "pools.npz")


if __name__ == "__main__":
    main()
