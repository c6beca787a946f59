"""How much each ledger resolves on a record: rows resolved at windows W = 1, 4, 8.

    python tools/ledger_resolution.py tests/fixtures/grpo_run/paired

prints, for the paired and the unpaired ledger, the share of the record's step pairs that lie
in a row (a step pair, or a window of W) which Benjamini-Hochberg at q = 0.05 resolves --
refused step pairs count in the total -- the run's eta (a ratio of sums over every priced
row, debiased, 95 % interval: the headline) and, for comparison, the median over the resolved
rows (selected on significance, so it leans high). The README's table is this script's output; a test re-runs it. (The
in-sample bias the paired ledger avoids is measured against the truth by ``tools/truth.py``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def resolution(record: str | Path, windows=(1, 4, 8)) -> dict[str, dict[int, dict]]:
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(record)
    samples = steps_from_run(run, SurfaceFeatures())
    out: dict[str, dict[int, dict]] = {}
    for ledger in ("paired", "unpaired"):
        out[ledger] = {}
        for w in windows:
            priced = price_run(run, samples, ledger=ledger, window=w)
            book = priced.book
            med, ci = book.headline()
            run_est = book.run_level()
            out[ledger][w] = {"resolved": sum(r.steps for r in book.resolved_rows),
                              "total": len(book.kl_min.rows) + len(priced.not_formed), "eta": med, "interval": ci,
                              "eta_run": run_est.eta_debiased if run_est else None,
                              "eta_run_interval": run_est.interval() if run_est else None}
    return out


def table(record: str | Path, res: dict | None = None) -> str:
    res = res or resolution(record)
    lines = ["| ledger | W | step pairs in resolved rows | η of the run (ratio of sums) [95 %] | "
             "median η over resolved rows (selected) |", "|---|---|---|---|---|"]

    def cell(v, ci):
        return "—" if v is None else f"{v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")

    for ledger, by_w in res.items():
        for w, r in by_w.items():
            lines.append(f"| {ledger} | {w} | {r['resolved']} of {r['total']} ({100 * r['resolved'] / r['total']:.0f} %) "
                         f"| {cell(r['eta_run'], r['eta_run_interval'])} | {cell(r['eta'], r['interval'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    rec = sys.argv[1] if len(sys.argv) > 1 else REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    print(table(rec))
    b = in_sample_bias(rec)
    print(f"\nmedian 1/2 Var(r) / D_t: in-sample {b['half_var_in']:.2f}, independent {b['half_var_ind']:.2f}; "
          f"features' R^2 of r: in-sample {b['r2_in']:.2f}, independent {b['r2_ind']:.2f}")
