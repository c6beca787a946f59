"""The findings' evidence runs: the task recipe (tools/make_task_record.py's Qwen3, pretrained on
arithmetic, from the task record's own starting checkpoint) trained with GRPO and the tap, at a
learning rate that collapses it and at its own, over seeds.

    python tools/findings_runs.py --collapse                 # lr 3e-3, 12 steps: what check finds, and when
    python tools/findings_runs.py --healthy-seeds 5          # lr 5e-4, 30 steps, seeds 1..5: false positives
    python tools/findings_runs.py --healthy-seeds 5 --quote  # the block docs/findings.md quotes

The slow test tests/acceptance/test_findings_runs.py trains the collapsing run; the healthy
seeds (about 1.5 minutes each on 2 CPU cores) are measured by this script and quoted.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import truth  # noqa: E402

COLLAPSE = dataclasses.replace(truth.REGIMES["collapse"], steps=12, learning_rate=3e-3, seed=13)
HEALTHY = dataclasses.replace(truth.REGIMES["collapse"], name="healthy", steps=30, learning_rate=5e-4)


def train(regime, work: Path):
    """A tapped run (live findings checked every step); its record and the trainer's logs."""
    regime = dataclasses.replace(regime, name="collapse")  # truth._setup: the task recipe
    return truth.train(regime, work, check_every=1)


def check(record: Path) -> list:
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    return build_report(open_run(record), features=load_basis(truth.TASK_BASIS)).findings


def held(findings, at_least: str = "warn") -> list:
    from reward_lens.findings import RANK

    return [f for f in findings if f.status == "holds" and RANK[f.severity] >= RANK[at_least]]


def healthy_seeds(seeds: list[int], work: Path) -> list[tuple[int, list]]:
    out = []
    for seed in seeds:
        trained = train(dataclasses.replace(HEALTHY, seed=seed), work / f"seed-{seed}")
        out.append((seed, check(trained.record)))
    return out


def quote(results: list[tuple[int, list]]) -> str:
    lines = [f"task recipe at lr {HEALTHY.learning_rate:g}, {HEALTHY.steps} steps, {len(results)} seeds:"]
    total = 0
    for seed, found in results:
        bad = held(found)
        total += len(bad)
        info = [f.id for f in found if f.status == "holds" and f.severity == "info"]
        lines.append(f"  seed {seed}: warn or critical: {', '.join(f.id for f in bad) or 'none'}; "
                     f"info: {', '.join(info) or 'none'}")
        lines += [f"    {f.id}: {f.evidence}" for f in bad]
    lines.append(f"warn or critical findings on runs of the healthy recipe: {total} in {len(results)} runs")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collapse", action="store_true")
    ap.add_argument("--healthy-seeds", type=int, default=0)
    ap.add_argument("--quote", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.collapse:
            trained = train(COLLAPSE, Path(tmp) / "collapse")
            for f in check(trained.record):
                print(f"{f.id:24s} {f.status:14s} {f.severity:8s} onset={f.onset}")
            live = sorted({k for e in trained.log_history for k in e if k.startswith("reward_lens/finding/")})
            print("live keys:", live)
        if a.healthy_seeds:
            res = healthy_seeds(list(range(1, a.healthy_seeds + 1)), Path(tmp))
            print(quote(res))


if __name__ == "__main__":
    main()
