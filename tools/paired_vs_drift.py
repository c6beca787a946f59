"""Does the paired ledger's dz add up to what the run actually did?

For a record and a basis, prints per feature: the paired ledger's dz of every usable step pair,
summed with the weights that make the sum the drift's own quantity (each step's movement, read
on samples independent of it)
and the run's drift as the effect book measures it (mean over the last tenth of the steps
minus the first tenth, from the rollouts themselves). Over a run the two should agree up to
noise (the sum's SE: the step pairs' SEs in quadrature, each pair a separate sample; the run
covers the drift's steps only roughly, first and last tenth against every step pair); the docs
quote this script on `task` and `paired`:

    python tools/paired_vs_drift.py task --features examples/features/task.yaml
    python tools/paired_vs_drift.py paired
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", help="a bundled example name or a record directory")
    ap.add_argument("--features", help="a basis file (default: the surface basis)")
    a = ap.parse_args(argv)
    print(text(a.record, a.features))


def text(record: str, features: str | None = None) -> str:
    """What ``main`` prints (the docs quote it)."""
    import numpy as np

    from reward_lens.examples import example_record
    from reward_lens.measure.books import RunContext
    from reward_lens.measure.effect import drift
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run

    path = Path(record) if Path(record).is_dir() else example_record(record)
    basis = features_from(features)
    ctx = RunContext(open_run(path), basis, ledger="paired")
    usable = set(ctx.decisions.usable)
    ledgers = [lg for lg in ctx.priced.ledgers if tuple(lg.step_pair) in usable]
    dr, first, last = drift(ctx.samples, list(basis.names), basis.units())
    # The drift is mean z over the last steps L minus the first steps F; with z_b = z_a + dz of
    # the step pair (a, b), that is sum over the pairs of w * dz, w = #{s in L: s >= b}/|L| -
    # #{s in F: s >= b}/|F|: the same quantity, read from the ledgers.
    w = np.array([np.mean(np.array(last) >= lg.step_pair[1]) - np.mean(np.array(first) >= lg.step_pair[1])
                  for lg in ledgers])
    total = np.sum([wi * lg.delta_z for wi, lg in zip(w, ledgers)], axis=0)
    total_se = np.sqrt(np.sum([wi ** 2 * lg.se ** 2 for wi, lg in zip(w, ledgers)], axis=0))  # separate samples
    lines = [f"{path.name}: {len(ledgers)} usable paired step pairs ({len(ctx.decisions.refused)} refused); "
             f"drift = steps {last[0]}-{last[-1]} minus {first[0]}-{first[-1]}",
             f"{'feature':16s} {'paired dz, summed (SE)':>24s} {'drift (SE)':>18s} {'difference / SE':>16s}"]
    for j, d in enumerate(dr):
        z = (total[j] - d.drift) / np.hypot(total_se[j], d.se)
        lines.append(f"{d.feature:16s} {total[j]:+13.3g} ({total_se[j]:.2g}) {d.drift:+11.3g} ({d.se:.2g}) "
                     f"{z:+16.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
