"""Where a tapped report's time goes, phase by phase, against the read-plus-features baseline.

    .venv/bin/python bench/report_phases.py [--steps N] [--repeats R] [--paired]

Generates (not committed) the record ``report_large.py --tapped`` reports on (10,000 steps x 64
rollouts, two-sided, D_t on every step pair; with ``--paired``, the one ``report_large.py
--paired`` reports on), then, from a cold interpreter each round:

* the baseline: a pyarrow read of the report's columns plus the nine surface features;
* ``reward-lens report`` with the phases it passes through timed from inside (wrappers around
  the functions the report calls, nothing else changed): reading the rollouts with their
  features, the paired ledgers, the within-group metric, the cost book (of which the
  I-projections with their delete-one-group jackknife), the other books and findings (the
  rest of building the report) and rendering md, html and json; what the total holds beyond
  them is the imports, the checksums and writing the files.

Prints each phase's seconds (median over rounds) and as a multiple of the baseline: the
report's target is 1.3x the baseline, so the phases' multiples say what that target leaves
each of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from report_large import ENV, FEATURES, HWM_SRC, make_record, saved_to  # noqa: E402

PHASES = """
import sys, time, json
t0 = time.perf_counter()
spans = {}

def timed(module, name, label):
    fn = getattr(module, name)
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spans.setdefault(label, []).append((t, time.perf_counter()))
    setattr(module, name, wrapper)

def wall(intervals):
    # the time during which at least one of the calls ran: calls on threads at once (the
    # jackknife's chunks) are counted once, not summed
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total

import reward_lens.cli as cli
import reward_lens.measure.ledger.price as price
import reward_lens.measure.efficiency.of_run as of_run
import reward_lens.measure.efficiency.eta as eta
import reward_lens.report as report
timed(price, "steps_from_run", "read the rollouts and compute the features")
timed(of_run, "paired_ledger_series", "paired ledgers")
timed(of_run, "within_group_metric", "within-group metric")
timed(of_run, "cost_series", "cost book")
timed(eta, "group_jackknife", "  of which I-projections with their jackknife")
timed(report, "build_report", "build the report (all books and findings)")  # the cli imports them from here
for name in ("to_markdown", "to_html", "to_json"):
    timed(report, name, "render md, html and json")
code = cli.main(["report", sys.argv[1], "--out", sys.argv[2], "--quiet", "--fail-on", "never"])
spent = {label: wall(v) for label, v in spans.items()}
spent["total (imports included)"] = time.perf_counter() - t0
print(json.dumps(spent))
"""

ORDER = ["read the rollouts and compute the features", "paired ledgers", "within-group metric", "cost book",
         "  of which I-projections with their jackknife", "other books and findings", "render md, html and json",
         "total (imports included)"]


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code.replace("HWM\n", HWM_SRC), *args], capture_output=True,
                         text=True, check=True, cwd=REPO, env=ENV)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--per-step", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paired", action="store_true", help="the record of report_large.py --paired instead (one-sided: "
                    "no kl_prev, no held-out rows, no D_t)")
    ap.add_argument("--save", action="store_true", help="also write the output to bench/results/report_phases"
                    "[_paired].txt (docs/benchmarks.md quotes it: tools/bench_quotes.py)")
    a = ap.parse_args()
    if a.save:
        with saved_to(REPO / "bench" / "results" / ("report_phases_paired.txt" if a.paired else "report_phases.txt")):
            run_all(a)
    else:
        run_all(a)


def run_all(a) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", "reward_lens", "reward_lens_spec"], check=True, cwd=REPO,
                   env=ENV)
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "record"
        make_record(rec, a.steps, a.per_step, paired=True, tapped=not a.paired)
        base, phases = [], []
        for r in range(a.repeats):  # interleaved
            base.append(run(FEATURES, str(rec))["seconds"])
            spent = run(PHASES, str(rec), str(Path(tmp) / f"out{r}"))
            # the books and findings other than the phases timed inside building the report
            inside = sum(spent.get(k, 0.0) for k in ORDER[:4])
            spent["other books and findings"] = spent["build the report (all books and findings)"] - inside
            phases.append(spent)
    b = statistics.median(base)
    print(f"{'paired' if a.paired else 'tapped'} record: {a.steps} steps x {a.per_step} rollouts; medians of "
          f"{a.repeats} interleaved rounds")
    print(f"  baseline, read plus the nine features (imports included): {b:.2f} s; the target, 1.3x, is "
          f"{1.3 * b:.2f} s")
    for label in ORDER:
        s = statistics.median(p.get(label, 0.0) for p in phases)
        print(f"  {label:<46s} {s:6.2f} s  {s / b:5.2f}x the baseline")


if __name__ == "__main__":
    main()
