"""Does the paired ledger's dz add up to what the run actually did?

For a record and a basis, prints per feature: the sum over step pairs of the paired ledger's
dz (each step's movement, read on the next step's rollouts reweighted to the previous policy)
and the run's drift as the effect book measures it (mean over the last tenth of the steps
minus the first tenth, from the rollouts themselves). Over a run the two should agree up to
noise; the README's known limits quote this script on `task` and `paired`:

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
    import numpy as np

    from reward_lens.examples import example_record
    from reward_lens.measure.books import RunContext
    from reward_lens.measure.effect import drift
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", help="a bundled example name or a record directory")
    ap.add_argument("--features", help="a basis file (default: the surface basis)")
    a = ap.parse_args(argv)
    path = Path(a.record) if Path(a.record).is_dir() else example_record(a.record)
    basis = features_from(a.features)
    ctx = RunContext(open_run(path), basis, ledger="paired")
    ledgers = list(ctx.priced.ledgers)
    total = np.sum([lg.delta_z for lg in ledgers], axis=0)
    dr, first, last = drift(ctx.samples, list(basis.names), basis.units())
    print(f"{path.name}: {len(ledgers)} paired step pairs; drift = steps {last[0]}-{last[-1]} minus {first[0]}-{first[-1]}")
    print(f"{'feature':16s} {'sum of paired dz':>17s} {'drift (SE)':>18s}")
    for j, d in enumerate(dr):
        print(f"{d.feature:16s} {total[j]:+17.3g} {d.drift:+11.3g} ({d.se:.2g})")


if __name__ == "__main__":
    main()
