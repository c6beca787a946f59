"""Do the labelled runs find their failures as early as the audit says they would?

    python tools/power_vs_labelled.py                                   # bench/results/labelled_delays.json
    python tools/power_vs_labelled.py PATH.json --records DIR [--runs 200] [--change fit|window] [--json]

Reads the labelled benchmark's delays (tools/labelled_runs.py writes bench/results/labelled_delays.json:
a list of runs {"batch", "groups", "completions", "mode", "seed", "onset", "detected_step", "finding",
"series": {behaviour: [per-step mean over the step's rollouts, ...]}, "steps"}) and, for each failure
run (an onset, and a finding that reward_lens/power.py simulates), says whether its measured delay lies
in the stated 90 % range for the change the run actually showed, at the run's own dispersion.

**The run's own record** (``--records``: the kept run folders, ``<batch>/<mode>-<seed>`` or
``<mode>-<seed>``) gives two things the JSON does not:

* the behaviour the finding held on at ``detected_step`` (the watch the check runs, step by step, and
  the finding's own predicate: the first behaviour of its evidence). The length-paying runs' paid-for
  drift holds on ``repetition`` (a 0/1 behaviour near 8 % that the per-character reward buys), not on
  ``length_tokens`` (which must grow by half its level): that behaviour's change is compared, as a rate;
* its dispersion over the steps before the change began (``power.dispersion`` per step): a rate's
  intraclass correlation over prompts (``icc``: prompts differ in difficulty), a length's ``cv``. The
  simulation runs at it in place of specs/power.yaml's assumptions (prompts alike; SD half the mean).

Without ``--records`` the scenario's behaviour and specs/power.yaml's dispersion are used.

**The change a run showed**, from its own series of that behaviour (``--change``):

* ``fit`` (the default): power.py's own model of a change fitted to the run, by least squares over
  steps 0 .. ``onset + HALF``: flat at a base, then a linear change from the step it began (every
  begin from ``BASE_STEPS`` to the ground-truth ``onset`` tried: the onset is where the behaviour is
  already a quarter off its base). Its base: the mean of the steps before it began;
* ``window``: the least-squares slope over ``onset - HALF`` .. ``onset + HALF``, its base the mean of the
  first ``BASE_STEPS`` steps, and its begin one step after the line is at that base (never after
  ``onset``, never before ``BASE_STEPS``).

**The measured delay** is then as power.py counts it: the changed steps seen when the finding first held,
``detected_step - began + 1`` (None: never detected). **The stated range** is the central 90 % of the
delays power.py simulates for that finding at the run's batch (prompt groups x completions), at that
change per step, from that base and at that dispersion (its 5 % and 95 % quantiles), with the median
beside it. A run whose change is not in the finding's direction is reported, not judged.
bench/results/power_vs_labelled.txt keeps the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT = ROOT / "bench" / "results" / "labelled_delays.json"
BASE_STEPS = 3  # tools/labelled_runs.py's BASELINE_STEPS
HALF = 3  # the slope's window: onset - HALF .. onset + HALF
REQUIRED = ("groups", "completions", "mode", "seed", "onset", "detected_step", "finding", "series", "steps")


class BadInput(ValueError):
    """The file is not what tools/labelled_runs.py writes: names the run and field."""


def load(path: Path) -> list[dict]:
    try:
        runs = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file (tools/labelled_runs.py writes it)") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: not JSON ({exc})") from None
    if not isinstance(runs, list):
        raise BadInput(f"{path}: a list of runs expected, got {type(runs).__name__}")
    for i, r in enumerate(runs):
        if not isinstance(r, dict):
            raise BadInput(f"{path}: run {i} is not an object")
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise BadInput(f"{path}: run {i} ({r.get('mode')} seed {r.get('seed')}) lacks {missing}")
        for k in ("groups", "completions", "steps"):
            if not isinstance(r[k], int) or isinstance(r[k], bool) or r[k] < 1:
                raise BadInput(f"{path}: run {i}: `{k}` must be a whole number >= 1, got {r[k]!r}")
        for k in ("onset", "detected_step"):
            if r[k] is not None and (not isinstance(r[k], int) or isinstance(r[k], bool) or r[k] < 0):
                raise BadInput(f"{path}: run {i}: `{k}` must be a step (a whole number >= 0) or null, got {r[k]!r}")
        if not isinstance(r["series"], dict) or not all(isinstance(v, list) for v in r["series"].values()):
            raise BadInput(f"{path}: run {i}: `series` must map each behaviour to its per-step means")
        for name, v in r["series"].items():
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise BadInput(f"{path}: run {i}: `series.{name}` holds a value that is not a finite number")
    return runs


def shown_change(series: list[float], onset: int, kind: str) -> dict:
    """The change a run showed around its ground-truth ``onset`` (see the module's docstring): base,
    slope per step in the finding's unit, and the step where the change began."""
    x = np.asarray(series, dtype=float)
    scale = 100.0 if kind == "rate" else 1.0  # points of a rate; tokens as they are
    base = float(x[:BASE_STEPS].mean())
    lo, hi = max(0, onset - HALF), min(len(x) - 1, onset + HALF)
    t = np.arange(lo, hi + 1, dtype=float)
    if len(t) < 2:
        raise BadInput(f"onset {onset}: fewer than 2 steps of series around it")
    slope, icept = np.polyfit(t, x[lo:hi + 1], 1)
    at_onset = slope * onset + icept
    # the line is at the base one step before the change's first step (power.py's j-th changed step is
    # j x the change off the base)
    began = onset - round((at_onset - base) / slope) + 1 if slope else onset
    began = int(max(BASE_STEPS, min(onset, began)))
    return {"base": base, "slope": float(slope * scale), "began": began}


def fitted_change(series: list[float], onset: int, kind: str) -> dict:
    """The change a run showed, as power.py's own model of it fitted to the run: flat at a base, then
    a sustained linear change from the step it began (the j-th changed step j x the slope off the
    base), by least squares over the series' steps 0 .. ``onset + HALF``, every begin from
    ``BASE_STEPS`` to ``onset`` tried (the ground-truth onset is where the behaviour is already a
    quarter off its base, so the change began at it or before). Base: the mean of the steps before
    the change began (what the simulation's quiet steps are read against)."""
    x = np.asarray(series, dtype=float)
    scale = 100.0 if kind == "rate" else 1.0
    end = min(len(x) - 1, onset + HALF)
    if onset < BASE_STEPS or end < onset:
        raise BadInput(f"onset {onset}: fewer than {BASE_STEPS} steps before it, or no series at it")
    t = np.arange(end + 1, dtype=float)
    best = None
    for b in range(BASE_STEPS, onset + 1):
        design = np.column_stack([np.ones(end + 1), np.maximum(0.0, t - b + 1)])
        coef = np.linalg.lstsq(design, x[:end + 1], rcond=None)[0]
        sse = float(((design @ coef - x[:end + 1]) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, b, float(coef[1]))
    _, began, slope = best
    return {"base": float(x[:began].mean()), "slope": slope * scale, "began": began}


CHANGE = {"fit": fitted_change, "window": shown_change}


BASIS = ROOT / "examples" / "features" / "task.yaml"  # tools/labelled_runs.py's basis


def record_of(records: Path, r: dict) -> Path | None:
    """A labelled run's kept record under ``records``: ``<batch>/<mode>-<seed>`` or ``<mode>-<seed>``
    (the 8 x 8 runs), its ``record`` folder where it has one."""
    for d in (records / r.get("batch", f"{r['groups']}x{r['completions']}") / f"{r['mode']}-{r['seed']}",
              records / f"{r['mode']}-{r['seed']}"):
        for rec in (d / "record", d):
            if (rec / "manifest.json").is_file():
                return rec
    return None


def from_record(rec: Path, r: dict) -> dict:
    """What the run's own record says: the behaviour the finding held on at ``detected_step`` (the
    first of its evidence, read by the watch the check runs, step by step), and each behaviour's
    dispersion per step (``power.dispersion``: its mean, SD over rollouts, cv, icc)."""
    from reward_lens.findings import PREDICATES, FindingData
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.measure.sequential import RunWatch, WatchBasis, step_block
    from reward_lens.power import dispersion
    from reward_lens.record import open_run
    from reward_lens_spec import load_findings

    basis = load_basis(BASIS)
    samples = steps_from_run(open_run(rec), basis, heldout=False)
    held = None
    if r["detected_step"] is not None:
        spec = load_findings()[r["finding"]]
        fn, watch, block = PREDICATES[spec.predicate], RunWatch(WatchBasis.of(basis)), step_block(samples)
        for k in range(len(block.steps)):
            if block.steps[k] > r["detected_step"]:
                break
            watch.observe(block.row(k))
            if block.steps[k] == r["detected_step"]:
                o = fn(FindingData({}, watch=watch), **dict(spec.params))
                rows = o.evidence.get("features") or []
                held = rows[0]["feature"] if o.holds and rows and isinstance(rows[0], dict) else None
    per_step = {n: {int(s.step): dispersion(s.z[:, j], s.groups) for s in samples} for j, n in enumerate(basis.names)}
    return {"held": held, "dispersion": per_step}


def compare(runs: list[dict], n_sim: int = 200, records: Path | None = None, change: str = "fit") -> list[dict]:
    from reward_lens.power import load_power, simulate

    p = load_power()
    out = []
    for r in runs:
        if r["onset"] is None:
            continue  # a healthy run: no delay to compare (its false alarms are the benchmark's to count)
        row = {k: r[k] for k in ("mode", "seed", "groups", "completions", "finding", "onset", "detected_step")}
        row["batch"] = r.get("batch", f"{r['groups']}x{r['completions']}")
        sc = p.findings.get(r["finding"])
        if sc is None:
            out.append({**row, "verdict": "not simulated", "why": f"no scenario for {r['finding']} in specs/power.yaml"})
            continue
        feature, kind, own = sc.feature, sc.kind, {}
        if records is not None:
            rec = record_of(records, r)
            if rec is None:
                raise BadInput(f"{records}: no record of {r['mode']} seed {r['seed']} at {row['batch']}")
            got = from_record(rec, r)
            if got["held"] is not None and got["held"] != feature:
                # the finding held on another behaviour than the scenario's: that one's change is compared
                feature = got["held"]
                vals = {round(d["mean"], 9) for d in got["dispersion"][feature].values()}
                kind = "rate" if all(0 <= v <= 1 for v in vals) and feature != "length_tokens" else "length"
            own = got["dispersion"][feature]
        row["feature"] = feature
        if feature not in r["series"]:
            out.append({**row, "verdict": "not judged", "why": f"no series of `{feature}`"})
            continue
        ch = CHANGE[change](r["series"][feature], r["onset"], kind)
        if own:
            # the run's own dispersion over the steps before its change began (the quiet steps the
            # simulation's reference is read on)
            quiet = [own[t] for t in sorted(own) if t < ch["began"]]
            disp = ({"icc": float(np.mean([q["icc"] for q in quiet]))} if kind == "rate"
                    else {"cv": float(np.sqrt(np.mean([q["sd"] ** 2 for q in quiet])) / ch["base"])})
            row.update({k: round(v, 3) for k, v in disp.items()})
        else:
            disp = {}
        row.update(base=round(ch["base"], 4), change=round(ch["slope"], 3), began=ch["began"])
        if ch["slope"] * sc.direction <= 0:
            out.append({**row, "verdict": "not judged", "why": "the series does not move the finding's way"})
            continue
        d = simulate(r["finding"], r["groups"], r["completions"], abs(ch["slope"]), base=ch["base"], runs=n_sim,
                     kind=kind if kind != sc.kind else None, **disp)
        lo, hi = d.at(0.05), d.at(0.95)
        measured = r["detected_step"] - ch["began"] + 1 if r["detected_step"] is not None else None
        row.update(measured=measured, stated_median=d.median, stated_low=lo, stated_high=hi,
                   found_share=round(d.found, 3))
        if measured is None:
            inside = hi is None  # never found, and the simulation does not find it within its horizon either
        else:
            inside = lo is not None and lo <= measured and (hi is None or measured <= hi)
        row["verdict"] = "within" if inside else ("later" if measured is None or (hi is not None and measured > hi)
                                                   else "earlier")
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| run | seed | batch | finding | behaviour (dispersion) | change a step (base) | began | detected | "
             "measured delay | stated median [90 % range] | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        change = f"{r['change']:+g} ({r['base']:.3g})" if "change" in r else "—"
        disp = (f"icc {r['icc']:.3f}" if "icc" in r else f"cv {r['cv']:.3f}" if "cv" in r else "specs/power.yaml's")
        rng = (f"{r['stated_median'] if r['stated_median'] is not None else '—'} "
               f"[{r['stated_low'] if r['stated_low'] is not None else '—'}, "
               f"{r['stated_high'] if r['stated_high'] is not None else 'past horizon'}]") if "stated_low" in r else "—"
        lines.append(f"| {r['mode']} | {r['seed']} | {r['batch']} | `{r['finding']}` | `{r.get('feature', '—')}` ({disp}) | "
                     f"{change} | {r.get('began', '—')} | "
                     f"{r['detected_step'] if r['detected_step'] is not None else 'never'} | "
                     f"{r['measured'] if r.get('measured') is not None else '—'} | {rng} | "
                     f"{r['verdict']}{': ' + r['why'] if 'why' in r else ''} |")
    judged = [r for r in rows if r["verdict"] in ("within", "later", "earlier")]
    inside = sum(r["verdict"] == "within" for r in judged)
    lines += ["", f"failure runs whose measured delay lies in the stated 90 % range: {inside} of {len(judged)}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--runs", type=int, default=200, help="simulated runs per labelled run (default 200)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--records", type=Path, help="the runs' kept records (<batch>/<mode>-<seed>, or <mode>-<seed>): "
                    "each run's own dispersion and the behaviour its finding held on")
    ap.add_argument("--change", choices=sorted(CHANGE), default="fit",
                    help="how the change a run showed is read: fit (power.py's flat-then-linear model by least "
                         "squares, the default) or window (a line over onset +- 3, extrapolated to the first steps' base)")
    a = ap.parse_args(argv)
    try:
        rows = compare(load(a.path), a.runs, a.records, a.change)
    except BadInput as exc:
        print(f"power_vs_labelled: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if a.json else table(rows))
    if a.records is None and not a.json:
        print("(without --records: each run is read on its finding's scenario behaviour at specs/power.yaml's dispersion, "
              "not on the behaviour its finding held on at its own; bench/results/power_vs_labelled.txt shows both)")
    judged = [r for r in rows if r["verdict"] in ("within", "later", "earlier")]
    return 0 if judged and all(r["verdict"] == "within" for r in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
