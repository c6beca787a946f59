"""The effect, cause, price and agreement books on hand-made samples with known answers
(never against the implementation's own output)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reward_lens.measure import decisions as dec
from reward_lens.measure.agreement import (AGAINST, AGREE, CARRIED, COLLATERAL, NEITHER, NOT_BOUGHT, OTHER_WAY,
                                           agreement_table, selection_from_cause)
from reward_lens.measure.cause import cause_series, selection_differential, selection_gradient
from reward_lens.measure.decisions import Selection, decide_from, verdict_of
from reward_lens.measure.effect import effect_series
from reward_lens.measure.efficiency import metric_g
from reward_lens.measure.ledger.price import StepSample, ledger_series
from reward_lens.measure.price_book import best_of_n_kl, fit_frontier, price_series

NAMES = ("collateral", "not_bought", "bought", "neither")


def _world(steps: int = 12, groups: int = 16, per: int = 8, seed: int = 0) -> list[StepSample]:
    """Four features with known roles. `collateral` drifts up 0.3 a step and the advantage does
    not depend on it; `not_bought` drives the advantage but its mean never moves; `bought` drives
    the advantage and drifts up 0.3 a step; `neither` is noise."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        n = groups * per
        z = rng.normal(size=(n, 4))
        z[:, 0] += 0.3 * t
        z[:, 2] += 0.3 * t
        codes = np.repeat(np.arange(groups), per)
        a = z[:, 1] + z[:, 2]
        a = a - (np.bincount(codes, weights=a) / per)[codes]  # GRPO: centred within each prompt group
        out.append(StepSample(t, NAMES, z, advantages=a, groups=np.array([f"{t}:{g}" for g in codes], dtype=object),
                              rewards=a.copy()))
    return out


def test_effect_moves_what_drifts_and_not_what_does_not():
    samples = _world()
    sec = effect_series(decide_from(ledger_series(samples), NAMES), samples, {n: "u" for n in NAMES})
    drift = {d.feature: d for d in sec.drift}
    assert drift["collateral"].moved and drift["bought"].moved
    assert not drift["not_bought"].moved and not drift["neither"].moved
    # 0.3 a step over 12 steps: first step 0 vs last step 11 (a tenth of 12 steps, rounded, is one)
    assert drift["bought"].drift == pytest.approx(3.3, abs=4 * drift["bought"].se)
    assert sec.first_steps == [0] and sec.last_steps == [11]
    # per step pair the t of a 0.3 drift with 128 rollouts a step (SE ~ 0.125) is about 2.4
    t = np.array(sec.rows.t["collateral"])
    assert len(t) == len(sec.rows.step_pair) == 11
    assert 1.2 < t.mean() < 3.6
    assert all(abs(x) < 6 for x in sec.rows.t["neither"])


def test_selection_differential_by_hand():
    z = np.array([[1.0], [3.0], [0.0], [4.0]])
    a = np.array([-1.0, 1.0, -2.0, 2.0])
    s = StepSample(0, ("f",), z, advantages=a, groups=np.array(["g1", "g1", "g2", "g2"], dtype=object))
    sel, se = selection_differential(s)
    # within g1: (1-2)(-1) + (3-2)(1) = 2; within g2: (0-2)(-2) + (4-2)(2) = 8; over 4 rollouts: 10/4
    assert sel[0] == pytest.approx(2.5)
    # groups as units: u = (2, 8), n_g = 2 each; residuals u - n_g s = (-3, 3); var = 2/1 * 18 / 16
    assert se[0] == pytest.approx(math.sqrt(2 * 18 / 16))


def test_cause_selects_what_the_advantage_depends_on():
    samples = _world()
    sec = cause_series(ledger_series(samples), samples, metric_g(samples, method="covariance_bound"))
    sel = {x.feature: x for x in sec.selected}
    assert sel["not_bought"].selected and sel["bought"].selected
    assert not sel["collateral"].selected and not sel["neither"].selected
    # Cov(z_j, A) within groups: Var(z_j) (per-1)/per for the two that enter A, 0 otherwise
    expected = 7 / 8
    rows = sec.rows
    assert len(rows.step_pair) == len(rows.kl_quad) == 11
    for sel_bought, along, collateral, quad in zip(rows.selection["bought"], rows.kl_along, rows.kl_collateral,
                                                  rows.kl_quad):
        assert sel_bought == pytest.approx(expected, abs=0.35)
        assert along + collateral == pytest.approx(quad)
        assert 0 <= along <= quad + 1e-12


def test_cosine_is_one_for_an_exact_tilt():
    """Reweighting a sample by exp(lambda A) moves the feature means along Cov(z, A): Delta z =
    lambda s to first order, so the G^-1 cosine is 1 and nothing is collateral."""
    rng = np.random.default_rng(3)
    n, per = 40000, 8
    z = rng.normal(size=(n, 3)) @ np.array([[1.0, 0.3, 0.0], [0.0, 1.0, 0.5], [0.0, 0.0, 1.0]])
    codes = np.repeat(np.arange(n // per), per)
    a = z @ np.array([0.5, -0.2, 0.1])
    a = a - (np.bincount(codes, weights=a) / per)[codes]
    names = ("x", "y", "w")
    groups = codes.astype(str).astype(object)
    pre = StepSample(0, names, z, advantages=a, groups=groups)
    lam = 0.05
    w = np.exp(lam * a)
    idx = rng.choice(n, size=n, p=w / w.sum())  # a sample of the tilted policy
    post = StepSample(1, names, z[idx], advantages=a[idx], groups=groups)
    sec = cause_series(ledger_series([pre, post]), [pre, post], metric_g([pre, post], method="covariance_bound"))
    assert sec.rows.step_pair == [(0, 1)]
    ((cosine,), (collateral,), (quad,)) = sec.rows.cosine, sec.rows.kl_collateral, sec.rows.kl_quad
    assert cosine > 0.97
    assert collateral < 0.06 * quad


def test_price_by_hand_and_the_frontier_form():
    names = ("f",)
    groups = np.array([f"g{i // 4}" for i in range(16)], dtype=object)
    samples = [StepSample(t, names, np.zeros((16, 1)), rewards=np.full(16, 0.1 * t) + np.tile([-0.05, 0.05], 8),
                          groups=groups) for t in range(5)]
    sec = price_series(samples, {t: 0.5 for t in range(4)}, n_generations=8)
    assert [r.reward_change for r in sec.rows] == pytest.approx([0.1] * 4)
    assert sec.summary["reward_per_nat"] == pytest.approx(0.4 / 2.0)
    assert sec.frontier.d == pytest.approx([0, math.sqrt(0.5), 2 * math.sqrt(0.5), 3 * math.sqrt(0.5),
                                            4 * math.sqrt(0.5)])
    assert sec.frontier.best_of_n_kl == pytest.approx(math.log(8) - 7 / 8)
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    d = np.linspace(0.1, 3, 30)
    alpha, beta, r2 = fit_frontier(d, d * (1.2 - 0.4 * np.log(d)))
    assert (alpha, beta, r2) == pytest.approx((1.2, 0.4, 1.0))


def _verdicts(samples, names):
    effect = effect_series(decide_from(ledger_series(samples), names), samples)
    cause = cause_series(ledger_series(samples), samples, metric_g(samples, method="covariance_bound"))
    return agreement_table(names, {}, None, {d.feature: (d.moved, d.drift) for d in effect.drift},
                           {x.feature: selection_from_cause(x) for x in cause.selected})


def test_agreement_verdicts_on_the_known_world():
    sec = _verdicts(_world(), NAMES)
    got = {f.feature: f.verdict for f in sec.features}
    assert got == {"collateral": COLLATERAL, "not_bought": NOT_BOUGHT, "bought": AGREE, "neither": NEITHER}
    assert sec.summary["disagreements"] == 2


def test_a_behaviour_that_only_correlates_with_the_rewarded_one_is_carried_along():
    """`echo` is `paid` plus noise and the reward pays for `paid` alone: both drift up, the
    selection differential of both is resolved, but only `paid` has a selection gradient --
    `echo` is carried along, not asked for (Lande & Arnold's direct and indirect selection)."""
    rng = np.random.default_rng(7)
    names = ("paid", "echo", "noise")
    samples = []
    for t in range(12):
        n, per = 16 * 8, 8
        paid = rng.normal(size=n) + 0.3 * t
        z = np.column_stack([paid, paid + 0.6 * rng.normal(size=n), rng.normal(size=n)])
        codes = np.repeat(np.arange(16), per)
        r = paid.copy()
        a = r - (np.bincount(codes, weights=r) / per)[codes]
        samples.append(StepSample(t, names, z, advantages=a, rewards=r,
                                  groups=np.array([f"{t}:{g}" for g in codes], dtype=object)))
    got = {f.feature: f for f in _verdicts(samples, names).features}
    assert got["paid"].verdict == AGREE and got["paid"].asked == "directly"
    assert got["echo"].verdict == CARRIED and got["echo"].selected and got["echo"].asked == "no"
    assert got["noise"].verdict == NEITHER


def test_a_behaviour_that_falls_while_selected_for_through_a_correlate_moved_against_it():
    """`echo` correlates with `paid` within every prompt group, so the reward selects for more of
    it through `paid` (its differential is resolved and positive), but something else pulls its
    mean down 1.0 a step: it moved against what the reward selects, never "carried along"."""
    rng = np.random.default_rng(8)
    names = ("paid", "echo")
    samples = []
    for t in range(12):
        n, per = 16 * 8, 8
        paid = rng.normal(size=n) + 0.3 * t
        z = np.column_stack([paid, paid + 0.6 * rng.normal(size=n) - 1.0 * t])
        codes = np.repeat(np.arange(16), per)
        a = paid - (np.bincount(codes, weights=paid) / per)[codes]
        samples.append(StepSample(t, names, z, advantages=a, rewards=paid.copy(),
                                  groups=np.array([f"{t}:{g}" for g in codes], dtype=object)))
    got = {f.feature: f for f in _verdicts(samples, names).features}
    assert got["paid"].verdict == AGREE
    echo = got["echo"]
    assert echo.asked == "no" and echo.selected and echo.selection > 0 and echo.moved and echo.drift < 0
    assert echo.verdict == AGAINST and echo.verdict_key == dec.AGAINST


def test_selection_gradient_by_least_squares_and_its_cluster_robust_se():
    """beta against numpy's least squares on the within-group centred data, and its SE against
    the sandwich written out cluster by cluster; a reward that is exactly a feature gives the
    other features no gradient at all."""
    rng = np.random.default_rng(11)
    names = ("a", "b")
    groups = np.repeat(np.arange(30), 6)
    z = rng.normal(size=(180, 2))
    r = 2.0 * z[:, 0] - 0.5 * z[:, 1] + rng.normal(size=180)
    s = StepSample(0, names, z, rewards=r, advantages=r, groups=groups, n_groups=30)
    beta, se, p, clusters = selection_gradient([s])[:4]
    zc = z - np.array([z[groups == g].mean(0) for g in groups])
    rc = r - np.array([r[groups == g].mean() for g in groups])
    want = np.linalg.lstsq(zc, rc, rcond=None)[0]
    np.testing.assert_allclose(beta, want, rtol=1e-10)
    bread = np.linalg.inv(zc.T @ zc)
    e = rc - zc @ want
    meat = sum(np.outer(zc[groups == g].T @ e[groups == g], zc[groups == g].T @ e[groups == g]) for g in range(30))
    np.testing.assert_allclose(se, np.sqrt(np.diag(bread @ meat @ bread) * 30 / 29), rtol=1e-8)
    assert clusters == [] and (p < 1e-6).all()
    exact = StepSample(0, names, z, rewards=z[:, 0].copy(), advantages=z[:, 0].copy(), groups=groups, n_groups=30)
    beta, _, p, _ = selection_gradient([exact])[:4]
    assert beta[0] == pytest.approx(1.0) and p[1] == 1.0 and beta[1] == 0.0
    # a near duplicate of the paid feature (r > 0.95: one cluster, tested jointly) takes a
    # coefficient of rounding whose sign the summation order sets; it is shown as 0, whatever
    # the order of the rows, with p = 1 of its own (never p = 0 beside an SE of rounding); the
    # cluster's joint test is its own field, shared by both, and both are asked for "more"
    dup = np.column_stack([z[:, 0], z[:, 0] + 0.05 * rng.normal(size=180)])
    for order in (np.arange(180), np.argsort(groups[::-1], kind="stable")[::-1]):
        s = StepSample(0, names, dup[order], rewards=z[order, 0].copy(), advantages=z[order, 0].copy(),
                       groups=groups[order])
        g = selection_gradient([s])
        assert g.clusters == [[0, 1]] and g.beta[0] == pytest.approx(1.0) and g.beta[1] == 0.0
        assert g.p[1] == 1.0 and g.p[0] < 1e-6 and g.p_joint[0] == g.p_joint[1] < 1e-6
        assert list(g.direction) == [1, 1]
    # the same against the reward: the cluster is asked for "less"
    s = StepSample(0, names, dup, rewards=-z[:, 0].copy(), advantages=-z[:, 0].copy(), groups=groups)
    assert list(selection_gradient([s]).direction) == [-1, -1]


def _v(moved: bool, drift: float, asked: str, direction: int, selected: bool, differential: float | None,
       jointly_with: tuple[str, ...] = ()) -> str:
    return verdict_of(moved, drift, Selection(asked, direction, jointly_with, selected, differential)).words


def test_verdicts_are_sign_aware():
    """Each verdict by hand: judged against the direction the reward selects the behaviour in
    (what it asked for where it asked; its selection differential otherwise), never carried along
    against it."""
    assert _v(True, -1.0, "directly", +1, True, +3.0) == OTHER_WAY
    assert _v(True, +1.0, "directly", +1, True, +3.0) == AGREE
    assert _v(True, -1.0, "directly", -1, True, -3.0) == AGREE
    assert _v(False, -1.0, "directly", +1, True, +3.0) == NOT_BOUGHT
    assert _v(True, +1.0, "no", 0, True, +3.0) == CARRIED
    assert _v(True, -1.0, "no", 0, True, -3.0) == CARRIED
    assert _v(True, +1.0, "no", 0, False, +3.0) == COLLATERAL
    assert _v(False, +1.0, "no", 0, True, +3.0) == NEITHER
    # selected for more through a correlated behaviour (issue #39's format-only run: `correct`
    # +0.47 differential), and it fell: moved against what the reward selects, never carried along
    assert _v(True, -0.32, "no", 0, True, +0.47) == AGAINST
    assert _v(True, +0.32, "no", 0, True, -0.47) == AGAINST
    # asked for more directly, selected against in total (it correlates with what the reward pays
    # against), and it fell with the total: it still moved against what it was asked for
    assert _v(True, -1.0, "directly", +1, True, -3.0) == OTHER_WAY
    # asked for jointly: a verdict of its own, naming the behaviours it cannot be told apart from
    assert _v(True, +1.0, "jointly", +1, True, +3.0, ("reward_format",)) == \
        "asked for jointly with `reward_format`, and bought"
    assert _v(False, +1.0, "jointly", +1, True, +3.0, ("a", "b")) == "asked for jointly with `a`, `b`, not bought"
    assert _v(True, -1.0, "jointly", +1, True, +3.0, ("a",)) == "asked for jointly with `a`, moved the other way"
    # a declared target moved or pushed the wrong way is a disagreement too (issue 57)
    assert {dec.AGAINST, dec.OTHER_WAY, dec.COLLATERAL, dec.NOT_BOUGHT, *dec.TARGET_WRONG} == set(dec.DISAGREEMENTS)


def test_a_declared_target_has_its_own_verdict_never_bought():
    """Issue 57: the reward asked for less `vowels` (directly) and it fell -- for any other behaviour
    "asked for and bought", for a target the user wants higher the headline: it fell, and the reward
    selected against it. Judged against what the user wants, whatever the reward asks."""
    def t(want, moved, drift, asked, direction, selected, differential):
        sel = Selection(asked, direction, (), selected, differential)
        return dec.target_verdict_of("vowels", want, moved, drift, sel)

    v = t("higher", True, -0.12, "directly", -1, True, -5.0)
    assert (v.key, v.words) == (dec.TARGET_FELL_SELECTED_AGAINST, "your target `vowels` fell; the reward selected against it")
    assert _v(True, -0.12, "directly", -1, True, -5.0) == AGREE  # what it would have said without the declaration
    assert t("higher", True, -0.12, "directly", +1, True, +5.0).key == dec.TARGET_FELL
    assert t("higher", True, -0.12, "no", 0, True, -5.0).key == dec.TARGET_FELL_SELECTED_AGAINST  # through a correlate
    assert t("higher", False, -0.01, "no", 0, True, -5.0).key == dec.TARGET_SELECTED_AGAINST
    assert t("higher", False, -0.01, "no", 0, False, -5.0).key == dec.TARGET_STILL
    met = t("lower", True, -0.12, "directly", -1, True, -5.0)
    assert (met.key, met.words) == (dec.TARGET_MET, "your target `vowels` fell, as you want")
    assert t("lower", True, +0.12, "no", 0, False, None).words == "your target `vowels` rose, against what you want (lower)"
    sec = agreement_table(("vowels", "bangs"), {}, None, {"vowels": (True, -0.12), "bangs": (True, 0.9)},
                          {"vowels": Selection("directly", -1, (), True, -5.0),
                           "bangs": Selection("directly", +1, (), True, 9.0)}, targets={"vowels": "higher"})
    assert [(f.feature, f.target, f.verdict_key) for f in sec.features] == [
        ("vowels", "higher", dec.TARGET_FELL_SELECTED_AGAINST), ("bangs", None, dec.BOUGHT)]
    assert sec.summary["disagreements"] == 1 and sec.summary["asked_for_and_bought"] == 1


def test_a_refused_cause_book_leaves_selected_unknown():
    sec = agreement_table(("a",), {}, None, {"a": (True, 1.0)}, None)
    (f,) = sec.features
    assert f.selected is None and f.verdict is None and f.moved


def test_long_lines_are_reduced_to_each_bins_min_and_max():
    from reward_lens.report.plots import MAX_POINTS, reduce_minmax

    rng = np.random.default_rng(1)
    x = np.arange(50_000, dtype=float)
    y = rng.normal(size=x.size)
    y[123] = 40.0  # a spike survives
    y[7_000] = np.nan  # a break survives
    xr, yr = reduce_minmax(x, y)
    assert len(xr) <= MAX_POINTS + 1 and np.all(np.diff(xr) > 0)
    assert 40.0 in yr and np.isnan(yr).sum() == 1 and np.nanmin(yr) == np.nanmin(y)
    # every bin of consecutive points keeps its own extremes
    bins = MAX_POINTS // 2
    b = (np.arange(x.size) * bins) // x.size
    for j in (0, 17, bins - 1):
        sel = (b == j) & np.isfinite(y)
        kept = yr[(b[xr.astype(int)] == j) & np.isfinite(yr)]
        assert kept.max() == y[sel].max() and kept.min() == y[sel].min()
    short = np.arange(10.0)
    assert reduce_minmax(short, short)[0] is short


def test_bands_and_stacks_are_reduced_per_bin_without_losing_their_envelope():
    from reward_lens.report.plots import MAX_POINTS, _bin_of, _per_bin

    rng = np.random.default_rng(2)
    lo = rng.normal(size=30_000)
    b = _bin_of(lo.size)
    env = _per_bin(lo, b, np.min)
    assert len(env) == MAX_POINTS // 2
    assert all(env[j] == lo[b == j].min() for j in (0, 321, MAX_POINTS // 2 - 1))
    # a stack keeps each bin's mean, so its area over the run is kept
    means = _per_bin(lo, b, np.mean)
    assert np.average(means, weights=np.bincount(b)) == pytest.approx(lo.mean())


def test_the_differentials_of_some_steps_are_those_worked_out_for_every_step_of_the_read():
    """Each step's selection differential is its own rows' alone: picked from the read's every
    step (worked out once, memoised on the read) they equal those worked out for the chosen
    steps alone, steps left out in between."""
    from pathlib import Path

    from reward_lens.measure.cause import _selection_arrays, step_selection
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(Path(__file__).parents[1] / "fixtures" / "grpo_run" / "paired")
    every = steps_from_run(run, SurfaceFeatures())
    sel = [s for s in every if s.step % 3 != 1][::-1]
    got, want = step_selection(every, sel), _selection_arrays(sel)
    assert any(k[0] == "selection_differentials" for k in every[0].stack._memo)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_every_book_reads_only_the_books_its_spec_says_it_needs(monkeypatch):
    """``RunContext.results`` builds the books whose ``report.needs`` are met at once, on threads:
    a book that read another book's result without naming it would wait on it there, holding a
    thread, and the spec would not say what the page depends on. Every builder's ``ctx.result``
    calls on the tapped example are recorded and checked against its spec; the needs are there
    (agreement reads effect and cause); and the report built this way is the report built one
    book after another."""
    import threading
    from pathlib import Path

    from reward_lens.measure import books
    from reward_lens.record.reader import open_run
    from reward_lens.report import build_report, to_json
    from reward_lens_spec import load_books

    current = threading.local()
    read: dict[str, set[str]] = {}
    build, result = books.RunContext._build, books.RunContext.result

    def traced_build(self, book_id):
        outer, current.book = getattr(current, "book", None), book_id
        try:
            return build(self, book_id)
        finally:
            current.book = outer

    def traced_result(self, book_id):
        by = getattr(current, "book", None)
        if by is not None and by != book_id:
            read.setdefault(by, set()).add(book_id)
        return result(self, book_id)

    monkeypatch.setattr(books.RunContext, "_build", traced_build)
    monkeypatch.setattr(books.RunContext, "result", traced_result)
    run_dir = Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "tapped"
    at_once = to_json(build_report(open_run(run_dir)))
    specs = {k: v for k, v in load_books().items() if v.report is not None}
    assert read.get("agreement") == {"effect", "cause"}
    for book_id, needed in read.items():
        assert needed <= set(specs[book_id].report.needs), (book_id, needed)
    one_by_one = books.RunContext.results
    monkeypatch.setattr(books.RunContext, "results", lambda self, ids, workers=None: one_by_one(self, ids, workers=1))
    assert to_json(build_report(open_run(run_dir))) == at_once


def test_a_shared_input_that_fails_is_read_once_and_its_error_reaches_every_book():
    """Books on threads share the record's read (``RunContext.cached``): where it fails (a corrupt
    row group), the books waiting on it get that error, not one more read each."""
    import threading
    import time

    from reward_lens.measure.books import RunContext

    calls = []

    class Failing(RunContext):
        def _build(self, book_id):
            return self.cached("samples", self._read)

        def _needs(self, book_id):
            return []

        def _read(self):
            calls.append(threading.current_thread().name)
            time.sleep(0.05)
            raise OSError("corrupt row group")

    ctx = Failing(run=None, features=None)
    with pytest.raises(OSError, match="corrupt row group"):
        ctx.results([f"book{i}" for i in range(6)])
    assert len(calls) == 1
    with pytest.raises(OSError, match="corrupt row group"):
        ctx.result("book0")  # and later asks too
    assert len(calls) == 1


def test_what_reads_the_samples_alone_is_made_once_beside_the_books(monkeypatch):
    """The report makes the findings' watch and the cause book's selection differentials on a
    thread of their own while the books are priced (``RunContext.beside_books``): the read's
    ``memo`` makes a key once when threads ask at once, and the report is the one made without
    that thread (the watch then made by the findings, the differentials by the cause book)."""
    import threading
    import time
    from pathlib import Path

    from reward_lens.measure import books
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run
    from reward_lens.report import build_report, to_json

    run_dir = Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "tapped"
    every = steps_from_run(open_run(run_dir), SurfaceFeatures())
    made = []

    def slow():
        made.append(threading.current_thread().name)
        time.sleep(0.05)
        return len(made)

    threads = [threading.Thread(target=lambda: every[0].stack.memo("k", every, slow)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and every[0].stack.memo("k", every, slow) == 1

    beside = books.RunContext.beside_books
    started = []
    monkeypatch.setattr(books.RunContext, "beside_books", lambda self: started.append(1) or beside(self))
    with_thread = to_json(build_report(open_run(run_dir)))
    assert started == [1]

    def none(self):
        t = threading.Thread(target=lambda: None)
        t.start()
        return t

    monkeypatch.setattr(books.RunContext, "beside_books", none)
    assert to_json(build_report(open_run(run_dir))) == with_thread


def test_a_book_that_fails_leaves_no_thread_computing_beside_it(monkeypatch):
    """The thread beside the books is joined when a book raises: the error reaches the caller
    once, and nothing is left computing behind it (a library caller that catches the error)."""
    import threading
    import time
    from pathlib import Path

    import reward_lens.measure.sequential as seq
    from reward_lens.measure import books
    from reward_lens.record.reader import open_run
    from reward_lens.report import build_report

    watch, build = seq.watch_samples, books.RunContext._build

    def slow(*a, **k):
        time.sleep(0.5)
        return watch(*a, **k)

    def failing(self, book_id):
        if book_id == "cost":
            raise ValueError("a book failed")
        return build(self, book_id)

    monkeypatch.setattr(seq, "watch_samples", slow)
    monkeypatch.setattr(books.RunContext, "_build", failing)
    with pytest.raises(ValueError, match="a book failed"):
        build_report(open_run(Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "tapped"))
    assert not [t for t in threading.enumerate() if t.name == "reward-lens-watch"]
