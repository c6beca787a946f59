"""Truth first (tools/paired_truth.py): on a tapped TRL run with the policy kept at every step,
the paired ledger's 95 % interval covers the efficiency measured from 4,096 fresh samples of
pi_{t+1} on at least 80 % of the checked step pairs it prices (the others refused, by name, for
heavy-tailed weights); the same estimator fed the rollouts each step trained on does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_paired_interval_covers_the_oracle_and_in_sample_does_not():
    sys.path.insert(0, str(REPO / "tools"))
    from paired_truth import CHECKED, run

    result = run()
    rows, n = result.rows, len(result.rows)
    # Every checked pair is priced or refused for a stated reason, and the only reason is weights
    # too heavy-tailed for 64 rollouts (PSIS k-hat). How many are refused depends on the training
    # trajectory, which differs between CPUs (19 of the 22 priced on one machine, 17 on another;
    # the same from run to run on each): at least two thirds priced, so that the 80 % below is a
    # statement about most of the checked pairs.
    assert {r.step_pair for r in rows} | set(result.refused) == {(t, t + 1) for t in CHECKED}
    assert set(result.refused.values()) <= {"ENVELOPE_VIOLATED heavy_tails"}, result.refused
    assert n >= 2 * len(CHECKED) / 3
    paired = sum(r.paired_covers for r in rows)
    in_sample = sum(r.in_sample_covers for r in rows)
    print(f"paired covers {paired} of {n}, in-sample {in_sample} of {n}")
    assert paired >= 0.8 * n
    assert in_sample < 0.8 * n and in_sample < paired
    # Where the features explain almost nothing (eta ~ 0), the in-sample estimate is far from it.
    early = [r for r in rows if r.step_pair[0] < 12]
    assert max(abs(r.oracle) for r in early) < 0.1
    assert sum(r.in_sample > 0.3 for r in early) >= 0.8 * len(early)
