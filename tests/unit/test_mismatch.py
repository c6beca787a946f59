"""The engine-mismatch series (measure/mismatch.py) against an exact truth.

The policy is a tabular autoregressive model: per prompt, the next token's logits depend on the
previous token only, so KL(pi_sampler || pi_t) summed over a sequence is exact by dynamic
programming over (position, previous token). Each sampler is a real cause of mismatch: the
table cast to bfloat16, a hotter sampling temperature, top-p truncation the scorer does not
apply. Redrawn many times (prompts drawn from the pool, completions from the sampler), the
estimate's 95 % interval must cover the exact value at about its nominal rate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from reward_lens.measure.mismatch import TAIL_RATIO, group_kl, step_mismatch

V, L, P = 6, 5, 16  # vocabulary (token 0 is EOS), longest completion, prompts in the pool
EOS = 0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _policy(seed: int = 0) -> np.ndarray:
    """(P, V, V) logits: prompt, previous token -> next token (previous EOS stands for the start)."""
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(P, V, V))


def _sampler(w: np.ndarray, cause: str) -> np.ndarray:
    """The sampler's log-probabilities (P, V, V) for a cause."""
    if cause == "bf16":
        return _log_softmax(torch.tensor(w, dtype=torch.float32).to(torch.bfloat16).float().numpy().astype(np.float64))
    if cause == "temperature":
        return _log_softmax(w / 1.3)
    if cause == "top_p":
        lp = _log_softmax(w)
        p = np.exp(lp)
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < 0.9  # the smallest set reaching 0.9
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        return _log_softmax(np.where(keep, w, -np.inf))
    raise ValueError(cause)


def _exact(ls: np.ndarray, lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: KL(sampler || policy) summed over the sequence, and the expected token count
    (EOS counted, as a record's ``num_tokens`` counts it)."""
    s = np.exp(ls)
    with np.errstate(invalid="ignore"):
        tok_kl = np.where(s > 0, s * (ls - lp), 0.0).sum(axis=-1)  # (P, V): KL at each previous token
    kl = np.zeros(P)
    length = np.zeros(P)
    reach = np.zeros((P, V))
    reach[:, EOS] = 1.0  # the start state
    for pos in range(L):
        kl += (reach * tok_kl).sum(axis=-1)
        length += reach.sum(axis=-1)
        nxt = np.einsum("pv,pvw->pw", reach, s)
        nxt[:, EOS] = 0.0  # an EOS ends the sequence
        reach = nxt
    return kl, length


def _draw(rng, ls, lp, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Completions of ``prompts`` by the sampler: each one's gap log s - log pi, and its tokens."""
    n = len(prompts)
    prev = np.full(n, EOS)
    alive = np.ones(n, dtype=bool)
    gap = np.zeros(n)
    tokens = np.zeros(n)
    s = np.exp(ls)
    for _ in range(L):
        probs = s[prompts, prev]
        u = rng.random(n)[:, None]
        tok = np.minimum((probs.cumsum(axis=-1) < u).sum(axis=-1), V - 1)
        g = ls[prompts, prev, tok] - lp[prompts, prev, tok]
        gap += np.where(alive, g, 0.0)
        tokens += alive
        prev = tok
        alive &= tok != EOS
    return gap, tokens


@pytest.mark.parametrize("cause", ["bf16", "temperature", "top_p"])
def test_the_series_interval_covers_the_exact_kl(cause):
    w = _policy()
    lp, ls = _log_softmax(w), _sampler(w, cause)
    kl, length = _exact(ls, lp)
    truth_seq = float(kl.mean())  # prompts drawn uniformly from the pool
    truth_tok = float(kl.sum() / length.sum())
    rng = np.random.default_rng(7)
    groups, per = 8, 8
    t = stats.t.ppf(0.975, groups - 1)
    hit_seq = hit_tok = 0
    redraws = 400
    for _ in range(redraws):
        prompts = rng.integers(0, P, size=groups)
        rows = np.repeat(prompts, per)
        gap, tokens = _draw(rng, ls, lp, rows)
        m = step_mismatch(0, gap, np.repeat(np.arange(groups), per), groups, tokens)
        hit_seq += abs(m.kl_seq - truth_seq) <= t * m.kl_seq_se
        hit_tok += abs(m.kl_token - truth_tok) <= t * m.kl_token_se
    assert truth_seq > 0
    # 400 redraws: a binomial SE of 1.1 % at 95 %; the band is 3.5 of them below and 3 above
    assert 0.91 <= hit_seq / redraws <= 0.985, (cause, hit_seq / redraws)
    assert 0.91 <= hit_tok / redraws <= 0.985, (cause, hit_tok / redraws)


def test_the_estimator_is_the_plain_definition_and_its_tail():
    gap = np.array([0.1, -0.2, 0.4, math.log(TAIL_RATIO) + 0.01, 0.0, -(math.log(TAIL_RATIO) + 0.5)])
    codes = np.array([0, 0, 1, 1, 2, 2])
    tokens = np.array([3, 4, 5, 6, 7, 8])
    m = step_mismatch(4, gap, codes, 3, tokens)
    means = [(0.1 - 0.2) / 2, (0.4 + gap[3]) / 2, gap[5] / 2]
    assert m.kl_seq == pytest.approx(np.mean(means)) and m.kl_seq_se == pytest.approx(np.std(means, ddof=1) / math.sqrt(3))
    assert m.kl_token == pytest.approx(gap.sum() / tokens.sum())
    assert m.max_log_ratio == pytest.approx(abs(gap[5])) and m.tail_share == pytest.approx(2 / 6)
    assert group_kl(gap, codes, 3) == (m.kl_seq, m.kl_seq_se)
    # a row the engine could not score is left out, not read as zero
    m2 = step_mismatch(4, np.r_[gap, np.nan], np.r_[codes, 2], 3, np.r_[tokens, 9])
    assert m2.n == 6 and m2.kl_seq == m.kl_seq
    assert step_mismatch(4, np.array([np.nan]), np.array([0]), 1) is None
