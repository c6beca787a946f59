"""What the tap's cost budget buys: the truth harness's moderate run (tools/truth.py) trained with
the tap at several budgets, each record read as the report reads it.

    python tools/cost_precision.py            # prints the table docs/recording.md quotes
    python tools/cost_precision.py --save     # also writes it and docs/assets/cost-precision.svg

Per budget: the share of the step pairs measured, the median relative standard error of D_t over
the measured pairs (the record's ``kl_to_previous_se / kl_to_previous``), the width of the
run-level eta interval (the cost book's ratio of sums over its priced pairs, 95 %), and the tap's
own time as a share of an untapped step (median of ``tap_seconds / (step_seconds - tap_seconds)``).
The budget chooses from timing, so another machine buys other shapes with the same budget; the
table says what this one bought. The figure plots the two precisions against the budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

BUDGETS = (0.05, 0.10, 0.25, 0.5, None)
RESULTS = REPO / "bench" / "results" / "cost_precision.txt"
FIGURE = REPO / "docs" / "assets" / "cost-precision.svg"


def measure(budget: float | None, workdir: Path) -> dict:
    import truth

    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record import open_run

    trained = truth.train(truth.REGIMES["moderate"], workdir, budget=budget)
    run = open_run(trained.record)
    t = run.telemetry.to_pydict()
    pairs = [i for i, s in enumerate(t["step"]) if s < max(t["step"])]
    measured = [i for i in pairs if t["kl_to_previous"][i] is not None]
    rel = [t["kl_to_previous_se"][i] / t["kl_to_previous"][i] for i in measured
           if t["kl_to_previous_se"][i] is not None and t["kl_to_previous"][i] > 0]
    share = [a / (b - a) for a, b in zip(t["tap_seconds"], t["step_seconds"]) if a is not None and b and b > a]
    priced = price_run(run, steps_from_run(run, SurfaceFeatures()))
    est = priced.book.run_level() if priced.book is not None else None
    lo, hi = est.interval() if est is not None else (None, None)
    return {"budget": budget, "pairs": len(pairs), "measured": len(measured),
            "rel_se": statistics.median(rel) if rel else None,
            "eta_width": None if lo is None else hi - lo, "share": statistics.median(share) if share else None}


def table(rows: list[dict]) -> str:
    lines = ["| budget | step pairs measured | D_t relative SE (median) | run-level η interval width | the tap's own time |",
             "|---|---|---|---|---|"]
    for r in rows:
        b = "none (everything)" if r["budget"] is None else f"{r['budget']:.2f}"
        rel = "—" if r["rel_se"] is None else f"{r['rel_se']:.3f}"
        width = "—" if r["eta_width"] is None else f"{r['eta_width']:.3f}"
        share = "—" if r["share"] is None else f"{r['share']:.3f}"
        lines.append(f"| {b} | {r['measured']} of {r['pairs']} | {rel} | {width} | {share} |")
    return "\n".join(lines)


def figure(rows: list[dict]) -> str:
    from reward_lens.measure.figures import FigureOut, Panel, Series
    from reward_lens.report.plots import render_figure

    # budget=None is drawn at the share of an untapped step it actually took
    xs = [r["budget"] if r["budget"] is not None else (r["share"] or 1.0) for r in rows]
    pts = sorted(zip(xs, rows), key=lambda p: p[0])

    def series(key: str, label: str) -> Series:
        kept = [(x, r[key]) for x, r in pts if r[key] is not None]
        return Series(label=label, x=[x for x, _ in kept], y=[y for _, y in kept], style="points")

    fig = FigureOut(id="cost-precision", caption="What a budget buys on the truth harness's moderate run",
                    x_label="budget (the tap's time as a share of an untapped step)",
                    panels=[Panel(title="D_t", y_label="relative SE (median)", series=[series("rel_se", "D_t")]),
                            Panel(title="run-level η", y_label="95 % interval width",
                                  series=[series("eta_width", "η")])])
    return render_figure(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", action="store_true")
    a = ap.parse_args()
    rows = []
    for b in BUDGETS:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(b, Path(tmp)))
    text = table(rows)
    print(text)
    if a.save:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text + "\n")
        FIGURE.write_text(figure(rows) + "\n")


if __name__ == "__main__":
    main()
