"""Step pairs split over threads give the shares of one thread, bit for bit, and those are the
Shapley values by definition (an independent per-subset enumeration)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from reward_lens.measure.efficiency import shapley


def _by_definition(dz, g):
    k = len(dz)

    def v(s):
        idx = list(s)
        return 0.0 if not idx else 0.5 * dz[idx] @ np.linalg.solve(g[np.ix_(idx, idx)], dz[idx])

    phi = np.zeros(k)
    for i in range(k):
        for r in range(k):
            w = math.factorial(r) * math.factorial(k - r - 1) / math.factorial(k)
            for s in itertools.combinations([j for j in range(k) if j != i], r):
                phi[i] += w * (v(tuple(sorted(s + (i,)))) - v(s))
    return phi


def test_threads_change_nothing(monkeypatch):
    k = shapley.PARALLEL_MIN_FEATURES
    rng = np.random.default_rng(0)
    a = rng.normal(size=(k, k))
    g = a @ a.T + np.eye(k)
    dz = rng.normal(size=(9, k))
    monkeypatch.setattr(shapley, "CHUNK_FLOATS", 1 << 14)  # several chunks, so several threads
    monkeypatch.setattr(shapley, "THREADS", 3)
    threaded = shapley.shapley_shares(dz, g)
    monkeypatch.setattr(shapley, "THREADS", 1)
    assert np.array_equal(threaded, shapley.shapley_shares(dz, g))
    # below PARALLEL_MIN_FEATURES, many step pairs in several chunks go to threads too
    few = 6
    many_dz = rng.normal(size=(400, few))
    one = shapley.shapley_shares(many_dz, g[:few, :few])
    monkeypatch.setattr(shapley, "THREADS", 3)
    assert np.array_equal(one, shapley.shapley_shares(many_dz, g[:few, :few]))
    small = 8  # the definition at a size it can afford
    np.testing.assert_allclose(shapley.shapley_shares(dz[0, :small], g[:small, :small]),
                               _by_definition(dz[0, :small], g[:small, :small]), rtol=1e-10, atol=1e-14)
