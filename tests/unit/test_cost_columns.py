"""The paired cost book of single step pairs is computed as columns over all step pairs at once
(``cost._paired_columns``, ``eta.EtaColumns``); every row, refusal, estimate and run-level number
equals the row-by-row definition (the loop a windowed book still takes, ``PAIRED_COLUMNS = False``)
to the last bit, on a series of irregular layouts: unequal prompt groups, a group of one, a step
missing, one-sided and two-sided steps, a step without the token KL, one with a NaN in it, heavy tails, a step
that prices nothing, an envelope violated, a step in which one group varies, and the record's
D_t beside the token KL (agreeing and not)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from reward_lens.measure.efficiency import cost as cost_mod
from reward_lens.measure.efficiency import eta as eta_mod
from reward_lens.measure.efficiency.cost import cost_series
from reward_lens.measure.efficiency.eta import EtaColumns, EtaEstimate, headline, run_level, window
from reward_lens.measure.efficiency.metric import within_group_metric
from reward_lens.measure.ledger.paired import paired_ledger_series
from reward_lens.measure.ledger.price import StepSample

NAMES = ("f1", "f2", "f3")


def _step(rng, step: int, sizes, *, held: int = 0, r_scale: float = 0.3, heavy: bool = False, nan_kl: bool = False,
          tiny_kl: bool = False, constant: bool = False, one_varies: bool = False, no_kl: bool = False):
    codes = np.repeat(np.arange(len(sizes)), sizes)
    n = len(codes)
    z = rng.normal(size=(n, 3)) * [1.0, 4.0, 0.2]
    if constant:  # no feature varies within any group: nothing to price
        z = np.repeat(rng.normal(size=(len(sizes), 3)), sizes, axis=0)
    if one_varies:  # only the first group varies
        z[codes > 0] = np.repeat(rng.normal(size=(len(sizes) - 1, 3)), sizes[1:], axis=0)
    r = r_scale * (z[:, 0] + 0.2 * z[:, 1] + 0.5 * rng.normal(size=n))
    if heavy:
        r = r_scale * rng.standard_cauchy(n) * 40
    kl = 0.5 * r ** 2 + 1e-3 * rng.uniform(size=n)
    if tiny_kl:
        kl = np.full(n, 1e-9)
    if nan_kl:
        kl[1] = np.nan
    lp0 = rng.normal(size=n)
    s = StepSample(step, NAMES, z, groups=codes, logp=lp0 + r, logp_prev=lp0, kl_prev=None if no_kl else kl,
                   n_groups=len(sizes))
    ho = None
    if held:
        hc = np.repeat(np.arange(len(sizes)), held)
        zh = rng.normal(size=(len(hc), 3)) * [1.0, 4.0, 0.2]
        if constant or one_varies:
            zh = z[np.r_[0, np.cumsum(sizes)[:-1]][hc]]  # each group's first rollout's features
        rh = r_scale * (zh[:, 0] + 0.5 * rng.normal(size=len(hc)))
        lh = rng.normal(size=len(hc))
        kh = np.full(len(hc), 1e-9) if tiny_kl else 0.5 * rh ** 2 + 1e-3
        ho = StepSample(step, NAMES, zh, groups=hc, logp=lh + rh, logp_prev=lh, kl_prev=kh, n_groups=len(sizes))
    return s, ho


def _irregular(seed: int):
    rng = np.random.default_rng(seed)
    samples, held = [], {}
    plan = {
        1: dict(sizes=[6, 6, 6, 6, 6, 6, 6, 6], held=4), 2: dict(sizes=[6] * 8, held=4),
        3: dict(sizes=[5, 7, 4, 6, 8], held=3, no_kl=True), 4: dict(sizes=[8] * 8, heavy=True),
        6: dict(sizes=[3, 5, 1, 7, 4, 6]),  # a group of one (dropped); step 5 missing
        7: dict(sizes=[6] * 8, held=4, constant=True), 8: dict(sizes=[6] * 8, tiny_kl=True),
        9: dict(sizes=[6] * 8, held=4, one_varies=True), 10: dict(sizes=[4, 6, 5, 7, 6, 5], held=2),
        11: dict(sizes=[6] * 8, held=4, r_scale=0.05), 12: dict(sizes=[6] * 8, r_scale=0.6),
        13: dict(sizes=[6] * 8, held=4), 14: dict(sizes=[2, 9, 3, 6], held=3),
        15: dict(sizes=[5, 6, 7, 5, 6], nan_kl=True),  # a NaN in the token KL: D_t is not a number
    }
    for step, kw in plan.items():
        s, ho = _step(rng, step, **kw)
        samples.append(s)
        if ho is not None:
            held[step] = ho
    return samples, held


def _fake_run(ledgers, rng):
    """What the book reads of a record: its id, per-step telemetry, and the record's D_t with its SE
    (near the token KL on some steps, far from it on others)."""
    d = {lg.step_pair[0]: (lg.d_t if lg.d_t is not None else 0.1) * (1.0 + (0.5 if lg.step_pair[0] % 3 else 0.01))
         for lg in ledgers}
    se = {t: (abs(v) * 0.02 if t % 2 else None) for t, v in d.items()}
    cols = {"kl_to_previous": d, "kl_to_previous_se": {t: v for t, v in se.items() if v is not None},
            "kl_to_previous_estimator": {t: "k3" for t in d}}
    return SimpleNamespace(run_id="fake-run-0123456789", manifest=SimpleNamespace(telemetry_per_step=True,
                                                                                   optimizer="adamw"),
                           telemetry_column=lambda name: dict(cols.get(name, {})), steps=np.arange(20))


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN, floats to the last bit (tuples, lists and dicts element by element)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b, equal_nan=True)
    return type(a) is type(b) and a == b


def _books(samples, held, run, monkeypatch):
    ledgers, _ = paired_ledger_series(samples, heldout=held)
    g = within_group_metric(ledgers)
    columns = cost_series(ledgers, g, run_=run)
    monkeypatch.setattr(cost_mod, "PAIRED_COLUMNS", False)
    rows = cost_series(ledgers, g, run_=run)
    monkeypatch.setattr(cost_mod, "PAIRED_COLUMNS", True)
    return ledgers, columns, rows


@pytest.mark.parametrize("seed", range(4))
def test_paired_columns_are_the_row_by_row_book(seed, monkeypatch):
    samples, held = _irregular(seed)
    ledgers, _ = paired_ledger_series(samples, heldout=held)
    run = _fake_run(ledgers, np.random.default_rng(seed))
    ledgers, a, b = _books(samples, held, run, monkeypatch)
    # the layouts do what they are there for
    codes = {r.code for r in b.refusals}
    premises = {r.context.get("premise") for r in b.refusals}
    assert {"ENVELOPE_VIOLATED", "PREMISE_FAILED", "RECORD_INCOMPLETE"} <= codes and "heavy_tails" in premises
    statuses = {r.status for r in b.rows}
    assert "nothing_priced" in statuses and any(r.no_interval for r in b.rows) and any(r.interval for r in b.rows)
    assert any(r.d_t_disagrees for r in b.rows) and any("record" in r.d_t_checks and not r.d_t_disagrees
                                                           for r in b.rows)
    assert any(r.kl_spent_se is not None for r in b.rows)
    assert {lg.sides for lg in ledgers} == {"one-sided", "two-sided"} and (4, 5) not in {lg.step_pair for lg in ledgers}
    # the same book
    assert len(a.rows) == len(b.rows) and all(_same(vars(x), vars(y)) for x, y in zip(a.rows, b.rows))
    assert [(r.code, r.subject) for r in a.refusals] == [(r.code, r.subject) for r in b.refusals]
    assert all(_same(x.context, y.context) for x, y in zip(a.refusals, b.refusals))
    assert [r.detail for r in a.refusals] == [r.detail for r in b.refusals]
    assert list(a._estimates) == list(b._estimates)
    assert all(_same(vars(a._estimates[p]), vars(b._estimates[p])) for p in b._estimates)
    assert _same(a.headline(), b.headline()) and a.counts() == b.counts()
    assert _same(vars(a.run_level()), vars(b.run_level()))
    assert a.false_discoveries_expected == b.false_discoveries_expected
    assert [vars(r) for r in a.resolved_rows] == [vars(r) for r in b.resolved_rows]
    # and the report's lists of the columns are the rows' own
    for name in ("step_pair", "steps", "status", "kl_min", "kl_spent", "kl_spent_se", "kl_spent_interval", "efficiency",
                 "efficiency_null", "efficiency_debiased", "interval", "p_value", "resolved", "d_t_checks",
                 "d_t_disagrees", "no_interval"):
        assert _same(a.columns.lists(name), [getattr(r, name) for r in b.rows]), name
        assert _same(b.columns.lists(name), [getattr(r, name) for r in b.rows]), name
    assert a.columns.lists("source") == [r.kl_spent_source for r in b.rows]


def _estimates(rng, n: int) -> list[EtaEstimate]:
    """Estimates over many scales, with the edges each property has: D_t of 0, below 0, NaN and
    huge; a covariance whose quadratic form is negative, NaN or infinite; no groups varying, one,
    two; degrees of freedom finite, repeated and infinite."""
    out = []
    for i in range(n):
        k = float(rng.normal() * 10.0 ** rng.integers(-8, 3))
        kd = k - abs(float(rng.normal())) * 10.0 ** rng.integers(-9, 0)
        d = float(abs(rng.normal()) * 10.0 ** rng.integers(-6, 3))
        a = rng.normal(size=(2, 2))
        cov = a @ a.T * 10.0 ** rng.integers(-12, 1)
        edge = i % 17
        if edge == 1:
            d = 0.0
        elif edge == 2:
            d = -d
        elif edge == 3:
            d = float("nan")
        elif edge == 4:
            d = 1e31
        elif edge == 5:
            cov = np.array([[1.0, 5.0], [5.0, 1.0]])  # indefinite: a negative form on some gradients
        elif edge == 6:
            cov = np.array([[np.nan, 0.0], [0.0, 1.0]])
        elif edge == 7:
            cov = np.array([[1e40, 0.0], [0.0, 1e40]])
        elif edge == 8:
            cov = np.zeros((2, 2))
        elif edge == 9:
            kd = d + 10 * math.sqrt(abs(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]))  # far above the envelope
        gv = [None, 0, 1, 2, 5][i % 5]
        dof = [float("inf"), 1.0, 3.0, 7.0, float(rng.integers(1, 30))][i % 5]
        out.append(EtaEstimate(step_pair=(i, i + 1), kind="paired", kl_min=k, kl_min_debiased=kd, d_t=d,
                               p_value=float(rng.uniform()), cov=cov, dof=dof, converged=bool(i % 3),
                               steps=1, groups_varying=gv))
    return out


def test_eta_columns_compute_each_estimates_properties_to_the_last_bit():
    rng = np.random.default_rng(3)
    es = _estimates(rng, 3000)
    c = EtaColumns.of(es)
    assert len(c) == len(es)
    assert all(_same(vars(c.estimate(i)), vars(e)) for i, e in enumerate(es))
    for name in ("null_kl", "eta", "eta_null", "eta_debiased", "se", "excess_z", "estimable"):
        got = getattr(c, name).tolist()
        want = [getattr(e, name) for e in es] if name not in ("eta", "eta_null") else \
            [getattr(e, name) if e.d_t != 0 else (math.copysign(math.inf, e.kl_min) if name == "eta" and e.kl_min
                                                  else getattr(c, name)[j]) for j, e in enumerate(es)]
        assert all(_same(float(x), float(y)) for x, y in zip(got, want)), name
    lo, hi = c.interval()
    for j, e in enumerate(es):
        assert _same((float(lo[j]), float(hi[j])), e.interval())
    sub = [1, 5, 9, 2000, 17]
    assert all(_same(vars(c.take(np.array(sub)).estimate(q)), vars(es[i])) for q, i in enumerate(sub))


def test_a_moderated_books_intervals_with_their_bias_bounds_are_each_rows_own():
    """The same estimates as a paired book states them (``eta.moderate``: the SE pooled and each
    stated row's bias bound set): the columns' intervals are each row's own to the last bit, edges
    included, and some bounds are at work."""
    from reward_lens.measure.efficiency.eta import moderate

    rng = np.random.default_rng(5)
    c = moderate(EtaColumns.of(_estimates(rng, 3000)))
    assert c.bias_bound is not None and int((c.bias_bound > 0).sum()) >= 1000
    lo, hi = c.interval()
    for j in range(len(c)):
        assert _same((float(lo[j]), float(hi[j])), c.estimate(j).interval())


def test_windows_run_level_and_headline_of_columns_are_those_of_the_estimates():
    rng = np.random.default_rng(8)
    es = [e for e in _estimates(rng, 400) if e.d_t > 0 and e.d_t < 1e30 and np.isfinite(e.cov).all()]
    c = EtaColumns.of(es)
    assert _same(vars(window(c)), vars(window(es))) and _same(vars(run_level(c)), vars(run_level(es)))
    assert run_level(EtaColumns.of([], "paired")) is None and run_level([]) is None
    fine = [e for e in es if np.isfinite(e.se)]
    assert _same(headline(EtaColumns.of(fine)), headline(fine))
    assert _same(headline(c), headline(es))  # some SE infinite: a median without an interval
    assert headline(EtaColumns.of([], "paired")) == headline([]) == (None, None)


def test_t975s_are_the_scalar_functions_of_each_entry():
    from reward_lens.measure.efficiency.cost import _t975s_moderated
    from reward_lens.measure.ledger.moderated import t975

    dof = np.array([np.nan, np.inf, -np.inf, 0.5, 1.0, 2.0, 2.0, 17.3, np.nan, 1e9, -3.0, 0.0])
    dof = np.r_[dof, np.random.default_rng(1).uniform(0, 60, size=500)]
    assert np.array_equal(eta_mod.t975s(dof), [eta_mod._t975(float(v)) for v in dof], equal_nan=True)
    assert np.array_equal(_t975s_moderated(dof), [t975(float(v)) for v in dof], equal_nan=True)


@pytest.mark.parametrize("window", [1, 2])
def test_ledgers_out_of_step_order_give_the_book_of_those_in_order(window, monkeypatch):
    """A caller's ledgers in any order give the book of the same ledgers in step order, on both
    paths (the row-by-row one, which windows take, walked them as given and failed)."""
    samples, held = _irregular(1)
    ledgers, _ = paired_ledger_series(samples, heldout=held)
    run = _fake_run(ledgers, np.random.default_rng(1))
    g = within_group_metric(ledgers)
    shuffled = [ledgers[i] for i in np.random.default_rng(7).permutation(len(ledgers))]
    assert [lg.step_pair for lg in shuffled] != sorted(lg.step_pair for lg in shuffled)
    for columns in (True, False):
        monkeypatch.setattr(cost_mod, "PAIRED_COLUMNS", columns)
        want = cost_series(ledgers, g, run_=run, window=window)
        got = cost_series(shuffled, g, run_=run, window=window)
        assert len(got.rows) == len(want.rows) > 0
        assert all(_same(vars(x), vars(y)) for x, y in zip(got.rows, want.rows)), (window, columns)
        assert sorted((r.code, r.detail) for r in got.refusals) == sorted((r.code, r.detail) for r in want.refusals)
        assert _same(got.headline(), want.headline())
