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
3. Every run trains with ``stop_on="critical"`` and the live findings checked at every step; the
   tap's stop signal is noted and the run goes on (the halted run and its unhalted twin are one
   run up to the halt), so `check` reads the whole record. Where the exact KL reaches D_t
   (critical), `check` on the whole record must say critical, and the live tap must signal the
   halt no later than the first prefix at which `check` says critical (a prefix as the tap saw it
   at the end of step k: rollouts of steps 0..k, D_t of steps 0..k-1, since a step's D_t is
   measured on the next step's rollouts). The halt's lag behind the critical onset `check` names
   is reported, not judged: a rule that needs evidence after a step cannot halt at it.
4. On every run the live finding's first hold and its halt are `check`'s at the same prefix (the
   live finding is `check` at every prefix). On every clean run the live finding never holds,
   and `check` is clear on the whole record and at every prefix.

Changed for issue 59 after the first benchmark (one seed at 4 prompt groups a step, which missed
the stale engine: no step resolved it): 8 prompt groups a step (the smallest batch a user runs
is larger), the finding's pooled rule (a one-sided CUSUM of each step's evidence, reward_lens/
findings.py), several seeds per cause, and the halt judged against `check` on the same record.

Changed for issue 59 at stop 67, after the table of seeds 21-23 had been read: the series' SE is
the stratified one given the step's prompts (measure.mismatch.group_kl), where it was the spread
of the group means across prompts. On those seeds' stale runs the prompts' spread was about three
times the within-group one, and the score of a step could not pass about 1 / (its relative SE)
however far past D_t the mismatch was: `check` said critical on 1 of the 5 runs reaching D_t.
The rules above are not changed. The reported seeds are now 24-26, run once after the change;
seeds 21-23, rerun on the same code, are kept beside them (bench/results/mismatch_runs_21-23.json).

    python tools/mismatch_runs.py            # every cause and seed; prints the table and JSON
    python tools/mismatch_runs.py --quick    # one seed of each cause and one clean run
    python tools/mismatch_runs.py --json bench/results/mismatch_runs.json   # the reported run
    python tools/mismatch_runs.py --jobs 4 --json bench/results/mismatch_runs.json   # 4 runs at once
    python tools/mismatch_runs.py --coverage # the series' coverage of the exact KL, into
                                             # bench/results/mismatch_coverage.json
    python tools/mismatch_runs.py --quote    # the block docs/findings.md quotes, from that file, and
                                             # the coverage line docs/science.md quotes
"""

from __future__ import annotations

import argparse
import contextlib
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

GROUPS, GENERATIONS, MAX_NEW, HELDOUT = 8, 8, 12, 4
PROMPTS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
LOGIT_SCALE = 40.0
LR = 3e-3
ONSET = 3
LAG = 2
ENGINE_TEMPERATURE = 1.25
ENGINE_TOP_P = 0.9
FRESH = 4
TOLERANCE = 1
SHARE, CRITICAL = 0.1, 1.0
CAUSES = ("bf16", "stale", "temperature", "top_p")
# The reported seeds (24-26) were run once, after the SE given the prompts (module docstring); seeds
# 21-23 were reported before it, seeds 11 and 12 looked at while writing the pooled rule (the stale
# engine's per-step series at 4 and 8 groups), and no parameter was set from any of them: K = 1 and
# h = 5 are the sequential watch's.
SEEDS = {"mismatch": {"stale": (24, 25, 26), "temperature": (24, 25), "top_p": (24, 25), "bf16": (24,)},
         "clean": (24, 25, 26)}
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
            # the tap's stop signal under stop_on="critical" (what the TRL adapter turns into
            # TrainerControl.should_training_stop): noted, and the run goes on, so that `check` reads
            # the whole record of the same run, the unhalted twin of the halted one
            halted = step if halted is None else halted
    core.end(steps)
    live_held = sorted(t for t, ids in core.findings_log.items() if "engine_mismatch" in ids)
    return {"truth": truth, "halted": halted, "live_held": live_held, "entropy": float(np.mean(entropy))}


def check(record_dir: Path):
    """`check`'s engine_mismatch on the whole record, D_t by step, and the same finding at every
    prefix as the live tap saw it at the end of step k: the rollouts of steps 0..k and D_t of steps
    0..k-1 (a step's D_t is measured on the next step's rollouts), through check's own read of the
    record (``FindingData.from_run``) and its evaluation (``evaluate_one``)."""
    from reward_lens.findings import FindingData, evaluate, evaluate_one
    from reward_lens.record import open_run
    from reward_lens_spec import load_findings

    run = open_run(record_dir)
    f = next(x for x in evaluate(run) if x.id == "engine_mismatch")
    spec = load_findings()["engine_mismatch"]
    full = FindingData.from_run(run)
    prefixes = {}
    for k in sorted(full.mismatch):
        data = FindingData({n: {s: v for s, v in full.series(n).items() if s < k}
                            for n in ("kl_to_previous", "kl_to_previous_se", "tap_groups")},
                           mismatch={s: m for s, m in full.mismatch.items() if s <= k})
        g = evaluate_one(spec, data, [])
        prefixes[k] = g.severity if g.status == "holds" else g.status
    return f, dict(run.telemetry_column("kl_to_previous")), prefixes


def one(cause: str, seed: int, steps: int, workdir: Path) -> dict:
    rec = workdir / f"{cause}-{seed}"
    got = train(rec, cause, seed, steps, "critical")
    f, d_t, prefixes = check(rec)
    truth = got["truth"]
    ratio = {s: truth[s][0] / d_t[s] for s in truth if d_t.get(s)}
    onset = next((s for s in sorted(ratio) if s >= ONSET and ratio[s] >= SHARE), None) if cause != "clean" else None
    crit = next((s for s in sorted(ratio) if s >= ONSET and ratio[s] >= CRITICAL), None) if cause != "clean" else None
    row = {"cause": cause, "seed": seed, "steps": len(d_t) + 1, "entropy": got["entropy"],
           "truth_onset": onset, "truth_critical": crit, "status": f.status, "severity": f.severity,
           "onset": f.onset, "critical_from": f.values.get("critical_from") if f.severity == "critical" else None,
           "rule": f.values.get("rule"), "halted": got["halted"], "live_held": got["live_held"],
           "first_warn": next((k for k, v in prefixes.items() if v in ("warn", "critical")), None),
           "first_critical": next((k for k, v in prefixes.items() if v == "critical"), None),
           "prefixes": prefixes,
           "truth_ratio": {s: round(v, 4) for s, v in ratio.items()},
           "measured_ratio": f.values.get("ratio"), "peak_ratio": f.values.get("peak_ratio")}
    # the live finding is `check` at every prefix: its first hold and its halt are check's first
    row["live_is_check"] = (got["live_held"][:1] == ([row["first_warn"]] if row["first_warn"] is not None else [])
                            and got["halted"] == row["first_critical"])
    if cause == "clean":
        row["pass"] = not got["live_held"] and f.status == "clear" and set(prefixes.values()) <= {"clear", "not_evaluated"}
    elif onset is None:
        row["pass"] = f.status != "holds" and not got["live_held"]
    else:
        ok = f.status == "holds" and f.onset is not None and abs(f.onset - onset) <= TOLERANCE
        if crit is not None:
            ok = (ok and f.severity == "critical" and got["halted"] is not None
                  and row["first_critical"] is not None and got["halted"] <= row["first_critical"])
        row["pass"] = bool(ok and row["live_is_check"])
    return row


def table(rows: list[dict]) -> str:
    def v(x):
        return "—" if x is None else str(x)

    out = ["| cause | seed | truth onset (≥ 0.1 D_t) | truth critical (≥ D_t) | check | onset | critical from | rule | "
           "first warn | first critical | live halt | peak ratio measured | pass |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = f"{r['status']}" + (f" ({r['severity']})" if r["status"] == "holds" else "")
        peak = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "—"
        out.append(f"| {r['cause']} | {r['seed']} | {v(r['truth_onset'])} | {v(r['truth_critical'])} | {status} | "
                   f"{v(r['onset'])} | {v(r['critical_from'])} | {v(r['rule'])} | {v(r['first_warn'])} | "
                   f"{v(r['first_critical'])} | {v(r['halted'])} | {peak} | {'yes' if r['pass'] else '**no**'} |")
    return "\n".join(out)


def quote(rows: list[dict]) -> str:
    """The block docs/findings.md quotes: the table and what it adds up to."""
    timed = [r for r in rows if r["cause"] != "clean" and r["truth_onset"] is not None]
    below = [r for r in rows if r["cause"] != "clean" and r["truth_onset"] is None]
    clean = [r for r in rows if r["cause"] == "clean"]
    crit = [r for r in timed if r["truth_critical"] is not None]
    on_time = [r for r in timed if r["status"] == "holds" and r["onset"] is not None
               and abs(r["onset"] - r["truth_onset"]) <= TOLERANCE]
    named = [r for r in crit if r["status"] == "holds" and r["severity"] == "critical"]
    halted = [r for r in named if r["halted"] is not None and r["first_critical"] is not None
              and r["halted"] <= r["first_critical"]]
    lags = [r["halted"] - r["critical_from"] for r in halted if r["critical_from"] is not None]
    delays = [r["first_warn"] - r["truth_onset"] for r in on_time if r["first_warn"] is not None]
    return (table(rows) + "\n\n"
            f"mismatched runs named with their onset within {TOLERANCE} step of the ground-truth onset: {len(on_time)} "
            f"of {len(timed)}" + (f" (first said {min(delays)} to {max(delays)} steps after it)" if delays else "")
            + f"; reaching D_t at some step (exact): {len(crit)}, of which `check` says critical on {len(named)}, and "
            f"on {len(halted)} of those the live tap signalled the halt no later than `check`'s first critical prefix"
            + (f" ({min(lags)} to {max(lags)} steps after the critical onset `check` names)" if lags else "")
            + f"; below the line and quiet: {sum(r['pass'] for r in below)} of {len(below)}; clean runs quiet at every "
            f"prefix: {sum(r['pass'] for r in clean)} of {len(clean)}; live = `check` at every prefix on "
            f"{sum(bool(r.get('live_is_check')) for r in rows)} of {len(rows)} runs")


RESULTS = REPO / "bench" / "results" / "mismatch_runs.json"
COVERAGE = REPO / "bench" / "results" / "mismatch_coverage.json"
# The coverage check: per cause, REDRAWS steps' rollouts drawn fresh from the engine (GROUPS prompts
# x GENERATIONS each), and TRUTH_PER fresh engine samples of every prompt for the exact KL.
TRUTH_PER, REDRAWS, COVER_SEED, CHUNK = 64, 200, 5, 1024


def coverage(causes=("bf16", "temperature", "top_p")) -> list[dict]:
    """Does the mismatch series' 95 % interval cover the exact KL? Per cause, the benchmark's policy
    (seed COVER_SEED, untrained) and its engine departed by that cause. The truth is the exact
    KL(pi_engine || pi_t) per sequence of each prompt -- the full-vocabulary token KL summed along
    ``TRUTH_PER`` fresh engine samples of it (``exact_kl``) -- averaged over the step's own prompts
    (the SE is given them: ``measure.mismatch.group_kl``; before stop 67 the truth was the mean
    over all prompts, for the SE across prompts then). ``REDRAWS`` steps are drawn, each fresh and
    independent of the others: ``GROUPS`` prompts drawn with replacement, ``GENERATIONS`` engine
    completions of each; each step gives the series' estimate (``measure.mismatch.step_mismatch``,
    on the gaps log pi_engine - log pi_t the tap records). Its 95 % interval is the series'
    (``measure.mismatch.moderated_kl_se``, each step's own SE moderated across its neighbours, t
    quantile on the degrees of freedom it returns), the REDRAWS steps read in the order drawn as
    one run's consecutive steps; the step's own SE (t on its own degrees of freedom), the SE before
    issue 59's moderation, is measured beside it.
    (A first version redrew the steps from a shared pool of 64 completions a prompt: its redraws
    centred on the pool's mean, not the truth, and top-p read 44 %.) The stale engine needs a
    trained policy beside it and is not in it."""
    from scipy import stats

    from reward_lens.measure.ledger.moderated import t975
    from reward_lens.measure.mismatch import moderated_kl_se, step_mismatch

    out = []
    for cause in causes:
        torch.manual_seed(COVER_SEED)
        model, tok = build(COVER_SEED)
        model.eval()
        engine = Engine(model, cause, 0)
        engine.sync(model, 0)
        eos, pad = tok.eos_token_id, tok.pad_token_id
        gen = torch.Generator().manual_seed(COVER_SEED)
        rng = np.random.default_rng(COVER_SEED)
        picks = rng.integers(0, len(PROMPTS), size=(REDRAWS, GROUPS))
        truth, truth_se, gaps, toks = [], [], [], []
        for p, prompt in enumerate(PROMPTS):
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            kl, se = exact_kl(engine, model, [ids] * TRUTH_PER, eos, pad, gen)
            truth.append(kl)
            truth_se.append(se)
            need = int((picks == p).sum()) * GENERATIONS
            g_p, t_p = [], []
            for start in range(0, need, CHUNK):
                n = min(CHUNK, need - start)
                comps, lp_engine = engine.generate([ids] * n, eos, gen)
                full, mask = _padded([ids] * n, comps, pad)
                with torch.no_grad():
                    lp = torch.log_softmax(model(input_ids=full).logits[:, len(ids) - 1:-1].double(), -1)
                lp_pol = (lp.gather(-1, full[:, len(ids):, None])[:, :, 0] * mask).sum(-1).numpy()
                g_p.append(np.asarray(lp_engine) - lp_pol)
                t_p.append(mask.sum(-1).numpy())
            gaps.append(np.concatenate(g_p) if g_p else np.zeros(0))
            toks.append(np.concatenate(t_p) if t_p else np.zeros(0))
        exact = float(np.mean(truth))
        exact_se = float(math.sqrt(np.sum(np.square(truth_se))) / len(truth_se))
        # each step's truth is its own prompts' (the SE is given them: measure.mismatch.group_kl)
        cond = np.array([np.mean([truth[p] for p in row]) for row in picks])
        cond_se = float(np.median([math.sqrt(sum(truth_se[p] ** 2 for p in row)) / len(row) for row in picks]))
        used = [0] * len(PROMPTS)
        est, ses, dofs, sizes = [], [], [], []
        for row in picks:  # every completion is used once: the redraws are independent
            gap, tokens = [], []
            for p in row:
                gap.append(gaps[p][used[p]:used[p] + GENERATIONS])
                tokens.append(toks[p][used[p]:used[p] + GENERATIONS])
                used[p] += GENERATIONS
            m = step_mismatch(0, np.concatenate(gap), np.repeat(np.arange(GROUPS), GENERATIONS), GROUPS,
                              np.concatenate(tokens))
            est.append(m.kl_seq)
            ses.append(m.kl_seq_se)
            dofs.append(m.kl_seq_dof)
            sizes.append(m.kl_seq_size)
        est_a, own = np.array(est), np.array(ses)
        series, dof = moderated_kl_se(est_a, own, dofs, sizes)  # the 200 steps as one run's, in the order drawn
        half = np.array([t975(f) for f in dof]) * series
        q = stats.t.ppf(0.975, np.array(dofs))
        out.append({"cause": cause, "exact_kl_seq": exact, "exact_kl_seq_se": exact_se, "redraws": REDRAWS,
                    "groups": GROUPS, "per_group": GENERATIONS, "mean_estimate": float(est_a.mean()),
                    "spread": float(np.std(est_a, ddof=1)), "mean_se": float(series.mean()),
                    "median_dof": float(np.median(dof)), "truth": "each step's own prompts",
                    "median_truth_se": cond_se, "coverage": float(np.mean(np.abs(est_a - cond) <= half)),
                    "mean_se_own": float(own.mean()),
                    "coverage_own": float(np.mean(np.abs(est_a - cond) <= q * own))})
        print(json.dumps(out[-1]), flush=True)
    return out


def coverage_line(rows: list[dict]) -> str:
    """The coverage line the quote ends with, from bench/results/mismatch_coverage.json."""
    parts = [f"{r['cause']} {100 * r['coverage']:.1f} % (step's own SE {100 * r['coverage_own']:.1f} %; exact "
             f"{r['exact_kl_seq']:.3g} nats/seq over all prompts; estimates {r['mean_estimate']:.3g} on "
             f"average, mean SE {r['mean_se']:.2g}, own {r['mean_se_own']:.2g}, the truth's own SE "
             f"{r['median_truth_se']:.2g})" for r in rows]
    n = rows[0]
    return (f"the series' 95 % interval (its SE given the step's prompts, moderated across neighbouring steps) "
            f"covers the exact KL(π_engine ‖ π_t) per sequence of the step's own prompts over {n['redraws']} redraws "
            f"of {n['groups']} prompt groups × {n['per_group']}, each drawn fresh and read as one run's consecutive "
            f"steps: " + "; ".join(parts))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed of each cause and one clean run")
    ap.add_argument("--causes", nargs="*", default=[*CAUSES, "clean"],
                    help=f"which of {', '.join(CAUSES)} and clean (default: all)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--json", type=Path, help=f"write the rows here (the reported run: {RESULTS.relative_to(REPO)})")
    ap.add_argument("--quote", action="store_true", help="print the block docs/findings.md quotes, from the rows kept")
    ap.add_argument("--coverage", action="store_true",
                    help=f"measure the series' coverage of the exact KL per cause into {COVERAGE.relative_to(REPO)}")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each on one thread)")
    ap.add_argument("--seeds", type=int, nargs="*",
                    help="these seeds for every cause and the clean runs, instead of the reported ones (SEEDS)")
    ap.add_argument("--keep", type=Path, help="keep the records in this folder (made; must not exist yet)")
    a = ap.parse_args(argv)
    if a.quote:
        print(quote(json.loads(RESULTS.read_text())))
        if COVERAGE.exists():
            print("\n" + coverage_line(json.loads(COVERAGE.read_text())))
        return []
    if a.coverage:
        torch.set_num_threads(1)
        COVERAGE.write_text(json.dumps(coverage(), indent=1))
        return []
    seeds = {c: tuple(a.seeds) for c in CAUSES} if a.seeds else SEEDS["mismatch"]
    runs = [(c, s) for c in a.causes if c != "clean" for s in seeds[c][:1 if a.quick else None]]
    runs += [("clean", s) for s in (tuple(a.seeds) if a.seeds else SEEDS["clean"])[:1 if a.quick else None]
             if "clean" in a.causes]
    rows = []
    if a.keep is not None:
        a.keep.mkdir(parents=True)  # never into a folder this tool did not make
    with (contextlib.nullcontext(str(a.keep)) if a.keep is not None else tempfile.TemporaryDirectory()) as tmp:
        if a.jobs > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(a.jobs, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                futures = [pool.submit(one, c, s, a.steps, Path(tmp)) for c, s in runs]
                for fut in futures:
                    rows.append(fut.result())
                    print(json.dumps(rows[-1]), flush=True)
                    if a.json:  # kept as each run ends, in the order the runs are listed
                        a.json.write_text(json.dumps(rows, indent=1))
        else:
            for cause, seed in runs:
                rows.append(one(cause, seed, a.steps, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
