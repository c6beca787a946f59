"""Cache-sized blocks on threads against one whole batch on one thread, at a 10k-step report's sizes.

Three batched computations of the cost book work over blocks of step pairs small enough to stay
in cache, the blocks on threads (numpy releases the GIL inside each array operation):

* the exact Shapley sweep (``shapley.CHUNK_FLOATS``, ``THREADS``) at k = 7 for 10,000 step pairs;
* the paired ledger's I-projections with a 9-replicate jackknife (``iproj.BATCH_FLOATS``,
  ``THREADS``) for 2,000 step pairs of 8 groups x 8 rollouts and 7 features;
* PSIS k-hats (``paired.KHAT_BLOCK_FLOATS``, ``KHAT_THREADS``) for 10,000 rows of 64 weights.

For each it prints the best of 3 timings in the previous setting (one whole 32 MiB batch, one
thread) and in the current one, their ratio, and whether the results are identical bit for bit.

    .venv/bin/python bench/blocks.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reward_lens.measure.efficiency import iproj, shapley  # noqa: E402
from reward_lens.measure.ledger import paired  # noqa: E402


def best(fn, reps: int = 3) -> tuple[float, object]:
    out, times = None, []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def compare(label: str, fn, module, old: dict) -> None:
    new_t, new = best(fn)
    saved = {k: getattr(module, k) for k in old}
    for k, v in old.items():
        setattr(module, k, v)
    try:
        old_t, ref = best(fn)
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
    same = all(np.array_equal(a, b) for a, b in zip(ref, new)) if isinstance(ref, list) else np.array_equal(ref, new)
    print(f"{label}: whole batch on one thread {old_t * 1e3:.0f} ms, blocks on threads {new_t * 1e3:.0f} ms "
          f"({old_t / new_t:.2f}x), identical: {same}")


def main() -> None:
    rng = np.random.default_rng(0)
    p, k = 10_000, 7
    a = rng.normal(size=(p, k, k))
    g = a @ a.transpose(0, 2, 1) + np.eye(k)
    dz = rng.normal(size=(p, k))
    compare(f"Shapley shares, k = {k}, {p:,} step pairs", lambda: shapley.shapley_shares(dz, g), shapley,
            {"CHUNK_FLOATS": 1 << 22, "THREADS": 1})

    pairs, groups, m = 2_000, 8, 8
    codes = np.repeat(np.arange(groups), m)
    z = rng.normal(size=(pairs, groups * m, k))
    r = 0.05 * z[:, :, 0] + 0.02 * rng.normal(size=(pairs, groups * m))
    weights = np.vstack([np.ones((1, groups)), 1.0 - np.eye(groups)])  # the jackknife's replicates

    def projections():
        return [x.kl_min for x in iproj.i_projections(z, r, codes, groups, weights)]

    compare(f"I-projections, {pairs:,} step pairs x {len(weights)} replicates", projections, iproj,
            {"BATCH_FLOATS": 4_000_000, "THREADS": 1})

    lw = rng.normal(size=(p, 64)) * np.linspace(0.01, 3.0, p)[:, None]
    compare(f"k-hats, {p:,} rows of 64 weights", lambda: paired.pareto_khats(lw), paired,
            {"KHAT_BLOCK_FLOATS": 1 << 40, "KHAT_THREADS": 1})


if __name__ == "__main__":
    main()
