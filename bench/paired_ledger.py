"""What the paired ledger costs: pricing a record, and recording it with the tap.

1. Pricing: ``price_run`` on the bundled ``paired`` record (80 steps x 64 rollouts) with the
   paired ledger vs the unpaired one (same features, same record), interleaved, 5 repeats
   each, medians. The paired ledger does more per step pair (an exact I-projection with a
   delete-one-group jackknife); the unpaired one a quadratic form with Monte Carlo draws.
2. Recording: the same tiny GRPO training (8 prompts x 8 completions of 32 tokens, 16 steps)
   with the tap scoring each step's rollouts under the previous policy (``paired=True``, the
   default) vs without (``paired=False``), interleaved, 3 repeats each, median seconds per
   step after 4 warm-up steps.

Prints each median and the ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

STEPS = 16


def pricing(repeats: int = 5) -> dict[str, float]:
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(REPO / "tests" / "fixtures" / "grpo_run" / "paired")
    samples = steps_from_run(run, SurfaceFeatures())
    times: dict[str, list[float]] = {"paired": [], "unpaired": []}
    for _ in range(repeats):
        for ledger in times:
            t0 = time.perf_counter()
            price_run(run, samples, ledger=ledger)
            times[ledger].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def training(paired: bool) -> float:
    from tap_overhead import timed_training

    return timed_training(batch=64, prompts=[f"p{i}" for i in range(64)], lr=1e-2, steps=STEPS,
                          tap={"flush_every": 8, "paired": paired})


def main() -> None:
    p = pricing()
    print(f"pricing the 'paired' record: paired ledger {p['paired']:.2f} s, unpaired {p['unpaired']:.2f} s "
          f"({p['paired'] / p['unpaired']:.2f}x)")
    t: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for paired in (False, True):
            t[paired].append(training(paired))
    on, off = statistics.median(t[True]), statistics.median(t[False])
    print(f"tapped step, 64 rollouts: scoring under the previous policy {1000 * on:.0f} ms, without "
          f"{1000 * off:.0f} ms ({on / off:.2f}x; per-run medians {[round(1000 * x) for x in t[True]]} vs "
          f"{[round(1000 * x) for x in t[False]]} ms)")


if __name__ == "__main__":
    main()
