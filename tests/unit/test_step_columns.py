"""The watch's per-step series and the checks of each step's advantages are taken over the
samples of a read at once where they lie one after another in it (``sequential._stacked_series``,
``_finite_advantages``); each is what the step-by-step definition gives, on reads with and without
rewards, with a NaN advantage, a step of another layout in between, a step whose groups are not in
blocks, and samples made one by one."""

from __future__ import annotations

import numpy as np

from reward_lens.measure.ledger.price import StepSample, _samples, blocks, sample_codes
from reward_lens.measure.sequential import _finite_advantages, _in_blocks, _series, _stacked_series, step_block


def _read(rng, with_rewards: bool = True):
    sizes = [12, 12, 12, 8, 12, 12]  # step 3 of another layout
    steps = np.repeat(np.arange(len(sizes)), sizes)
    n = len(steps)
    groups = np.concatenate([np.repeat(np.arange(4), k // 4) for k in sizes]).astype(float)
    groups[-12:] = np.tile(np.arange(4), 3)  # the last step's groups interleaved: not in blocks
    cols = {"group_id": groups, "advantage": rng.normal(size=n)}
    cols["advantage"][30] = np.nan  # step 2's advantages are not all finite
    if with_rewards:
        cols["reward"] = rng.normal(size=n)
    return _samples(steps, rng.normal(size=(n, 3)), cols, {"advantage"}, ("a", "b", "c"))


def test_stacked_series_and_finite_advantages_are_each_samples_own():
    rng = np.random.default_rng(2)
    for with_rewards in (True, False):
        samples = _read(rng, with_rewards)
        for chunk in (samples[:3], samples[4:], samples[1:3]):
            n = chunk[0].n
            got = _stacked_series(chunk, n)
            want = np.stack([_series(s) for s in chunk])
            assert got is not None and got.dtype == want.dtype and got.strides == want.strides
            assert np.array_equal(got, want, equal_nan=True)
        assert _stacked_series([samples[0], samples[2]], 12) is None  # not one after another
        ns = np.array([s.n for s in samples])
        gs = np.array([s.n_groups for s in samples])
        equal = [bool(blocks(*sample_codes(s))) for s in samples]
        assert _in_blocks(samples, gs, ns).tolist() == equal and equal.count(False) == 1
        want = [s.advantages is not None and bool(np.isfinite(s.advantages).all()) for s in samples]
        assert _finite_advantages(samples, ns).tolist() == want and want.count(False) == 1
        alone = [StepSample(s.step, s.names, s.z.copy(), rewards=s.rewards, groups=s.groups, advantages=s.advantages,
                            n_groups=s.n_groups) for s in samples]
        assert _stacked_series(alone[:3], 12) is None and _finite_advantages(alone, ns).tolist() == want
        assert _in_blocks(alone, gs, ns) is None
        # the whole block, read as one or made one sample at a time: the same numbers
        a, b = step_block(samples), step_block(alone)
        for name in ("steps", "level", "groups", "ss_between", "n", "ss_rows", "selection", "selection_se"):
            assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True), name


def test_t_dofs_of_many_ledgers_are_each_ledgers_own():
    from types import SimpleNamespace

    from reward_lens.measure.decisions import t_dof, t_dofs

    rng = np.random.default_rng(3)
    paired = [SimpleNamespace(dof=rng.choice([np.nan, np.inf, -1.0, 0.0, 2.5, 7.0], size=3), n_groups=g)
              for g in (0, 1, 2, 8, 8, 3)]
    plain = [SimpleNamespace(), SimpleNamespace(n_groups=5)]  # no degrees of freedom of their own
    for ledgers in (paired, paired + plain, plain, paired[:1]):
        want = np.array([t_dof(lg, 3) for lg in ledgers])
        assert np.array_equal(t_dofs(ledgers, 3), want, equal_nan=True)


def test_price_rows_are_each_step_pairs_definition():
    """The price book's rows: the p-values of all pairs at once (and the rows made without
    validating each) against the pair-by-pair definition, with a step of one group (no SE), a step
    whose rewards are constant (SE 0, with and without a change) and a missing D_t."""
    import math

    from scipy import special

    from reward_lens.measure.efficiency.eta import benjamini_hochberg
    from reward_lens.measure.price_book import PriceRow, price_series, step_rewards

    rng = np.random.default_rng(5)
    samples = []
    for t in range(12):
        n = 1 if t == 4 else 8  # one rollout: no SE
        rewards = rng.normal(size=n) + 0.3 * t
        if t in (7, 8):
            rewards = np.full(n, 2.0)
        if t == 9:
            rewards = np.full(n, 3.0)
        samples.append(StepSample(t, ("a",), rng.normal(size=(n, 1)), rewards=rewards,
                                  groups=np.repeat(np.arange(4), 2) if n == 8 else np.zeros(1, dtype=int)))
    kl = {t: 0.01 * (t + 1) for t in range(12) if t != 10}
    got = price_series(samples, kl)
    means = step_rewards(samples)
    want, p = [], []
    for t in sorted(means):
        if t + 1 not in means or t not in kl:
            continue
        (a, sa), (b, sb) = means[t], means[t + 1]
        se = math.sqrt(sa ** 2 + sb ** 2)
        dr = b - a
        pv = 1.0 if math.isnan(se) else float(2 * special.ndtr(-abs(dr) / se)) if se > 0 else (0.0 if dr else 1.0)
        p.append(pv)
        want.append(dict(step_pair=(t, t + 1), reward_change=dr, se=se, d_t=float(kl[t]),
                         reward_per_nat=dr / kl[t], p_value=pv))
    rej = benjamini_hochberg(p)
    want = [PriceRow(**w, resolved=bool(r)) for w, r in zip(want, rej)]
    assert {r.p_value for r in want} >= {0.0, 1.0} and any(math.isnan(r.se) for r in want)
    assert len(got.rows) == len(want) and all(
        list(a.model_dump()) == list(b.model_dump()) and all(
            type(x) is type(y) and (x == y or (x != x and y != y)) for x, y in zip(a.model_dump().values(),
                                                                                   b.model_dump().values()))
        for a, b in zip(got.rows, want))
