"""Exact Shapley shares: the Schur-complement sweep against a per-subset brute force.

Prints, in one run: (1) at k = 14 features, seconds per step pair for the sweep and for the
brute force (one linear solve per subset, then the Shapley sum), on the same step pairs, and
their ratio (target >= 50x); (2) at k = 20 features for 200 step pairs, wall seconds and the
peak resident memory the sweep added, with step pairs split over threads and on one thread;
(3) the memory floor measured in the same run -- k strided passes over 2^k float64 values per
step pair, what any exact method that reads every subset's value once per feature costs --
and the sweep's ratio to it (issue 14: within 4x).
"""

from __future__ import annotations

import itertools
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reward_lens.measure.efficiency import shapley as shapley_module  # noqa: E402
from reward_lens.measure.efficiency.shapley import shapley_shares  # noqa: E402


def brute_force(dz: np.ndarray, g: np.ndarray) -> np.ndarray:
    k = len(dz)
    v = {}
    for r in range(k + 1):
        for s in itertools.combinations(range(k), r):
            idx = list(s)
            v[s] = 0.0 if not idx else 0.5 * dz[idx] @ np.linalg.solve(g[np.ix_(idx, idx)], dz[idx])
    phi = np.zeros(k)
    for i in range(k):
        others = [j for j in range(k) if j != i]
        for r in range(k):
            w = math.factorial(r) * math.factorial(k - r - 1) / math.factorial(k)
            for s in itertools.combinations(others, r):
                phi[i] += w * (v[tuple(sorted(s + (i,)))] - v[s])
    return phi


def problem(k: int, p: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(k, k))
    return rng.normal(size=(p, k)), a @ a.T + np.eye(k)


def main() -> None:
    k, pairs = 14, 3
    dz, g = problem(k, pairs, 0)
    t = time.perf_counter()
    brute = np.array([brute_force(d, g) for d in dz])
    t_brute = (time.perf_counter() - t) / pairs
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        sweep = shapley_shares(dz, g)
    t_sweep = (time.perf_counter() - t) / (reps * pairs)
    err = float(np.abs(sweep - brute).max())
    print(f"k={k}: brute force {t_brute * 1e3:.1f} ms/pair, sweep {t_sweep * 1e3:.2f} ms/pair, "
          f"ratio {t_brute / t_sweep:.0f}x (max |diff| {err:.1e})")

    k, pairs = 20, 200
    dz, g = problem(k, pairs, 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    shares = shapley_shares(dz, g)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"k={k}, {pairs} step pairs, threads: {wall:.1f} s ({wall / pairs * 1e3:.0f} ms/pair), peak RSS "
          f"{peak / 1024:.0f} MiB (+{(peak - before) / 1024:.0f} MiB over the process before), "
          f"all shares >= 0: {bool((shares >= 0).all())}")
    saved, shapley_module.THREADS = shapley_module.THREADS, 1
    sub = 40
    t = time.perf_counter()
    one = shapley_shares(dz[:sub], g)
    wall1 = (time.perf_counter() - t) / sub
    shapley_module.THREADS = saved
    assert np.array_equal(one, shares[:sub])
    # the floor: per step pair, k passes over 2^k float64 values, strided (bit i as an axis, as
    # the Shapley sum needs) and, stricter, contiguous (pure memory bandwidth)
    x = np.random.default_rng(0).random((3, 2 ** k))
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        for i in range(k):
            x.reshape(3, 2 ** (k - 1 - i), 2, 2 ** i).sum(axis=(1, 3))
    strided = (time.perf_counter() - t) / (reps * 3)
    t = time.perf_counter()
    for _ in range(reps):
        for i in range(k):
            x.sum(axis=1)
    contiguous = (time.perf_counter() - t) / (reps * 3)
    print(f"k={k}: one thread {wall1 * 1e3:.0f} ms/pair (identical shares); floor per pair: {k} strided passes "
          f"over 2^{k} float64 {strided * 1e3:.1f} ms, {k} contiguous passes {contiguous * 1e3:.1f} ms; sweep / "
          f"contiguous floor: {wall / pairs / contiguous:.1f}x with threads, {wall1 / contiguous:.1f}x on one "
          f"(strided: {wall / pairs / strided:.1f}x, {wall1 / strided:.1f}x)")


if __name__ == "__main__":
    main()
