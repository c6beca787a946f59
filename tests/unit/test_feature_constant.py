"""The cost book's metric table calls a behaviour "constant" only when it is (issue 57, item 6).

The task record's table said `repetition` and `reward_format` were "constant: its within-step
variance is zero in every step" while both vary within prompt groups at most steps: the table
took one step's reason for exclusion (the last step's, from a dict merged over the steps) and
stated it for the run. Here each step's within-group variance is computed from the sample the
per-step metric reads (each step pair's independent sample: its ledger's z and prompt groups),
written out plainly, and the table's counts must match it.
"""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.examples import example_features, example_record
from reward_lens.measure.books import RunContext
from reward_lens.measure.efficiency.metric import CONSTANT_TOL
from reward_lens.measure.ledger.features import SurfaceFeatures, features_from
from reward_lens.record.reader import open_run
from reward_lens_spec import load_books


def _within_group_variance(z: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """sum over groups of sum_i (z_i - zbar_g)^2 / (n - G), per feature, written out."""
    out = np.zeros(z.shape[1])
    groups = np.unique(codes)
    for g in groups:
        zg = z[codes == g]
        out += ((zg - zg.mean(axis=0)) ** 2).sum(axis=0)
    return out / max(len(z) - len(groups), 1)


@pytest.mark.parametrize("basis", ["own", "surface"])
def test_constant_means_zero_within_group_variance_at_every_step(basis):
    run = open_run(example_record("task"))
    features = features_from(example_features("task")) if basis == "own" else SurfaceFeatures()
    ctx = RunContext(run, features)
    ctx.specs = {k: v for k, v in load_books().items() if v.report is not None}
    section = ctx.result("cost").data
    ledgers = ctx.priced.ledgers
    constant = np.zeros(len(features.names), dtype=int)
    for lg in ledgers:
        z = np.asarray(lg.z, dtype=np.float64)
        var = _within_group_variance(z, np.asarray(lg.codes))
        constant += np.sqrt(var) <= CONSTANT_TOL * np.maximum(1.0, np.abs(z.mean(axis=0)))
    table = {f.name: f for f in section.features}
    for j, name in enumerate(features.names):
        f = table[name]
        assert f.steps == len(ledgers)
        assert f.steps_constant == constant[j], (name, f.status, constant[j])
        assert f.status.startswith("constant") == (constant[j] == len(ledgers)), (name, f.status)
        assert f.steps_priced + f.steps_constant + f.steps_collinear == f.steps
    if basis == "own":  # the case: both vary within prompt groups at some steps
        for name in ("repetition", "reward_format"):
            assert not table[name].status.startswith("constant")
            assert constant[features.names.index(name)] < len(ledgers)
