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
