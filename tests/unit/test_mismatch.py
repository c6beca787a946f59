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
    """The truth is the step's own: the exact KL averaged over the prompts the step drew (the SE is
    given the step's prompts, ``group_kl``), per sequence and per token, not the mean over the
    whole pool, which the prompts drawn estimate too."""
    w = _policy()
    lp, ls = _log_softmax(w), _sampler(w, cause)
    kl, length = _exact(ls, lp)
    rng = np.random.default_rng(7)
    groups, per = 8, 8
    hit_seq = hit_tok = 0
    redraws = 400
    series, truth = {}, {}
    for k in range(redraws):
        prompts = rng.integers(0, P, size=groups)
        rows = np.repeat(prompts, per)
        gap, tokens = _draw(rng, ls, lp, rows)
        m = step_mismatch(k, gap, np.repeat(np.arange(groups), per), groups, tokens)
        series[k] = m
        truth[k] = float(kl[prompts].mean())
        t = stats.t.ppf(0.975, m.kl_seq_dof)
        assert m.se_within and m.kl_seq_dof <= groups * (per - 1)
        hit_seq += abs(m.kl_seq - truth[k]) <= t * m.kl_seq_se
        hit_tok += abs(m.kl_token - kl[prompts].sum() / length[prompts].sum()) <= t * m.kl_token_se
    assert min(truth.values()) > 0
    # 400 redraws: a binomial SE of 1.1 % at 95 %; the band is 3.5 of them below and 3 above
    assert 0.91 <= hit_seq / redraws <= 0.985, (cause, hit_seq / redraws)
    assert 0.91 <= hit_tok / redraws <= 0.985, (cause, hit_tok / redraws)
    # the series' SE (each step's own moderated across its neighbours: the redraws read as one
    # run's steps) covers at the same rate
    spread = series_se(series)
    hit = sum(abs(series[k].kl_seq - truth[k]) <= stats.t.ppf(0.975, spread[k][1]) * spread[k][0] for k in series)
    assert 0.91 <= hit / redraws <= 0.985, (cause, hit / redraws)


def test_the_estimator_is_the_plain_definition_and_its_tail():
    gap = np.array([0.1, -0.2, 0.4, math.log(TAIL_RATIO) + 0.01, 0.0, -(math.log(TAIL_RATIO) + 0.5)])
    codes = np.array([0, 0, 1, 1, 2, 2])
    tokens = np.array([3, 4, 5, 6, 7, 8])
    m = step_mismatch(4, gap, codes, 3, tokens)
    means = [(0.1 - 0.2) / 2, (0.4 + gap[3]) / 2, gap[5] / 2]
    # the SE given the prompts (stratified): each group's s_g^2 = (a - b)^2 / 2 over n_g = 2, so its
    # mean's variance is (a - b)^2 / 4; their sum over 3^2, on Welch-Satterthwaite's degrees of freedom
    w = np.array([(0.1 + 0.2) ** 2, (0.4 - gap[3]) ** 2, gap[5] ** 2]) / 4
    assert m.kl_seq == pytest.approx(np.mean(means)) and m.kl_seq_se == pytest.approx(math.sqrt(w.sum()) / 3)
    assert m.se_within and m.kl_seq_size == 6 and m.kl_seq_dof == pytest.approx(w.sum() ** 2 / (w ** 2).sum())
    # per token, its residuals e = gap - kl_tok x tokens the same way: sum of n_g s_g^2(e) over the token total
    e = gap - m.kl_token * tokens
    assert m.kl_token_se == pytest.approx(math.sqrt(sum(2 * (e[i] - e[i + 1]) ** 2 / 2 for i in (0, 2, 4))) / tokens.sum())
    assert m.kl_token == pytest.approx(gap.sum() / tokens.sum())
    assert m.max_log_ratio == pytest.approx(abs(gap[5])) and m.tail_share == pytest.approx(2 / 6)
    assert group_kl(gap, codes, 3)[:2] == (m.kl_seq, m.kl_seq_se)
    # a group of one completion (as PPO samples) has no spread of its own: the SE is the group means'
    # across groups, on G - 1 degrees of freedom (wider: the prompts' spread is in it)
    one = group_kl(gap[[0, 2, 4]], np.array([0, 1, 2]), 3)
    assert not one.within and one.se == pytest.approx(np.std(gap[[0, 2, 4]], ddof=1) / math.sqrt(3)) and one.dof == 2
    assert math.isnan(group_kl(gap[:1], np.array([0]), 1).se)
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
    """Three steps of 4 prompt groups, estimates 1.0, 2.0, 1.5 with own SEs 0.1, 0.2, 0.3, each
    resolved (above t_{.975,3} = 3.182 own SEs): relative variances per group u = 4 (SE / kl)^2 =
    0.04, 0.04, 0.16, every step in every other's window (3 either side), their mean 0.08. Step 0:
    v = 0.04 / 2 + 0.08 / 2 = 0.06, SE = 1.0 sqrt(0.06 / 4) = 0.12247; its terms (2/3) 0.04, (1/6)
    0.04, (1/6) 0.16 on 3 degrees of freedom each: 0.06^2 / ((0.02667^2 + 0.00667^2 + 0.02667^2) / 3)
    = 7.364. Step 1: the same v, SE = 2.0 x 0.12247 = 0.24495. Step 2: v = 0.08 + 0.04 = 0.12, SE =
    1.5 sqrt(0.03) = 0.25981. A step not resolved (0.1 with an SE of 0.1) keeps its own SE on 3
    degrees of freedom and lends nothing; one of one group (no SE) has none."""
    se, dof = moderated_kl_se([1.0, 2.0, 1.5], [0.1, 0.2, 0.3], [3, 3, 3], [4, 4, 4])
    assert se == pytest.approx([0.12247, 0.24495, 0.25981], abs=1e-5)
    assert dof[0] == pytest.approx(7.364, abs=1e-3)
    v, f = _pooled_plain([0.04, 0.04, 0.16], [3, 3, 3])
    assert np.allclose(se, np.array([1.0, 2.0, 1.5]) * np.sqrt(v / 4)) and np.allclose(dof, f)
    se2, dof2 = moderated_kl_se([1.0, 0.1, 2.0, 7.0, 1.5], [0.1, 0.1, 0.2, float("nan"), 0.3], [3, 3, 3, float("nan"), 3],
                                [4, 4, 4, 1, 4])
    assert se2[1] == 0.1 and dof2[1] == 3 and np.isnan(se2[3]) and np.isnan(dof2[3])
    assert np.allclose(se2[[0, 2, 4]], se) and np.allclose(dof2[[0, 2, 4]], dof)
    # equal relative variances keep each SE and add degrees of freedom: 3 / (a^2 + (m - 1) b^2) with m
    # steps in the window, a = 1/2 + 1/(2m), b = 1/(2m): 8.4 with 3 on either side (m = 7)
    se4, dof4 = moderated_kl_se([1.0] * 9, [0.1] * 9, [3] * 9, [4] * 9)
    assert np.allclose(se4, 0.1) and dof4[4] == pytest.approx(8.4) and dof4[0] == pytest.approx(48 / 7)
    # the series' SE of StepMismatch values, by step
    steps = {s: step_mismatch(s, np.array([1.0, 1.2, 2.0, 2.6]) * (s + 1), np.array([0, 0, 1, 1]), 2) for s in (3, 5, 9)}
    got = series_se(steps)
    want = moderated_kl_se(*([getattr(steps[s], a) for s in (3, 5, 9)] for a in ("kl_seq", "kl_seq_se", "kl_seq_dof",
                                                                                 "kl_seq_size")))
    assert all(steps[s].se_within and steps[s].kl_seq_size == 4 for s in (3, 5, 9))
    assert sorted(got) == [3, 5, 9] and [got[s][0] for s in (3, 5, 9)] == pytest.approx(want[0].tolist())


def test_the_two_kinds_of_se_are_pooled_apart():
    """Steps whose SE is within the groups (relative variance per rollout) and steps whose SE is
    across them (per group, a group of one completion) alternate. Each kind's relative variances
    are equal among themselves (0.1 on 16 rollouts: u = 16 x 0.01 = 0.16; 0.3 on 4 groups: u = 4 x
    0.09 = 0.36), so pooled by kind every SE stays its own (0.1, 0.3). Pooled together the
    within steps would read u = 0.16 beside 0.36 and widen, the across steps narrow: the argument
    decides the answer."""
    within = [True, False] * 4
    kl, se = [1.0] * 8, [0.1 if w else 0.3 for w in within]
    dof, size = [15 if w else 3 for w in within], [16 if w else 4 for w in within]
    got, _ = moderated_kl_se(kl, se, dof, size, within)
    assert got == pytest.approx(se, abs=1e-12)
    mixed, _ = moderated_kl_se(kl, se, dof, size)
    assert all(m > 0.1 + 0.01 for m, w in zip(mixed, within) if w)
    assert all(m < 0.3 - 0.01 for m, w in zip(mixed, within) if not w)
    # the series reads each step's kind: a step with a group of one completion is across-group
    base, codes = np.array([1.0, 1.3, 2.0, 2.4, 1.1, 1.6]), np.array([0, 0, 1, 1, 2, 2])
    steps = {s: step_mismatch(s, base * (1 + s / 10), codes, 3) for s in range(6)}
    steps[3] = step_mismatch(3, base[:5] * 1.3, codes[:5], 3)  # group 2 holds one completion
    assert [steps[s].se_within for s in range(6)] == [True, True, True, False, True, True]
    series = series_se(steps)
    fields = ("kl_seq", "kl_seq_se", "kl_seq_dof", "kl_seq_size")
    alone = moderated_kl_se(*([getattr(steps[s], a) for s in (0, 1, 2, 4, 5)] for a in fields))
    assert [series[s][0] for s in (0, 1, 2, 4, 5)] == pytest.approx(alone[0].tolist())
    assert series[3][0] == pytest.approx(steps[3].kl_seq_se)  # its kind's only step: its own


def _scaled(levels, spread, offsets=(-1.5, -0.5, 0.5, 1.5)):
    """Per step, one rollout per prompt group whose gaps are ``level`` (1 + ``spread`` x offset):
    group means known exactly, the relative SE the same at every step."""
    codes = np.arange(len(offsets))
    return {s: step_mismatch(s, lv * (1 + spread * np.array(offsets)), codes, len(offsets)) for s, lv in enumerate(levels)}


def test_at_a_jump_the_matched_steps_lend_nothing():
    """A matched engine (gaps within 1e-4 of 0) for 10 steps, then one 0.5 nats a sequence off the
    policy. The matched steps are not resolved: each keeps its own SE and lends nothing, so the
    onset step pools only with the mismatched steps after it, and at the live edge (the onset the
    last step) with none: its own SE. Pooled as a variance (the first version of the moderation),
    the matched steps before the onset would have borrowed its large variance and the onset step
    their small one."""
    from reward_lens.measure.ledger.moderated import pooled_variances

    rng = np.random.default_rng(0)
    groups, per = 8, 4
    codes = np.repeat(np.arange(groups), per)
    series = {}
    for s in range(20):
        level, sd = (0.5, 0.3) if s >= 10 else (0.0, 1e-4)
        # a matched engine departs on no prompt: its gaps are the numbers' noise alone, each prompt's KL 0
        prompt = rng.normal(0.0, sd, size=groups)[codes] if s >= 10 else 0.0
        gap = level + prompt + rng.normal(0.0, sd / 3, size=len(codes))
        series[s] = step_mismatch(s, gap, codes, groups)
    own = np.array([series[s].kl_seq_se for s in range(20)])
    own_dof = np.array([series[s].kl_seq_dof for s in range(20)])
    n = groups * per
    whole = series_se(series)
    se = np.array([whole[s][0] for s in range(20)])
    assert (se[:10] == own[:10]).all() and [whole[s][1] for s in range(10)] == own_dof[:10].tolist()
    after = series_se({s: series[s] for s in range(10, 20)})  # as if the run began at the jump
    assert np.allclose(se[10:], [after[s][0] for s in range(10, 20)])  # the matched steps lent nothing
    edge = series_se({s: series[s] for s in range(11)})  # the live tap at the onset step
    assert edge[10] == (own[10], own_dof[10])
    var, _ = pooled_variances(n * own ** 2, own_dof)
    assert (np.sqrt(var[7:10] / n) > 10 * own[7:10]).all() and np.sqrt(var[10] / n) < own[10]


def test_a_mismatch_that_changes_size_keeps_its_relative_se():
    """A stale engine's mismatch shrinks as the policy slows: 20, 10, 5, 2.5, 1.25 nats a sequence,
    its spread across groups a third of its size at every step. Equal relative variances pool to
    themselves: each step keeps its own SE. Pooled as a variance, the last step would borrow the
    first steps' spread, an SE over three times its own."""
    from reward_lens.measure.ledger.moderated import pooled_variances

    series = _scaled([20.0, 10.0, 5.0, 2.5, 1.25], spread=0.2)
    own = np.array([series[s].kl_seq_se for s in range(5)])
    got = series_se(series)
    assert [got[s][0] for s in range(5)] == pytest.approx(own.tolist())
    var, _ = pooled_variances(4 * own ** 2, np.full(5, 3.0))
    assert np.sqrt(var[4] / 4) > 3 * own[4]


def test_the_ledgers_refusal_reads_the_series_se():
    """The paired ledger's ``sampler_mismatch`` (a pair refused where its engine departs from the
    policy by more than a tenth of D_t beyond 2 SE) reads the series' SE: each pair's own moderated
    across the run's pairs in step order by the same function, its own kept beside it. Worked on
    three pairs of estimates 1.0, 2.0, 1.5 and own SEs 0.1, 0.2, 0.3 over 4 groups
    (test_the_series_se_worked_by_hand: 0.12247, 0.24495, 0.25981), listed out of order; a pair
    without an SE is no one's neighbour."""
    from types import SimpleNamespace

    from reward_lens.measure.ledger.paired import PairedLedger, _series_sampler_se

    def pair(t, kl, se):
        return SimpleNamespace(step_pair=(t - 1, t), n_groups=4, sampler_kl=kl, sampler_kl_se=se, sampler_kl_se_own=se,
                               sampler_kl_dof=3.0, sampler_kl_size=4, sampler_kl_within=True, d_t=4.0,
                               d_hat=4.0)

    ledgers = [pair(3, 1.5, 0.3), pair(1, 1.0, 0.1), pair(4, 9.0, float("nan")), pair(2, 2.0, 0.2)]
    _series_sampler_se(ledgers)
    got = {lg.step_pair[1]: lg.sampler_kl_se for lg in ledgers}
    assert [got[1], got[2], got[3]] == pytest.approx([0.12247, 0.24495, 0.25981], abs=1e-5) and math.isnan(got[4])
    assert [lg.sampler_kl_se_own for lg in ledgers][:2] == [0.3, 0.1]
    # the refusal at 2 SE: at D_t = 7.9 (the line 0.79) the pair's own SE refuses it (1.0 - 2 x 0.1 =
    # 0.8 > 0.79), the series' keeps it (1.0 - 2 x 0.12247 = 0.755); at D_t = 7 (0.7) both refuse
    first = ledgers[1]
    first.d_t = 7.9
    assert 1.0 - 2 * first.sampler_kl_se_own > 0.1 * first.d_t and not PairedLedger.sampler_mismatch.fget(first)
    first.d_t = 7.0
    assert PairedLedger.sampler_mismatch.fget(first)
