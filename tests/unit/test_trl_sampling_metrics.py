"""TRL with vLLM: the `sampling/*` metrics GRPOTrainer logs are mapped to fields named for what
each is (a mean absolute log-ratio, an applied importance weight), checked against the installed
TRL source, never as a KL."""

from __future__ import annotations

import inspect
import json
import re

import pytest

from reward_lens.record import open_run
from reward_lens.record.importers.trl_output import import_trl
from reward_lens_spec import load_fields
from tests.unit.test_importer import _trl_output

SAMPLING = {
    "sampling/sampling_logp_difference/mean": "sampler_logp_diff_mean",
    "sampling/sampling_logp_difference/max": "sampler_logp_diff_max",
    "sampling/importance_sampling_ratio/min": "sampler_is_ratio_min",
    "sampling/importance_sampling_ratio/mean": "sampler_is_ratio_mean",
    "sampling/importance_sampling_ratio/max": "sampler_is_ratio_max",
}


def test_the_installed_trl_writes_exactly_these_sampling_keys():
    import trl.trainer.grpo_trainer as trainer
    src = inspect.getsource(trainer)
    assert set(re.findall(r'\["(sampling/[^"]+)"\]', src)) == set(SAMPLING)
    # what each is: |old - sampling| log-probabilities, and exp(old - sampling) as the applied weight
    assert "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)" in src
    assert "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask" in src
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in src


def test_fields_name_them_for_what_they_are():
    fields = load_fields()
    assert {k: v for k, v in fields.framework_keys("trl").items() if k.startswith("sampling/")} == SAMPLING
    for name in SAMPLING.values():
        meaning = fields.fields[name].meaning
        assert "kl" not in name and ("not a KL" in meaning or "not a divergence" in meaning), name
    assert fields.fields["sampler_logp_diff_mean"].unit == "nats_per_token"
    assert fields.fields["sampler_is_ratio_mean"].unit == "dimensionless"
    # an estimate of the KL names its estimator beside it
    assert fields.fields["sampler_kl_token"].companion == "sampler_kl_token_estimator"


def test_a_trl_log_with_sampling_metrics_imports_them(tmp_path):
    out = _trl_output(tmp_path / "trl")
    state = json.loads((out / "trainer_state.json").read_text())
    for i, e in enumerate(state["log_history"][:-1]):
        e.update({"sampling/sampling_logp_difference/mean": 0.01 * (i + 1), "sampling/sampling_logp_difference/max": 0.5,
                  "sampling/importance_sampling_ratio/min": 0.2, "sampling/importance_sampling_ratio/mean": 0.999,
                  "sampling/importance_sampling_ratio/max": 2.0})
    (out / "trainer_state.json").write_text(json.dumps(state))
    import_trl(out, tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert run.telemetry_column("sampler_logp_diff_mean") == {0: 0.01, 1: 0.02, 2: 0.03}
    assert run.telemetry_column("sampler_is_ratio_max") == {0: 2.0, 1: 2.0, 2: 2.0}
    assert run.telemetry_column("sampler_kl_token") == {}  # TRL logs no KL of the engine's gap
