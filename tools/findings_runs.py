"""The findings on a collapsing run: the task recipe (tools/make_task_record.py's Qwen3,
pretrained on arithmetic, from the task record's own starting checkpoint) trained with GRPO and the
tap at lr 3e-3, where correctness collapses at the first updates.

    python tools/findings_runs.py --collapse   # 12 steps: what check finds, and when; what went live

The slow test tests/acceptance/test_findings_runs.py trains it: `check` names the collapse, the
live findings reach the trainer's logs, and with ``stop_on="critical"`` the tap halts the run on a
book-grounded finding. Healthy runs and the other failures (length, format-only, a wrong answer
key) are tools/labelled_runs.py's labelled benchmark.
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


def train(regime, work: Path, **tap):
    """A tapped run (live findings checked every step); its record and the trainer's logs."""
    regime = dataclasses.replace(regime, name="collapse")  # truth._setup: the task recipe
    return truth.train(regime, work, **{"check_every": 1, **tap})


def check(record: Path) -> list:
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    return build_report(open_run(record), features=load_basis(truth.TASK_BASIS)).findings


def held(findings, at_least: str = "warn") -> list:
    from reward_lens.findings import RANK

    return [f for f in findings if f.status == "holds" and RANK[f.severity] >= RANK[at_least]]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collapse", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.collapse:
            trained = train(COLLAPSE, Path(tmp) / "collapse", features=str(truth.TASK_BASIS))
            for f in check(trained.record):
                print(f"{f.id:24s} {f.status:14s} {f.severity:8s} onset={f.onset}")
            live = sorted({k for e in trained.log_history for k in e if k.startswith("reward_lens/finding/")})
            print("live keys:", live)


if __name__ == "__main__":
    main()
