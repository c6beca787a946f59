"""``steps_from_run`` makes its StepSamples without the frozen dataclass's __init__ (``price._made``)
and lists each step's rows as views of one reshaped array where the steps are of equal size
(``price._step_views``); each sample is what the constructor makes of the same values, and each
view is the slice it replaces, of the same memory. The paired estimates are made in chunks on
threads (``eta.ESTIMATE_CHUNK``): every pair's numbers are its own, whatever the chunk."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reward_lens.examples import example_record
from reward_lens.measure.efficiency import eta as eta_mod
from reward_lens.measure.efficiency import iproj
from reward_lens.measure.ledger import price
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.paired import paired_ledger_series
from reward_lens.measure.ledger.price import StepSample, steps_from_run
from reward_lens.record.reader import open_run


def test_a_made_sample_is_what_the_constructor_makes():
    z = np.arange(12.0).reshape(4, 3)
    values = {f.name: None for f in dataclasses.fields(StepSample)}
    values.update(step=3, names=("a", "b", "c"), z=z, rewards=np.ones(4), groups=np.array([0, 0, 1, 1]), n_groups=2,
                  index=7)
    made = price._made([tuple(values.values())], tuple(values))[0]
    again = StepSample(**values)
    assert type(made) is StepSample and vars(made).keys() == vars(again).keys()
    assert all(getattr(made, k) is getattr(again, k) for k in values)
    assert made.n == again.n == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.step = 4
    with pytest.raises(ValueError, match="every field"):
        price._made([(1,)], ("step",))


@pytest.mark.parametrize("sizes", [[4, 4, 4], [4, 2, 5], [3]])
def test_step_views_are_the_slices_of_the_same_memory(sizes):
    ns = np.array(sizes)
    starts = np.r_[0, np.cumsum(ns)[:-1]]
    for v in (np.arange(float(ns.sum() * 2)).reshape(-1, 2), np.arange(float(ns.sum()))):
        v.flags.writeable = False
        absent = np.zeros(len(ns), dtype=bool)
        absent[-1] = True
        for gone in (None, absent):
            got = price._step_views(v, starts, ns, gone)
            for i, (a, n) in enumerate(zip(starts, ns)):
                if gone is not None and gone[i]:
                    assert got[i] is None
                    continue
                want = v[a:a + n]
                assert got[i].shape == want.shape and got[i].strides == want.strides
                assert np.array_equal(got[i], want) and np.shares_memory(got[i], v)
                assert got[i].base is want.base and not got[i].flags.writeable
    # a column that is not C-contiguous is sliced, never reshaped into a copy
    w = np.arange(24.0).reshape(12, 2)[:, 0]
    got = price._step_views(w, np.array([0, 4, 8]), np.array([4, 4, 4]), None)
    assert all(np.shares_memory(x, w) for x in got) and np.array_equal(got[1], w[4:8])


def _reference_samples(stack, steps, names, attach):
    """The samples as ``price._samples`` made them before ``_made``: the constructor, each step's
    rows sliced from the stack's arrays, a column absent at a step left at None."""
    out = []
    for i, (a, n) in enumerate(zip(stack.starts.tolist(), stack.ns.tolist())):
        kw = {attr: v[a:a + n] for attr, v in stack.arrays.items()
              if attr != "z" and stack.views[attr][i] is not None}
        out.append(StepSample(steps[i], names, stack.arrays["z"][a:a + n], stack=stack, index=i, **kw,
                              n_groups=None if stack.views.get("groups") is None else int(kw["groups"].max()) + 1,
                              **{k: v.get(steps[i]) for k, v in attach.items()}))
    return out


def test_the_samples_of_a_read_are_what_their_constructor_makes():
    run = open_run(example_record("tapped"))
    samples = steps_from_run(run, SurfaceFeatures())
    assert len(samples) > 10
    names = [f.name for f in dataclasses.fields(StepSample)]
    steps = [s.step for s in samples]
    attach = {side: {s.step: getattr(s, side) for s in samples if getattr(s, side) is not None}
              for side in ("heldout", "fresh")}
    for s, ref in zip(samples, _reference_samples(samples[0].stack, steps, samples[0].names, attach)):
        assert vars(s).keys() == vars(ref).keys()
        for k in names:  # the same values, and each array the same rows of the same memory
            a, b = getattr(s, k), getattr(ref, k)
            if isinstance(b, np.ndarray):
                assert a.shape == b.shape and a.strides == b.strides and np.shares_memory(a, b)
                assert np.array_equal(a, b, equal_nan=True) and not a.flags.writeable
            else:
                assert a is b or a == b, (s.step, k)
        assert s.z is s.stack.views["z"][s.index]
        for side in (s.heldout, s.fresh):
            if side is not None:
                assert side.step == s.step and side.z is side.stack.views["z"][side.index]
    # the stack hands consecutive samples back as one view (``stacked``), as before
    z = price.stacked(samples)
    assert np.array_equal(z, np.concatenate([s.z for s in samples])) and np.shares_memory(z, samples[0].z)


def _tapped_items():
    run = open_run(example_record("tapped"))
    samples = steps_from_run(run, SurfaceFeatures())
    ledgers, _ = paired_ledger_series(samples, heldout={s.step: s.heldout for s in samples if s.heldout is not None})
    k = len(samples[0].names)
    return [(lg, np.arange(k)) for lg in ledgers if lg.kl is not None]


def _irregular_items():
    """Forty step pairs of one layout whose groups are not equal consecutive blocks (groups of
    5, 7, 4 and 6 rollouts, 3 held-out rows each), and the irregular layouts of
    ``test_cost_columns``: their weights' group sums are matrix products."""
    from tests.unit.test_cost_columns import _irregular, _step

    rng = np.random.default_rng(7)
    steps = [_step(rng, t, [5, 7, 4, 6], held=3) for t in range(1, 41)]
    samples, held = [s for s, _ in steps], {s.step: h for s, h in steps}
    more, more_held = _irregular(0)
    ledgers, _ = paired_ledger_series(samples, heldout=held)
    ledgers += paired_ledger_series(more, heldout=more_held)[0]
    k = len(samples[0].names)
    return [(lg, np.arange(k)) for lg in ledgers if lg.kl is not None and np.isfinite(lg.kl).all()]


@pytest.mark.parametrize("make", [_tapped_items, _irregular_items])
def test_paired_estimates_do_not_depend_on_the_chunk_the_batch_or_the_threads(monkeypatch, make):
    items = make()
    assert len(items) > 5
    if make is _irregular_items:  # the case the chunks must not reach: not every layout in blocks
        assert any(not price.blocks(np.sort(np.asarray(lg.codes)), lg.n_groups) for lg, _ in items)
    want = eta_mod.paired_estimate_columns(items)
    for chunk, floats, threads in ((1, 10_000, 1), (3, 250_000, 2), (len(items) + 5, 4_000_000, 4)):
        monkeypatch.setattr(eta_mod, "ESTIMATE_CHUNK", chunk)
        monkeypatch.setattr(iproj, "JACKKNIFE_BATCH_FLOATS", floats)
        monkeypatch.setattr(price, "FEATURE_THREADS", threads)
        got = eta_mod.paired_estimate_columns(items)
        for f in dataclasses.fields(got):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), f.name
            else:
                assert a == b, f.name

