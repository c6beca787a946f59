"""How the thresholds of the sequential findings were set: on tools/labelled_runs.py's
TUNING_SEEDS only (never on its REPORTED_SEEDS).

    python tools/labelled_runs.py --tune --keep /tmp/tuning   # trains what is missing there, prints the grid

For every tuning run (22 healthy seeds, 5 seeds of each failure mode) and every combination of
the grid below, the sequential watch is run step by step over the record (what ``check`` reads at
each prefix) and the book-grounded findings are evaluated at every step with those parameters. A
combination is *feasible* when every failure run's right finding holds within
``labelled_runs.WITHIN`` steps of its ground-truth onset and no healthy run raises any of the five
findings at any step. The grid prints each combination's worst delay and its false alarms; the
specs carry the chosen values: h 5; min_size 0.6 for moving against the reward and collateral
behaviour (0.5 and under raised moving_against_reward on healthy seed 206, whose correctness dipped
by a quarter); 0.4 for proxy gaming (its reward-holds-up condition keeps healthy dips out, so a
smaller fall suffices); paid-for drift 0.5 of its level and 0.5 SD. No combination met both
criteria on every tuning run: the format-only runs of seeds 1001 (its ground-truth onset at step 27
of 30) and 2001 (4-5 steps late) are missed by all that keep the healthy seeds quiet.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import labelled_runs as lr  # noqa: E402

FINDINGS = ("moving_against_reward", "proxy_gaming", "paid_for_drift", "collateral_behaviour", "length_drift")
GRID = {"h": (4.0, 5.0, 6.0), "min_size": (0.5, 0.6, 0.75), "proxy_size": (0.25, 0.4, 0.5, 0.6),
        "paid_size": (0.5, 0.75), "paid_relative": (0.5,)}


def records(work: Path) -> dict[tuple[str, int], Path]:
    out = {}
    for mode, seeds in lr.TUNING_SEEDS.items():
        for seed in seeds:
            d = work / f"tune-{mode}-{seed}"
            rec = d / "record"
            if not (rec / "manifest.json").is_file():
                d.mkdir(parents=True, exist_ok=True)
                lr.train(mode, seed, d)
            out[(mode, seed)] = rec
    return out


def watches(record: Path):
    """The watch after each step of the record (a copy per step: the state a check on that prefix reads)."""
    import copy

    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.measure.sequential import RunWatch, WatchBasis, step_stats
    from reward_lens.record import open_run

    basis = load_basis(lr.BASIS)
    w = RunWatch(WatchBasis.of(basis))
    out = {}
    for s in steps_from_run(open_run(record), basis, heldout=False):
        st = step_stats(s)
        if st is not None:
            w.observe(st)
        out[s.step] = copy.deepcopy(w)
    return out


def params_of(combo: dict, finding: str) -> dict:
    from reward_lens_spec import load_findings

    p = dict(load_findings()[finding].params)
    p["h"] = combo["h"]
    if "min_size" in p:
        p["min_size"] = {"paid_for_drift": combo["paid_size"], "proxy_gaming": combo["proxy_size"]}.get(
            finding, combo["min_size"])
    if finding == "paid_for_drift":
        p["min_relative"] = combo["paid_relative"]
    return p


def evaluate(by_step: dict, combo: dict) -> dict[str, list[int]]:
    from reward_lens.findings import PREDICATES, FindingData
    from reward_lens_spec import load_findings

    specs = load_findings()
    out: dict[str, list[int]] = {}
    for step, w in sorted(by_step.items()):
        d = FindingData({}, watch=w)
        for fid in FINDINGS:
            if PREDICATES[specs[fid].predicate](d, **params_of(combo, fid)).holds:
                out.setdefault(fid, []).append(step)
    return out


def main(work: Path) -> None:
    recs = records(Path(work))
    truths = {key: lr.ground_truth(rec, key[0]) for key, rec in recs.items()}
    for key, t in sorted(truths.items()):
        print(f"{key[0]:12s} {key[1]}: ground-truth onset {t.onset} ({t.rule}); rules broken at {t.broken}")
    states = {key: watches(rec) for key, rec in recs.items()}
    print()
    print("h  min_size proxy_size paid_size paid_rel | worst delay (failure runs) | missed | healthy runs with a false alarm")
    for values in itertools.product(*GRID.values()):
        combo = dict(zip(GRID, values))
        delays, missed, false = [], [], []
        for key, by_step in states.items():
            mode = key[0]
            hits = evaluate(by_step, combo)
            if mode == "healthy":
                if hits:
                    false.append(f"{key[1]}:{','.join(sorted(hits))}")
                continue
            onset = truths[key].onset
            right = hits.get(lr.RIGHT[mode], [])
            early = [s for s in right if s < onset - lr.WITHIN]
            d = right[0] - onset if right and onset is not None else None
            if d is None or d > lr.WITHIN or early:
                missed.append(f"{mode}-{key[1]}({d})")
            else:
                delays.append(d)
        print(f"{combo['h']:.1f}  {combo['min_size']:<8} {combo['proxy_size']:<10} {combo['paid_size']:<9} "
              f"{combo['paid_relative']:<8} | "
              f"{max(delays) if delays else '-':>4} | {' '.join(missed) or 'none'} | {' '.join(false) or 'none'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
