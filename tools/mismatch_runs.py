"""Labelled engine-mismatch runs: does `engine_mismatch` hold where the engine departs from the
policy, from when, and stay quiet where it does not?

Each run is a hand-written GRPO loop in plain torch (the loop of examples/plain_torch_tap.py)
through the tap core, with a *stand-in engine* sampling the rollouts: a second copy of the
policy, synced from it before every generation, that samples token by token and hands over its
own log-probability of each completion (as vLLM does through TRL). From the labelled onset step
on, the engine departs from the policy by one real cause:

* ``bf16``: its weights cast to bfloat16 (it computes in bfloat16) while the trainer trains and
  scores in float32;
* ``stale``: it holds the weights of ``LAG`` updates before (a sync that did not happen);
* ``temperature``: it samples at ``ENGINE_TEMPERATURE`` while the trainer scores at 1.0;
* ``top_p``: it truncates to the top ``ENGINE_TOP_P`` of the mass, which the scorer does not.

``clean`` runs are matched: the same loop and engine, synced and in float32 at every step.

The truth, per step: the exact KL(pi_engine || pi_t) -- the full-vocabulary token KL summed along
``FRESH`` fresh engine samples per prompt group (never trained on), both models' whole
distributions at every position -- over the step's D_t as the tap recorded it.

The policy is the reference records' tiny Qwen3 with its output layer scaled by
``LOGIT_SCALE``: at its initial scale it is nearly uniform over 260 tokens (5.5 nats of entropy
per token), where no precision or temperature changes anything; scaled, its next-token entropy
is that of a small trained model (printed), and each cause is the size it is in practice.

THE RULES, written before any finding was read, and not tuned on these seeds:

1. A mismatched run's ground-truth onset is the first step at or after the labelled onset where
   the exact KL(pi_engine || pi_t) is at least a tenth of the recorded D_t (the finding's own
   line). Where no step reaches it, the run is labelled "below the line" and the finding must
   stay quiet on it (the gap exists but is small against the updates).
2. On a run with a ground-truth onset, `check` on the record (every step the tap recorded) must
   name `engine_mismatch` at warn or above with its onset within ``TOLERANCE`` steps of the
   truth's (either side).
3. Where the exact KL reaches D_t (critical), the run is trained with ``stop_on="critical"``: the
   live tap must halt it, at a step no later than the truth's critical onset + ``HALT_WITHIN``
   (D_t of a step is known one step late, and the rule asks for two steps in a row), and `check`
   on the halted record must say critical.
4. On every clean run the live finding (checked at every step, which is `check` at every prefix:
   tests/unit/test_live_findings.py) never holds, and `check` on the whole record is clear.

    python tools/mismatch_runs.py            # every cause and seed; prints the table and JSON
    python tools/mismatch_runs.py --quick    # one seed of each cause and one clean run
    python tools/mismatch_runs.py --json bench/results/mismatch_runs.json   # the reported run
    python tools/mismatch_runs.py --quote    # the block docs/findings.md quotes, from that file
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GROUPS, GENERATIONS, MAX_NEW, HELDOUT = 4, 8, 12, 4
PROMPTS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
LOGIT_SCALE = 40.0
LR = 3e-3
ONSET = 3
LAG = 2
ENGINE_TEMPERATURE = 1.25
ENGINE_TOP_P = 0.9
FRESH = 8
TOLERANCE = 1
HALT_WITHIN = 2
SHARE, CRITICAL = 0.1, 1.0
CAUSES = ("bf16", "stale", "temperature", "top_p")
SEEDS = {"mismatch": (11,), "clean": (11, 12, 13)}
STEPS = 8


def lowercase(texts: list[str]) -> list[float]:
    return [sum(c.islower() for c in t) / max(len(t), 1) for t in texts]


def build(seed: int):
    sys.path.insert(0, str(REPO / "tools"))
    import make_reference_records as gen

    sys.path.pop(0)
    tok = gen.build_tokenizer()
    model = gen.build_model(len(tok), seed, tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model, tok


def processed(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The log-probabilities a sampler draws from: logits / temperature, truncated to the smallest
    set of tokens holding ``top_p`` of the mass (as transformers' TopPLogitsWarper and vLLM do)."""
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sp, order = torch.sort(lp.exp(), dim=-1, descending=True)
        drop_sorted = (sp.cumsum(-1) - sp) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        lp = torch.log_softmax(torch.where(drop, torch.tensor(-math.inf, dtype=lp.dtype), lp), dim=-1)
    return lp


class Engine:
    """The stand-in inference engine: a copy of the policy, synced before each generation."""

    def __init__(self, policy, cause: str, onset: int):
        self.model = copy.deepcopy(policy).eval()
        self.cause, self.onset = cause, onset
        self.history: list[dict] = []
        self.temperature, self.top_p = 1.0, 1.0

    def sync(self, policy, step: int) -> None:
        self.history = (self.history + [{k: v.detach().clone() for k, v in policy.state_dict().items()}])[-(LAG + 1):]
        on = step >= self.onset and self.cause != "clean"
        state = self.history[0] if (on and self.cause == "stale") else self.history[-1]
        self.model.float()
        self.model.load_state_dict(state)
        if on and self.cause == "bf16":
            self.model.to(torch.bfloat16)
        self.temperature = ENGINE_TEMPERATURE if on and self.cause == "temperature" else 1.0
        self.top_p = ENGINE_TOP_P if on and self.cause == "top_p" else 1.0

    def log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return processed(self.model(input_ids=ids).logits.float(), self.temperature, self.top_p)

    def generate(self, rows: list[list[int]], eos: int, gen: torch.Generator) -> tuple[list[list[int]], list[float]]:
        """Completions of the prompts ``rows`` (all one length) and each one's log-probability
        under the engine's processed distribution, cut after its first EOS (kept)."""
        ids = torch.tensor(rows)
        width = ids.shape[1]
        total = torch.zeros(len(rows), dtype=torch.float64)
        alive = torch.ones(len(rows), dtype=torch.bool)
        for _ in range(MAX_NEW):
            lp = self.log_probs(ids)[:, -1]
            nxt = torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
            total += torch.where(alive, lp.gather(-1, nxt[:, None])[:, 0], torch.zeros_like(total))
            alive &= nxt != eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if not alive.any():
                break
        out = []
        for c in ids[:, width:].tolist():
            out.append(c[:c.index(eos) + 1] if eos in c else c)
        return out, total.tolist()


def _padded(rows: list[list[int]], comps: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + completion ids right-padded into one batch (a causal model's positions before the
    padding are unaffected by it), and the mask of each completion's positions."""
    width = max(len(c) for c in comps)
    ids = torch.tensor([r + c + [pad] * (width - len(c)) for r, c in zip(rows, comps)])
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in comps], dtype=torch.float64)
    return ids, mask


def exact_kl(engine: Engine, policy, rows: list[list[int]], eos: int, pad: int, gen: torch.Generator
             ) -> tuple[float, float]:
    """The truth: KL(pi_engine || pi_t) summed over each of fresh engine samples' positions, with the
    whole vocabulary at each (both models' distributions), averaged; and its SE."""
    comps, _ = engine.generate(rows, eos, gen)
    ids, mask = _padded(rows, comps, pad)
    width = len(rows[0])
    le = engine.log_probs(ids)[:, width - 1:-1]
    with torch.no_grad():
        lp = torch.log_softmax(policy(input_ids=ids).logits[:, width - 1:-1].double(), -1)
    pe = le.exp()
    per_pos = torch.where(pe > 0, pe * (le - lp), torch.zeros_like(pe)).sum(-1)
    a = (per_pos * mask).sum(-1).numpy()
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a)))


def train(record_dir: Path, cause: str, seed: int, steps: int, stop_on: str | None = None) -> dict:
    from reward_lens.taps.core import Generation, TapCore
    from reward_lens.taps.settings import tap_settings

    torch.manual_seed(seed)
    model, tok = build(seed)
    engine = Engine(model, cause, ONSET)
    gen = torch.Generator().manual_seed(seed)
    truth_gen = torch.Generator().manual_seed(seed + 1000)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    eos = tok.eos_token_id

    def reward_rows(rows):
        for r, v in zip(rows, lowercase([r.completion for r in rows])):
            r.rewards, r.reward = {"lowercase": v}, v

    core = TapCore(record_dir, model, tap_settings(budget=None, overwrite=True, heldout=HELDOUT, check_every=1,
                                                   stop_on=stop_on),
                   pad_id=tok.pad_token_id, eos_id=eos, captured=False,
                   decode=lambda ids: tok.batch_decode(ids, skip_special_tokens=True), temperature=1.0,
                   framework={"name": "plain-torch"}, optimizer="adamw", reward=reward_rows,
                   trainer_config={"num_generations": GENERATIONS, "learning_rate": LR, "max_completion_length": MAX_NEW,
                                   "temperature": 1.0},
                   notes=[f"recorded by tools/mismatch_runs.py: stand-in engine, cause {cause} from step {ONSET}"])
    truth: dict[int, tuple[float, float]] = {}
    entropy: list[float] = []
    halted = None
    core.begin()
    for step in range(steps):
        texts = [PROMPTS[(step * GROUPS + g) % len(PROMPTS)] for g in range(GROUPS)]
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in texts for _ in range(GENERATIONS)]
        prompts = [p for p in texts for _ in range(GENERATIONS)]
        model.eval()
        engine.sync(model, step)
        truth[step] = exact_kl(engine, model, [tok(p, add_special_tokens=False)["input_ids"] for p in texts
                                               for _ in range(FRESH)], eos, tok.pad_token_id, truth_gen)
        extra = core.extra_requests(step, prompt_ids, prompts, group_size=GENERATIONS)
        completions, logp_sampler = engine.generate(prompt_ids + extra, eos, gen)
        core.extras_generated(completions[len(prompt_ids):], logp_sampler[len(prompt_ids):])
        completions, logp_sampler = completions[:len(prompt_ids)], logp_sampler[:len(prompt_ids)]
        texts_out = tok.batch_decode(completions, skip_special_tokens=True)
        rewards = np.array(lowercase(texts_out))
        by_group = rewards.reshape(GROUPS, GENERATIONS)
        adv = ((by_group - by_group.mean(1, keepdims=True)) / (by_group.std(1, keepdims=True) + 1e-4)).ravel()
        core.on_generation(Generation(
            step=step, prompts=prompts, completions=texts_out,
            prompt_ids=[torch.tensor(p) for p in prompt_ids], completion_ids=[torch.tensor(c) for c in completions],
            rewards=rewards[:, None], all_rewards=rewards[:, None], reward_names=["lowercase"],
            reward_weights=np.ones(1), advantages=adv.tolist(), group_size=GENERATIONS, logp_sampler=logp_sampler))
        model.train()
        ids, mask = _padded(prompt_ids, completions, tok.pad_token_id)
        width = len(prompt_ids[0])
        lp = torch.log_softmax(model(input_ids=ids).logits[:, width - 1:-1], -1)
        if step == 0:  # the policy's next-token entropy along its first rollouts
            ent = -(lp.exp() * lp).sum(-1).double()
            entropy.append(float((ent.detach() * mask).sum() / mask.sum()))
        seq = (lp.gather(-1, ids[:, width:, None])[:, :, 0].double() * mask).sum(-1)
        loss = -(torch.tensor(adv) * seq).sum() / len(prompt_ids)
        opt.zero_grad()
        loss.backward()
        unclipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        core.before_optimizer_step(step, learning_rate=LR, grad_norm_unclipped=unclipped, max_grad_norm=1.0)
        opt.step()
        core.after_optimizer_step(step)
        if core.end_step(step):
            halted = step
            break
    core.end(steps if halted is None else halted + 1)
    live_held = sorted(t for t, ids in core.findings_log.items() if "engine_mismatch" in ids)
    return {"truth": truth, "halted": halted, "live_held": live_held, "entropy": float(np.mean(entropy))}


def check(record_dir: Path):
    from reward_lens.findings import evaluate
    from reward_lens.record import open_run

    run = open_run(record_dir)
    f = next(x for x in evaluate(run) if x.id == "engine_mismatch")
    return f, dict(run.telemetry_column("kl_to_previous"))


def one(cause: str, seed: int, steps: int, workdir: Path) -> dict:
    rec = workdir / f"{cause}-{seed}"
    stop_on = None if cause == "clean" else "critical"
    got = train(rec, cause, seed, steps, stop_on)
    f, d_t = check(rec)
    truth = got["truth"]
    ratio = {s: truth[s][0] / d_t[s] for s in truth if d_t.get(s)}
    onset = next((s for s in sorted(ratio) if s >= ONSET and ratio[s] >= SHARE), None) if cause != "clean" else None
    crit = next((s for s in sorted(ratio) if s >= ONSET and ratio[s] >= CRITICAL), None) if cause != "clean" else None
    row = {"cause": cause, "seed": seed, "steps": len(d_t) + 1, "entropy": got["entropy"],
           "truth_onset": onset, "truth_critical": crit, "status": f.status, "severity": f.severity,
           "onset": f.onset, "halted": got["halted"], "live_held": got["live_held"],
           "truth_ratio": {s: round(v, 4) for s, v in ratio.items()},
           "measured_ratio": f.values.get("ratio"), "peak_ratio": f.values.get("peak_ratio")}
    if cause == "clean":
        row["pass"] = not got["live_held"] and f.status == "clear"
    elif onset is None:
        row["pass"] = f.status != "holds"
    else:
        ok = f.status == "holds" and f.onset is not None and abs(f.onset - onset) <= TOLERANCE
        if crit is not None:
            ok = ok and got["halted"] is not None and got["halted"] <= crit + HALT_WITHIN and f.severity == "critical"
        row["pass"] = bool(ok)
    return row


def table(rows: list[dict]) -> str:
    out = ["| cause | seed | truth onset (≥ 0.1 D_t) | truth critical (≥ D_t) | check | from step | live halt | "
           "peak ratio measured | pass |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = f"{r['status']}" + (f" ({r['severity']})" if r["status"] == "holds" else "")
        peak = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "—"
        out.append(f"| {r['cause']} | {r['seed']} | {r['truth_onset'] if r['truth_onset'] is not None else '—'} | "
                   f"{r['truth_critical'] if r['truth_critical'] is not None else '—'} | {status} | "
                   f"{r['onset'] if r['onset'] is not None else '—'} | {r['halted'] if r['halted'] is not None else '—'} | "
                   f"{peak} | {'yes' if r['pass'] else '**no**'} |")
    return "\n".join(out)


def quote(rows: list[dict]) -> str:
    """The block docs/findings.md quotes: the table and what it adds up to."""
    timed = [r for r in rows if r["cause"] != "clean" and r["truth_onset"] is not None]
    below = [r for r in rows if r["cause"] != "clean" and r["truth_onset"] is None]
    clean = [r for r in rows if r["cause"] == "clean"]
    crit = [r for r in timed if r["truth_critical"] is not None]
    return (table(rows) + "\n\n"
            f"mismatched runs found within {TOLERANCE} step of the ground-truth onset: {sum(r['pass'] for r in timed)} of "
            f"{len(timed)}; of them reaching D_t, halted live: {sum(r['halted'] is not None for r in crit)} of {len(crit)}; "
            f"below the line and quiet: {sum(r['pass'] for r in below)} of {len(below)}; clean runs quiet at every "
            f"prefix: {sum(r['pass'] for r in clean)} of {len(clean)}")


RESULTS = REPO / "bench" / "results" / "mismatch_runs.json"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed of each cause and one clean run")
    ap.add_argument("--causes", nargs="*", default=list(CAUSES))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--json", type=Path, help=f"write the rows here (the reported run: {RESULTS.relative_to(REPO)})")
    ap.add_argument("--quote", action="store_true", help="print the block docs/findings.md quotes, from the rows kept")
    a = ap.parse_args(argv)
    if a.quote:
        print(quote(json.loads(RESULTS.read_text())))
        return []
    runs = [(c, s) for c in a.causes for s in SEEDS["mismatch"][:1 if a.quick else None]]
    runs += [("clean", s) for s in SEEDS["clean"][:1 if a.quick else None]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cause, seed in runs:
            rows.append(one(cause, seed, a.steps, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
