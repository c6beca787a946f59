"""What the tap's cost budget buys: the truth harness's moderate run (tools/truth.py) with the tap
at several budgets.

    python tools/cost_precision.py            # prints the table docs/recording.md quotes
    python tools/cost_precision.py --save     # also writes it and docs/assets/cost-precision.svg

Two steps, because the tap's extra completions ride in the trainer's own generation and so change
the run's random draws: each budget's run follows its own trajectory, and precisions read off
different trajectories would mix the budget with the run.

1. **What each budget buys on this machine.** The run is trained with the tap at each budget; its
   telemetry says what the budget bought: the share of step pairs measured, the prompt groups
   measured per pair (median, of 8) and the completions per group and policy (median), and the
   tap's own time as a share of an untapped step (median of ``tap_seconds / (step_seconds -
   tap_seconds)``). The budget chooses from timing, so another machine buys other shapes.
2. **What that buys in precision, on one trajectory.** The run with ``budget=None`` (every pair
   measured whole: 8 groups, 4 completions per group and policy) is subsampled to each budget's
   shape -- its share of the pairs, that many groups chosen at random, that many completions per
   group and side -- ``REPLICATES`` times, and read as the report reads a record (the paired
   ledger, the within-group metric, the cost book): the median relative standard error of D_t
   over the measured pairs and the width of the run-level eta interval (95 %), medians over the
   replicates. A budget that bought one-sided pairs (no completions per group) is read off its
   own run instead, and marked so: the whole run's pairs are measured on extra completions, and
   hold no rollouts scored under pi_t to subsample (the figure leaves it out).
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
REPLICATES = 20
RESULTS = REPO / "bench" / "results" / "cost_precision.txt"
# The same rows as data: the report's remedy for a tapped record quotes what a larger budget buys
# from it (templates/refusals/RECORD_INCOMPLETE/cost.remedy.j2, reason not_measured).
CURVE = REPO / "specs" / "cost_precision.yaml"
FIGURE = REPO / "docs" / "assets" / "cost-precision.svg"


def bought(record: Path) -> dict:
    """What the tap measured in a record, from its telemetry."""
    from reward_lens.record import open_run

    t = open_run(record).telemetry.to_pydict()
    last = max(t["step"])
    pairs = [i for i, s in enumerate(t["step"]) if s < last]
    measured = [i for i in pairs if t["kl_to_previous"][i] is not None]
    share = [a / (b - a) for a, b in zip(t["tap_seconds"], t["step_seconds"]) if a is not None and b and b > a]
    med = lambda xs: statistics.median(xs) if xs else 0  # noqa: E731
    return {"measured": len(measured) / len(pairs), "groups": med([t["tap_groups"][i] for i in measured]),
            "per_group": med([t["tap_per_group"][i] for i in measured]), "share": med(share)}


def _take(sample, rows, chosen):
    """A StepSample of the rows ``rows`` of ``sample``, its groups coded 0..m-1 in the order of
    ``chosen`` (both sides of a pair coded alike, as the reader codes them)."""
    import dataclasses

    import numpy as np

    from reward_lens.measure.ledger.price import StepSample

    fields = {f.name: getattr(sample, f.name)[rows] for f in dataclasses.fields(StepSample)
              if isinstance(getattr(sample, f.name), np.ndarray)}
    code = {int(g): i for i, g in enumerate(chosen)}
    fields["groups"] = np.array([code[int(g)] for g in fields["groups"]], dtype=np.int64)
    return StepSample(sample.step, sample.names, n_groups=len(chosen), **fields)


def precision(record: Path, shape: dict, replicates: int, seed: int = 0) -> dict:
    """The whole record subsampled to ``shape`` ``replicates`` times, read as the report reads it."""
    import numpy as np

    from reward_lens.measure.efficiency.cost import cost_series
    from reward_lens.measure.efficiency.metric import within_group_metric
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.paired import paired_ledger_series
    from reward_lens.measure.ledger.price import learning_rates, steps_from_run
    from reward_lens.record import open_run

    run = open_run(record)
    samples = [s for s in steps_from_run(run, SurfaceFeatures()) if s.fresh is not None and s.heldout is not None]
    lrs = learning_rates(run)
    rng = np.random.default_rng(seed)
    m, k = int(round(shape["groups"])), int(round(shape["per_group"]))
    rel, width = [], []
    for _ in range(replicates):
        pairs, held = [], {}
        for s in samples:
            if rng.random() >= shape["measured"]:
                continue
            b, a = s.fresh, s.heldout
            groups = np.unique(b.groups)
            chosen = np.sort(rng.choice(groups, min(m, len(groups)), replace=False))
            rb = np.concatenate([rng.choice(np.flatnonzero(b.groups == g), k, replace=False) for g in chosen])
            ra = np.concatenate([rng.choice(np.flatnonzero(a.groups == g), k, replace=False) for g in chosen])
            pairs.append(_take(b, rb, chosen))
            held[s.step] = _take(a, ra, chosen)
        ledgers, _ = paired_ledger_series(pairs, lrs, held)
        ledgers = [lg for lg in ledgers if lg.d_t is not None and lg.d_t > 0]
        rel.append(statistics.median(lg.d_t_se / lg.d_t for lg in ledgers))
        book = cost_series(ledgers, within_group_metric(ledgers), run_=run)
        est = book.run_level()
        if est is not None:
            lo, hi = est.interval()
            width.append(hi - lo)
    return {"rel_se": statistics.median(rel), "eta_width": statistics.median(width) if width else None}


def own_precision(record: Path) -> dict:
    """A one-sided budget's precision, read off its own run as the report reads it: the whole
    run's two-sided measurement holds no rollouts scored under pi_t to subsample to a one-sided
    shape (its pairs are measured on the extra completions), so this row mixes the budget with
    its run's trajectory, and says so (``own``)."""
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record import open_run

    run = open_run(record)
    priced = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="paired")
    ledgers = [lg for lg in priced.ledgers if getattr(lg, "d_t", None) is not None and lg.d_t > 0
               and lg.d_t_se == lg.d_t_se]
    est = priced.book.run_level() if priced.book is not None else None
    width = None
    if est is not None:
        lo, hi = est.interval()
        width = hi - lo
    return {"rel_se": statistics.median(lg.d_t_se / lg.d_t for lg in ledgers) if ledgers else None,
            "eta_width": width, "own": True}


def table(rows: list[dict]) -> str:
    lines = ["| budget | the tap's own time | step pairs measured | groups of 8 | completions per group and policy "
             "| D_t relative SE | run-level η interval width |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = "none (everything)" if r["budget"] is None else f"{r['budget']:.2f}"
        width = "—" if r["eta_width"] is None else f"{r['eta_width']:.3f}"
        rel = "—" if r["rel_se"] is None else f"{r['rel_se']:.3f}"
        sides = "0 (one-sided: its own run)" if r.get("own") else f"{r['per_group']:g}"
        lines.append(f"| {b} | {r['share']:.3f} | {r['measured']:.0%} | {r['groups']:g} | {sides} "
                     f"| {rel} | {width} |")
    return "\n".join(lines)


def figure(rows: list[dict]) -> str:
    from reward_lens.measure.figures import FigureOut, Panel, Series
    from reward_lens.report.plots import render_figure

    pts = sorted(rows, key=lambda r: r["share"])  # every budget at the share of an untapped step it took

    def series(key: str, label: str) -> Series:
        kept = [r for r in pts if r[key] is not None and not r.get("own")]
        return Series(label=label, x=[r["share"] for r in kept], y=[r[key] for r in kept], style="points")

    fig = FigureOut(id="cost-precision", caption="What a budget buys on the truth harness's moderate run",
                    x_label="the tap's own time as a share of an untapped step",
                    panels=[Panel(title="D_t", y_label="relative SE (median)", series=[series("rel_se", "D_t")]),
                            Panel(title="run-level η", y_label="95 % interval width",
                                  series=[series("eta_width", "η")])])
    return render_figure(fig)


def main() -> None:
    import truth

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--replicates", type=int, default=REPLICATES)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        records = {}
        for b in BUDGETS:
            work = Path(tmp) / f"b{b}"
            records[b] = truth.train(truth.REGIMES["moderate"], work, budget=b).record
        for b in BUDGETS:
            shape = bought(records[b])
            got = (own_precision(records[b]) if int(round(shape["per_group"])) == 0
                   else precision(records[None], shape, a.replicates))
            rows.append({"budget": b, **shape, **got})
    text = table(rows)
    print(text)
    if a.save:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text + "\n")
        FIGURE.write_text(figure(rows) + "\n")
        CURVE.write_text(curve(rows))


def curve(rows: list[dict]) -> str:
    """The rows as specs/cost_precision.yaml: each budget, what it bought, what that bought."""
    import yaml

    keep = ("budget", "share", "measured", "groups", "per_group", "rel_se", "eta_width")

    def printed(k, v):  # as the table prints them: counts whole, the rest to 3 significant digits
        if v is None or k == "budget":
            return v
        return int(round(v)) if k in ("groups", "per_group") else float(f"{v:.3g}")

    head = ("# What the tap's cost budget buys, measured by tools/cost_precision.py --save on the truth\n"
            "# harness's moderate run (the rows of docs/recording.md's table; `own: true`: one-sided, read\n"
            "# off its own run). Written by that tool, never by hand; the report quotes it.\n")
    return head + yaml.safe_dump({"run": "the truth harness's moderate run (tools/truth.py), 8 prompt groups a step",
                                  "rows": [{**{k: printed(k, r.get(k)) for k in keep}, "own": bool(r.get("own"))} for r in rows]},
                                 sort_keys=False)


if __name__ == "__main__":
    main()
