"""eta's bias-aware interval (``eta.bias_aware_halves``, issue 41): the half-width covers the truth
at 95 % whatever the estimate's bias up to a bound, checked against scipy's root finder on scipy's
t (``interval_helpers``), at its edges, and row by row against the columns the book computes."""

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from reward_lens.measure.efficiency.eta import EtaColumns, EtaEstimate, bias_aware_halves, moderate
from tests.unit.interval_helpers import bias_aware_half


def test_the_half_width_is_the_bias_aware_critical_value():
    rng = np.random.default_rng(7)
    dof = np.concatenate([rng.uniform(0.7, 60.0, 300), [1.0, 2.0, 3.0, 1e6, 1e12, np.inf]])
    se = rng.uniform(0.005, 0.6, len(dof))
    bound = se * rng.choice([0.0, 0.01, 0.3, 1.0, 3.0, 30.0], len(dof))
    got = bias_aware_halves(dof, se, bound)
    want = np.array([bias_aware_half(d, s, b) for d, s, b in zip(dof, se, bound)])
    assert np.allclose(got, want, rtol=1e-10, atol=0)
    # between t975 * se (no bias) and bound + t975 * se, and t975 * se exactly where the bound is 0
    q975 = np.where(np.isinf(dof), stats.norm.ppf(0.975), stats.t.ppf(0.975, np.where(np.isinf(dof), 1.0, dof)))
    assert (got >= q975 * se * (1 - 1e-12)).all() and (got <= bound + q975 * se * (1 + 1e-12)).all()
    assert np.allclose(got[bound == 0], (q975 * se)[bound == 0], rtol=1e-13, atol=0)
    # and far out, the one-sided quantile above the bound: c - b -> t95
    far = bias_aware_halves(np.array([np.inf]), np.array([1.0]), np.array([50.0]))[0]
    assert far == pytest.approx(50.0 + stats.norm.ppf(0.95), rel=1e-12)


def test_its_edges_are_named():
    dof = np.array([5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0])
    se = np.array([0.0, np.inf, 0.1, 0.1, 0.1, 1e-300, 0.0])
    bound = np.array([0.2, 0.2, np.inf, np.nan, 0.0, 1e10, 0.0])
    got = bias_aware_halves(dof, se, bound)
    q975 = stats.t.ppf(0.975, 5.0)
    assert got[0] == 0.2  # no sampling error: the bias alone
    assert math.isinf(got[1]) and math.isinf(got[2])  # an infinite SE or bound is an infinite half
    assert got[3] == pytest.approx(q975 * 0.1, rel=1e-15) and got[4] == pytest.approx(q975 * 0.1, rel=1e-15)
    assert got[5] == pytest.approx(1e10, rel=1e-12)  # a ratio that overflows: the range's upper end
    assert got[6] == 0.0
    assert bias_aware_halves(np.zeros(0), np.zeros(0), np.zeros(0)).shape == (0,)
    # degrees of freedom past NORMAL_DOF read as the normal, finite where t's constant loses its digits
    huge = bias_aware_halves(np.array([1e17, np.inf]), np.array([0.1, 0.1]), np.array([0.05, 0.05]))
    assert np.isfinite(huge).all() and huge[0] == pytest.approx(huge[1], rel=1e-9)


def test_a_rows_half_width_does_not_depend_on_its_batch():
    rng = np.random.default_rng(3)
    dof = rng.uniform(1.0, 20.0, 200)
    se = rng.uniform(0.01, 0.3, 200)
    bound = se * rng.uniform(0.0, 5.0, 200)
    whole = bias_aware_halves(dof, se, bound)
    assert all(bias_aware_halves(dof[i:i + 1], se[i:i + 1], bound[i:i + 1])[0] == whole[i] for i in range(200))
    back = bias_aware_halves(dof[::-1], se[::-1], bound[::-1])[::-1]
    assert (back == whole).all()


def test_a_moderated_book_states_the_bound_and_its_rows_agree_with_its_columns():
    """``moderate`` sets each stated row's bound to |KL_min - KL_jk| / D_t; the columns' intervals
    and each row's own (``EtaEstimate.interval``) are the same numbers to the last bit, and
    without the bound the interval is the plain t one, inside the bounded one."""
    rng = np.random.default_rng(11)
    n = 40
    est = []
    for i in range(n):
        d = float(rng.uniform(0.2, 2.0))
        k = float(rng.uniform(0.0, 1.0)) * d
        k_jk = k - float(rng.uniform(0.0, 0.1)) * d
        a = rng.normal(size=(2, 2)) * 0.02
        est.append(EtaEstimate(step_pair=(i, i + 1), kind="paired", kl_min=k, kl_min_debiased=k_jk, d_t=d,
                               p_value=float(rng.uniform()), cov=a @ a.T + np.eye(2) * 1e-4, dof=float(rng.integers(1, 8)),
                               groups_varying=int(rng.integers(2, 9))))
    cols = moderate(EtaColumns.of(est, "paired"))
    assert cols.bias_bound is not None
    assert np.allclose(cols.bias_bound, np.abs(cols.kl_min - cols.kl_min_debiased) / cols.d_t, rtol=0, atol=0)
    lo, hi = cols.interval()
    for i in range(n):
        e = cols.estimate(i)
        assert e.bias_bound == cols.bias_bound[i]
        assert e.interval() == (lo[i], hi[i])
        plain_lo, plain_hi = dataclasses.replace(e, bias_bound=None).interval()
        q = stats.t.ppf(0.975, e.dof_pooled)
        assert plain_hi - e.eta_debiased == pytest.approx(q * e.se, rel=1e-12)
        assert lo[i] <= plain_lo and plain_hi <= hi[i]
    # taking rows keeps their bounds
    part = cols.take(np.array([3, 1]))
    assert (part.bias_bound == cols.bias_bound[[3, 1]]).all()


def _paired(pair, k, kd, d, var_k, var_d, kind="paired", tail=0.0):
    return EtaEstimate(step_pair=pair, kind=kind, kl_min=k, kl_min_debiased=kd, d_t=d, p_value=0.01,
                       cov=np.array([[var_k, 0.0], [0.0, var_d]]), dof=20.0, groups_varying=8, d_t_tail=tail)


def test_a_window_and_the_runs_interval_cover_a_bias_up_to_their_sums_correction():
    """The run's eta (a window of every row) has the bound a row has, on its sums: by hand,
    (0.30 + 0.10 - 0.22 - 0.06) / (1.0 + 0.5) = 0.08, and its half-width is the bias-aware critical
    value on that bound (checked against scipy's root finder), not t975 * SE."""
    from reward_lens.measure.efficiency.eta import run_level, window

    rows = [_paired((0, 1), 0.30, 0.22, 1.0, 4e-4, 1e-4), _paired((1, 2), 0.10, 0.06, 0.5, 1e-4, 4e-5)]
    for w in (window(rows), run_level(rows), run_level(EtaColumns.of(rows, "paired"))):
        assert w.bias_bound == pytest.approx(0.08, rel=1e-12)
        lo, hi = w.interval()
        half = bias_aware_half(w.dof, w.se, 0.08)
        assert hi - w.eta_debiased == pytest.approx(half, rel=1e-9)
        assert w.eta_debiased - lo == pytest.approx(half, rel=1e-9)
        plain = dataclasses.replace(w, bias_bound=None).interval()
        assert plain[0] > lo and plain[1] < hi  # the bound widens it; the estimate does not move
    # a correction of nothing states no bound's width; an unpaired window no bound at all
    none = run_level([_paired((0, 1), 0.3, 0.3, 1.0, 4e-4, 1e-4)])
    assert none.bias_bound == 0.0
    assert none.interval() == dataclasses.replace(none, bias_bound=None).interval()
    assert run_level([_paired((0, 1), 0.3, 0.2, 1.0, 4e-4, 1e-4, kind="unpaired")]).bias_bound is None
    # a window whose D_t is not positive states no bound
    assert window([_paired((0, 1), 0.3, 0.2, 0.0, 4e-4, 1e-4)]).bias_bound is None
