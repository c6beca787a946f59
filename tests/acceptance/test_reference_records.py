"""The reference GRPO records: real TRL runs, imported the way a user imports one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reward_lens.record import open_run
from reward_lens.record.importers.trl_output import import_trl
from tests.conftest import FIXTURES, LONG, SHORT

REPO = Path(__file__).resolve().parents[2]


def test_long_record_shape_and_manifest():
    run = open_run(LONG)
    assert run.steps.tolist() == list(range(200))
    steps, counts = np.unique(run.rollout_steps, return_counts=True)
    assert steps.tolist() == list(range(200)) and set(counts) == {8}
    m = run.manifest
    assert m.optimizer == "adamw_torch_fused" and m.trainer_config["beta"] == 0.0
    assert m.framework.name == "trl" and m.framework.version == "1.16.0"
    assert m.trainer_config["num_generations"] == 8 and m.telemetry_per_step
    run.verify()


def test_short_record_differs():
    a, b = open_run(LONG), open_run(SHORT)
    assert len(b.steps) == 60
    assert a.manifest.trainer_config["seed"] != b.manifest.trainer_config["seed"]
    ra = {r[0] for r in a.read_rollouts(["rewards"]).column("rewards").to_pylist()[0]}
    rb = {r[0] for r in b.read_rollouts(["rewards"]).column("rewards").to_pylist()[0]}
    assert ra == {"lowercase"} and rb == {"digits"}


def test_records_are_small():
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 20_000_000


@pytest.mark.parametrize("record", [LONG, SHORT])
def test_starting_checkpoint_loads_offline_and_matches_the_manifest(record):
    run = open_run(record)
    (ck,) = run.manifest.checkpoints
    assert ck.step == 0
    code = (
        "import sys, json; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        f"m = AutoModelForCausalLM.from_pretrained({str(record / ck.path)!r});"
        f"t = AutoTokenizer.from_pretrained({str(record / ck.path)!r});"
        "print(json.dumps([sum(p.numel() for p in m.parameters()), m.config.vocab_size, len(t),"
        " m.config.hidden_size, m.config.num_hidden_layers, type(m).__name__]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    n, vocab, ntok, hidden, layers, arch = json.loads(out.stdout.strip().splitlines()[-1])
    assert n == run.manifest.model.n_parameters == 30824
    assert vocab == ntok == run.manifest.model.vocab_size == 260
    assert (hidden, layers, arch) == (8, 2, run.manifest.model.architecture)


@pytest.mark.slow
def test_generator_and_importer_end_to_end(tmp_path):
    """A few real GRPO steps, then the import: the generator and importer cannot rot."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_reference_records as gen
    finally:
        sys.path.pop(0)
    out, initial = gen.train(tmp_path, seed=5, steps=3, reward="lowercase", prompts=["a b", "c d"])
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    keys = set().union(*[e.keys() for e in history])
    # TRL itself logged no KL of any kind and no update norm: absence is TRL's, not ours.
    assert "kl" not in keys and not any("update" in k for k in keys)
    assert "grad_norm" in keys
    manifest = import_trl(out, tmp_path / "rec", checkpoint=initial)
    run = open_run(tmp_path / "rec", manifest.run_id)
    assert run.steps.tolist() == [0, 1, 2] and run.n_rollouts == 24
    assert "kl_to_ref" not in run.fields() and "kl_to_previous" not in run.fields()
    assert manifest.optimizer == "adamw_torch_fused"


def test_tapped_record_supports_the_cost_book_from_the_record_alone():
    from collections import Counter

    from reward_lens.measure.efficiency import cost_series, metric_g
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import ledger_series, steps_from_run
    from tests.conftest import TAPPED

    run = open_run(TAPPED)
    assert run.manifest.framework.name == "trl" and run.manifest.optimizer == "adamw_torch_fused"
    assert set(np.unique(run.rollout_steps, return_counts=True)[1]) == {256}
    est = set(run.telemetry_column("kl_to_previous_estimator").values())
    assert est == {"independent_two_sided"} and len(run.telemetry_column("kl_to_previous")) == 29  # not the last step
    samples = steps_from_run(run, SurfaceFeatures())
    g = metric_g(samples, scope="auto")
    assert g.scope == "per_step"
    book = cost_series(ledger_series(samples), g, run_=run)
    codes = Counter(r.code for r in book.refusals)
    assert "RECORD_INCOMPLETE" not in codes
    assert len(book.rows) + sum(len(r.subject.step_pairs) for r in book.refusals) == 29
    assert all(0.0 <= r.efficiency <= 1.0 for r in book.rows if r.status != "nothing_priced")
    # From step 17 on the policy has collapsed and every feature is constant: those rows price
    # nothing and carry no efficiency (never an eta of 0).
    assert all(r.efficiency is None and not r.shares for r in book.rows if r.status == "nothing_priced")
    assert sum(r.status == "nothing_priced" for r in book.rows) >= 5
    assert sum(r.resolved for r in book.rows) >= 5  # the record was made to resolve movement
