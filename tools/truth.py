"""The truth harness: every estimate of a tapped run against a truth measured another way.

    python tools/truth.py --quote               # every regime: the lines docs/science.md quotes
    python tools/truth.py --regime collapse     # one, with timings
    python tools/truth.py --cache /tmp/truth    # keep the trained runs and oracle pools there
    python tools/truth.py --quote --budget default --save bench/results/truth_default_budget.txt

About 11 minutes on 2 idle CPU cores (the oracle's sampling about 5, the checks with their 100
redraws of every update about 5; the bootstrap of the oracle's own eta under a minute), and 30 on
a machine loaded fourfold; the slow test tests/acceptance/test_truth.py runs it.

Three regimes, each a real TRL ``GRPOTrainer`` run with the reward-lens tap attached and every
policy pi_t kept:

* **moderate** -- the reference tiny Qwen3 (built in code, random init), 8 prompts x 8
  generations a step, AdamW at a constant 1e-2, two rewards (lowercase fraction, no spaces),
  read in the surface basis;
* **collapse** -- the task recipe (``tools/make_task_record.py``: the Qwen3 pretrained on
  synthetic arithmetic, the record's own starting checkpoint) at lr 3e-3, where correctness
  collapses to 0 within ten steps and the policy sharpens; read in the task basis;
* **sharpened** -- the same recipe at its own learning rate, 5e-4 (the README's record): a policy
  pretrained to answer nearly deterministically (its samples' distinct completions hold most of
  its mass), trained for 40 steps without collapsing: the small updates of a sharp policy that
  does not break.

The oracle. For every step pair (t, t+1) the tap measured it draws ``n`` fresh completions per
prompt of the step -- every prompt group of the generation the tap measured the pair on
(``step_prompts``: generation t two-sided, t + 1 one-sided), the groups it measured among them
(``measured_prompts``, read from the record) -- from pi_t *and* from pi_{t+1} (float64 sampling at
the trainer's temperature), scores each under both policies, sums the full-vocabulary token
KL(pi_{t+1} || pi_t) along it, and computes the features. The truth each number is checked
against is the step's change over all of its prompts, which is what the report names; where the
budget measured a subset of the groups, the same checks against the truth over the measured groups
alone are printed as a second line. The truth is then:

* dz = mean over prompts of (mean z under pi_{t+1} - mean z under pi_t), plain means;
* D_t = the mean over prompts of the token KL summed along pi_{t+1}'s samples (chain rule);
* KL_min = the I-projection with the book's own definition (one lambda for all prompts, the
  pooled mean constraint, a log-partition per prompt) on both samples combined (multiple
  importance sampling, balance heuristic); eta = KL_min / D_t.

Its own sampling error is reported (standard errors over its samples). The record's numbers
-- what ``reward-lens report`` reads from the tapped record -- are compared cell by cell, and
the estimator's bias and real spread are measured by replicates: the record's sampling
(k extra completions per prompt from each policy; one-sided, m rollouts of pi_{t+1}) redrawn
from the oracle's own samples, the estimator applied to each; where the tap measured n of a step's
N groups, each redraw draws n groups afresh (the others left unscored, as the tap leaves them).

The tap runs with ``budget=None`` by default (every pair measured whole: 8 prompt groups, 4 extra
completions per group and policy), so that a run is the same run every time on the same machine
(the slow test asserts on it, and docs/science.md quotes it). ``--budget default`` runs the tap's
own default (0.10 of an untapped step): the budget sizes each pair's measurement from timing (n of
the step's prompt groups drawn at random, or every group on a share of the pairs), so
which groups and pairs are measured -- and, since the extra completions share the trainer's
sampling, the run's tokens -- differ from run to run; its output is saved with ``--save`` and
quoted as it was printed (tools/bench_quotes.py). Pairs the budget left unmeasured are counted
and have no oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
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


# Oracle samples per prompt and policy the test draws (tests/acceptance/test_truth.py).
DEFAULT_N = {"moderate": 64, "collapse": 128, "sharpened": 128}

REGIMES = {
    "moderate": Regime("moderate", steps=40, learning_rate=1e-2, seed=31, cap=32),
    "collapse": Regime("collapse", steps=60, learning_rate=3e-3, seed=13, cap=24),
    # the task recipe at its own learning rate (the README's record): a policy pretrained to answer
    # nearly deterministically, trained without collapsing -- small updates of a sharpened policy
    "sharpened": Regime("sharpened", steps=40, learning_rate=5e-4, seed=13, cap=24),
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
    log_history: list = field(default_factory=list)  # the trainer's own logs (the tap's reward_lens/* keys in them)


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
    return Trained(regime, record, params, prompts, time.monotonic() - t0, list(trainer.state.log_history))


@dataclass
class Pool:
    """The oracle's samples of one step pair (t, t+1), for every prompt of the step (``step_prompts``; the
    tap's measured groups first): side "a" drawn
    from pi_t, side "b" from pi_{t+1}, ``n`` per prompt each. Per sample: its prompt group, the
    features, log pi_t(y), log pi_{t+1}(y) and the summed token KL(pi_{t+1} || pi_t) along it."""

    step_pair: tuple[int, int]
    names: tuple[str, ...]
    groups: dict[str, "object"] = field(default_factory=dict)  # side -> (N,) int
    z: dict[str, "object"] = field(default_factory=dict)  # side -> (N, k)
    logp_t: dict[str, "object"] = field(default_factory=dict)
    logp_t1: dict[str, "object"] = field(default_factory=dict)
    kl: dict[str, "object"] = field(default_factory=dict)
    # the prompt groups the tap measured: groups 0..measured-1 (``step_prompts``); None: every group
    measured: int | None = None

    @property
    def n_groups(self) -> int:
        import numpy as np

        return len(np.unique(self.groups["b"]))

    def restricted(self) -> "Pool":
        """The pool of the measured groups alone (itself where every group was measured)."""
        if self.measured is None or self.measured >= self.n_groups:
            return self
        out = Pool(self.step_pair, self.names)
        for side in ("a", "b"):
            keep = self.groups[side] < self.measured
            for name in ("groups", "z", "logp_t", "logp_t1", "kl"):
                getattr(out, name)[side] = getattr(self, name)[side][keep]
        return out


def _score_many(pre, post, tok, basis, rewards, prompts: list[dict], n: int, cap: int, seed: int, policy):
    """``n`` completions of every prompt from ``policy`` (pre or post; all prompts in one batch),
    each scored under both policies in float64, with its features. Returns per sample: the
    prompt's index, z, log pi_t, log pi_{t+1}, and the summed token KL(pi_{t+1} || pi_t)."""
    import numpy as np
    import pyarrow as pa
    import torch

    from reward_lens.measure.whitebox.kl import summed_kl_and_logps
    from reward_lens.measure.whitebox.policy import sample_prompts

    gen = torch.Generator().manual_seed(seed)
    comp = sample_prompts(policy, [p["prompt_ids"] for p in prompts], n, cap, tok.eos_token_id, tok.pad_token_id, gen)
    rows = [(g, p) for g, p in enumerate(prompts) for _ in range(n)]
    kl, lp_old, lp_new = np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows))
    for a in range(0, len(rows), 512):
        part = range(a, min(len(rows), a + 512))
        pw = max(len(rows[i][1]["prompt_ids"]) for i in part)
        cw = max(max(len(comp[i]) for i in part), 1)
        ids = torch.full((len(part), pw + cw), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        mask = torch.zeros((len(part), cw), dtype=torch.bool)
        for j, i in enumerate(part):
            pid, c = rows[i][1]["prompt_ids"], comp[i]
            ids[j, pw - len(pid):pw] = torch.tensor(pid)
            ids[j, pw:pw + len(c)] = torch.tensor(c, dtype=torch.long)
            att[j, pw - len(pid):pw + len(c)] = 1
            mask[j, :len(c)] = True
        with torch.no_grad():
            new = post(input_ids=ids, attention_mask=att).logits[:, pw - 1:-1]
            old = pre(input_ids=ids, attention_mask=att).logits[:, pw - 1:-1]
        k, lo, ln = summed_kl_and_logps(new, old, ids[:, pw:], mask)
        kl[a:a + len(part)], lp_old[a:a + len(part)], lp_new[a:a + len(part)] = k, lo, ln
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    per_fn = {}
    for fn in rewards:
        extra = {k: [p[k] for _, p in rows] for k in rows[0][1] if k not in ("prompt_ids", "prompt")}
        per_fn[fn.__name__] = [float(x) for x in fn(prompts=[p.get("prompt", "") for _, p in rows], completions=texts,
                                                    completion_ids=comp, **extra)]
    table = pa.table({
        "completion": texts, "completion_ids": pa.array(comp, pa.list_(pa.int64())),
        "num_tokens": [len(c) for c in comp],
        "rewards": pa.array([list({k: v[i] for k, v in per_fn.items()}.items()) for i in range(len(rows))],
                            pa.map_(pa.string(), pa.float64()))})
    z = basis.compute(table, context={"eos_token_id": tok.eos_token_id, "max_completion_length": cap})
    return np.array([g for g, _ in rows]), z, lp_old, lp_new, kl


def step_prompts(trained: Trained) -> dict[tuple[int, int], tuple[list[dict], int]]:
    """Every prompt of the step each measured pair (t, t + 1) estimates the change over -- the
    generation the tap measured it on (t two-sided, t + 1 one-sided), all of its prompt groups --
    with the groups the tap measured first, in ``measured_prompts``' order, and how many those are.
    At ``budget=None`` the tap measures every group and the two lists are one."""
    out = {}
    for pair, (rows, gen) in _measured(trained).items():
        rest = [p for p in trained.prompts.get(gen, []) if p not in rows]
        out[pair] = (rows + rest, len(rows))
    return out


def measured_prompts(trained: Trained) -> dict[tuple[int, int], list[dict]]:
    """``_measured``'s prompts alone."""
    return {pair: rows for pair, (rows, _) in _measured(trained).items()}


def _measured(trained: Trained) -> dict[tuple[int, int], tuple[list[dict], int]]:
    """The prompts the tap measured each step pair (t, t + 1) on, read from the record: two-sided,
    the groups of generation t it drew extra completions for (held-out rows filed under step
    t + 1, drawn by step t, group ``h<g>``: the g-th prompt group of generation t); one-sided,
    the groups of generation t + 1 whose rollouts it scored under pi_t (``kl_prev`` recorded).
    A pair the budget left unmeasured has none (it is refused as ``not_measured``). Each with the
    generation its prompts are of."""
    from reward_lens.record.reader import open_run

    run = open_run(trained.record)
    out: dict[tuple[int, int], list[dict]] = {}
    gen: dict[tuple[int, int], int] = {}
    view = run.heldout()
    held = view.read_rollouts(["group_id", "prompt", "drawn_by_step"]).to_pylist() if view is not None else []
    for x in held:
        t1 = x["step"]
        if x["drawn_by_step"] != t1 - 1 or t1 - 1 not in trained.prompts:
            continue
        g = int(str(x["group_id"]).rsplit("h", 1)[1])
        rows = out.setdefault((t1 - 1, t1), [])
        gen[(t1 - 1, t1)] = t1 - 1
        prompt = trained.prompts[t1 - 1][g]
        if prompt.get("prompt", x["prompt"]) != x["prompt"]:
            raise RuntimeError(f"held-out group {x['group_id']} of step {t1} is not prompt {g} of generation {t1 - 1}")
        if prompt not in rows:
            rows.append(prompt)
    scored: dict[int, list] = {}
    for x in run.read_rollouts(["group_id", "kl_prev"]).to_pylist():
        labels = scored.setdefault(x["step"], [])
        if x["group_id"] not in [lab for lab, _ in labels]:
            labels.append((x["group_id"], False))
        if x["kl_prev"] is not None:
            labels[[lab for lab, _ in labels].index(x["group_id"])] = (x["group_id"], True)
    for t1, labels in scored.items():
        if (t1 - 1, t1) in out or t1 not in trained.prompts:
            continue
        idx = [i for i, (_, on) in enumerate(labels) if on]
        if idx:
            out[(t1 - 1, t1)] = [trained.prompts[t1][i] for i in idx]
            gen[(t1 - 1, t1)] = t1
    return {pair: (rows, gen[pair]) for pair, rows in sorted(out.items())}


def pools(trained: Trained, n: int, pairs=None, progress=print) -> dict[tuple[int, int], Pool]:
    """The oracle's samples of every measured step pair (or ``pairs``), ``n`` per prompt and
    policy, for every prompt of the step (``step_prompts``: the groups the tap measured first,
    ``Pool.measured`` of them)."""
    tok, build, rewards, _, basis = _setup(trained.regime)
    pre, post = build(), build()
    pre.eval()
    post.eval()
    every = step_prompts(trained)
    pairs = pairs or [p for p in every if p[1] in trained.params]
    out = {}
    t0 = time.monotonic()
    for t, t1 in pairs:
        pre.load_state_dict(trained.params[t])
        post.load_state_dict(trained.params[t1])
        pool = Pool((t, t1), tuple(basis.names), measured=every[(t, t1)][1])
        for side, policy in (("a", pre), ("b", post)):
            seed = 7_000_003 * t + (0 if side == "a" else 500_009)
            g, z, lo, ln, kl = _score_many(pre, post, tok, basis, rewards, every[(t, t1)][0], n,
                                           trained.regime.cap, seed, policy)
            pool.groups[side], pool.z[side], pool.logp_t[side], pool.logp_t1[side], pool.kl[side] = g, z, lo, ln, kl
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
        if p.measured is not None:
            arrays[f"{t}_{t1}_m_measured"] = np.array(p.measured)
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
        if name == "measured":  # a cache of pools drawn on the measured prompts alone has none: every group
            p.measured = int(data[key])
            continue
        getattr(p, name)[side] = data[key]
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------ the truth
@dataclass
class PairTruth:
    """The oracle's numbers for one step pair, computed here from its own samples (not by the
    package's estimators): plain code for the balance heuristic, scipy for the I-projection."""

    step_pair: tuple[int, int]
    dz: "object"  # (k,) E_{pi_{t+1}}[z] - E_{pi_t}[z], mean over prompts
    dz_se: "object"  # (k,) its sampling error (within prompts: the oracle's own noise)
    d_t: float  # token-level KL along the samples, nats per sequence
    d_t_se: float
    kl_min: float  # the I-projection on both samples combined, nats per sequence
    # eta's own sampling error: the SD of eta over bootstrap redraws of the oracle's samples, and
    # the redraws' mean (``oracle_eta_spread``; NaN until measured)
    eta_sd: float = float("nan")
    eta_boot: float = float("nan")

    @property
    def eta(self) -> float:
        return self.kl_min / self.d_t


def _balance(lp0, lp1, side_a, groups):
    """Per row: the balance-heuristic weights towards pi_{t+1} (q) and pi_t (p), normalised
    within each prompt group, written out from the log-probabilities."""
    import numpy as np

    q, p = np.empty(len(lp0)), np.empty(len(lp0))
    for g in np.unique(groups):
        s = groups == g
        n_a, n_b = int((side_a & s).sum()), int((~side_a & s).sum())
        m = np.maximum(lp0[s], lp1[s])
        mix = n_a * np.exp(lp0[s] - m) + n_b * np.exp(lp1[s] - m)
        qs, ps = np.exp(lp1[s] - m) / mix, np.exp(lp0[s] - m) / mix
        q[s], p[s] = qs / qs.sum(), ps / ps.sum()
    return q, p


def _iproj_scipy(z, lq, lp, groups) -> float:
    """KL_min = max_lambda sum over groups of [lambda . E_q z - log E_p exp(lambda . z)] / G, by BFGS.
    Each group's log-partition is written out (max-shifted sums over the group's rows, the rows
    ordered by group once), not scipy's logsumexp, whose per-call overhead made the oracle's
    bootstrap (``oracle_eta_spread``) cost minutes."""
    import numpy as np
    from scipy import optimize

    order = np.argsort(groups, kind="stable")
    z, lq, lp, groups = z[order], lq[order], lp[order], groups[order]
    gs, starts, sizes = np.unique(groups, return_index=True, return_counts=True)
    q, p = np.exp(lq), np.exp(lp)
    mu = np.add.reduceat(q[:, None] * z, starts, axis=0)  # (G, k) E_q z in each group
    sd = z.std(axis=0)
    keep = sd > 1e-12
    if not keep.any():
        return 0.0
    zs = z[:, keep] / sd[keep]
    mu = mu[:, keep] / sd[keep]
    n_groups = len(gs)

    def parts(lam):
        a = lp + zs @ lam
        m = np.maximum.reduceat(a, starts)
        e = np.exp(a - np.repeat(m, sizes))
        tot = np.add.reduceat(e, starts)
        return m + np.log(tot), e / np.repeat(tot, sizes)  # (G,) log E_p exp(lambda . z), tilted weights

    def f(lam):
        return -float(np.mean(mu @ lam - parts(lam)[0]))

    def grad(lam):
        w = parts(lam)[1]
        return -(mu.sum(axis=0) - w @ zs) / n_groups

    res = optimize.minimize(f, np.zeros(int(keep.sum())), jac=grad, method="BFGS", options={"gtol": 1e-10})
    return max(0.0, -float(res.fun))


def _pooled(pool: Pool):
    """The oracle's samples of both policies as one set of rows: side (True: pi_t's), prompt
    group, features, log pi_t, log pi_{t+1}, token KL."""
    import numpy as np

    side = np.r_[np.ones(len(pool.groups["a"]), bool), np.zeros(len(pool.groups["b"]), bool)]
    groups = np.r_[pool.groups["a"], pool.groups["b"]]
    z = np.vstack([pool.z["a"], pool.z["b"]])
    lp0 = np.r_[pool.logp_t["a"], pool.logp_t["b"]]
    lp1 = np.r_[pool.logp_t1["a"], pool.logp_t1["b"]]
    kl = np.r_[pool.kl["a"], pool.kl["b"]]
    return side, groups, z, lp0, lp1, kl


def _kl_min(z, q, p, groups) -> float:
    import numpy as np

    with np.errstate(divide="ignore"):
        lq, lp = np.log(q), np.log(p)
    return _iproj_scipy(z, np.where(q > 0, lq, -np.inf), np.where(p > 0, lp, -np.inf), groups)


def oracle_truth(pool: Pool) -> PairTruth:
    import numpy as np

    side, groups, z, lp0, lp1, kl = _pooled(pool)
    q, p = _balance(lp0, lp1, side, groups)
    gs = np.unique(groups)
    dz_g, var_g, d_g, dvar_g = [], [], [], []
    for g in gs:
        s = groups == g
        mu_b, mu_a = q[s] @ z[s], p[s] @ z[s]
        dz_g.append(mu_b - mu_a)
        d = q[s] @ kl[s]
        d_g.append(d)
        # the influence of each sample on the group's estimates, its variance summed side by side
        psi = q[s, None] * (z[s] - mu_b) - p[s, None] * (z[s] - mu_a)
        phi = q[s] * (kl[s] - d)
        v, vd = 0.0, 0.0
        for side_rows in (side[s], ~side[s]):
            nn = int(side_rows.sum())
            if nn > 1:
                v = v + ((psi[side_rows] - psi[side_rows].mean(0)) ** 2).sum(0) * nn / (nn - 1)
                vd += float(((phi[side_rows] - phi[side_rows].mean()) ** 2).sum()) * nn / (nn - 1)
        var_g.append(v)
        dvar_g.append(vd)
    G = len(gs)
    return PairTruth(pool.step_pair, np.mean(dz_g, axis=0), np.sqrt(np.sum(var_g, axis=0)) / G,
                     float(np.mean(d_g)), float(np.sqrt(np.sum(dvar_g)) / G), _kl_min(z, q, p, groups))


# Bootstrap redraws of the oracle's own samples that measure its eta's sampling error. D_t's and
# dz's have standard errors from influence functions, added to the record's SE wherever an
# interval is checked against them; eta's is a ratio of an I-projection, and on a sharpened
# policy its error is neither small nor symmetric (the collapsing run: a median SD of a twentieth
# of the record's interval, several times the interval on its narrowest rows, and the redraws'
# mean above the oracle's own eta -- the I-projection of fewer distinct completions reads high,
# the oracle's 128 per prompt and policy included).
ORACLE_BOOTSTRAP = 50


def oracle_eta_spread(pool: Pool, draws: int = ORACLE_BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """The SD of the oracle's eta over ``draws`` redraws of its samples -- each prompt's
    completions of each policy resampled with replacement, the balance heuristic's weights and
    the I-projection worked out again -- and the redraws' mean. Seeded by the step pair."""
    import numpy as np

    side, groups, z, lp0, lp1, kl = _pooled(pool)
    rng = np.random.default_rng([seed, *pool.step_pair])
    strata = [np.flatnonzero((groups == g) & (side == s)) for g in np.unique(groups) for s in (True, False)]
    etas = []
    for _ in range(draws):
        i = np.concatenate([rng.choice(rows, len(rows), replace=True) for rows in strata if len(rows)])
        q, p = _balance(lp0[i], lp1[i], side[i], groups[i])
        d_t = float(np.mean([q[groups[i] == g] @ kl[i][groups[i] == g] for g in np.unique(groups[i])]))
        etas.append(_kl_min(z[i], q, p, groups[i]) / d_t)
    return float(np.std(etas, ddof=1)), float(np.mean(etas))


# ------------------------------------------------------------------------------------ the checks
# A reported dz is within reach of the truth when it lies within this many combined standard
# errors (the record's and the oracle's) of it.
CELL_Z = 3.0
D_T_BAND = (0.8, 1.25)
# Updates this small (nats per sequence) keep their KL in sequences the policy rarely samples: a
# tail that 8 + 4 samples per prompt seldom see.
SMALL_D_T = 0.05
# A step pair whose true eta is below this is, for the features, a step that bought nothing:
# resolving it is a false discovery.
NULL_ETA = 0.02


@dataclass
class Cell:
    step_pair: tuple[int, int]
    feature: str
    status: str  # "reported" | a refusal's premise or reason
    estimate: float | None = None
    se: float | None = None
    truth: float = float("nan")
    truth_se: float = float("nan")

    @property
    def within(self) -> bool:
        import math

        return abs(self.estimate - self.truth) <= CELL_Z * math.sqrt(self.se ** 2 + self.truth_se ** 2)


@dataclass
class RegimeResult:
    regime: str
    pairs: list[tuple[int, int]]
    truths: dict
    cells: list[Cell]
    d_t: dict  # pair -> (record's kl_to_previous or None, in-sample token KL, truth, truth SE, record's SE)
    eta_rows: list  # (pair, status, eta_debiased, interval, truth eta, the interval without its bias bound,
    #                   p-value, the test's degrees of freedom (dfn, dfd), Benjamini-Hochberg's threshold)
    eta_run: tuple | None  # (estimate, (lo, hi), truth over the priced pairs)
    replicates: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    # pair -> the report's D_t from the record's rows: (estimate, SE, its degrees of freedom, truth, truth SE,
    # the sample's own SE, its degrees of freedom); the SE moderated across neighbouring updates
    # (``moderated_d_t_se``), the sample's own beside it
    d_t_report: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # quantity -> its calibration (``_calibration``)
    # what the tap's budget bought: (pairs measured, pairs, median groups per measured pair, of
    # how many, median completions per group and policy)
    bought: tuple = ()
    # where the budget measured a subset of a step's prompt groups: the same comparisons against the
    # truth over the measured groups alone (the second line), and per pair (groups measured, groups)
    measured: "RegimeResult | None" = None
    groups: dict = field(default_factory=dict)

    # ---- summaries
    def reported(self) -> list[Cell]:
        return [c for c in self.cells if c.status == "reported"]

    def refused(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.cells:
            if c.status != "reported":
                out[c.status] = out.get(c.status, 0) + 1
        return out

    def d_t_within(self, which: int = 0) -> tuple[int, int]:
        rows = [v for v in self.d_t.values() if v[which] is not None]
        ok = sum(D_T_BAND[0] <= v[which] / v[2] <= D_T_BAND[1] for v in rows)
        return ok, len(rows)

    def eta_coverage(self, oracle_error: bool = True, bound: bool = True) -> tuple[int, int]:
        """(priced pairs whose 95 % interval of eta covers the truth, priced pairs). With
        ``oracle_error``, as D_t's and dz's: the oracle's own error (its bootstrap SD) added to the
        interval's half-width (``_covers``); else against the oracle's eta alone. ``bound`` False:
        the intervals without their bias bound (``EtaEstimate.bias_bound``)."""
        rows = [(r[0], r[1], r[2], r[3] if bound else r[5], r[4]) for r in self.eta_rows if r[3] is not None]
        if not oracle_error:
            return sum(r[3][0] <= r[4] <= r[3][1] for r in rows), len(rows)
        # the interval need not be centred on the estimate (its lower end allows for D_t's tail,
        # ``eta.tail_low``): the half on the truth's side is the one checked
        return sum(_covers(r[2], _side(r[2], r[3], r[4]), r[4], self.truths[r[0]].eta_sd) for r in rows), len(rows)

    def d_t_coverage(self, own: bool = False, tail: bool = True) -> tuple[int, int]:
        """The report's D_t against the truth on the record's updates: (covered by its 95 %
        interval -- t on its degrees of freedom, the upper end raised by the tail allowance, the
        oracle's own error added (``_covers``) --, updates). ``own``: the interval from the
        sample's own SE, not the moderated one, and without the allowance; ``tail`` False: without
        the allowance."""
        from reward_lens.measure.ledger.moderated import t975

        covered = 0
        for est, se, dof, t, t_se, se_own, dof_own, allowance in self.d_t_report.values():
            if own:  # an SE without degrees of freedom (every stratum constant) states no interval
                se, dof, allowance = se_own, dof_own, None
                if not dof == dof:
                    continue
            # the report's upper end adds the tail allowance (``tail_allowance``), the lower stops at 0
            up = (allowance or 0.0) if t > est and tail else 0.0
            covered += _covers(est, t975(dof) * se + up, t, t_se) if se == se else False
        return covered, len(self.d_t_report)

    def resolved_bias_adjusted(self) -> float | None:
        """``resolved_bias`` with each resolved row's eta adjusted for its selection
        (``selection_adjusted``: a candidate, not adopted)."""
        import numpy as np

        rows = [r for r in self.eta_rows if r[1] == "resolved" and r[3] is not None]
        if not rows:
            return None
        eta, truth, p, dfn, dfd, p_star = (np.array(x, dtype=np.float64)
                                           for x in zip(*[(r[2], r[4], *r[6:10]) for r in rows]))
        return float(np.median(selection_adjusted(eta, p, dfn, dfd, p_star) - truth))

    def resolved_bias(self) -> float | None:
        """The median of (eta - truth) over the resolved rows that state an interval, as the
        book's median over resolved rows (a row whose eta has none -- one prompt group varies --
        is left out of both)."""
        import numpy as np

        diffs = [r[2] - r[4] for r in self.eta_rows if r[1] == "resolved" and r[3] is not None]
        return float(np.median(diffs)) if diffs else None


def _side(estimate: float, interval: tuple[float, float], truth: float) -> float:
    """The half of an interval on the truth's side of the estimate: an interval whose lower end
    allows for D_t's tail (``eta.tail_low``) is not centred on it."""
    return estimate - interval[0] if truth < estimate else interval[1] - estimate


def _covers(estimate: float, half: float, truth: float, truth_sd: float) -> bool:
    """Whether an interval estimate +- half covers a truth that has its own sampling SD: the two
    errors are independent, so the interval's half-width and the truth's 95 % half-width (normal:
    the oracle's is a bootstrap over hundreds of completions) add in quadrature. Not the
    interval's t quantile on the truth's part: on 1 degree of freedom that would widen it by 12.7
    of the truth's SDs. A truth whose SD is unknown (NaN) counts as exact."""
    import math

    extra = 1.959963984540054 * truth_sd if truth_sd == truth_sd else 0.0
    return abs(estimate - truth) <= math.sqrt(half ** 2 + extra ** 2)


def _bought(run, groups: int) -> tuple:
    """What the tap's budget measured, from the record's telemetry: (pairs measured, pairs, median
    prompt groups per measured pair, of ``groups``, median completions per group and policy)."""
    import statistics

    measured = run.telemetry_column("tap_groups")
    per_group = run.telemetry_column("tap_per_group")
    last = max(run.steps.tolist())
    steps = [s for s in run.steps.tolist() if s < last]
    on = [s for s in steps if (measured.get(s) or 0) > 0]
    med = lambda xs: statistics.median(xs) if xs else 0  # noqa: E731
    return (len(on), len(steps), med([measured[s] for s in on]), groups, med([per_group.get(s) or 0 for s in on]))


def _in_sample_d_t(trained: Trained, run, pair: tuple[int, int]) -> float:
    """What the earlier tap's "rollout" estimator recorded as D_t: the token KL(pi_{t+1} || pi_t)
    summed along the rollouts step t trained on (their prefixes drawn from pi_t), averaged."""
    import numpy as np
    import torch

    from reward_lens.measure.whitebox.kl import summed_kl_and_logps

    tok, build, *_ = _setup(trained.regime)
    pre, post = build(), build()
    pre.load_state_dict(trained.params[pair[0]])
    post.load_state_dict(trained.params[pair[1]])
    pre.eval()
    post.eval()
    rows = [x for x in run.read_rollouts(["prompt", "completion_ids"]).to_pylist() if x["step"] == pair[0]]
    per = []
    for x in rows:
        pid = tok(x["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([pid + x["completion_ids"]])
        mask = torch.zeros((1, len(x["completion_ids"])), dtype=torch.bool)
        mask[:] = True
        with torch.no_grad():
            new = post(input_ids=ids).logits[:, len(pid) - 1:-1]
            old = pre(input_ids=ids).logits[:, len(pid) - 1:-1]
        per.append(float(summed_kl_and_logps(new, old, ids[:, len(pid):], mask)[0][0]))
    return float(np.mean(per))


# Redraws of the tap's sampling per update for the calibration lines. The estimates' spread is
# heavy-tailed where a few completions carry most of an update's KL: 20 draws of such an update
# seldom hold one, and their SD reads a fraction of the real one (D_t's real SD / SE on the
# collapsing run read 0.74 at 20 draws per update and 0.89 at 100, the same SEs).
CALIBRATION_DRAWS = 100


def check(trained: Trained, pools_: dict, replicates: int = 20, progress=print,
          calibration_draws: int = CALIBRATION_DRAWS) -> RegimeResult:
    """The record's numbers (what ``reward-lens report`` reads) against the oracle's, pair by
    pair and cell by cell; and, by replicates drawn from the oracle's samples, the estimator's
    bias and real spread."""
    import math

    import numpy as np

    from reward_lens.measure.efficiency.cost import _window_spread
    from reward_lens.measure.efficiency.eta import FDR_Q
    from reward_lens.measure.efficiency.metric import active_index
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    t0 = time.monotonic()
    *_, basis = _setup(trained.regime)
    run = open_run(trained.record)
    samples = steps_from_run(run, basis)
    priced = price_run(run, samples, ledger="paired")
    book = priced.book
    ledgers = {tuple(lg.step_pair): lg for lg in priced.ledgers}
    premises = dict(book.kl_min.premises) if book is not None else {}
    rows = {r.step_pair: r for r in book.rows} if book is not None else {}
    # Benjamini-Hochberg's threshold of the book's decision: q times its rejections over its tests
    decided = [r for r in book.rows if r.status in ("resolved", "unresolved")] if book is not None else []
    p_star = FDR_Q * sum(r.status == "resolved" for r in decided) / max(len(decided), 1)
    d_rec = run.telemetry_column("kl_to_previous")
    d_rec_se = run.telemetry_column("kl_to_previous_se")
    names = list(basis.names)
    # the truth over every prompt of the step (what the report's numbers name), and over the prompts
    # the tap measured (a second line, where the budget measured a subset of the groups)
    truths = {pair: oracle_truth(pool) for pair, pool in pools_.items()}
    for pair, pool in pools_.items():
        truths[pair].eta_sd, truths[pair].eta_boot = oracle_eta_spread(pool)
    subset = {pair: pool.restricted() for pair, pool in pools_.items()}
    subset = {pair: pool for pair, pool in subset.items() if pool is not pools_[pair]}
    in_sample = {pair: _in_sample_d_t(trained, run, pair) for pair in truths}
    active = {}
    if priced.metric is not None:
        active = {pair: active_index(priced.metric.names, priced.metric.active_of(pair[0])) for pair in truths}
    moderated = _moderated(ledgers)

    def compare(truths: dict) -> RegimeResult:
        cells, d_t, eta_rows = [], {}, []
        for pair, truth in truths.items():
            lg = ledgers.get(pair)
            why = (priced.not_formed[pair].reason if pair in priced.not_formed else premises.get(pair)
                   or (None if lg is not None else "not formed"))
            for j, n in enumerate(names):
                if why is not None:
                    cells.append(Cell(pair, n, why, truth=float(truth.dz[j]), truth_se=float(truth.dz_se[j])))
                elif not lg.se[j] > 0:
                    cells.append(Cell(pair, n, "constant in every group", truth=float(truth.dz[j]),
                                      truth_se=float(truth.dz_se[j])))
                else:
                    cells.append(Cell(pair, n, "reported", float(lg.delta_z[j]), float(lg.se[j]), float(truth.dz[j]),
                                      float(truth.dz_se[j])))
            d_t[pair] = (d_rec.get(pair[0]), in_sample[pair], truth.d_t, truth.d_t_se,
                         d_rec_se.get(pair[0], float("nan")))
            r = rows.get(pair)
            if r is not None and r.efficiency_debiased is not None:
                est = book.estimates[pair]
                eta_rows.append((pair, r.status, r.efficiency_debiased, r.interval, truth.eta,
                                 (dataclasses.replace(est, bias_bound=None).interval()
                                  if r.interval is not None else None),
                                 r.p_value, *_rollout_dfs(lg, active[pair]), p_star))
        eta_run = None
        run_est = book.run_level() if book is not None else None
        if run_est is not None:
            checked = [r[0] for r in eta_rows]
            truth_run = sum(truths[p].kl_min for p in checked) / sum(truths[p].d_t for p in checked)
            eta_run = (run_est.eta_debiased, run_est.interval(), truth_run)
        result = RegimeResult(trained.regime.name, list(truths), truths, cells, d_t, eta_rows, eta_run)
        result.bought = _bought(run, trained.regime.prompts_per_step)
        for pair, truth in truths.items():
            lg = ledgers.get(pair)
            if lg is not None and pair in moderated:
                result.d_t_report[pair] = (lg.d_t, *moderated[pair], truth.d_t, truth.d_t_se, lg.d_t_se, lg.d_t_dof,
                                           lg.d_t_tail)
                # the interval ``d_t_coverage`` checks is the one the book states, where the book has the row
                row = rows.get(pair)
                stated = getattr(row, "kl_spent_interval", None) if row is not None else None
                if stated is not None:
                    mine = _window_spread(lg.d_t, [moderated[pair]], [lg.d_t_tail])[1] or (math.nan, math.nan)
                    if not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(mine, stated)):
                        raise RuntimeError(f"{pair}: the harness's D_t interval {mine} is not the book's {stated}")
        return result

    result = compare(truths)
    if subset:
        measured = {pair: oracle_truth(pool) for pair, pool in subset.items()}
        for pair, pool in subset.items():
            measured[pair].eta_sd, measured[pair].eta_boot = oracle_eta_spread(pool)
        result.measured = compare({pair: measured.get(pair, truth) for pair, truth in truths.items()})
        result.groups = {pair: (pool.measured, pool.n_groups) for pair, pool in pools_.items()}
    result.seconds["check"] = time.monotonic() - t0
    if replicates:
        result.replicates = _replicates(pools_, truths, names, replicates)
        # the completions per group and policy the tap drew for each pair (its budget's shape)
        tel = run.telemetry_column("tap_per_group")
        per_group = {pair: int(tel[pair[0]]) for pair in truths if (tel.get(pair[0]) or 0) >= 2}
        result.calibration = _calibration(pools_, truths, names, calibration_draws, active, per_group=per_group)
        # what the redraws drew: the median completions per group and policy, and whether any pair's
        # groups were a subset of the step's (the calibration line says so)
        result.calibration["shape"] = (statistics.median([per_group.get(pair, 4) for pair in truths] or [4]),
                                       result.measured is not None)
    progress(f"{trained.regime.name}: checked in {time.monotonic() - t0:.0f} s")
    return result


def _moderated(ledgers: dict) -> dict:
    """pair -> (SE, degrees of freedom) of D_t moderated across a run's updates (``ledgers``:
    pair -> paired ledger), as the report forms them (``moderated_by_pair``)."""
    from reward_lens.measure.ledger.moderated import moderated_by_pair

    return moderated_by_pair(ledgers.values())


def _draw(pool: Pool, pair: tuple[int, int], names: list[str], rng, m: int, h: int):
    """One redraw of the record's sampling from the oracle's samples of a pair: ``m`` of pi_{t+1}'s
    and ``h`` of pi_t's per prompt, without replacement. Where the tap measured ``pool.measured``
    of the step's groups (a budget), as many groups are drawn afresh, uniformly without
    replacement, as the tap draws them, and the others' rows are left unscored (null log pi_t and
    token KL, no held-out rows: the record a budgeted tap writes), so the ledger knows the step's
    groups. Returns the two sides as StepSamples and log pi_{t+1} of the scored rows in the
    ledger's order (side b, then side a)."""
    import numpy as np

    from reward_lens.measure.ledger.price import StepSample

    groups = np.unique(pool.groups["b"])
    scored = set(groups.tolist())
    if pool.measured is not None and pool.measured < len(groups):
        scored = set(rng.choice(groups, pool.measured, replace=False).tolist())
    sb, sa = [], []
    for g in groups:
        sb.append(rng.choice(np.flatnonzero(pool.groups["b"] == g), m, replace=False))
        if g in scored:
            sa.append(rng.choice(np.flatnonzero(pool.groups["a"] == g), h, replace=False))
    ib, ia = np.concatenate(sb), np.concatenate(sa)
    on = np.isin(pool.groups["b"][ib], list(scored))

    def blank(a):
        return a if on.all() else np.where(on, a, np.nan)

    roll = StepSample(pair[1], tuple(names), pool.z["b"][ib], groups=pool.groups["b"][ib], logp=pool.logp_t1["b"][ib],
                      logp_prev=blank(pool.logp_t["b"][ib]), kl_prev=blank(pool.kl["b"][ib]))
    held = StepSample(pair[1], tuple(names), pool.z["a"][ia], groups=pool.groups["a"][ia], logp=pool.logp_t1["a"][ia],
                      logp_prev=pool.logp_t["a"][ia], kl_prev=pool.kl["a"][ia])
    return roll, held, np.r_[pool.logp_t1["b"][ib][on], pool.logp_t1["a"][ia]]


def _replicates(pools_: dict, truths: dict, names: list[str], r: int, m: int = 8, hs=(0, 4)) -> dict:
    """The record's sampling redrawn ``r`` times from the oracle's samples, through the
    package's ledger -- one-sided (h = 0: the m rollouts of pi_{t+1} per prompt the next
    generation trained on, scored under pi_t) and two-sided (h > 0: as the tap measures a pair,
    h extra completions per prompt from each policy, pi_t's and pi_{t+1}'s): per
    h, the cells whose mean estimate is biased beyond 3 standard errors of that mean, the median
    |bias| / SD, and the median of the real SD over the reported SE. The draws are subsets of
    the oracle's samples, so their target is the oracle's number exactly: its own error is not
    added (``_calibration``)."""
    import numpy as np

    from reward_lens.measure.decisions import t_dof
    from reward_lens.measure.ledger.paired import paired_ledger

    from scipy import special

    rng = np.random.default_rng(0)
    out = {}
    for h in hs:
        mb = h if h else m  # side b: the extra completions of pi_{t+1} (two-sided), else the rollouts
        biased = total = covered = tried = 0
        ratios, sd_se = [], []
        d_in_band, d_mean, d_sd = [], [], []  # per pair: the share of draws in the band, mean / truth, SD / truth
        for pair, pool in pools_.items():
            truth = truths[pair]
            est, ses, d_ts = [], [], []
            for _ in range(r):
                roll, held, _ = _draw(pool, pair, names, rng, mb, h)
                lg = paired_ledger(roll, heldout=held if h else None)
                if getattr(lg, "d_t", None) is not None:  # the tap's D_t: recorded whatever the premises
                    d_ts.append(lg.d_t / truth.d_t)
                if hasattr(lg, "delta_z") and lg.premise() is None:  # as the books: a failed premise is refused
                    est.append(lg.delta_z)
                    ses.append(lg.se)
                    # the t quantiles the effect book uses: the ledger's own degrees of freedom
                    q = special.stdtrit(np.maximum(t_dof(lg, len(names)), 1.0), 0.975)
                    seen = lg.se > 0
                    off = np.abs(lg.delta_z - truth.dz) <= q * lg.se  # subsets of the oracle's samples: its number, exactly
                    covered += int((off & seen).sum())
                    tried += int(seen.sum())
            if len(d_ts) > 1:
                d_ts = np.array(d_ts)
                d_in_band.append(float(np.mean((d_ts >= D_T_BAND[0]) & (d_ts <= D_T_BAND[1]))))
                d_mean.append(float(d_ts.mean()))
                d_sd.append(float(d_ts.std(ddof=1)))
            if len(est) < 2:
                continue
            est, ses = np.array(est), np.array(ses)
            for j in range(len(names)):
                sd = est[:, j].std(ddof=1)
                if not sd > 0:
                    continue
                total += 1
                bias = est[:, j].mean() - truth.dz[j]
                biased += abs(bias) > 3 * sd / np.sqrt(len(est))
                ratios.append(abs(bias) / sd)
                pos = ses[:, j] > 0  # the draws that state an SE: the spread over the same draws (_calibration)
                sd_pos = est[pos, j].std(ddof=1) if pos.sum() >= 2 else 0.0
                if sd_pos > 0:
                    sd_se.append(sd_pos / np.sqrt(np.mean(ses[pos, j] ** 2)))
        out[h] = {"cells": total, "biased": int(biased), "median_bias_over_sd": float(np.median(ratios)),
                  "median_sd_over_se": float(np.median(sd_se)), "replicates": r,
                  "coverage": covered / tried if tried else None,
                  "d_t_in_band": float(np.mean(d_in_band)) if d_in_band else None,
                  "d_t_mean_over_truth": float(np.median(d_mean)) if d_mean else None,
                  "d_t_sd_over_truth": (float(np.median(d_sd)), float(np.max(d_sd))) if d_sd else None}
    return out


def _calibration(pools_: dict, truths: dict, names: list[str], r: int, active: dict, m: int = 4, h: int = 4,
                 per_group: dict | None = None) -> dict:
    """The tap's two-sided sampling (m extra completions of pi_{t+1} and h of pi_t per prompt; where
    ``per_group`` has the pair, as many of each as the tap drew for it) redrawn ``r`` times from the
    oracle's samples -- for the same prompts, or, where the tap measured a subset of the step's
    groups (a budget), on as many groups drawn afresh each time (``_draw``) --: per update and quantity,
    the real SD of the estimate over the draws against the root mean square of the SE the
    package reports (D_t's and dz's conditional on the prompts: the stratified jackknife over
    each prompt's completions of each policy, D_t's moderated across updates; eta's from the
    delete-one-group jackknife, pooled with the neighbouring updates' as the book pools it), and
    how often its 95 % interval covers the truth (t on the SE's degrees of freedom). Per quantity:
    the ratios of every update, the coverage over every draw.

    The draws are subsets of the oracle's own samples, so the number they scatter around is the
    oracle's, exactly (the mean of the draws' D_t over it: 1.00 in both regimes): its own error is
    not added to the intervals here. Where the record's estimates -- samples independent of the
    oracle's -- are checked against it (``d_t_coverage``, ``eta_coverage``, ``Cell.within``), it is.
    (Until issue 41's review it was added here too, and read D_t's coverage as 89.9 % and 91.4 %
    where it is 83.6 % and 60.7 %.)"""
    import math

    import numpy as np
    from scipy import special

    from reward_lens.measure.decisions import t_dof
    from reward_lens.measure.efficiency.cost import _window_spread
    from reward_lens.measure.efficiency.eta import EtaColumns, moderate, paired_estimates
    from reward_lens.measure.ledger.paired import paired_ledger, tail_allowance

    rng = np.random.default_rng(1)
    # per update: the real SD over the root mean square of the SEs ("ratio"), and the median draw's
    # SE over the real SD ("typical"): the first hides an SE that is small on most draws and large
    # on a few (on the collapsing run D_t's reads 0.97 while its typical draw's SE is a third of the SD)
    out = {q: {"ratio": [], "typical": [], "covered": 0, "draws": 0} for q in ("d_t", "dz", "eta")}

    def q975(dof):
        return float(special.stdtrit(max(dof, 1.0), 0.975)) if dof == dof and math.isfinite(dof) else 1.959963984540054

    tails = []
    drawn = {}  # pair -> its r draws (None where a draw has no D_t), for D_t's moderation across updates
    priced_draws: dict[int, list] = {}  # draw j -> (p, estimable, eta - truth) of each pair it prices
    run_draws: dict[int, list] = {}  # draw j -> (estimate, truth) of each pair it prices: its run-level eta
    for pair, pool in pools_.items():
        truth = truths[pair]
        lgs, logps, every = [], [], []
        for _ in range(r):
            k = (per_group or {}).get(pair)
            roll, held, logp = _draw(pool, pair, names, rng, k or m, k or h)
            lg = paired_ledger(roll, heldout=held)
            if getattr(lg, "d_t", None) is not None and lg.d_t_se is not None:
                lgs.append(lg)
                logps.append(logp)
                every.append((lg, logp))
            else:
                every.append(None)
        drawn[pair] = every
        if len(lgs) < 2:
            continue
        # dz and eta: the draws whose premises hold, as the books
        ok = [lg for lg in lgs if lg.premise() is None]
        if len(ok) >= 2:
            dz = np.stack([lg.delta_z for lg in ok])
            se = np.stack([lg.se for lg in ok])
            c = out["dz"]
            for j in range(len(names)):
                # the draws where the book states an SE for the cell: one with none (a behaviour
                # constant in every prompt group, dz exactly 0) is refused by name, not reported,
                # so its draws enter neither the spread nor the SE (the coverage below reads the
                # same draws). Before, the spread counted them and the SE did not: on the
                # collapsing run, where most behaviours vary in few groups, that read 0.71
                pos = se[:, j] > 0
                sd = dz[pos, j].std(ddof=1) if pos.sum() >= 2 else 0.0
                if sd > 0:
                    c["ratio"].append(sd / math.sqrt(np.mean(se[pos, j] ** 2)))
                    c["typical"].append(float(np.median(se[pos, j])) / sd)
                for lg, e in zip(ok, se[:, j]):
                    if e > 0:
                        q = q975(t_dof(lg, len(names))[j])
                        c["covered"] += abs(lg.delta_z[j] - truth.dz[j]) <= q * e
                        c["draws"] += 1
        idx = active.get(pair)
        if idx is None or not len(idx) or len(ok) < 2:
            continue
        # as the book: a draw in which no priced feature varies within any prompt group prices
        # nothing, one in which it varies in one group states no interval (``estimable``), and one
        # whose KL_min exceeds its D_t beyond noise is refused (ENVELOPE_VIOLATED): neither enters
        # the run's decision nor lends its SE to its neighbours
        every_est = paired_estimates([(lg, idx) for lg in ok])
        js = [j for j, x in enumerate(every) if x is not None and x[0].premise() is None]  # ok's draws
        refused = EtaColumns.of(every_est, "paired").outside_envelope
        for j, e, no in zip(js, every_est, refused.tolist()):
            if e.groups_varying != 0 and not no:  # priced: in the redrawn run j's book-wide decision
                priced_draws.setdefault(j, []).append((e.p_value, e.estimable, e.eta_debiased - truth.eta,
                                                       _heldout_test(every[j][0], idx), e.eta_debiased,
                                                       truth.eta, *_rollout_dfs(every[j][0], idx)))
                run_draws.setdefault(j, []).append((e, truth))
    # eta's intervals as the report states them: in each redrawn run j, each row's SE pooled with
    # its neighbouring updates' (``eta.moderate``, over the run's priced rows in step order); and
    # with the jackknife's own SE (``eta_own``), as before

    per_pair: dict = {}  # pair -> [(the estimate with its SE pooled, its truth)]
    for j, got in run_draws.items():
        got = sorted(got, key=lambda x: x[0].step_pair)
        pooled = moderate(EtaColumns.of([e for e, _ in got], "paired"))
        for i, (_, truth) in enumerate(got):
            per_pair.setdefault(truth.step_pair, []).append((pooled.estimate(i), truth))
    out["eta_own"] = {"ratio": [], "typical": [], "covered": 0, "draws": 0}
    for pair in sorted(per_pair):
        rows = [(e, truth) for e, truth in per_pair[pair] if e.estimable]
        if len(rows) < 2:
            continue
        truth = rows[0][1]
        eta = np.array([e.eta_debiased for e, _ in rows])
        for key, ses, ivs in (("eta", np.array([e.se for e, _ in rows]), [e.interval() for e, _ in rows]),
                              ("eta_own", np.array([e.own_se for e, _ in rows]),
                               # as before issue 41's pooling and allowances: the jackknife's SE, no tail
                               # allowance, no bias bound
                               [dataclasses.replace(e, se_pooled=None, dof_pooled=None, d_t_tail=0.0,
                                                    bias_bound=None).interval() for e, _ in rows])):
            c = out[key]
            if np.isfinite(ses).all() and eta.std(ddof=1) > 0:
                c["ratio"].append(eta.std(ddof=1) / math.sqrt(np.mean(ses ** 2)))
                c["typical"].append(float(np.median(ses)) / eta.std(ddof=1))
            c["covered"] += sum(lo <= truth.eta <= hi for lo, hi in ivs)
            c["draws"] += len(rows)
            if key == "eta":
                # the same intervals without the bias bound (``EtaEstimate.bias_bound``): what it buys
                c["unbounded"] = c.get("unbounded", 0) + sum(
                    lo <= truth.eta <= hi for lo, hi in (dataclasses.replace(e, bias_bound=None).interval()
                                                         for e, _ in rows))
    # D_t, every draw (the tap records it whatever the premises), as the report forms its SE: the
    # j-th draws of every update are one redrawn run, its SEs moderated across its updates
    # (``moderated_d_t_se``); and with the sample's own SE (``d_t_own``), as before
    mod = {}
    for j in range(r):
        run_j = {pair: every[j][0] for pair, every in drawn.items() if every[j] is not None}
        for pair, v in _moderated(run_j).items():
            mod[(pair, j)] = v
    out["d_t_own"] = {"ratio": [], "typical": [], "covered": 0, "draws": 0}
    for pair, every in drawn.items():
        truth = truths[pair]
        got = [(j, x) for j, x in enumerate(every) if x is not None and (pair, j) in mod]
        if len(got) < 2:
            continue
        d = np.array([x[0].d_t for _, x in got])
        for key, se, dofs in (("d_t", np.array([mod[(pair, j)][0] for j, _ in got]),
                               [mod[(pair, j)][1] for j, _ in got]),
                              ("d_t_own", np.array([x[0].d_t_se for _, x in got]), [x[0].d_t_dof for _, x in got])):
            c = out[key]
            c["ratio"].append(d.std(ddof=1) / math.sqrt(np.mean(se ** 2)))
            if d.std(ddof=1) > 0:
                c["typical"].append(float(np.median(se)) / d.std(ddof=1))
            for (_, (lg, lp)), e, f in zip(got, se, dofs):
                if key == "d_t":  # the interval the report states (``cost._window_spread``): the tail allowance added above
                    iv = _window_spread(lg.d_t, [(e, f)], [lg.d_t_tail])[1]
                    inside = iv[0] <= truth.d_t <= iv[1] if iv is not None else lg.d_t == truth.d_t
                    c["covered_no_tail"] = c.get("covered_no_tail", 0) + bool(abs(lg.d_t - truth.d_t) <= q975(f) * e)
                    # the small updates alone, and the allowance at other sharpness thresholds (measured, not adopted)
                    if lg.d_t < SMALL_D_T:
                        c["small_covered"] = c.get("small_covered", 0) + bool(inside)
                        c["small_draws"] = c.get("small_draws", 0) + 1
                    c["allowed"] = c.get("allowed", 0) + bool(lg.d_t_tail and lg.d_t_tail > 0)
                    if lg.d_t_tail and lg.d_t_tail > 0 and lg.d_t > 0:
                        c.setdefault("allowance_share", []).append(lg.d_t_tail / lg.d_t)
                    for th in SHARP_SWEEP:
                        a = float(tail_allowance(lp[None], (lp - lg.log_ratio)[None], lg.kl[None], lg.codes,
                                                 lg.n_groups, sharp=th)[0])
                        jv = _window_spread(lg.d_t, [(e, f)], [a])[1]
                        c.setdefault("sweep", {}).setdefault(th, 0)
                        c["sweep"][th] += bool(jv[0] <= truth.d_t <= jv[1] if jv is not None else lg.d_t == truth.d_t)
                else:
                    inside = abs(lg.d_t - truth.d_t) <= q975(f) * e
                c["covered"] += inside
                c["draws"] += 1
                if key == "d_t":
                    values = _tail_values(lg, lp)
                    # the interval says itself that D_t is not measured to the band (half-width above
                    # a quarter of it), or the update is small on a sharpened policy
                    values["wide_or_small_sharp"] = float(q975(f) * e > (D_T_BAND[1] - 1.0) * lg.d_t
                                                          or values["small_sharp"] > 0)
                    tails.append((values, not D_T_BAND[0] <= lg.d_t / truth.d_t <= D_T_BAND[1], not inside))
    out["tail"] = _tail_separation(tails) if tails else {}
    for name, _ in FLAG_CANDIDATES:
        out[name] = _flag_separation(tails, name) if tails else {}
    out["windows"] = _window_sweep(drawn, truths, r)
    out["draws_per_update"] = r
    out["eta_selection"] = _selection(priced_draws)
    out["eta_run"] = _run_levels(run_draws)
    return out


# The sharpness thresholds of D_t's tail allowance measured beside the book's (``SHARP_SEEN``, 0.5).
SHARP_SWEEP = (0.3, 0.5, 0.7, 0.9)

# The windows the moderation of D_t's SE was chosen among (measured updates on either side; None:
# the whole run), each measured on the same redrawn runs (``_window_sweep``).
SWEPT_WINDOWS = (1, 2, 3, 5, 8, None)


def _window_sweep(drawn: dict, truths: dict, r: int) -> dict:
    """For each window of ``SWEPT_WINDOWS``: the 95 % intervals of D_t moderated with it over the
    redrawn runs (``drawn``: pair -> its draws, as ``_calibration``), their coverage over draws and
    the median over updates of the real SD over the SE's root mean square."""
    import math

    import numpy as np

    from reward_lens.measure.ledger.moderated import moderated_d_t_se, t975

    out = {}
    pairs = sorted(drawn)
    for w in SWEPT_WINDOWS:
        per: dict = {}
        for j in range(r):
            got = [(p, drawn[p][j][0]) for p in pairs if drawn[p][j] is not None]
            if not got:
                continue
            se, dof = moderated_d_t_se([lg.d_t for _, lg in got], [lg.d_t_se for _, lg in got],
                                       [lg.d_t_dof for _, lg in got], [lg.n_groups for _, lg in got],
                                       window=len(got) if w is None else w)
            for (p, lg), e, f in zip(got, se, dof):
                per.setdefault(p, []).append((lg.d_t, e, f))
        covered = draws = 0
        ratios = []
        for p, rows in per.items():
            if len(rows) < 2:
                continue
            d = np.array([x[0] for x in rows])
            e = np.array([x[1] for x in rows])
            ratios.append(d.std(ddof=1) / math.sqrt(np.mean(e ** 2)))
            covered += sum(abs(a - truths[p].d_t) <= t975(f) * b for a, b, f in rows)
            draws += len(rows)
        out[w] = (covered / draws if draws else float("nan"), float(np.median(ratios)) if ratios else float("nan"))
    return out


def _run_levels(run_draws: dict[int, list]) -> dict:
    """The run-level eta of each redrawn run (``eta.run_level`` over every pair it prices, as the
    book), against the truth over the same pairs (sum KL_min / sum D_t, the oracle's): how often
    its 95 % interval covers, and the runs' spread against the interval's SE."""
    import numpy as np

    from reward_lens.measure.efficiency.eta import run_level

    covered, errors, ses = 0, [], []
    for rows in run_draws.values():
        est = run_level([e for e, _ in rows])
        truth = sum(t.kl_min for _, t in rows) / sum(t.d_t for _, t in rows)
        lo, hi = est.interval()
        covered += lo <= truth <= hi
        errors.append(est.eta_debiased - truth)
        ses.append(est.se)
    n = len(errors)
    return {"runs": n, "covered": covered, "median_error": float(np.median(errors)) if n else None,
            "sd_over_se": float(np.std(errors, ddof=1) / np.sqrt(np.mean(np.square(ses)))) if n > 1 else None}


def _heldout_test(lg, idx) -> float:
    """A candidate for the book's decision that eta does not read twice: the within-group F test
    of the log-ratio on the priced features (``within_group_r2_tests``, the book's test) on the
    held-out side's rows alone, where the book tests the rollouts'. eta still reads both sides, so
    the held-out side's noise still selects it, on half of its sample."""
    import numpy as np

    from reward_lens.measure.efficiency.eta import within_group_r2_tests

    held = np.asarray(lg.heldout, dtype=bool)
    kept, g = np.unique(np.asarray(lg.codes)[held], return_inverse=True)
    z = np.asarray(lg.z, dtype=np.float64)[held][:, idx]
    r = np.asarray(lg.log_ratio, dtype=np.float64)[held]
    return float(within_group_r2_tests(z[None], r[None], g, len(kept))[1][0])


def _rollout_dfs(lg, idx) -> tuple[int, int]:
    """The degrees of freedom of the book's test of a paired sample (``eta.rollout_test``: the
    within-group F test over the rollouts' side, every row of a one-sided sample): the priced
    features, and the rows less the groups less the features."""
    import numpy as np

    codes = np.asarray(lg.codes)
    if lg.heldout is not None:  # two-sided: the test reads the rollouts' side (a one-sided sample is all rollouts)
        codes = codes[~np.asarray(lg.heldout, dtype=bool)]
    return len(idx), len(codes) - len(np.unique(codes)) - len(idx)


# Bisection steps of ``selection_adjusted`` (each halves the bracket of the noncentrality).
SELECTION_BISECTIONS = 60


def selection_adjusted(eta, p, dfn, dfd, p_star):
    """A candidate for the resolved rows' lean, measured, not adopted: eta scaled by how much the
    selection inflated the test's noncentrality. The book's test is an F test (``rollout_test``),
    under the noncentral F(dfn, dfd, lambda) with lambda about 2 n KL_min / sigma^2 to first
    order, and a row is resolved when its p-value is at most Benjamini-Hochberg's threshold
    ``p_star`` (the row's run's rejections times q over its tests). The conditional
    median-unbiased lambda given that selection over the unconditional one
    (``selection_lambdas``; the winner's-curse correction of Zhong & Prentice, Biostatistics 2008,
    for an F) is the factor, 0 where the conditional one is 0. It treats eta's noise as the
    test's, which it is only in part (eta reads the held-out side too), and sets a barely resolved
    row's eta to 0: measured for the owner's choice, not adopted. Elementwise on arrays."""
    import numpy as np

    eta = np.asarray(eta, dtype=np.float64)
    lam_u, lam_c = selection_lambdas(p, dfn, dfd, p_star)
    factor = np.where(np.isinf(lam_u), 1.0, lam_c / np.where((lam_u > 0) & np.isfinite(lam_u), lam_u, 1.0))
    return np.where(lam_u > 0, eta * factor, eta)


def selection_lambdas(p, dfn, dfd, p_star):
    """(lambda_u, lambda_c) of F tests with p-values ``p`` on (dfn, dfd) degrees of freedom,
    selected where p <= ``p_star``: the unconditional median-unbiased noncentrality, P(F > F_obs;
    lambda_u) = 1/2, and the conditional one given the selection, P(F > F_obs | F > F_c;
    lambda_c) = 1/2 (F_c the threshold's F), each 0 where even lambda = 0 puts half the mass
    above F_obs, both infinite where p is 0 (its F beyond a float). Both probabilities increase
    with lambda (the noncentral F's monotone likelihood ratio): ``SELECTION_BISECTIONS``
    bisections each. Elementwise on arrays."""
    import numpy as np
    from scipy import special, stats

    p, dfn, dfd, p_star = (np.asarray(x, dtype=np.float64) for x in (p, dfn, dfd, p_star))
    if not (np.all(dfd >= 1) and np.all(dfn >= 1)):
        raise ValueError("selection_lambdas: an F test needs at least one degree of freedom on either side")
    f_obs = stats.f.isf(p, dfn, dfd)
    f_c = stats.f.isf(p_star, dfn, dfd)
    strong = ~np.isfinite(f_obs)  # a p-value of 0 (below the smallest float): no selection to undo
    f_obs = np.where(strong, 1.0, f_obs)

    def sf(f, lam):
        return 1.0 - special.ncfdtr(dfn, dfd, lam, f)

    def solve(half_at) -> np.ndarray:  # the lambda where half_at(lambda) = 1/2
        lo, hi = np.zeros_like(f_obs), 4.0 * dfn * f_obs + 100.0
        zero = half_at(lo) >= 0.5
        for _ in range(SELECTION_BISECTIONS):
            mid = 0.5 * (lo + hi)
            up = half_at(mid) < 0.5
            lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
        return np.where(zero, 0.0, 0.5 * (lo + hi))

    with np.errstate(divide="ignore", invalid="ignore"):
        lam_u = solve(lambda lam: sf(f_obs, lam))
        lam_c = solve(lambda lam: sf(f_obs, lam) / np.maximum(sf(f_c, lam), 1e-300))
    return np.where(strong, np.inf, lam_u), np.where(strong, np.inf, lam_c)


def _selection(priced_draws: dict[int, list]) -> dict:
    """eta - truth over the redrawn runs' rows that state an interval: every one, those the
    run's book-wide decision resolves (Benjamini-Hochberg over each redrawn run's priced pairs,
    as the book decides), and the others. A row is resolved when its test rejects, and the test
    reads the same sample as eta: the resolved rows are selected on their own noise. Beside it,
    the same decision made on the held-out side's test alone (``_heldout_test``), measured as a
    candidate, not adopted.

    ``per_run``: each redrawn run's own median over the rows it resolves (those with an interval;
    runs that resolve none are left out), the statistic the record gives once. Its spread over the
    draws says how far one record's figure can sit from where the estimator centres by chance."""
    import numpy as np

    from reward_lens.measure.efficiency.eta import FDR_Q, benjamini_hochberg

    every, resolved, other, held, adjusted, per_run = [], [], [], [], [], []
    for rows in priced_draws.values():
        n_before = len(resolved)
        decided = benjamini_hochberg([r[0] for r in rows])
        by_held = benjamini_hochberg([r[3] for r in rows])
        p_star = FDR_Q * int(decided.sum()) / len(rows)
        for (p, estimable, diff, _, eta, truth, dfn, dfd), rej, rej_h in zip(rows, decided, by_held):
            if estimable:
                every.append(diff)
                (resolved if rej else other).append(diff)
                if rej_h:
                    held.append(diff)
                if rej:
                    adjusted.append((eta, truth, p, dfn, dfd, p_star))
        if len(resolved) > n_before:
            per_run.append(float(np.median(resolved[n_before:])))
    if adjusted:
        eta, truth, *rest = (np.array(x, dtype=np.float64) for x in zip(*adjusted))
        adjusted = (selection_adjusted(eta, *rest) - truth).tolist()

    def med(x):
        return float(np.median(x)) if x else None

    return {"every": med(every), "resolved": med(resolved), "other": med(other), "n_resolved": len(resolved),
            "n": len(every), "heldout": med(held), "n_heldout": len(held), "adjusted": med(adjusted),
            "per_run": per_run}


# The tail diagnostics the issue proposed for a D_t whose sample missed where its KL sits, each
# measured on the draws of ``_calibration`` (what it would flag, at the thresholds that flag a
# quarter and a tenth of the draws) before any was chosen: (name, words, flags high values).
TAIL_CANDIDATES = (
    ("khat", "Pareto k-hat of the rows' contributions q_i kl_i to D_t", True),
    ("ess", "effective sample size of the weaker side, per row", False),
    ("max_kl", "largest token KL along a row over D_t (a bound from the largest log-ratio seen)", True),
    ("unseen", "pi_{t+1}'s mass outside the sampled sequences times the largest KL seen, over D_t", True),
)


# Yes-or-no candidates for a tail flag on D_t (``_flag_separation``), measured on the same draws.
FLAG_CANDIDATES = (
    ("small_sharp", f"an update under {SMALL_D_T:g} nats of a sharpened policy (its sample's distinct completions "
                    "hold half of pi_{t+1}'s mass in the median prompt group)"),
    ("wide_or_small_sharp", "the same, or an interval whose half-width exceeds a quarter of D_t (not measured to "
                            "the band)"),
)


def _tail_values(lg, logp_next) -> dict:
    """The candidates of ``TAIL_CANDIDATES`` on one paired sample (``logp_next``: log pi_{t+1}
    of its rows, which names a sequence: equal rows of a group are one sequence)."""
    import numpy as np

    from reward_lens.measure.ledger.paired import mis_log_weights, pareto_khats

    side = lg.heldout if lg.heldout is not None else np.zeros(len(lg.codes), dtype=bool)
    q = np.exp(mis_log_weights(lg.log_ratio, lg.heldout, lg.codes, lg.n_groups)[0])
    contrib = q * lg.kl * np.bincount(lg.codes)[lg.codes]
    d = max(lg.d_t, 1e-300)
    unseen, seen = 0.0, []
    for g in range(lg.n_groups):
        rows = lg.codes == g
        mass = float(np.exp(_distinct(logp_next[rows], logp_next[rows] - lg.log_ratio[rows])).sum())
        seen.append(mass)
        unseen += max(0.0, 1.0 - mass) * float(lg.kl[rows].max())
    return {"khat": float(pareto_khats(np.log(np.maximum(contrib, 1e-300))[None])[0]),
            "ess": min(lg.ess[0] / max(int(side.sum()), 1), lg.ess[1] / max(int((~side).sum()), 1)),
            "max_kl": float(lg.kl.max()) / d, "unseen": unseen / lg.n_groups / d,
            "small_sharp": float(lg.d_t < SMALL_D_T and float(np.median(seen)) >= 0.5)}


def _distinct(logp_next, logp_prev, tol: float = 1e-4):
    """log pi_{t+1} of each distinct sequence among rows (one prompt group): rows whose
    log-probabilities under both policies agree within ``tol`` nats are one sequence. The same
    completion scored in two batches differs by up to ~1e-5 (padding); rounding to a fixed number
    of decimals split such pairs at a rounding edge (an earlier version counted them twice)."""
    import numpy as np

    kept: list[tuple[float, float]] = []
    for a, b in zip(np.asarray(logp_next, dtype=float).tolist(), np.asarray(logp_prev, dtype=float).tolist()):
        if not any(abs(a - x) <= tol and abs(b - y) <= tol for x, y in kept):  # a group's few rows
            kept.append((a, b))
    return np.array([x for x, _ in kept])


def _flag_separation(draws: list, name: str) -> dict:
    """A yes-or-no candidate (``draws`` as ``_tail_separation``'s): the share of the draws it
    flags, of the band's misses and of the intervals' misses it flags, and the intervals'
    coverage over the draws it leaves."""
    import numpy as np

    flag = np.array([d[0][name] > 0 for d in draws])
    band = np.array([d[1] for d in draws])
    ci = np.array([d[2] for d in draws])

    def share(x):
        return float(x.mean()) if x.size else float("nan")

    return {"flags": share(flag), "band": share(flag[band]), "ci": share(flag[ci]), "cover_rest": share(~ci[~flag])}


def _tail_separation(draws: list) -> dict:
    """For each candidate: at the thresholds that flag a quarter and a tenth of the draws, the
    share of the band's misses, of the intervals' misses and of the other draws it flags.
    ``draws``: (candidate values, misses the band, interval misses the truth)."""
    import numpy as np

    band = np.array([d[1] for d in draws])
    ci = np.array([d[2] for d in draws])
    out = {}
    for name, _, high in TAIL_CANDIDATES:
        v = np.array([d[0][name] for d in draws], dtype=np.float64)
        v = np.where(np.isfinite(v), v, -np.inf if high else np.inf)
        rows = []
        for rate in (0.25, 0.10):
            thr = np.quantile(v, 1 - rate if high else rate)
            flag = v >= thr if high else v <= thr
            rows.append((rate, float(thr), float(flag[band].mean()) if band.any() else float("nan"),
                         float(flag[ci].mean()) if ci.any() else float("nan"), float(flag[~band & ~ci].mean())))
        out[name] = rows
    return out


def machine() -> str:
    """What a run's trajectory depends on beyond the code and the seeds: the torch build and the
    CPU kernels it dispatches to. The training samples its rollouts from logits whose last bits
    differ between kernels (AVX2 against AVX512), and one different token sends the run down
    another path: the same code on another machine trains another run, and prints other lines."""
    import torch

    return f"run with torch {torch.__version__} on CPU kernels {torch.backends.cpu.get_cpu_capability()}"


def _measured_lines(res: RegimeResult) -> list[str]:
    """The second line where the budget measured a subset of the groups: the record's numbers
    against the truth over the prompt groups the tap measured, not over all the step's."""
    import numpy as np

    m = res.measured
    rep = m.reported()
    within = sum(c.within for c in rep)
    cov, n_cov = m.eta_coverage()
    covered, total = m.d_t_coverage()
    sub = [a for a, b in res.groups.values() if a is not None and a < b]
    run = ""
    if m.eta_run is not None:
        e, (lo, hi), t = m.eta_run
        run = f"; the run-level eta's interval {'covers' if lo <= t <= hi else 'MISSES'} its {t:.3f}"
    return [f"  against the truth over the prompt groups the tap measured (a subset on {len(sub)} of "
            f"{len(res.groups)} pairs, a median {np.median(sub) if sub else 0:g} groups there): dz within "
            f"{CELL_Z:g} SE {within} of {len(rep)} ({100 * within / max(len(rep), 1):.1f} %); D_t's 95 % intervals "
            f"cover it on {covered} of {total} updates; eta's per-pair intervals on {cov} of {n_cov}{run}"]


def summary_lines(res: RegimeResult) -> list[str]:
    """What the harness prints for one regime (and the README quotes)."""
    import numpy as np

    from reward_lens.measure.ledger.moderated import MODERATION_WINDOW
    from reward_lens.measure.ledger.paired import SHARP_SEEN

    rep = res.reported()
    within = sum(c.within for c in rep)
    d_new, n_new = res.d_t_within(0)
    d_old, n_old = res.d_t_within(1)
    cov, n_cov = res.eta_coverage()
    alone, _ = res.eta_coverage(oracle_error=False)
    unbound, _ = res.eta_coverage(bound=False)
    lines = [f"{res.regime}: {len(res.pairs)} step pairs, {len(res.cells)} (pair, feature) cells",
             *([f"  the tap measured {res.bought[0]} of {res.bought[1]} step pairs: "
                f"{res.bought[2]:g} of {res.bought[3]} prompt groups, {res.bought[4]:g} completions per group and "
                "policy (medians)"] if res.bought else []),
             f"  D_t (record kl_to_previous) within [{D_T_BAND[0]}, {D_T_BAND[1]}]x the truth: {d_new} of {n_new} pairs; "
             f"the in-sample estimate it replaced: {d_old} of {n_old} (ratio "
             f"{min(v[1] / v[2] for v in res.d_t.values()):.2f}-{max(v[1] / v[2] for v in res.d_t.values()):.2f})",
             f"  dz cells reported as a number: {len(rep)}, within {CELL_Z:g} SE of the truth: {within} "
             f"({100 * within / max(len(rep), 1):.1f} %); refused by name: "
             + (", ".join(f"{n} {k}" for k, n in sorted(res.refused().items())) or "none")]
    if res.measured is not None:
        lines[-1] += " (the truth over all the step's prompt groups)"
        lines += _measured_lines(res)
    if n_cov:
        resolved = [r for r in res.eta_rows if r[1] == "resolved" and r[3] is not None]
        bare = [r for r in res.eta_rows if r[3] is None]
        null = [r for r in res.eta_rows if r[4] < NULL_ETA]
        lines.append(f"  eta: per-pair 95 % intervals cover the truth on {cov} of {n_cov} priced pairs that state one "
                     f"({100 * cov / n_cov:.0f} %), the oracle's own error added ({alone}, {100 * alone / n_cov:.0f} %, "
                     f"against its eta alone), {unbound} without the bias bound"
                     + (f", {len(bare)} more with no interval (one prompt group varies)" if bare else "")
                     + f"; {len(resolved)} rows resolved with an interval, median (eta - truth) over them "
                     + (f"{res.resolved_bias():+.3f} (adjusted for their selection, a candidate, not adopted: "
                        f"{res.resolved_bias_adjusted():+.3f})" if resolved else "(none)")
                     + f"; of the {len(null)} pairs whose true eta is below {NULL_ETA:g}, "
                     f"{sum(r[1] == 'resolved' for r in null)} resolved")
    if res.eta_run is not None:
        e, (lo, hi), t = res.eta_run
        lines.append(f"  run-level eta {e:.3f} [{lo:.3f}, {hi:.3f}] against the truth {t:.3f}: "
                     f"{'covers' if lo <= t <= hi else 'MISSES'}")
    for h, s in sorted(res.replicates.items()):
        shape = f"{h} + {h} completions per prompt, two-sided" if h else "8 completions of pi_t+1 per prompt, one-sided"
        lines.append(f"  replicates ({shape}, {s['replicates']} each): "
                     f"{s['biased']} of {s['cells']} cells biased beyond 3 SE; median |bias|/SD "
                     f"{s['median_bias_over_sd']:.2f}; median real SD / reported SE {s['median_sd_over_se']:.2f}; "
                     f"95 % intervals (t on the ledger's degrees of freedom) cover the truth in {100 * s['coverage']:.1f} % of identified cells")
    two = res.replicates.get(max(res.replicates, default=0))
    if two and two["d_t_in_band"] is not None:
        recorded = [v for v in res.d_t.values() if v[0] is not None]
        misses = [v for v in recorded if not D_T_BAND[0] <= v[0] / v[2] <= D_T_BAND[1]]
        large = [v for v in recorded if v[2] >= SMALL_D_T]
        sd_med, sd_max = two["d_t_sd_over_truth"]
        lines.append(f"  D_t replicates (the tap's sampling redrawn, {two['replicates']} each): in the band in "
                     f"{100 * two['d_t_in_band']:.0f} % of draws; median mean / truth {two['d_t_mean_over_truth']:.2f}, "
                     f"relative SD median {sd_med:.2f}, max {sd_max:.2f}; the record's misses: {len(misses)}, "
                     f"{sum(v[2] < SMALL_D_T for v in misses)} of them where D_t < {SMALL_D_T:g} nats "
                     f"(updates of {SMALL_D_T:g} nats or more: {len(large) - sum(v in misses for v in large)} of "
                     f"{len(large)} in the band)")
    rel = [t.d_t_se / t.d_t for t in res.truths.values()]
    lines.append(f"  oracle's own error: median relative SE of D_t {np.median(rel):.3f}, max {np.max(rel):.3f}")
    priced = [res.truths[r[0]] for r in res.eta_rows if r[3] is not None]
    if priced:
        sds = [t.eta_sd for t in priced]
        lean = [t.eta_boot - t.eta for t in priced]
        lines.append(f"  oracle's own eta ({ORACLE_BOOTSTRAP} bootstrap redraws of its samples, those pairs): SD "
                     f"median {np.median(sds):.3f}, max {np.max(sds):.3f}; the redraws' mean less its eta: median "
                     f"{np.median(lean):+.3f}, max {np.max(lean):+.3f}")
    cal = res.calibration
    if cal:
        def ratio(c, key):
            v = c[key]
            if not v:
                return "-"
            out = np.mean([not 0.8 <= x <= 1.25 for x in v])
            return f"{np.median(v):.2f} [{np.min(v):.2f}, {np.max(v):.2f}], outside [0.8, 1.25] on {100 * out:.0f} % of updates"

        def cover(c, key):
            return f"{100 * c[key] / c['draws']:.1f} %" if c["draws"] else "-"

        k, subset = cal.get("shape", (4, False))
        shape = (f"{k:g} + {k:g} completions per prompt (the tap's own, a median over updates), "
                 + ("on as many of the step's prompt groups as it measured, drawn afresh each time, against "
                    "the truth over all of them" if subset else "the prompts fixed"))
        if (k, subset) == (4, False):
            shape = "4 + 4 completions per prompt, the prompts fixed"
        lines.append(f"  calibration, the tap's sampling redrawn ({cal.get('draws_per_update', '')} "
                     f"draws of {shape}): real SD / reported SE (its root "
                     "mean square), median [range] over updates; the median draw's SE / real SD, median over updates; "
                     "95 % intervals covering the truth, over draws")
        for q, words in (("d_t_own", "D_t, the sample's own SE"),
                         ("d_t", "D_t, moderated across updates, the upper end raised by the tail allowance"),
                         ("dz", "dz"), ("eta_own", "eta, the jackknife's own SE without the tail allowance or the bias bound"),
                         ("eta", "eta, moderated across updates, widened by the bias bound")):
            c = cal.get(q)
            if c is None:
                continue
            typical = f"{np.median(c['typical']):.2f}" if c["typical"] else "-"
            lines.append(f"    {words}: SD / SE {ratio(c, 'ratio')}; typical SE / SD {typical}; cover "
                         f"{cover(c, 'covered')} of {c['draws']}"
                         + (f" (without the bias bound: {cover(c, 'unbounded')})" if "unbounded" in c else "")
                         + (f" (without the tail allowance: {cover(c, 'covered_no_tail')})"
                            if "covered_no_tail" in c else ""))
        c = cal.get("d_t") or {}
        if c.get("draws") and "sweep" in c:
            small = (f"{100 * c['small_covered'] / c['small_draws']:.1f} % of {c['small_draws']}"
                     if c.get("small_draws") else "none")
            share = (f", a median {np.median(c['allowance_share']):.2f} of D_t where it is"
                     if c.get("allowance_share") else "")
            lines.append(f"    D_t's tail allowance: on {100 * c['allowed'] / c['draws']:.0f} % of the draws{share}; "
                         f"the updates under {SMALL_D_T:g} nats alone covered on {small}; the coverage at other "
                         "thresholds of a sharpened group's mass (the report's is "
                         f"{SHARP_SEEN:g}, measured, not adopted): " + ", ".join(
                             f"{th:g}: {100 * v / c['draws']:.1f} %" for th, v in c["sweep"].items()))
    sw = cal.get("windows") if cal else None
    if sw:
        lines.append("  D_t moderated over other windows (measured updates on either side; the report's is "
                     f"{MODERATION_WINDOW}; without the tail allowance): " + "; ".join(
                         f"{'the whole run' if w is None else w}: cover {100 * c:.1f} %, SD / SE {q:.2f}"
                         for w, (c, q) in sw.items()))
    er = cal.get("eta_run") if cal else None
    if er and er["runs"]:
        lines.append(f"  the run-level eta of the redrawn runs: its 95 % interval covers the truth (over the pairs each "
                     f"prices) in {er['covered']} of {er['runs']} runs; median (eta - truth) {er['median_error']:+.3f}, "
                     f"real SD / SE {er['sd_over_se']:.2f}")
    sel = cal.get("eta_selection") if cal else None
    if sel and sel["n"]:
        def signed(x):
            return "-" if x is None else f"{x:+.3f}"

        lines.append(f"  eta over the redrawn runs (each draw of every update one run, decided book-wide as the "
                     f"book does): median (eta - truth) {signed(sel['every'])} over the {sel['n']} rows with an "
                     f"interval, {signed(sel['resolved'])} over the {sel['n_resolved']} resolved, "
                     f"{signed(sel['other'])} over the others (the resolved rows are selected on their own noise); "
                     f"decided on the held-out side's test alone (a candidate, not adopted: eta reads that side too) "
                     f"{signed(sel.get('heldout'))} over its {sel.get('n_heldout', 0)} resolved; the resolved rows' "
                     f"eta adjusted for their selection (a candidate, not adopted) "
                     f"{signed(sel.get('adjusted'))}")
        runs = np.asarray(sel.get("per_run") or [], dtype=np.float64)
        if len(runs) >= 2:
            own = res.resolved_bias()
            lines.append(f"  one run's median (eta - truth) over its own resolved rows, as the record's is taken, over the "
                         f"{len(runs)} redrawn runs that resolve a row: median {np.median(runs):+.3f}, SD "
                         f"{runs.std(ddof=1):.3f}, 5-95 % [{np.quantile(runs, 0.05):+.3f}, {np.quantile(runs, 0.95):+.3f}]"
                         f"; within 0.05 of 0 in {100 * np.mean(np.abs(runs) <= 0.05):.0f} % of them"
                         + ("" if own is None else f"; the record's ({own:+.3f}) above {100 * np.mean(runs < own):.0f} % "
                            "of them"))
    if cal.get("tail"):
        lines.append("  tail diagnostics for D_t, on the same draws: the share of the band's misses, of the "
                     "intervals' misses and of the other draws each flags, at the threshold that flags a quarter "
                     "(a tenth) of the draws")
        for name, words, _ in TAIL_CANDIDATES:
            (_, _, b1, c1, o1), (_, _, b2, c2, o2) = cal["tail"][name]
            lines.append(f"    {words}: {100 * b1:.0f} % ({100 * b2:.0f} %), {100 * c1:.0f} % ({100 * c2:.0f} %), "
                         f"{100 * o1:.0f} % ({100 * o2:.0f} %)")
        def pct(x):
            return "-" if x != x else f"{100 * x:.0f} %"

        for name, words in FLAG_CANDIDATES:
            f = cal.get(name)
            if f:
                lines.append(f"    {words}, yes or no: flags {pct(f['flags'])} of the draws, {pct(f['band'])} of the "
                             f"band's misses and {pct(f['ci'])} of the intervals'; the intervals cover "
                             f"{pct(f['cover_rest'])} of the draws it leaves")
    if res.d_t_report:
        covered, total = res.d_t_coverage()
        own, _ = res.d_t_coverage(own=True)
        bare, _ = res.d_t_coverage(tail=False)
        lines.append(f"  D_t on the record: 95 % intervals cover the truth on {covered} of {total} updates "
                     f"(without the tail allowance: {bare}; with the sample's own SE: {own})")
    return lines


def run_regime(name: str, work: Path, n: int = 256, replicates: int = 20, progress=print,
               cache: bool = False, **tap_kwargs) -> RegimeResult:
    """Train, draw the oracle's samples, check. ``cache``: keep the trained run and the samples
    in ``work`` and reuse them when they are there (for working on the estimators)."""
    import torch

    regime = REGIMES[name]
    t0 = time.monotonic()
    if cache and (work / "pools.npz").exists():
        saved = torch.load(work / "trained.pt")
        trained = Trained(regime, work / "record", saved["params"], saved["prompts"])
        ps = load_pools(work / "pools.npz")
        t1 = t2 = time.monotonic()
    else:
        if cache and (work / "trained.pt").exists():  # trained, the oracle not drawn yet
            saved = torch.load(work / "trained.pt")
            trained = Trained(regime, work / "record", saved["params"], saved["prompts"])
        else:
            trained = train(regime, work, **tap_kwargs)
            progress(f"{name}: trained {regime.steps} steps with the tap in {trained.seconds:.0f} s")
            if cache:
                torch.save({"params": trained.params, "prompts": trained.prompts}, work / "trained.pt")
        t1 = time.monotonic()
        ps = pools(trained, n, progress=progress)
        t2 = time.monotonic()
        if cache:
            save_pools(ps, work / "pools.npz")
    res = check(trained, ps, replicates=replicates, progress=progress)
    res.seconds.update(train=t1 - t0, oracle=t2 - t1, total=time.monotonic() - t0)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regime", choices=sorted(REGIMES), action="append")
    ap.add_argument("--n", type=int, help="oracle samples per prompt and policy (default: the test's, 64 moderate "
                    "and 128 collapse)")
    ap.add_argument("--quote", action="store_true", help="print only the summary lines the docs quote")
    ap.add_argument("--replicates", type=int, default=20)
    ap.add_argument("--cache", type=Path, help="keep (and reuse) the trained runs and the oracle's samples here")
    ap.add_argument("--budget", default="none", help="the tap's cost budget: 'none' (every pair measured whole, "
                    "the default: a run that is the same on every run of the same machine), 'default' (the tap's "
                    "own default) or a share of an untapped step")
    ap.add_argument("--save", type=Path, help="also write what it printed to this file (bench/results/ for a quote)")
    args = ap.parse_args(argv)
    tap = {} if args.budget == "default" else {"budget": None if args.budget == "none" else float(args.budget)}
    printed = [machine() + ("" if args.budget == "none" else f", the tap's budget {args.budget}")]
    print(printed[0], flush=True)
    for name in args.regime or list(REGIMES):
        with tempfile.TemporaryDirectory() as tmp:
            work = args.cache / name if args.cache else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            quiet = (lambda *_: None) if args.quote else print
            res = run_regime(name, work, args.n or DEFAULT_N[name], args.replicates, progress=quiet,
                             cache=args.cache is not None, **tap)
            printed += summary_lines(res)
            print("\n".join(summary_lines(res)), flush=True)
            if not args.quote:
                print(f"  ({res.seconds['total']:.0f} s: training {res.seconds['train']:.0f}, oracle "
                      f"{res.seconds['oracle']:.0f}, checks {res.seconds['check']:.0f})", flush=True)
    if args.save:
        args.save.write_text("\n".join(printed) + "\n")


if __name__ == "__main__":
    main()
