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

from reward_lens.measure.mismatch import TAIL_RATIO, group_kl, moderated_kl_se, series_se, step_mismatch

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
    series = {}
    for k in range(redraws):
        prompts = rng.integers(0, P, size=groups)
        rows = np.repeat(prompts, per)
        gap, tokens = _draw(rng, ls, lp, rows)
        m = step_mismatch(k, gap, np.repeat(np.arange(groups), per), groups, tokens)
        series[k] = m
        hit_seq += abs(m.kl_seq - truth_seq) <= t * m.kl_seq_se
        hit_tok += abs(m.kl_token - truth_tok) <= t * m.kl_token_se
    assert truth_seq > 0
    # 400 redraws: a binomial SE of 1.1 % at 95 %; the band is 3.5 of them below and 3 above
    assert 0.91 <= hit_seq / redraws <= 0.985, (cause, hit_seq / redraws)
    assert 0.91 <= hit_tok / redraws <= 0.985, (cause, hit_tok / redraws)
    # the series' SE (each step's own moderated across its neighbours: the redraws read as one
    # run's steps) covers at the same rate
    spread = series_se(series)
    hit = sum(abs(series[k].kl_seq - truth_seq) <= stats.t.ppf(0.975, spread[k][1]) * spread[k][0] for k in series)
    assert 0.91 <= hit / redraws <= 0.985, (cause, hit / redraws)


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


# ------------------------------------------------------------------ the series' SE (issue 59)
def _pooled_plain(u, f, window=3, own=0.5):
    """The moderation written out: each step's variance is ``own`` of its own and 1 - ``own`` of
    the mean over the steps within ``window`` of it (itself among them); Welch-Satterthwaite's
    degrees of freedom over the terms."""
    n = len(u)
    v, dof = [], []
    for j in range(n):
        idx = list(range(max(0, j - window), min(n, j + window + 1)))
        coef = {i: (1 - own) / len(idx) for i in idx}
        coef[j] += own
        total = sum(coef[i] * u[i] for i in idx)
        v.append(total)
        dof.append(total * total / sum((coef[i] * u[i]) ** 2 / f[i] for i in idx))
    return np.array(v), np.array(dof)


def test_the_series_se_worked_by_hand():
    """Three steps of 4 prompt groups, own SEs 0.1, 0.2, 0.3: variances per group u = 4 SE^2 =
    0.04, 0.16, 0.36, every step in every other's window (3 either side), their mean 0.18667.
    Step 0: v = 0.04 / 2 + 0.18667 / 2 = 0.11333, SE = sqrt(v / 4) = 0.16833; its terms (2/3) 0.04,
    (1/6) 0.16, (1/6) 0.36, each on 3 degrees of freedom: 0.11333^2 / ((0.02667^2 + 0.02667^2 +
    0.06^2) / 3) = 7.672. Step 2: v = 0.36 / 2 + 0.18667 / 2 = 0.27333, SE 0.26141. A step of one
    group (no SE) takes no part and is no one's neighbour; the result does not depend on which
    steps lie beyond the window."""
    se, dof = moderated_kl_se([0.1, 0.2, 0.3], [4, 4, 4])
    assert se[0] == pytest.approx(0.16833, abs=1e-5) and se[2] == pytest.approx(0.26141, abs=1e-5)
    assert dof[0] == pytest.approx(7.672, abs=1e-3)
    v, f = _pooled_plain([0.04, 0.16, 0.36], [3, 3, 3])
    assert np.allclose(se, np.sqrt(v / 4)) and np.allclose(dof, f)
    se2, dof2 = moderated_kl_se([0.1, float("nan"), 0.2, 0.3], [4, 1, 4, 4])
    assert np.isnan(se2[1]) and np.isnan(dof2[1]) and np.allclose(se2[[0, 2, 3]], se)
    # groups of different sizes: pooled per group, each step's SE over its own groups
    se3, _ = moderated_kl_se([0.1, 0.1], [4, 16])
    u = np.array([4 * 0.01, 16 * 0.01])
    assert se3 == pytest.approx(np.sqrt((u / 2 + u.mean() / 2) / np.array([4, 16])))
    # equal variances keep the SE and add degrees of freedom: 3 / (a^2 + (m - 1) b^2) with m steps
    # in the window, a = 1/2 + 1/(2m), b = 1/(2m): 8.4 with 3 on either side (m = 7)
    se4, dof4 = moderated_kl_se([0.1] * 9, [4] * 9)
    assert np.allclose(se4, 0.1) and dof4[4] == pytest.approx(8.4) and dof4[0] == pytest.approx(48 / 7)
    # the series' SE of StepMismatch values, by step
    steps = {s: step_mismatch(s, np.array([0.1, 0.3, 0.2, 0.6]) * (s + 1), np.array([0, 0, 1, 1]), 2) for s in (3, 5, 9)}
    got = series_se(steps)
    want = moderated_kl_se([steps[s].kl_seq_se for s in (3, 5, 9)], [2, 2, 2])
    assert sorted(got) == [3, 5, 9] and [got[s][0] for s in (3, 5, 9)] == pytest.approx(want[0].tolist())


def test_at_a_jump_the_variance_is_pooled_not_the_relative_variance():
    """A matched engine (gaps within 1e-4 of 0) for 10 steps, then one 0.5 nats a sequence off the
    policy with a spread across groups of 0.3. Pooled as a variance, each step after the jump
    within reach of the matched steps (3) borrows their small variance: its SE is less than the
    mismatched steps alone would give it and, at the live edge (the onset step the last), between
    sqrt(1/2 + 1/8) of its own and its own; the matched steps borrow the larger
    variance after it. Pooled as D_t's relative variance (SE / estimate)^2, the onset step would
    borrow the near-infinite relative variance of estimates at 0 and read an SE many times its
    own: the finding would wait out the window."""
    from reward_lens.measure.ledger.moderated import moderated_d_t_se

    rng = np.random.default_rng(0)
    groups, per = 8, 4
    codes = np.repeat(np.arange(groups), per)
    series = {}
    for s in range(20):
        level, sd = (0.5, 0.3) if s >= 10 else (0.0, 1e-4)
        gap = level + rng.normal(0.0, sd, size=groups)[codes] + rng.normal(0.0, sd / 3, size=len(codes))
        series[s] = step_mismatch(s, gap, codes, groups)
    own = np.array([series[s].kl_seq_se for s in range(20)])
    whole = series_se(series)
    se = np.array([whole[s][0] for s in range(20)])
    after = series_se({s: series[s] for s in range(10, 20)})  # as if the run began at the jump
    alone = np.array([after[s][0] for s in range(10, 20)])
    assert (se[10:13] < alone[:3]).all() and np.allclose(se[13:], alone[3:])  # the onset's reach reads less
    assert (se[7:10] > 10 * own[7:10]).all()  # the matched steps within reach borrow the larger
    assert np.allclose(se[:7], own[:7], rtol=0.6)  # beyond reach, their own scale
    edge = series_se({s: series[s] for s in range(11)})  # the live tap at the onset step
    assert own[10] * math.sqrt(0.5 + 1 / 8) <= edge[10][0] <= own[10]
    assert edge[10][1] >= groups - 1  # degrees of freedom never fewer than the fewest pooled
    kl = np.array([series[s].kl_seq for s in range(20)])
    rel, _ = moderated_d_t_se(np.abs(kl), own, np.full(20, groups - 1.0), np.full(20, groups))
    assert rel[10] > 20 * own[10]  # what the relative pooling would have stated
