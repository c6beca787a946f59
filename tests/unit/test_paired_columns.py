"""The paired ledgers of a series are made in batches without a per-ledger __init__ (``paired._made``)
and their per-row checks taken over each batch's arrays at once; each ledger is what the
dataclass's own constructor makes of the same values, and its D_t stands where its token KL is
finite on every row, as the row-by-row check has it -- on irregular layouts (unequal groups, a
group of one, a step missing, one- and two-sided steps, a NaN in the token KL, none at all)."""

from __future__ import annotations

import dataclasses

import numpy as np

from reward_lens.measure.ledger.paired import PairedLedger, paired_ledger, paired_ledger_series
from tests.unit.test_cost_columns import _irregular


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_ledgers_made_in_batches_are_what_their_constructor_makes():
    for seed in range(3):
        samples, held = _irregular(seed)
        ledgers, _ = paired_ledger_series(samples, heldout=held)
        assert len(ledgers) > 10 and {lg.sides for lg in ledgers} == {"one-sided", "two-sided"}
        for lg in ledgers:
            values = {f.name: getattr(lg, f.name) for f in dataclasses.fields(PairedLedger)}
            again = PairedLedger(**values)
            assert type(lg) is PairedLedger and lg.__class__.__init__ is PairedLedger.__init__
            assert set(vars(lg)) == set(vars(again)) | {"n_heldout"}
            assert all(_same(getattr(lg, k), getattr(again, k)) for k in vars(again))
            assert lg.n_heldout == again.n_heldout and lg.sides == again.sides and lg.premise() == again.premise()
            with np.testing.assert_raises(dataclasses.FrozenInstanceError):
                lg.d_t = 0.0


def test_d_t_stands_where_the_token_kl_is_finite_on_every_row():
    samples, held = _irregular(0)
    ledgers, _ = paired_ledger_series(samples, heldout=held)
    seen = set()
    for lg in ledgers:
        finite = lg.kl is not None and bool(np.isfinite(lg.kl).all())
        seen.add((lg.kl is None, finite))
        assert (lg.d_t is not None) == finite, lg.step_pair
        alone = paired_ledger(samples[[s.step for s in samples].index(lg.step_pair[1])],
                              heldout=held.get(lg.step_pair[1]))
        assert (alone.d_t is None) == (lg.d_t is None)
    assert seen == {(True, False), (False, False), (False, True)}  # no token KL; a NaN in it; finite


class _StrataAsWritten:
    """``paired.Strata``'s arithmetic as first written (a (1, n, 1) operand broadcast over the
    samples and features, gathers by fancy indexing): the reference the faster layout must equal."""

    def __init__(self, s):
        self.s = s

    def stratum_sums(self, x):
        s = self.s
        if x.ndim == 2:
            return (x @ s._onehot)[:, s.ids]
        return np.matmul(x.transpose(0, 2, 1), s._onehot).transpose(0, 2, 1)[:, s.ids]

    def deleted_means(self, w, x, group_means, codes):
        f = self.s.factor
        norm = 1.0 + (f - 1.0) * self.stratum_sums(w) - f * w
        wx = w * x if x.ndim == 2 else w[:, :, None] * x
        norm = np.where(norm > 0, norm, np.nan)
        if x.ndim == 2:
            return (group_means[:, codes] + (f - 1.0) * self.stratum_sums(wx) - f * wx) / norm
        return (group_means[:, codes] + (f - 1.0)[None, :, None] * self.stratum_sums(wx)
                - f[None, :, None] * wx) / norm[:, :, None]

    def jackknife(self, theta):
        s = self.s
        flat = theta.ndim == 2
        t = theta[:, :, None] if flat else theta
        t = np.where(s.ok[None, :, None], t, 0.0)
        mean = np.matmul(t.transpose(0, 2, 1), s._onehot) / np.maximum(s.size, 1)
        dev = np.where(s.ok[None, :, None], t - mean.transpose(0, 2, 1)[:, s.ids], 0.0)
        scaled = dev * s.weight[s.ids][None, :, None]
        cov = np.matmul(scaled.transpose(0, 2, 1), dev)
        v = np.matmul((scaled * dev).transpose(0, 2, 1), s._onehot)
        den = (v ** 2 / np.maximum(s.size - 1, 1)).sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            dof = np.where(den > 0, v.sum(axis=-1) ** 2 / np.where(den > 0, den, 1.0), np.nan)
        return (cov[:, 0, 0], dof[:, 0]) if flat else (cov, dof)


def test_strata_arithmetic_is_the_broadcast_written_out_to_the_last_bit():
    from reward_lens.measure.ledger.paired import Strata

    rng = np.random.default_rng(4)
    layouts = [  # (codes, side): unequal groups, strata of one row, one side only
        (np.repeat(np.arange(5), [3, 1, 4, 2, 6]), None),
        (np.r_[np.repeat(np.arange(4), 5), np.repeat(np.arange(4), [2, 1, 3, 2])],
         np.r_[np.zeros(20, bool), np.ones(8, bool)]),
        (np.r_[np.repeat(np.arange(3), 4), np.array([0, 2, 2])], np.r_[np.zeros(12, bool), np.ones(3, bool)]),
    ]
    for codes, side in layouts:
        g = int(codes.max()) + 1
        strata, ref = Strata(codes, side, g), None
        ref = _StrataAsWritten(strata)
        for p, k in ((7, 4), (3, 1), (5, 9)):
            w = rng.uniform(size=(p, len(codes)))
            w /= np.bincount(codes, minlength=g)[codes]  # weights about normalised in each group
            w[0, 0] = 1.0  # a row that carries its group's weight (a NaN deletion where alone)
            x3 = rng.normal(size=(p, len(codes), k))
            x3[1, 2, 0] = np.nan
            x2 = rng.normal(size=(p, len(codes)))
            gm3, gm2 = rng.normal(size=(p, g, k)), rng.normal(size=(p, g))
            for a, b in ((strata.stratum_sums(x3), ref.stratum_sums(x3)), (strata.stratum_sums(x2), ref.stratum_sums(x2)),
                         (strata.deleted_means(w, x3, gm3, codes), ref.deleted_means(w, x3, gm3, codes)),
                         (strata.deleted_means(w, x2, gm2, codes), ref.deleted_means(w, x2, gm2, codes)),
                         *zip(strata.jackknife(x3), ref.jackknife(x3)), *zip(strata.jackknife(x2), ref.jackknife(x2))):
                assert a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def test_a_batchs_gather_is_the_stack_of_each_samples_gather_in_value_and_layout():
    """``eta._gathered`` (one gather of the transposed samples) against ``_laid_out_as`` of the
    gathers it replaces, for orders, masks and slices of rows and one, some or every column."""
    from reward_lens.measure.efficiency.eta import _gathered, _laid_out_as

    rng = np.random.default_rng(6)
    rows = rng.normal(size=(13, 24, 5))
    for order in (rng.permutation(24), rng.uniform(size=24) > 0.4, slice(None), slice(3, 20)):
        for idx in (np.arange(5), np.array([0, 2, 3]), np.array([4]), np.array([3, 1])):
            got = _gathered(rows, order, idx)
            want = _laid_out_as(rows[0][order][:, idx], rows[:, order][:, :, idx])
            assert np.array_equal(got, want) and got.strides == want.strides and got.dtype == want.dtype
            assert np.array_equal(got, np.stack([r[order][:, idx] for r in rows]))
