"""The seed's "What it measures when the denominator exists", on our own model.

The checkpoint the long reference record started from (tiny Qwen3, 260-token byte
vocabulary, 30,824 parameters) takes one real policy-gradient step -- plain gradient
descent on the GRPO loss of the record's step-0 rollouts and advantages -- at two step
sizes. D_t is computed exactly from the two checkpoints, G by rung 1 and rung 2, and the
cost book either reports an efficiency in [0, 1] or refuses. Runs in CI (marker whitebox).
"""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.measure.whitebox.experiment import run_experiment
from reward_lens.measure.whitebox.policy import load_policy
from reward_lens.record import open_run
from reward_lens.record.reader import Window
from tests.conftest import LONG

LARGE, SMALL = 100.0, 0.01


@pytest.fixture(scope="module")
def results():
    run = open_run(LONG)
    model, tok = load_policy(LONG / run.manifest.checkpoints[0].path)
    step0 = run.read_rollouts(["prompt", "completion", "advantage"], Window(0, 0)).to_pydict()
    res = run_experiment(model, tok, step0["prompt"][0], step0["completion"], np.array(step0["advantage"]),
                         [LARGE, SMALL])
    for r in res:
        print(f"\ns={r.step_size}: D_t={r.d_t:.4g}±{r.d_t_se:.2g} max|t|={r.max_abs_t:.2f} "
              f"KL_min rung1={r.kl_min_rung1:.3g} (floor {r.noise_floor_rung1:.3g}) eta1={r.eta_rung1} "
              f"refusal1={r.refusal_rung1} KL_min rung2={r.kl_min_rung2} eta2={r.eta_rung2} "
              f"refusal2={r.refusal_rung2} stable2={r.rung2_stable} raw ratio1={r.raw_ratio_rung1:.3g} "
              f"Fisher/D_t fresh={r.fisher_fresh_ratio:.3g} own-rollouts={r.fisher_own_ratio:.3g}")
    return {r.step_size: r for r in res}


@pytest.mark.whitebox
def test_large_step_is_resolved_and_efficiency_is_inside_the_bound(results):
    r = results[LARGE]
    assert r.max_abs_t > 3  # the change is resolved
    assert r.d_t > 0 and r.d_t_se / r.d_t < 0.2
    assert r.refusal_rung1 is None and 0.0 <= r.eta_rung1 <= 1.0
    # rung 2 (the damped metric) on this checkpoint, as docs/science.md's table states it: the
    # scores do not identify the damping, so it states no eta and refuses by name. Asserted as it
    # is, not under a condition that never holds: the day the damping is identified this fails
    # and the table and this test change together.
    assert not r.rung2_stable and r.eta_rung2 is None and r.kl_min_rung2 is None
    (ref,) = r.details["book_rung2"].refusals
    assert r.refusal_rung2 == ref.code == "ENVELOPE_VIOLATED" and ref.context["premise"] == "damping_unidentified"


@pytest.mark.whitebox
def test_small_step_is_refused_with_the_failed_premise(results):
    r = results[SMALL]
    book = r.details["book_rung1"]
    # refused, not handed out: its KL_min is far above D_t (raw ratio 904 in docs/science.md's table)
    assert not book.rows
    (ref,) = book.refusals
    assert ref.code == "ENVELOPE_VIOLATED" and r.raw_ratio_rung1 > 100
    assert "standard error" in ref.detail and "samples" in ref.detail
    assert "times `D_t`" in ref.detail and "noise floor" in ref.detail


@pytest.mark.whitebox
def test_empirical_fisher_factors(results):
    small, large = results[SMALL], results[LARGE]
    # Fresh samples of the pre-step policy, in the quadratic regime: the quadratic is D_t.
    assert 0.5 < small.fisher_fresh_ratio < 2.0
    # From the rollouts the step was computed on, the update lies in their span: overestimate.
    assert small.fisher_own_ratio > 2 * small.fisher_fresh_ratio
    # Outside the quadratic regime, far worse.
    assert large.fisher_own_ratio > 100


@pytest.mark.whitebox
def test_readme_table_is_what_this_experiment_measures(results):
    """docs/science.md's "When the denominator exists" rows are this run's numbers (2 % tolerance)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "science.md").read_text()
    for size, r in results.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| {size:g} | "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        d_t = float(cells[2].split("±")[0])
        assert d_t == pytest.approx(r.d_t, rel=0.02)
        assert float(cells[4].split("(")[0]) == pytest.approx(r.kl_min_rung1, rel=0.02)
        # rung 2 refused at both sizes: the damping is not identified by the scores
        (ref,) = r.details["book_rung2"].refusals
        assert r.kl_min_rung2 is None and r.eta_rung2 is None
        assert cells[6] == "—" and ref.context["premise"] == "damping_unidentified"
        assert cells[7] == "ENVELOPE_VIOLATED, damping not identified"
        fresh, own = (float(x) for x in cells[8].split("/"))
        assert fresh == pytest.approx(r.fisher_fresh_ratio, rel=0.02) and own == pytest.approx(r.fisher_own_ratio,
                                                                                               rel=0.02)
