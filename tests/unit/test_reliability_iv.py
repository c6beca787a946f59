"""Issue 61 (the fourth hostile corpus): one test per item not covered by test_tap_calls.py and
test_tap_call_property.py. Each row of docs/reliability.md's issue-61 table names its test here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT = REPO / "tests" / "fixtures" / "grpo_run" / "short"


def _wide_basis(path: Path, k: int) -> Path:
    lines = ["name: wide", "features:"]
    for i in range(k):
        lines += [f"  - name: f{i}", "    kind: regex", f'    pattern: "{chr(97 + i)}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_item12_a_basis_past_the_exact_shapley_limit_is_refused_through_report(tmp_path):
    from reward_lens import cli
    from reward_lens.measure.efficiency import EXACT_MAX_FEATURES

    basis = _wide_basis(tmp_path / "wide.yaml", EXACT_MAX_FEATURES + 1)
    out = tmp_path / "rep"
    code = cli.main(["report", str(SHORT), "--features", str(basis), "--out", str(out), "--format", "json", "--quiet"])
    assert code == 1  # a refused book, not a crash (3) and not bad input (2)
    report = json.loads((out / "report.json").read_text())
    cost = next(b for b in report["books"] if b["id"] == "cost")
    assert cost["status"] == "refused"
    assert [r["code"] for r in cost["refusals"]] == ["LIMIT_EXCEEDED"]
    assert str(EXACT_MAX_FEATURES) in json.dumps(cost["refusals"][0])


_DUP_BASIS = """name: dup
features:
  - name: correct
    kind: regex
    pattern: "ok"
    target: higher
    target: lower
"""


def test_item10_a_duplicate_key_in_a_basis_is_an_error_naming_file_and_line(tmp_path):
    from reward_lens import cli
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens_spec.errors import SpecError

    basis = tmp_path / "dup.yaml"
    basis.write_text(_DUP_BASIS)
    with pytest.raises(SpecError, match=r"dup\.yaml:7: .*duplicate key 'target' \(first given on line 6"):
        load_basis(basis)
    assert cli.main(["check", str(SHORT), "--features", str(basis), "--quiet"]) == 2


def test_item10_a_duplicate_key_in_a_spec_or_a_config_is_an_error_naming_the_line(tmp_path):
    from reward_lens.audit import load_config
    from reward_lens.record.errors import RecordError
    from reward_lens_spec.errors import SpecError
    from reward_lens_spec.loader import load_model
    from reward_lens_spec.models import BookSpec

    spec = tmp_path / "cost.yaml"
    spec.write_text((REPO / "specs" / "books" / "cost.yaml").read_text() + "id: again\n")
    with pytest.raises(SpecError, match=r"cost\.yaml:\d+: .*duplicate key 'id'"):
        load_model(spec, BookSpec)
    config = tmp_path / "grpo.yaml"
    config.write_text("learning_rate: 1.0e-6\nnum_generations: 8\nnum_generations: 2\n")
    with pytest.raises(RecordError, match=r"grpo\.yaml.*duplicate key 'num_generations'.*line 3"):
        load_config(config)
    # a JSON config too (TRL's grpo_config.json): json.loads keeps the last value silently
    from reward_lens.record.importers.trl_output import load_trainer_config

    js = tmp_path / "grpo_config.json"
    js.write_text('{"learning_rate": 1e-06,\n "num_generations": 8,\n "num_generations": 2}\n')
    for load in (load_config, load_trainer_config):
        with pytest.raises(RecordError, match=r"grpo_config\.json.*\"num_generations\" is given twice.*line 3"):
            load(js)
    js.write_text('{"a": {"k": 1}, "b": {"k": 2}}')  # one key in two objects is no duplicate
    assert load_config(js) == {"a": {"k": 1}, "b": {"k": 2}}


def test_item7_a_missing_features_file_leaves_no_record_folder(tmp_path):
    from tests.unit import tap_driver as d

    rec = tmp_path / "rec"
    with pytest.raises(Exception, match="nope.yaml") as err:
        d.core_for(rec, d.TinyPolicy(), features=str(tmp_path / "nope.yaml"), overwrite=False)
    assert isinstance(err.value, ValueError)
    assert not rec.exists()  # a retry without overwrite is not refused by a half-made record


@pytest.mark.parametrize("key, value", [("budget", True), ("heldout", True), ("seed", 2**80), ("check_every", 10**12)])
def test_item8_settings_are_strict_about_booleans_and_bounded_in_the_api_and_the_audit(tmp_path, key, value):
    from reward_lens.audit import _check_tap_section
    from reward_lens.record.errors import RecordError
    from reward_lens.taps.settings import tap_settings

    with pytest.raises(ValueError, match=rf"RewardLensTap: {key}:"):
        tap_settings(**{key: value})
    with pytest.raises(RecordError, match=rf"reward_lens\.{key}:"):
        _check_tap_section(tmp_path / "c.yaml", "reward_lens", {key: value})


def _callable_basis(path: Path, fn: str) -> Path:
    path.write_text(f'name: slow\nfeatures:\n  - name: mine\n    kind: callable\n    function: "tests.unit.basis_helpers:{fn}"\n')
    return path


def test_item4_a_callable_that_never_returns_refuses_the_basis_naming_the_feature(tmp_path, monkeypatch, capsys):
    import time

    from reward_lens import cli
    from reward_lens.measure.ledger import basis as basis_mod

    monkeypatch.setattr(basis_mod, "CALLABLE_SECONDS", 0.5)
    spec = _callable_basis(tmp_path / "hang.yaml", "never_returns")
    t0 = time.perf_counter()
    assert cli.main(["check", str(SHORT), "--features", str(spec), "--quiet"]) == 2
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err
    assert "hang.yaml" in err and "feature `mine`" in err and "did not return within the 0.5 s limit per call" in err


def test_item4_the_callables_of_a_basis_have_a_limit_in_all(tmp_path, monkeypatch):
    import pyarrow as pa

    from reward_lens.measure.ledger import basis as basis_mod
    from reward_lens_spec.errors import SpecError

    monkeypatch.setattr(basis_mod, "CALLABLE_SECONDS", 5.0)
    monkeypatch.setattr(basis_mod, "CALLABLE_TOTAL_SECONDS", 0.5)
    b = basis_mod.load_basis(_callable_basis(tmp_path / "slow.yaml", "slow_vowels"))
    table = pa.table({"step": [0, 0], "completion": ["abc", "xyz"]})
    assert b.compute(table).ravel().tolist() == [1.0, 0.0]  # 0.3 s: inside both limits
    with pytest.raises(SpecError, match=r"slow\.yaml: feature `mine`: .* within the 0\.5 s limit of the basis's "
                                        r"callables in all"):
        b.compute(table)  # 0.3 s more would pass 0.5 s in all


def _length_paid_record(path: Path, *, own_groups: bool, steps: int = 12, n: int = 16) -> Path:
    """A record whose reward pays for length, lengths growing step by step; with ``own_groups``
    every rollout is its own prompt group (veRL PPO with n=1, or lost group ids)."""
    import numpy as np

    from reward_lens.record import OptimizerTelemetry, Rollout, write_run

    rng = np.random.default_rng(0)
    rows = []
    for s in range(steps):
        lengths = rng.integers(5 + 3 * s, 15 + 3 * s, size=n)
        reward = lengths / 50.0
        for i, k in enumerate(lengths):
            g = f"{s}:{i}" if own_groups else f"{s}:{i // 4}"
            members = [j for j in range(n) if (j if own_groups else j // 4) == (i if own_groups else i // 4)]
            adv = float(reward[i] - reward[members].mean())
            rows.append(Rollout(step=s, group_id=g, prompt=f"p{i // 4}", completion="ab" * int(k),
                                reward=float(reward[i]), advantage=adv))
    tel = [OptimizerTelemetry(step=s, learning_rate=1e-3) for s in range(steps)]
    write_run(path, framework={"name": "test", "version": "0"}, model={"description": "hand-made"},
              telemetry=tel, rollouts=rows)
    return path


SELECTION_FINDINGS = ("moving_against_reward", "collateral_behaviour", "length_drift", "paid_for_drift")


def test_item2_groups_of_one_leave_the_selection_findings_not_evaluated_by_name(tmp_path, capsys):
    from reward_lens import cli

    basis = tmp_path / "b.yaml"
    basis.write_text("name: b\nfeatures:\n  - name: length\n    kind: length\n    of: characters\n"
                     "  - name: good\n    kind: regex\n    pattern: '(ab){15}'\n    target: higher\n")
    rec = _length_paid_record(tmp_path / "rec", own_groups=True)
    assert cli.main(["check", str(rec), "--features", str(basis), "--format", "json", "--quiet",
                     "--fail-on", "never"]) == 0
    by = {f["id"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    for fid in SELECTION_FINDINGS:
        assert by[fid]["status"] == "not_evaluated", (fid, by[fid])
        assert "no selection within prompt groups can be read" in by[fid]["evidence"], fid
        assert "advantages differ" in by[fid]["missing"][0]
    # the same record in groups of four is judged (the selection can be read there)
    rec4 = _length_paid_record(tmp_path / "rec4", own_groups=False)
    cli.main(["check", str(rec4), "--features", str(basis), "--format", "json", "--quiet", "--fail-on", "never"])
    by4 = {f["id"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert all("no selection within" not in by4[fid]["evidence"] for fid in SELECTION_FINDINGS)
    assert by4["moving_against_reward"]["status"] != "not_evaluated"


def test_item2_a_constant_target_leaves_the_target_findings_not_evaluated_by_name(tmp_path, capsys):
    from reward_lens import cli

    basis = tmp_path / "b.yaml"  # every completion holds "ab": the target never varies
    basis.write_text("name: b\nfeatures:\n  - name: length\n    kind: length\n    of: characters\n"
                     "  - name: has_ab\n    kind: regex\n    pattern: 'ab'\n    target: higher\n")
    rec = _length_paid_record(tmp_path / "rec", own_groups=False)
    cli.main(["check", str(rec), "--features", str(basis), "--format", "json", "--quiet", "--fail-on", "never"])
    by = {f["id"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    for fid in ("paid_for_drift", "proxy_gaming"):
        assert by[fid]["status"] == "not_evaluated", (fid, by[fid])
        assert "`has_ab` never varied within a step" in by[fid]["evidence"], by[fid]["evidence"]


def test_item6_a_sum_over_a_partly_measured_run_is_never_judged_as_the_runs():
    from types import SimpleNamespace

    from reward_lens.findings import FindingData, evaluate_one
    from reward_lens_spec import load_findings

    spec = load_findings()["spending_without_buying"]

    class Data(FindingData):
        def __init__(self, total, rows, pairs):
            super().__init__({})
            eff = SimpleNamespace(kl_spent=[total / 2] * 2, efficiency_debiased=[0.03] * 2, step_pair=[(0, 1), (1, 2)])
            self.cost = SimpleNamespace(summary={"eta_run": 0.03, "eta_run_interval": [-0.08, 0.15], "d_t_total": total,
                                                 "eta_run_rows": rows, "step_pairs": pairs}, efficiency=eff)

        def book(self, book_id):
            return self.cost if book_id == "cost" else None

    part = evaluate_one(spec, Data(0.0849, 2, 4), [])  # the case: the budget measured 2 of 4 pairs
    assert part.status == "not_evaluated"
    assert "summed over 2 of the run's 4 step pairs" in part.evidence and "every step pair" in part.missing[0]
    assert evaluate_one(spec, Data(0.0849, 4, 4), []).status == "clear"  # every pair measured: the run's sum


@pytest.mark.parametrize("budget", [None, 0.1])
def test_item3_heldout_1_is_refused_naming_it_with_or_without_a_budget(tmp_path, budget):
    from reward_lens.audit import _check_tap_section
    from reward_lens.record.errors import RecordError
    from reward_lens.taps.settings import tap_settings

    with pytest.raises(ValueError, match=r"RewardLensTap: heldout: .*pass 0 .* or 2 or more"):
        tap_settings(heldout=1, budget=budget)
    with pytest.raises(RecordError, match=r"reward_lens\.heldout:"):
        _check_tap_section(tmp_path / "c.yaml", "reward_lens", {"heldout": 1, "budget": budget})
    assert tap_settings(heldout=2, budget=budget).heldout == 2 and tap_settings(heldout=0, budget=budget).heldout == 0


def test_item5_a_target_whose_reward_function_gave_none_is_not_evaluated_by_name(tmp_path, capsys):
    """TRL logs NaN for a reward function that returned None; the import keeps it. With that
    function as the declared target, check and report name the feature instead of exit 2."""
    import numpy as np
    import pandas as pd

    from reward_lens import cli
    from tests.unit.test_assumed_weights import BASIS, trl_output

    out = trl_output(tmp_path / "trl", config={"num_generations": 8, "reward_weights": [0.0, 1.0]})
    for f in sorted((out / "completions").glob("*.parquet")):
        df = pd.read_parquet(f)
        df.loc[df.index % 5 == 0, "correctness"] = np.nan
        df.to_parquet(f)
    basis = tmp_path / "gold.yaml"
    basis.write_text(BASIS)
    code = cli.main(["check", str(out), "--features", str(basis), "--format", "json", "--quiet"])
    assert code in (0, 1)
    by = {f["id"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    for fid in ("proxy_gaming", "paid_for_drift", "moving_against_reward", "collateral_behaviour"):
        assert by[fid]["status"] == "not_evaluated", fid
        assert "feature `correct` measured on every rollout" in by[fid]["missing"][0], by[fid]
    assert cli.main(["import", "trl", str(out), str(tmp_path / "rec")]) == 0
    assert cli.main(["report", str(tmp_path / "rec"), "--features", str(basis), "--out", str(tmp_path / "rep"),
                     "--format", "json", "--quiet"]) == 1
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    cost = next(b for b in report["books"] if b["id"] == "cost")
    assert cost["status"] == "refused" and cost["refusals"][0]["code"] == "RECORD_INCOMPLETE"
    assert "feature `correct` is not a finite number" in cost["refusals"][0]["detail"]
    assert "reward function `correctness` gave no score" in cost["refusals"][0]["detail"]
