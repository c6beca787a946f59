"""The KL_min half of the cost book keeps its rows as columns and makes a row on access: every
row, and the report's columns, equal the definitions computed here step pair by step pair
(1/2 dz_A^T G_A^-1 dz_A over the step's active set A, shares that sum to it, the leading
feature, the movement of the excluded features), across several active sets at once."""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.measure.efficiency import kl_min_series, metric_g
from reward_lens.measure.ledger.price import StepSample, ledger_series


def _samples():
    rng = np.random.default_rng(11)
    out = []
    for t in range(14):
        z = rng.normal(size=(40, 3)) * [1.0, 3.0, 0.5] + [0.1 * t, 0.0, 0.2 * t]
        if t in (4, 5, 9):  # the third feature constant at these steps: excluded there
            z[:, 2] = 7.0
        out.append(StepSample(t, ("a", "b", "c"), z))
    return out


def test_rows_made_from_columns_equal_the_definition_in_every_active_set():
    samples = _samples()
    g = metric_g(samples, scope="per_step")
    ledgers = ledger_series(samples)
    series = kl_min_series(ledgers, g)
    assert len({g.active_of(lg.step_pair[0]) for lg in ledgers}) == 2 and len(series) == len(ledgers)
    for i, (row, lg) in enumerate(zip(series.rows, ledgers)):
        sub = g.for_step(lg.step_pair[0])
        idx = [g.names.index(a) for a in sub.active]
        dz = lg.delta_z[idx]
        kl = 0.5 * dz @ np.linalg.solve(sub.matrix[np.ix_(idx, idx)], dz)
        assert row.step_pair == lg.step_pair and row.kl_min == pytest.approx(kl, rel=1e-12)
        assert list(row.shares) == list(sub.active) and sum(row.shares.values()) == pytest.approx(kl, rel=1e-9)
        lead = max(row.shares, key=row.shares.get)
        assert row.leading_feature == lead
        assert row.leading_delta == lg.delta_z[g.names.index(lead)] and row.leading_se == lg.se[g.names.index(lead)]
        assert row.unpriced_movement == {n: float(lg.delta_z[g.names.index(n)]) for n in sub.excluded
                                         if lg.delta_z[g.names.index(n)] != 0}
        assert (row.n_pre, row.n_post, row.kind) == (lg.n_pre, lg.n_post, "unpaired")
        assert series[i] == row and series[i - len(series)] == row  # one row alone, and from the end
    with pytest.raises(IndexError):
        series[len(series)]


def test_the_report_columns_are_the_rows():
    from reward_lens.measure.efficiency.section import _kl_min_rows

    samples = _samples()
    g = metric_g(samples, scope="per_step")
    series = kl_min_series(ledger_series(samples), g)
    cols, totals = _kl_min_rows(series.columns, g.names)
    for i, row in enumerate(series.rows):
        assert cols.step_pair[i] == row.step_pair and cols.kl_min[i] == row.kl_min
        assert (cols.noise_floor[i], cols.resolved[i], cols.p_value[i]) == (row.noise_floor, row.resolved, row.p_value)
        assert cols.leading_feature[i] == row.leading_feature
        assert {n: v[i] for n, v in cols.shares.items() if v[i] is not None} == row.shares
    assert totals == {n: sum(r.shares.get(n, 0.0) for r in series.rows) for n in g.names}
    res = [r for r in series.rows if r.resolved]
    # the shares the card, the agreement book and the task table state: the run's decisions,
    # summed over the resolved rows in one place; here summed plainly over the rows
    from reward_lens.measure.decisions import decide_from

    d = decide_from(ledger_series(samples), g.names, series=series)
    total = sum(r.kl_min for r in res)
    assert res and d.resolved_kl_min == pytest.approx(total, rel=1e-12)
    assert d.resolved_shares == pytest.approx({n: sum(r.shares.get(n, 0.0) for r in res) / total for n in g.names})
