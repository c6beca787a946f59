"""Surface features on hand-made text, ledgers by hand, and degenerate features by name."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from reward_lens.measure.efficiency import kl_min_series, metric_g
from reward_lens.measure.ledger.basis import surface_definitions
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.price import StepSample, ledger_series
from reward_lens.record import RecordError


def test_features_on_hand_made_text():
    f = SurfaceFeatures()
    t = pa.table({"completion": ["ab C1", "", "x\ny\nz", "é\ufffd!"]})
    z = f.compute(t)
    col = {n: z[:, i] for i, n in enumerate(f.names)}
    assert col["len_chars"].tolist() == [5, 0, 5, 3]
    assert col["n_lines"].tolist() == [1, 1, 3, 1]
    assert col["n_words"].tolist() == [2, 0, 3, 1]
    assert col["frac_lower"].tolist() == [2 / 5, 0, 3 / 5, 0]
    assert col["frac_upper"].tolist() == [1 / 5, 0, 0, 0]
    assert col["frac_digit"].tolist() == [1 / 5, 0, 0, 0]
    assert col["frac_space"].tolist() == [1 / 5, 0, 2 / 5, 0]
    assert col["frac_punct"].tolist() == [0, 0, 0, 1 / 3]
    assert col["frac_nonascii"].tolist() == [0, 0, 0, 2 / 3]


def test_feature_selection_and_bad_names():
    f = SurfaceFeatures(["frac_upper", "len_chars"])
    assert f.names == ("frac_upper", "len_chars")
    with pytest.raises(ValueError, match="unknown feature"):
        SurfaceFeatures(["nope"])
    with pytest.raises(ValueError, match="twice"):
        SurfaceFeatures(["len_chars", "len_chars"])
    with pytest.raises(RecordError, match=r"field `num_tokens`: feature `len_tokens` \(length\) needs this column"):
        SurfaceFeatures(["len_tokens"]).compute(pa.table({"completion": ["a"]}))
    assert set(SurfaceFeatures().names) <= set(surface_definitions()[0])


def test_ledger_by_hand():
    names = ("a", "b")
    pre = StepSample(0, names, np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 4.0]]))
    post = StepSample(1, names, np.array([[1.0, 0.0], [3.0, 2.0]]))
    (lg,) = ledger_series([pre, post], eta_by_step={0: 0.5})
    assert lg.step_pair == (0, 1) and lg.learning_rate == 0.5
    np.testing.assert_allclose(lg.delta_z, [2.0 - 2.0, 1.0 - 2.0])
    # var_pre(a) = 4, var_post(a) = 2 -> se^2 = 4/3 + 2/2
    np.testing.assert_allclose(lg.se[0] ** 2, 4 / 3 + 1.0)
    assert (lg.n_pre, lg.n_post) == (3, 2)


def test_ledger_pairs_only_adjacent_steps_and_needs_two_rollouts():
    names = ("a",)
    s = [StepSample(t, names, np.arange(4.0)[:, None] + t) for t in (0, 1, 3)]
    assert [lg.step_pair for lg in ledger_series(s)] == [(0, 1)]
    with pytest.raises(ValueError, match="step 1 has 1 rollout"):
        ledger_series([s[0], StepSample(1, names, np.ones((1, 1)))])


def test_constant_and_collinear_features_are_named_not_crashed():
    rng = np.random.default_rng(3)
    names = ("a", "const", "b", "a_plus_b")
    samples = []
    for t in range(3):
        a, b = rng.normal(size=20), rng.normal(size=20)
        samples.append(StepSample(t, names, np.column_stack([a + t, np.full(20, 32.0), b, a + b])))
    g = metric_g(samples)
    assert g.active == ("a", "b")
    assert g.excluded["const"].startswith("constant")
    assert g.excluded["a_plus_b"].startswith("collinear") and "(a, b)" in g.excluded["a_plus_b"]
    rows = kl_min_series(ledger_series(samples), g)
    assert len(rows) == 2 and set(rows[0].shares) == {"a", "b"}
    assert "a_plus_b" in rows[0].unpriced_movement and "const" not in rows[0].unpriced_movement


def test_metric_g_never_returns_rung_one_under_rung_two_s_name():
    s = [StepSample(0, ("a",), np.arange(3.0)[:, None])]
    with pytest.raises(ValueError, match="fisher_kernel.*needs scores="):
        metric_g(s, method="fisher_kernel")
    with pytest.raises(ValueError, match="unknown method"):
        metric_g(s, method="magic")


def test_pooled_covariance_by_hand():
    names = ("a",)
    s = [StepSample(0, names, np.array([[0.0], [2.0]])), StepSample(1, names, np.array([[10.0], [11.0], [12.0]]))]
    g = metric_g(s)
    # scatter: 2 + 2 = 4 over dof 1 + 2 = 3
    assert g.matrix[0, 0] == pytest.approx(4 / 3, rel=1e-15)
    assert g.n == 5 and g.damping == 0.0 and g.damping_stable and g.h2 == {"a": 1.0}


def test_per_step_scope_prices_each_step_with_its_own_covariance():
    rng = np.random.default_rng(5)
    names = ("a", "b")
    # The policy's feature spread shrinks 10x per step: a pooled covariance would be wrong
    # for every step, the per-step one is right for each.
    samples = [StepSample(t, names, rng.normal(size=(400, 2)) * 10.0 ** -t + t) for t in range(3)]
    g = metric_g(samples, scope="per_step")
    assert g.scope == "per_step" and sorted(g.by_step) == [0, 1, 2]
    for s in samples:
        np.testing.assert_allclose(g.for_step(s.step).matrix, np.cov(s.z, rowvar=False), rtol=1e-12)
    rows = kl_min_series(ledger_series(samples), g)
    for row, lg in zip(rows, ledger_series(samples)):
        c = np.cov(samples[lg.step_pair[0]].z, rowvar=False)
        assert row.kl_min == pytest.approx(0.5 * lg.delta_z @ np.linalg.solve(c, lg.delta_z), rel=1e-10)
    assert metric_g(samples, scope="auto").scope == "per_step"  # 400 >= 10 per feature x 2
    few = [StepSample(t, names, s.z[:8]) for t, s in enumerate(samples)]
    g = metric_g(few, scope="auto")  # 8 rollouts a step: pooled over +-10 steps, not the whole run
    assert g.scope == "per_step" and "local" in g.reading
    for t in (0, len(few) // 2):
        near = [x for x in few if abs(x.step - t) <= 10]
        scatter = sum((x.z - x.z.mean(0)).T @ (x.z - x.z.mean(0)) for x in near)
        np.testing.assert_allclose(g.for_step(t).matrix, scatter / sum(x.n - 1 for x in near), rtol=1e-12)
    with pytest.raises(ValueError, match="scope must be"):
        metric_g(samples, scope="window")


def test_unpaired_steps_that_share_prompts_are_matched_by_prompt():
    """dz is the mean over shared prompts of the per-prompt differences (a prompt effect that
    is the same at t and t+1 cancels), Sigma the covariance of those differences over P."""
    from reward_lens.measure.ledger.price import ledger_series

    rng = np.random.default_rng(1)
    effect = {"a": 0.0, "b": 10.0, "c": -5.0, "d": 3.0}  # large between-prompt differences
    def step(t, shift):
        prompts = np.repeat(list(effect), 4)
        z = np.array([[effect[p] + shift + 0.1 * rng.normal()] for p in prompts])
        return StepSample(t, ("x",), z, prompts=prompts.astype(object))
    pre, post = step(0, 0.0), step(1, 0.5)
    (lg,) = ledger_series([pre, post])
    diffs = [post.z[post.prompts == p].mean() - pre.z[pre.prompts == p].mean() for p in effect]
    assert lg.matched and lg.units == 4
    assert lg.delta_z[0] == pytest.approx(np.mean(diffs), rel=1e-12)
    assert lg.cov_delta[0, 0] == pytest.approx(np.var(diffs, ddof=1) / 4, rel=1e-12)
    assert lg.se[0] < 0.2  # the prompt effects (sd ~6) are not in the noise of dz
    # without shared prompts, the two samples are compared whole
    other = StepSample(1, ("x",), post.z, prompts=np.array([p + "!" for p in post.prompts], dtype=object))
    (lg2,) = ledger_series([pre, other])
    assert not lg2.matched


def test_batched_active_sets_are_the_sequential_ones():
    """The batched Cholesky path of _active_sets gives exactly what _active_set gives, window by
    window, for well-conditioned, constant, collinear and nearly collinear features."""
    from reward_lens.measure.efficiency.metric import _active_set, _active_sets

    rng = np.random.default_rng(0)
    names = ("a", "b", "c", "d")
    cs, ms = [], []
    kinds = ("good", "constant", "collinear", "near", "good", "collinear", "collinear", "constant", "near",
             "collinear")  # repeated kinds share a pattern: the batched check decides them
    for kind in kinds:
        z = rng.normal(size=(50, 4))
        if kind == "constant":
            z[:, 1] = 3.0
        elif kind == "collinear":
            z[:, 2] = z[:, 0] - 2 * z[:, 1] + 1e-9 * rng.normal(size=50)  # explained to ~1e-18, not exactly
        elif kind == "near":
            z[:, 3] = z[:, 0] + 1e-3 * rng.normal(size=50)
        cs.append(np.cov(z, rowvar=False))
        ms.append(z.mean(axis=0))
    got = _active_sets(np.stack(cs), np.stack(ms), names)
    assert got == [_active_set(c, m, names) for c, m in zip(cs, ms)]
    assert got[1][0] == ("a", "c", "d") and "constant" in got[1][1]["b"]
    assert got[2][0] == ("a", "b", "d") and "collinear" in got[2][1]["c"]
    assert got[3][0] == names  # 1e-3 noise is far above the collinearity tolerance


def test_one_singular_window_does_not_send_its_whole_pattern_to_the_sequential_path(monkeypatch):
    """numpy's batched Cholesky refuses a whole stack for one matrix that is not positive
    definite; that window alone is decided by _active_set, the rest of its pattern stays batched
    (a 10k-step paired run had sent every window down the per-window path: 5.7 s)."""
    import reward_lens.measure.efficiency.metric as metric

    rng = np.random.default_rng(1)
    names = ("a", "b", "c")
    cs, ms = [], []
    for w in range(40):
        z = rng.normal(size=(30, 3))
        if w == 17:
            z[:, 2] = z[:, 0]  # a duplicated feature: singular, and not positive definite once rounded
        cs.append(np.cov(z, rowvar=False))
        ms.append(z.mean(axis=0))
    sd = np.sqrt(np.diagonal(np.stack(cs), axis1=1, axis2=2))
    with pytest.raises(np.linalg.LinAlgError):  # the premise: numpy refuses the whole stack
        np.linalg.cholesky(np.stack(cs) / (sd[:, :, None] * sd[:, None, :]))
    expected = [metric._active_set(c, m, names) for c, m in zip(cs, ms)]
    calls = []
    sequential = metric._active_set
    monkeypatch.setattr(metric, "_active_set", lambda *a: calls.append(1) or sequential(*a))
    got = metric._active_sets(np.stack(cs), np.stack(ms), names)
    assert got == expected
    assert expected[17][0] == ("a", "b") and "collinear" in expected[17][1]["c"]
    assert len(calls) == 2  # the pattern's first window, and the singular one


def test_a_window_singular_among_its_kept_features_is_decided_alone_when_its_pattern_excludes_a_collinear_one():
    """The pattern's first window excludes c as collinear with (a, b); in one later window a and
    b are themselves duplicates. That window's check must not reach the batched solve of c on
    (a, b) (singular: it raised "Singular matrix" out of a 10k-step paired report)."""
    from reward_lens.measure.efficiency.metric import _active_set, _active_sets

    rng = np.random.default_rng(2)
    names = ("a", "b", "c")
    cs, ms = [], []
    for w in range(12):
        z = rng.normal(size=(30, 3))
        if w == 5:
            z[:, 1] = z[:, 0]
        z[:, 2] = z[:, 0] - 2 * z[:, 1]
        cs.append(np.cov(z, rowvar=False))
        ms.append(z.mean(axis=0))
    got = _active_sets(np.stack(cs), np.stack(ms), names)
    assert got == [_active_set(c, m, names) for c, m in zip(cs, ms)]
    assert got[0][0] == ("a", "b") and got[5][0] == ("a",)


def test_metric_g_without_two_rollouts_at_any_step_says_what_it_got():
    """It used to say only 'needs at least one step with two or more rollouts' (issue 31)."""
    import numpy as np
    import pytest

    from reward_lens.measure.efficiency import metric_g
    from reward_lens.measure.ledger.price import StepSample

    samples = [StepSample(s, ("a",), np.array([[float(s)]])) for s in range(3)]
    with pytest.raises(ValueError, match=r"got 3 step\(s\), with 1, 1, 1 rollouts"):
        metric_g(samples)
