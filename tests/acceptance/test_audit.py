"""`reward-lens audit`: the same resolver and templates as `report`, on a config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reward_lens.audit import audit
from tests.conftest import LONG

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
CLI = [str(Path(sys.executable).with_name("reward-lens"))]


def _cost(result):
    (b,) = [b for b in result.books if b.book == "cost"]
    return b


def test_trl_defaults_will_refuse_twice_with_remedies():
    res = audit(CONFIGS / "trl_grpo_defaults.yaml")
    assert res.framework == "trl"
    assert any("`logging_steps` = 10: telemetry will be means over 10-step windows" in n for n in res.notes)
    b = _cost(res)
    assert b.verdict == "will refuse"
    by_req = {r.context["requirement"]: r for r in b.refusals}
    assert set(by_req) == {"rollouts", "denominator"}
    assert "(`logging_steps` = 10)" in by_req["rollouts"].detail
    assert "`log_completions=True` and `logging_steps=1`" in by_req["rollouts"].remedy
    assert "`beta` is 0.0 on every step of this configuration" in by_req["denominator"].remedy
    assert res.supplied["rollout.completion"].count == 50 and res.supplied["rollout.completion"].of == 500


def test_per_step_logging_leaves_only_the_denominator_missing():
    res = audit(CONFIGS / "trl_grpo_per_step.yaml")
    b = _cost(res)
    assert [r.context["requirement"] for r in b.refusals] == ["denominator"]
    assert set(b.partial) == {"kl_min", "shares", "noise_floor"}
    near = {m["field"]: m for m in b.refusals[0].context["near_misses"]}
    assert near["kl_to_ref"]["present"]  # beta > 0: TRL logs KL to the reference...
    assert "such a run will have `kl_to_ref` (on 1000 of 1000 steps)" in b.refusals[0].remedy  # ...not D_t
    assert "`kl_to_ref`: KL to the reference model, not to the previous policy" in b.refusals[0].remedy
    assert "the configured optimizer is `adamw_torch_fused`" in b.refusals[0].remedy


def test_no_completions_means_no_ledger(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_generations": 8, "logging_steps": 1, "log_completions": False}))
    b = _cost(audit(cfg))
    assert {r.context["requirement"] for r in b.refusals} == {"rollouts", "denominator"}
    assert b.partial == []


def test_verl_config():
    res = audit(CONFIGS / "verl_grpo.yaml")
    assert res.framework == "verl"
    assert "ppo_kl" in res.supplied and "kl_to_ref" in res.supplied
    b = _cost(res)
    assert [r.context["requirement"] for r in b.refusals] == ["denominator"]
    assert any("`kl_to_previous` will be absent" in n and "ppo_kl" in n for n in res.notes)


def test_record_manifest_uses_the_record_itself():
    res = audit(LONG / "manifest.json")
    assert res.kind == "record"
    b = _cost(res)
    assert [r.context["requirement"] for r in b.refusals] == ["denominator"]


def test_cli_table_json_and_require(tmp_path):
    r = subprocess.run(CLI + ["audit", str(CONFIGS / "trl_grpo_defaults.yaml")], capture_output=True, text=True)
    assert r.returncode == 0
    assert "cost_series   will refuse" in r.stdout and "cost_series  RECORD_INCOMPLETE" in r.stdout
    assert "Remedy: Log the completions of every optimizer step" in r.stdout
    r = subprocess.run(CLI + ["audit", str(CONFIGS / "trl_grpo_defaults.yaml"), "--format", "json",
                              "--require", "cost"], capture_output=True, text=True)
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["books"][0]["verdict"] == "will refuse" and data["books"][0]["refusals"][0]["code"] == "RECORD_INCOMPLETE"
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_generations: [unclosed\n")
    r = subprocess.run(CLI + ["audit", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "bad.yaml" in r.stderr and "not valid YAML" in r.stderr
    unknown = tmp_path / "u.yaml"
    unknown.write_text("foo: 1\n")
    r = subprocess.run(CLI + ["audit", str(unknown)], capture_output=True, text=True)
    assert r.returncode == 2 and "cannot tell which framework" in r.stderr
