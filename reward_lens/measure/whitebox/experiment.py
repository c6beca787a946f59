"""The seed's two-checkpoint experiment, as a reusable self-check of the cost book.

Load a policy, take **one real policy-gradient step** -- plain gradient descent on the GRPO
loss of a step's own rollouts and advantages, so dtheta is known exactly -- at a given step
size, then measure everything the cost book needs on the two checkpoints:

* dz from ``m`` samples of each policy (seeded per sample set), with its standard error;
* D_t exactly (``kl.kl_between``: full-vocabulary token KL over ``n_kl`` sequences from the
  post-step policy), with its standard error;
* G by rung 1 (pooled covariance of the two sample sets) and by rung 2 (Fisher kernel from
  ``n_scores`` fresh sequences of the pre-step policy, damping by GCV);
* the cost book's verdict for each rung: an efficiency in [0, 1] or a refusal;
* the empirical-Fisher quadratic 1/2 dtheta^T F dtheta over D_t, with F from the fresh
  scores and from the rollouts the step was computed on.

Two things are not the trainer's and are stated: the step is plain gradient descent, not
AdamW, and the step sizes are far larger than a real run's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from reward_lens.measure.efficiency import cost_series, metric_g
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.price import StepSample, ledger_series
from reward_lens.measure.whitebox.fisher import empirical_fisher_quadratic
from reward_lens.measure.whitebox.kl import kl_between
from reward_lens.measure.whitebox.policy import Sequences, sample
from reward_lens.measure.whitebox.scores import score_matrix


@dataclass
class StepResult:
    step_size: float
    update_norm: float
    d_t: float
    d_t_se: float
    max_abs_t: float
    kl_min_rung1: float
    noise_floor_rung1: float
    eta_rung1: float | None
    refusal_rung1: str | None
    kl_min_rung2: float | None
    eta_rung2: float | None
    refusal_rung2: str | None
    rung2_stable: bool
    rung2_reading: str
    fisher_fresh_ratio: float
    fisher_own_ratio: float
    raw_ratio_rung1: float
    details: dict[str, Any] = field(default_factory=dict)


def _features(tokenizer, seqs: Sequences, features: SurfaceFeatures, step: int) -> StepSample:
    texts = [tokenizer.decode(row[seqs.prompt_len:][m[seqs.prompt_len:]].tolist(), skip_special_tokens=True)
             for row, m in zip(seqs.ids, seqs.completion_mask)]
    return StepSample(step, features.names, features.compute(pa.table({"completion": texts})))


def rollout_sequences(tokenizer, prompt: str, completions: list[str], max_new_tokens: int) -> Sequences:
    """The step's rollouts as token sequences. Text re-encoded: exact for a byte-level
    vocabulary except where the trainer's decode replaced invalid UTF-8 by U+FFFD."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"][:max_new_tokens] for c in completions]
    width = len(p) + max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p):len(p) + len(r)] = True
    return Sequences(ids, mask, len(p))


def grpo_gradient(model, seqs: Sequences, advantages: np.ndarray) -> list[torch.Tensor]:
    """Gradient of the on-policy GRPO loss -sum_i A_i sum_t log pi(y_it) / sum_i |y_i|."""
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(input_ids=seqs.ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, seqs.ids[:, 1:, None])[..., 0]
    mask = seqs.completion_mask[:, 1:].float()
    adv = torch.tensor(advantages, dtype=torch.float32)[:, None]
    loss = -(adv * logp * mask).sum() / mask.sum()
    return list(torch.autograd.grad(loss, params))


def stepped(model, grads: list[torch.Tensor], step_size: float):
    post = copy.deepcopy(model)
    with torch.no_grad():
        for p, g in zip([p for p in post.parameters() if p.requires_grad], grads):
            p -= step_size * g
    post.eval()
    return post


def run_experiment(model, tokenizer, prompt: str, completions: list[str], advantages: np.ndarray,
                   step_sizes: list[float], *, m: int = 128, n_kl: int = 32, n_scores: int = 64,
                   max_new_tokens: int = 32, seed: int = 0) -> list[StepResult]:
    torch.manual_seed(seed)
    model.eval()
    features = SurfaceFeatures()
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    own = rollout_sequences(tokenizer, prompt, completions, max_new_tokens)
    grads = grpo_gradient(model, own, advantages)
    flat_grad = torch.cat([g.reshape(-1) for g in grads]).numpy().astype(np.float64)
    pre_seqs = sample(model, prompt_ids, m, max_new_tokens, eos, pad, seed=seed + 1)
    pre = _features(tokenizer, pre_seqs, features, 0)
    fresh = sample(model, prompt_ids, n_scores, max_new_tokens, eos, pad, seed=seed + 2)
    s_fresh = score_matrix(model, fresh)
    s_own = score_matrix(model, own)
    z_fresh = _features(tokenizer, fresh, features, 0)
    results = []
    for k, s in enumerate(step_sizes):
        post_model = stepped(model, grads, s)
        dtheta = -s * flat_grad
        post = _features(tokenizer, sample(post_model, prompt_ids, m, max_new_tokens, eos, pad,
                                           seed=seed + 10 + k), features, 1)
        (ledger,) = ledger_series([pre, post])
        d = kl_between(model, post_model, prompt_ids, n=n_kl, max_new_tokens=max_new_tokens, eos_token_id=eos,
                       pad_token_id=pad, seed=seed + 20 + k)
        g1 = metric_g([pre, post])
        b1 = cost_series([ledger], g1, kl_spent={0: d.mean})
        g2 = metric_g([z_fresh], method="fisher_kernel", scores=s_fresh, delta_z=ledger.delta_z)
        b2 = cost_series([ledger], g2, kl_spent={0: d.mean})
        kr1 = b1.kl_min.rows[0]
        kr2 = b2.kl_min.rows[0] if b2.kl_min.rows else None
        results.append(StepResult(
            step_size=s, update_norm=float(np.linalg.norm(dtheta)), d_t=d.mean, d_t_se=d.se,
            max_abs_t=float(np.max(np.abs(ledger.t))), kl_min_rung1=kr1.kl_min, noise_floor_rung1=kr1.noise_floor,
            eta_rung1=b1.rows[0].efficiency if b1.rows else None,
            refusal_rung1=b1.refusals[0].code if b1.refusals else None,
            kl_min_rung2=kr2.kl_min if kr2 else None,
            eta_rung2=b2.rows[0].efficiency if b2.rows else None,
            refusal_rung2=b2.refusals[0].code if b2.refusals else None,
            rung2_stable=g2.damping_stable, rung2_reading=g2.reading,
            fisher_fresh_ratio=empirical_fisher_quadratic(s_fresh, dtheta) / d.mean,
            fisher_own_ratio=empirical_fisher_quadratic(s_own, dtheta) / d.mean,
            raw_ratio_rung1=kr1.kl_min / d.mean,
            details={"book_rung1": b1, "book_rung2": b2, "ledger": ledger, "g2": g2},
        ))
    return results
