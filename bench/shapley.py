"""Exact Shapley shares: the Schur-complement sweep against a per-subset brute force.

Prints, in one run: (1) at k = 14 features, seconds per step pair for the sweep and for the
brute force (one linear solve per subset, then the Shapley sum), on the same step pairs, and
their ratio (target >= 50x); (2) at k = 20 features for 200 step pairs, wall seconds and the
peak resident memory the sweep added.
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
    print(f"k={k}, {pairs} step pairs: {wall:.1f} s ({wall / pairs * 1e3:.0f} ms/pair), peak RSS "
          f"{peak / 1024:.0f} MiB (+{(peak - before) / 1024:.0f} MiB over the process before), "
          f"all shares >= 0: {bool((shares >= 0).all())}")


if __name__ == "__main__":
    main()
