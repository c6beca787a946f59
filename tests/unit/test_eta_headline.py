"""What leads eta on the first screen (``measure.decisions.headline_of``), on hand-made ledgers: no
single update resolves and windows of 4 do; single updates resolve (they keep the lead); the
window boundaries and the pooled numbers against a computation written out here."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from reward_lens.measure.decisions import ROWS_RESOLVED_SHARE, WINDOW_PRECISION, headline_of
from reward_lens.measure.efficiency.cost import EtaEstimates
from reward_lens.measure.efficiency.eta import EtaEstimate

Z975 = 1.959963984540054  # the normal's 97.5 % quantile (an infinite dof's t)

# Every update alike: KL_min (debiased, no bias correction: KL_min == KL_jk) 0.04 nats of D_t 0.1,
# eta 0.4; var(KL) 4e-4 and var(D_t) 0.5e-4, uncorrelated. Delta method: var(eta) of W pooled
# updates is W (4e-4 + 0.4^2 0.5e-4) / (W 0.1)^2, so SE(eta) = 0.20199 / sqrt(W): half-widths
# 0.3959 (W=1), 0.2286 (W=3), 0.1980 (W=4); the run's eta 0.4 sets the target 0.5 * 0.4 = 0.2,
# first met at W = 4.
K, D, VK, VD = 0.04, 0.1, 4e-4, 0.5e-4


def _est(pair, k=K, d=D, vk=VK, vd=VD, p=0.5):
    return EtaEstimate(step_pair=pair, kind="paired", kl_min=k, kl_min_debiased=k, d_t=d, p_value=p,
                       cov=np.array([[vk, 0.0], [0.0, vd]]))


def _book(estimates, ledger="paired", window=1):
    return SimpleNamespace(window=window, ledger=ledger, estimates=EtaEstimates.of(estimates, ledger))


def _decided(priced, resolved):
    return SimpleNamespace(priced=tuple(priced), resolved=tuple(resolved))


def _half(w: int) -> float:
    return Z975 * math.sqrt(w * (VK + (K / D) ** 2 * VD)) / (w * D)


def test_the_hand_numbers_are_what_the_test_says():
    assert _half(1) > _half(3) > WINDOW_PRECISION * K / D >= _half(4)


def test_no_single_update_resolves_windows_of_four_do():
    pairs = [(t, t + 1) for t in range(10)]
    h = headline_of(_book([_est(p) for p in pairs]), _decided(pairs, []))
    assert (h.lead, h.why) == ("windows", "windows")
    assert h.target == pytest.approx(WINDOW_PRECISION * 0.4, rel=1e-12)
    assert h.row_half_width == pytest.approx(_half(1), rel=1e-9)
    # greedy in step order: 4, 4, and the last 2 short of the target
    assert [(w.first, w.last, w.updates, w.span, w.short) for w in h.windows] == [
        (0, 4, 4, 4, False), (4, 8, 4, 4, False), (8, 10, 2, 2, True)]
    for w in h.windows:
        assert w.eta == pytest.approx(w.updates * K / (w.updates * D), rel=1e-12)
        assert w.kl_min == pytest.approx(w.updates * K, rel=1e-12) and w.d_t == pytest.approx(w.updates * D, rel=1e-12)
        lo, hi = w.interval
        want = _half(w.updates)
        assert (lo, hi) == (pytest.approx(0.4 - want, rel=1e-9), pytest.approx(0.4 + want, rel=1e-9))
        assert w.resolved == (lo > 0)
    assert h.resolved == 3  # each window's lower end is above 0, the short one's too (0.4 - 0.28)


def test_single_updates_that_resolve_keep_the_lead():
    pairs = [(t, t + 1) for t in range(10)]
    est = [_est(p) for p in pairs]
    half = math.ceil(ROWS_RESOLVED_SHARE * len(pairs))
    h = headline_of(_book(est), _decided(pairs, pairs[:half]))
    assert (h.lead, h.why) == ("rows", "rows_resolve")
    # one fewer resolved: the windows lead
    h = headline_of(_book(est), _decided(pairs, pairs[:half - 1]))
    assert h.lead == "windows"


def test_single_updates_precise_enough_keep_the_lead():
    pairs = [(t, t + 1) for t in range(6)]
    h = headline_of(_book([_est(p, vk=1e-5, vd=1e-6) for p in pairs]), _decided(pairs, []))
    assert (h.lead, h.why) == ("rows", "rows_precise")
    assert h.row_half_width <= h.target


def test_a_window_spans_an_unmeasured_update_and_pools_only_the_measured():
    # (3, 4) was not measured: the second window spans it, its sums hold the three it pooled
    pairs = [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]
    ks = [0.03, 0.05, 0.04, 0.02, 0.06, 0.04, 0.04, 0.04]
    est = [_est(p, k=k) for p, k in zip(pairs, ks)]
    h = headline_of(_book(est), _decided(pairs, []))
    assert h.lead == "windows"
    first, second = h.windows[0], h.windows[1]
    assert (first.first, first.last, first.updates, first.span) == (0, 5, 4, 5)
    assert first.kl_min == pytest.approx(0.03 + 0.05 + 0.04 + 0.02, rel=1e-12)
    assert first.d_t == pytest.approx(4 * D, rel=1e-12)
    eta = 0.14 / 0.4
    se = math.sqrt(4 * VK + eta ** 2 * 4 * VD) / 0.4
    assert first.eta == pytest.approx(eta, rel=1e-12)
    assert first.interval == (pytest.approx(eta - Z975 * se, rel=1e-9), pytest.approx(eta + Z975 * se, rel=1e-9))
    assert (second.first, second.last, second.updates, second.span) == (5, 9, 4, 4)


def test_no_window_where_the_run_is_not_positive_or_the_ledger_shares_samples():
    pairs = [(t, t + 1) for t in range(8)]
    noise = [_est(p, k=0.0) for p in pairs]
    assert headline_of(_book(noise), _decided(pairs, [])).why == "run_not_positive"
    # a positive eta not resolved over the run (0.1 [-0.18, 0.38]) is still windowed: here no window
    # reaches half of it (an SE of 0.4 per update would need about 250 of them), and the rows keep the lead
    phases = [_est(p, k=-0.02 if p[0] < 4 else 0.04, vk=1.6e-3) for p in pairs]
    h = headline_of(_book(phases), _decided(pairs, []))
    assert (h.lead, h.why, h.target) == ("rows", "never_precise", pytest.approx(0.05, rel=1e-12))
    est = [_est(p) for p in pairs]
    # the unpaired ledger reads update (t, t+1) from steps t and t+1: consecutive updates share a
    # step's rollouts, and no window pools them as independent
    unpaired = [EtaEstimate(step_pair=e.step_pair, kind="unpaired", kl_min=e.kl_min, kl_min_debiased=e.kl_min,
                            d_t=e.d_t, p_value=e.p_value, cov=e.cov) for e in est]
    h = headline_of(_book(unpaired, ledger="unpaired"), _decided(pairs, []))
    assert (h.lead, h.why, h.windows) == ("rows", "unpaired", ())
    h = headline_of(_book(est, window="adaptive"), _decided(pairs, []))
    assert (h.lead, h.why) == ("rows", "windowed_book")
    assert headline_of(_book(est[:1]), _decided(pairs[:1], [])).why == "few"


def test_updates_that_never_reach_the_target_leave_the_run_level_alone():
    # every update so noisy that only the whole run is precise: no window short of it leads
    pairs = [(t, t + 1) for t in range(4)]
    est = [_est(p, vk=VK * 3.0) for p in pairs]
    h = headline_of(_book(est), _decided(pairs, []))
    assert (h.lead, h.why, h.windows) == ("rows", "never_precise", ())


def test_the_cuts_are_the_plain_definition_written_out():
    """The windows searched a chunk of candidate ends at a time (``LOOK_AHEAD``, the intervals as
    columns) are those of the plain definition: from each start, add members one at a time and close
    at the first whose ``eta.window`` interval is narrow enough (a window of one: its row's own)."""
    from reward_lens.measure.decisions import LOOK_AHEAD, _cuts
    from reward_lens.measure.efficiency.eta import EtaColumns, moderate, window

    rng = np.random.default_rng(7)
    n = 3 * LOOK_AHEAD + 5
    est = []
    for t in range(n):
        k = float(rng.uniform(0.0, 0.08))
        est.append(EtaEstimate(step_pair=(t, t + 1), kind="paired", kl_min=k + float(rng.uniform(0, 0.01)),
                               kl_min_debiased=k, d_t=float(rng.uniform(0.05, 0.15)), p_value=0.5,
                               cov=np.diag([float(rng.uniform(1e-5, 2e-3)), float(rng.uniform(1e-6, 1e-4))]),
                               dof=float(rng.integers(2, 8)), d_t_tail=float(rng.uniform(0, 0.005))))
    cols = moderate(EtaColumns.of(est, "paired"))  # the rows as a paired book holds them: pooled SEs, bounds
    rows = cols.estimates()
    for target in (0.05, 0.15, 0.3, 10.0):
        plain, start = [], 0
        while start < n:
            end = None
            for j in range(start, n):
                e = rows[j] if j == start else window(rows[start:j + 1])
                lo, hi = e.interval()
                if (j > start or e.estimable) and (hi - lo) / 2 <= target:
                    end = j + 1
                    break
            plain.append((start, n if end is None else end, end is not None))
            start = n if end is None else end
        assert _cuts(cols, target) == plain, target
    assert any(b - a > LOOK_AHEAD for a, b, _ in _cuts(cols, 0.05))  # the search went past its first chunk
