"""The segmented passes over all steps give each step's moments and selection differential as
the definitions do, written here plainly per step (np.cov of group means, covariances within
groups) -- not by the package's own code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reward_lens.measure.ledger.price import StepSample, all_step_moments, step_moments


def _moments_by_definition(s: StepSample):
    """Mean; Cov(group means) / G with groups as units, or C / n with one group or none."""
    labels = list(dict.fromkeys(s.groups.tolist())) if s.groups is not None else []
    if len(labels) >= 2:
        gm = np.array([s.z[s.groups == g].mean(axis=0) for g in labels])
        return s.z.mean(axis=0), np.atleast_2d(np.cov(gm, rowvar=False, ddof=1)) / len(labels), len(labels)
    return s.z.mean(axis=0), np.atleast_2d(np.cov(s.z, rowvar=False, ddof=1)) / s.n, s.n


def test_all_step_moments_equal_the_definition():
    rng = np.random.default_rng(0)
    samples = []
    for t in range(40):
        n = int(rng.integers(2, 40))
        # no groups; one group (rollouts become the units); several groups of unequal sizes
        groups = None if t % 5 == 0 else rng.integers(0, 1 if t % 7 == 0 else 4, n).astype(str)
        samples.append(StepSample(t, ("a", "b", "c"), rng.normal(size=(n, 3)) * [1, 10, 0.1], groups=groups))
    together = all_step_moments(samples)
    assert sorted(together) == list(range(40))
    for s in samples:
        mean, cov, units = _moments_by_definition(s)
        m2, c2, u2 = together[s.step]
        assert all(np.array_equal(a, b) for a, b in zip(step_moments(s)[:2], (m2, c2)))  # one step alone
        assert u2 == units
        np.testing.assert_allclose(m2, mean, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(c2, cov, rtol=1e-10, atol=1e-15 * np.abs(cov).max())


def test_group_codes_are_first_appearance_codes_for_any_labels():
    """Labels of any type (including integer labels that already are, or are not, codes in order
    of first appearance) get the codes of the definition: the order in which they first appear."""
    from reward_lens.measure.ledger.price import group_codes

    rng = np.random.default_rng(0)
    for _ in range(500):
        g = rng.integers(0, 5, int(rng.integers(1, 12)))
        for labels in (g, g.astype(str)):
            seen: dict = {}
            expected = [seen.setdefault(x, len(seen)) for x in labels.tolist()]
            codes, n = group_codes(labels)
            assert codes.tolist() == expected and n == len(seen)


def _selection_by_definition(s: StepSample):
    """sum over groups of sum_i (z_i - zbar_g)(A_i - Abar_g) / n; SE with groups as units
    (g / (g - 1) sum_g (u_g - n_g s)^2 / n^2), or with one group the rollouts' products."""
    labels = list(dict.fromkeys(s.groups.tolist()))
    u, sizes, prods = [], [], []
    for g in labels:
        z, a = s.z[s.groups == g], s.advantages[s.groups == g]
        p = (z - z.mean(axis=0)) * (a - a.mean())[:, None]
        u.append(p.sum(axis=0))
        sizes.append(len(z))
        prods.append(p)
    u, sizes, n = np.array(u), np.array(sizes, float), s.n
    sel = u.sum(axis=0) / n
    if len(labels) >= 2:
        g = len(labels)
        return sel, np.sqrt(g / (g - 1) * ((u - sizes[:, None] * sel) ** 2).sum(axis=0) / n ** 2)
    if n < 3:
        return sel, np.full(s.z.shape[1], np.nan)
    return sel, np.vstack(prods).std(axis=0, ddof=1) / np.sqrt(n)


def test_selection_differentials_equal_the_definition():
    from reward_lens.measure.cause import selection_differential, selection_differentials

    rng = np.random.default_rng(1)
    samples = []
    for t in range(40):
        n = int(rng.integers(2, 30))
        groups = rng.integers(0, 1 if t % 4 == 0 else 5, n).astype(str)  # every 4th step: one group
        samples.append(StepSample(t, ("a", "b"), rng.normal(size=(n, 2)) * [1, 50], advantages=rng.normal(size=n),
                                  groups=groups))
    together = selection_differentials(samples)
    for x in samples:
        s, se = _selection_by_definition(x)
        s2, se2 = together[x.step]
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(selection_differential(x), (s2, se2)))
        np.testing.assert_allclose(s2, s, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(se2, se, rtol=1e-8, atol=1e-13, equal_nan=True)


def test_group_codes_and_segment_codes_agree_with_first_appearance_written_plainly():
    from reward_lens.measure.ledger.price import group_codes, segment_codes

    def plain(labels):
        seen: dict = {}
        return [seen.setdefault(v, len(seen)) for v in labels.tolist()], len(set(labels.tolist()))

    rng = np.random.default_rng(0)
    for _ in range(300):
        lens = rng.integers(1, 12, size=rng.integers(1, 8))
        starts = np.r_[0, np.cumsum(lens)[:-1]]
        labels = rng.integers(-1, 5, size=lens.sum())  # -1: a null group id
        codes, counts = segment_codes(starts, int(lens.sum()), labels)
        for a, n, g in zip(starts, lens, counts):
            want, g_want = plain(labels[a:a + n])
            got, g_got = group_codes(labels[a:a + n])
            assert codes[a:a + n].tolist() == want == got.tolist() and g == g_want == g_got
    # a label -1 after a 0 is not already a code (the fast path once took it for one)
    assert group_codes(np.array([0, -1, 0, 1]))[0].tolist() == [0, 1, 0, 2]
    # a record's layout: every step's groups are new ids in order of first appearance (the
    # labels less the step's smallest are the codes); and near misses of it, which are not
    for _ in range(200):
        lens = rng.integers(1, 12, size=rng.integers(1, 8))
        starts = np.r_[0, np.cumsum(lens)[:-1]]
        labels, top = [], 0
        for n in lens:
            local = [0]
            for _ in range(n - 1):
                local.append(int(rng.integers(0, max(local) + 2)))
            labels += [top + c for c in local]
            top += max(local) + 1
        labels = np.array(labels)
        variants = [labels]
        if len(lens) > 1:
            repeat = labels.copy()
            repeat[starts[1]] = labels[0]  # step 1 starts with a group of step 0
            variants.append(repeat)
            swapped = labels.copy()
            swapped[starts[-1]:] = swapped[starts[-1]:][::-1]  # the last step's ids not in first-appearance order
            variants.append(swapped)
        for lab in variants:
            codes, counts = segment_codes(starts, int(lens.sum()), lab)
            for a, n, g in zip(starts, lens, counts):
                want, g_want = plain(lab[a:a + n])
                assert codes[a:a + n].tolist() == want and g == g_want


def test_step_scatter_and_window_sums_agree_with_the_definitions_written_plainly():
    from reward_lens.measure.efficiency.metric import _window_sum, step_scatter, step_sums
    from reward_lens.measure.ledger.price import StepSample

    rng = np.random.default_rng(3)
    samples = [StepSample(i, ("a", "b", "c"), rng.normal(size=(n, 3)) * [1, 10, 0.1])
               for i, n in enumerate([5, 0, 1, 7, 2, 9])]  # an empty step and a step of one rollout
    scat, sums = step_scatter(samples)
    sums2, squares = step_sums(samples)
    for s, got, total, total2, sq in zip(samples, scat, sums, sums2, squares):
        want = np.zeros((3, 3))
        if s.n >= 2:
            zc = s.z - s.z.mean(axis=0)
            want = sum(np.outer(r, r) for r in zc)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12) and np.allclose(total, s.z.sum(axis=0))
        assert np.allclose(sq, np.diag(want), rtol=1e-12, atol=1e-12) and np.array_equal(total2, total)
    values = rng.normal(size=(12, 2, 2))
    lo = np.array([0, 0, 1, 3, 5, 11])
    hi = np.array([1, 4, 4, 3, 12, 12])  # an empty window too
    got = _window_sum(values, lo, hi)
    for i, (a, b) in enumerate(zip(lo, hi)):
        assert np.allclose(got[i], sum(values[a:b], np.zeros((2, 2))), rtol=1e-14, atol=1e-15)


def test_features_in_threads_keep_order_and_raise_the_first_error_in_order():
    import time

    from reward_lens.measure.ledger.price import in_threads

    def slow_square(x):
        time.sleep(0.01 * (5 - x % 5))  # later items finish first
        if x == 7:
            raise ValueError("item 7")
        return x * x

    got = list(in_threads(iter(range(7)), slow_square, workers=3))
    assert got == [(x, x * x) for x in range(7)]
    seen = []
    with pytest.raises(ValueError, match="item 7"):
        for x, y in in_threads(iter(range(12)), slow_square, workers=3):
            seen.append(x)
    assert seen == list(range(7))  # everything before the failing item, in order


def test_steps_from_run_is_the_same_with_and_without_threads(monkeypatch):
    from reward_lens.measure.ledger import price
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.record import reader
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).parents[1] / "fixtures" / "grpo_run" / "paired")
    monkeypatch.setattr(reader, "ROWS_PER_READ", 256)  # many small reads, so threads overlap
    monkeypatch.setattr(price, "FEATURE_THREADS", 1)
    one = price.steps_from_run(run, SurfaceFeatures())
    monkeypatch.setattr(price, "FEATURE_THREADS", 3)
    three = price.steps_from_run(run, SurfaceFeatures())
    assert [s.step for s in one] == [s.step for s in three] and len(one) > 10
    for a, b in zip(one, three):
        assert np.array_equal(a.z, b.z) and np.array_equal(a.groups, b.groups) and a.n_groups == b.n_groups
        assert np.array_equal(a.logp, b.logp, equal_nan=True)


def test_stacked_is_a_view_of_consecutive_samples_and_a_copy_of_anything_else():
    """``stacked`` hands back the rows of consecutive samples of one read as a view of the
    stack, and concatenates (the same values) when the samples are not consecutive, come
    from elsewhere, or one holds another array than the stack gave it."""
    from dataclasses import replace

    from reward_lens.measure.ledger import price
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).parents[1] / "fixtures" / "grpo_run" / "paired")
    samples = price.steps_from_run(run, SurfaceFeatures())
    base = samples[0].stack.arrays["z"]
    assert not base.flags.writeable
    for part in (samples, samples[3:9], samples[5:6]):
        got = price.stacked(part)
        assert np.shares_memory(got, base) and np.array_equal(got, np.concatenate([s.z for s in part]))
        adv = price.stacked(part, "advantages")
        assert np.shares_memory(adv, samples[0].stack.arrays["advantages"])
    changed = list(samples[2:6])
    changed[1] = replace(changed[1], z=changed[1].z * 2.0)  # keeps its stack and index
    for part in (samples[2:6:2], samples[6:3:-1], changed,
                 [price.StepSample(s.step, s.names, s.z.copy()) for s in samples[:3]]):
        got = price.stacked(part)
        assert not np.shares_memory(got, base) and np.array_equal(got, np.concatenate([s.z for s in part]))
    # logp_prev is absent at step 0 (null there): a run of samples starting at step 0 has none to stack
    assert samples[0].logp_prev is None
    with pytest.raises((TypeError, ValueError)):
        price.stacked(samples[:3], "logp_prev")


def test_stack_views_is_a_view_of_rows_one_after_another_and_np_stack_otherwise():
    """``stack_views`` hands back equal-shaped views that lie one after another in one array
    as a read-only view of it (the paired ledgers of one batch), and ``np.stack``'s copy of
    anything else: out of order, a gap, another base, another shape."""
    from reward_lens.measure.ledger.price import stack_views

    base = np.arange(5 * 4 * 3, dtype=float).reshape(5, 4, 3)
    # whole rows, a run of them, one, and equal chunks of one row (they too lie one after another)
    for part in ([base[j] for j in range(5)], [base[j] for j in range(1, 4)], [base[2]], [base[0, :2], base[0, 2:]]):
        got = stack_views(part)
        assert np.shares_memory(got, base) and not got.flags.writeable
        assert np.array_equal(got, np.stack(part))
    flat = np.arange(40.0)
    rows = [flat[8 * j:8 * j + 8] for j in range(1, 4)]  # 1-D rows of a 1-D base
    assert np.shares_memory(stack_views(rows), flat) and np.array_equal(stack_views(rows), np.stack(rows))
    other = base.copy()
    for part in ([base[3], base[2]], [base[0], base[2]], [base[0], other[1]], [base[0, 1:3], base[0, 2:4]],
                 [base[0][:, :2], base[1][:, :2]], [np.ones((4, 3)), np.zeros((4, 3))]):
        got = stack_views(part)
        assert not np.shares_memory(got, base) and np.array_equal(got, np.stack(part))


def test_group_sums_and_unit_ids_equal_bincount_and_the_loop_over_samples():
    from reward_lens.measure.ledger.price import StepSample, group_sums, unit_ids

    rng = np.random.default_rng(5)
    z = rng.normal(size=(48, 3)) * [1, 1e3, 1e-3]
    blocks = np.repeat(np.arange(6), 8)  # equal consecutive blocks: the reshape path
    for uid, total in ((blocks, 6), (rng.permutation(blocks), 6), (np.sort(rng.integers(0, 9, 48)), 9)):
        want = np.stack([np.bincount(uid, weights=z[:, j], minlength=total) for j in range(3)], axis=1)
        assert np.array_equal(group_sums(z, uid, total), want)  # the same additions in the same order
        assert np.array_equal(group_sums(z[:, 0], uid, total), want[:, 0])
    # unit ids: groups (coded or not), a step of one group, a step without groups
    samples = [StepSample(0, ("a",), z[:8, :1], groups=np.array(list("aabbccdd"))),
               StepSample(1, ("a",), z[8:12, :1], groups=np.zeros(4, np.int64), n_groups=1),
               StepSample(2, ("a",), z[12:15, :1]),
               StepSample(3, ("a",), z[15:21, :1], groups=np.array([0, 1, 0, 2, 1, 2]), n_groups=3)]
    for groups_from, want_units in ((1, [4, 1, 3, 3]), (2, [4, 4, 3, 3])):
        uid, units = unit_ids(samples, groups_from=groups_from)
        assert units.tolist() == want_units
        offsets = np.r_[0, np.cumsum(want_units)[:-1]]
        plain = [[0, 0, 1, 1, 2, 2, 3, 3], [0] * 4 if groups_from == 1 else [0, 1, 2, 3], [0, 1, 2], [0, 1, 0, 2, 1, 2]]
        assert uid.tolist() == [c + o for p, o in zip(plain, offsets) for c in p]


def test_window_sums_over_long_runs_of_steps_with_gaps_add_in_order():
    """The local metric's windows: +-10 steps over a run with gaps, so most windows take the
    slice path and the edges and gaps the gathered one; each equals its plain sum."""
    from reward_lens.measure.efficiency.metric import _window_sum

    rng = np.random.default_rng(8)
    steps = np.r_[np.arange(0, 60), np.arange(75, 130), np.arange(131, 140)]
    values = rng.normal(size=(len(steps), 3, 3))
    lo = np.searchsorted(steps, steps - 10, side="left")
    hi = np.searchsorted(steps, steps + 10, side="right")
    got = _window_sum(values, lo, hi)
    for i, (a, b) in enumerate(zip(lo, hi)):
        want = np.zeros((3, 3))
        for v in values[a:b]:
            want = want + v
        assert np.array_equal(got[i], want)


def test_ledgers_match_by_prompt_exactly_where_two_prompts_are_shared():
    """Consecutive steps sharing two or more prompts are matched (per-prompt differences);
    the vectorised count of shared prompts picks the same pairs as the per-pair test."""
    from reward_lens.measure.ledger.price import MATCH_MIN_PROMPTS, ledger_series, matched_by_prompt

    rng = np.random.default_rng(4)
    samples = []
    for t in range(12):
        prompts = rng.choice([t * 10, t * 10 + 1, 3, 4, -1] if t % 3 else [t * 10 + j for j in range(4)], 12)
        samples.append(StepSample(t, ("a", "b"), rng.normal(size=(12, 2)), prompts=prompts,
                                  groups=prompts, advantages=rng.normal(size=12)))
    ledgers = ledger_series(samples)
    for lg in ledgers:
        pre, post = samples[lg.step_pair[0]], samples[lg.step_pair[1]]
        shared = set(pre.prompts.tolist()) & set(post.prompts.tolist())
        m = matched_by_prompt(pre, post)
        assert lg.matched == (len(shared) >= MATCH_MIN_PROMPTS) == (m is not None)
        if m is not None:
            np.testing.assert_allclose(lg.delta_z, m[0], rtol=1e-12)
            assert lg.units == m[2]
    assert 0 < sum(lg.matched for lg in ledgers) < len(ledgers)


def test_labels_read_in_many_parts_get_one_id_each_in_order_of_first_appearance(monkeypatch):
    """Group ids and prompts are read as integer ids, encoded part by part: with reads that
    split steps, every label still has one id over the whole record (first appearance order),
    and each step's groups are coded as the definition codes the raw labels."""
    from reward_lens.measure.ledger import price
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.record import reader
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).parents[1] / "fixtures" / "grpo_run" / "paired")
    monkeypatch.setattr(reader, "ROWS_PER_READ", 40)  # reads of 40 rows: steps of 64 straddle them
    samples = price.steps_from_run(run, SurfaceFeatures())
    raw = run.read_rollouts(["group_id", "prompt"])
    steps = raw.column("step").to_numpy()
    first: dict = {}
    want_prompts = np.array([first.setdefault(v, len(first)) for v in raw.column("prompt").to_pylist()])
    got_prompts = np.concatenate([s.prompts for s in samples])
    assert np.array_equal(got_prompts, want_prompts)
    labels = np.array(raw.column("group_id").to_pylist(), dtype=object)
    for s in samples:
        codes, g = price.group_codes(labels[steps == s.step])
        assert np.array_equal(s.groups, codes) and s.n_groups == g


def test_selection_differentials_of_groups_in_blocks_equal_the_definition():
    """TRL's layout (every step's prompt groups of m rollouts one after another) takes the
    broadcast path; it gives the definition's numbers, and those of the same steps with their
    rows shuffled (the gathering path)."""
    from reward_lens.measure.cause import selection_differentials

    rng = np.random.default_rng(6)
    samples, shuffled = [], []
    for t in range(12):
        g, m = int(rng.integers(1, 5)), 4  # some steps of one group: their rollouts are the units
        z, a = rng.normal(size=(g * m, 2)) * [1, 30], rng.normal(size=g * m)
        groups = np.repeat(np.arange(g), m)
        samples.append(StepSample(t, ("a", "b"), z, advantages=a, groups=groups, n_groups=g))
        order = rng.permutation(g * m)
        shuffled.append(StepSample(t, ("a", "b"), z[order], advantages=a[order], groups=groups[order].astype(str)))
    together, apart = selection_differentials(samples), selection_differentials(shuffled)
    for x in samples:
        s, se = _selection_by_definition(x)
        np.testing.assert_allclose(together[x.step][0], s, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(together[x.step][1], se, rtol=1e-8, atol=1e-13)
        np.testing.assert_allclose(together[x.step][0], apart[x.step][0], rtol=1e-10, atol=1e-13)


def test_a_ledger_series_is_a_sequence_of_ledgers_and_its_arrays():
    """ledger_series holds its ledgers as arrays: each item is the Ledger of those arrays' row,
    from either end; a subset keeps its rows; stacking the items gives the same arrays."""
    from reward_lens.measure.ledger.price import LedgerSeries, ledger_arrays, ledger_series

    rng = np.random.default_rng(9)
    samples = [StepSample(t, ("a", "b"), rng.normal(size=(10, 2)), groups=np.repeat([0, 1], 5)) for t in range(7)]
    series = ledger_series(samples, eta_by_step={t: 0.1 * t for t in range(7)})
    assert isinstance(series, LedgerSeries) and len(series) == 6
    a = series.arrays
    for q, lg in enumerate(series):
        assert series[q - 6] is lg and lg.step_pair == (q, q + 1) and lg.learning_rate == pytest.approx(0.1 * q)
        assert np.array_equal(lg.delta_z, a.delta_z[q]) and np.array_equal(lg.cov_delta, a.cov_delta[q])
        assert (lg.n_pre, lg.n_post, lg.units, lg.matched) == (10, 10, 4, False)
    with pytest.raises(IndexError):
        series[6]
    assert [lg.step_pair for lg in series[1:3]] == [(1, 2), (2, 3)]
    part = series.where(np.array([True, False, True, False, False, True]))
    assert [lg.step_pair for lg in part] == [(0, 1), (2, 3), (5, 6)]
    assert np.array_equal(part.arrays.delta_z, a.delta_z[[0, 2, 5]])
    from_list = ledger_arrays(list(series))
    for name in ("step_pairs", "delta_z", "se", "cov_delta", "n_pre", "n_post", "units", "matched"):
        assert np.array_equal(getattr(from_list, name), getattr(a, name))
    assert from_list.learning_rate == a.learning_rate and from_list.kind == a.kind == "unpaired"
    assert len(ledger_series([])) == 0 and len(ledger_series(samples[:1])) == 0
