"""Findings (specs/findings/): each predicate on hand-made series where it must hold and where it
must not, not-evaluated naming what is missing, `reward-lens check` (exit codes, --list, a TRL
output directory with no tap), the report leading with them, and the audit saying which a
configuration will support. The collapsing and healthy training runs are in
tests/acceptance/test_findings_runs.py (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reward_lens import cli
from reward_lens.findings import FindingData, PREDICATES, evaluate, evaluate_live, exit_code, finding_counts
from reward_lens_spec import load_findings

REPO = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).with_name("reward-lens"))]


def _series(**cols):
    return {k: {i: float(v) for i, v in enumerate(vals)} for k, vals in cols.items()}


def test_nine_findings_each_one_yaml_with_a_known_predicate():
    specs = load_findings()
    assert len(specs) >= 9
    for s in specs.values():
        assert s.predicate in PREDICATES and (REPO / "specs" / "findings" / f"{s.id}.yaml").is_file()
        assert s.validated and s.remedy and s.question.endswith("?")
    listed = subprocess.run(CLI + ["check", "--list"], capture_output=True, text=True)
    assert listed.returncode == 0 and all(f"`{i}`" in listed.stdout for i in specs)


# ---------------------------------------------------------------- predicates, by hand
def test_entropy_collapse_needs_the_fall_and_no_reward_for_it():
    h = 1.0 * 0.85 ** np.arange(30)  # falls to 1 % of its start
    flat = _series(entropy=h, reward_mean=np.full(30, 0.5))
    out = PREDICATES["entropy_collapse"](FindingData(flat), window=5, min_fall=0.5)
    first_low = next(i for i in range(5, 30) if h[max(0, i - 4):i + 1].mean() <= 0.5 * h[:5].mean())
    assert out.holds and out.onset == first_low
    rising = _series(entropy=h, reward_mean=np.linspace(0.1, 0.9, 30))  # the entropy bought reward
    assert not PREDICATES["entropy_collapse"](FindingData(rising), window=5, min_fall=0.5).holds
    steady = _series(entropy=np.full(30, 1.0), reward_mean=np.full(30, 0.5))
    assert not PREDICATES["entropy_collapse"](FindingData(steady), window=5, min_fall=0.5).holds


def test_advantage_collapse_from_its_onset():
    z = np.r_[np.zeros(10), np.ones(10)]
    out = PREDICATES["advantage_collapse"](FindingData(_series(frac_reward_zero_std=z)), window=5, share=0.5)
    assert out.holds and out.onset == 12  # the 5-step mean first reaches 0.5 at step 12 (3 of 5)
    ok = PREDICATES["advantage_collapse"](FindingData(_series(frac_reward_zero_std=np.full(20, 0.3))), window=5,
                                          share=0.5)
    assert not ok.holds


def test_kl_spikes_against_the_running_median_and_the_se():
    d = np.full(30, 0.01)
    d[20] = 0.5  # 50x the median
    out = PREDICATES["kl_spikes"](FindingData(_series(kl_to_previous=d)), window=10, factor=10, min_se=3)
    assert out.holds and out.onset == 20 and out.evidence["n_spikes"] == 1
    noisy = _series(kl_to_previous=d, kl_to_previous_se=np.full(30, 0.5))  # within its own noise
    assert not PREDICATES["kl_spikes"](FindingData(noisy), window=10, factor=10, min_se=3).holds


def test_kl_spikes_are_the_steps_a_loop_over_each_window_finds():
    """The running medians are taken for every step at once; the spikes, their count and the
    first five are those of a plain loop taking each step's previous ten one at a time."""
    rng = np.random.default_rng(5)
    d = rng.gamma(2.0, 0.005, size=400)
    d[rng.choice(np.arange(10, 400), 12, replace=False)] *= rng.uniform(5, 60, size=12)
    d[50:60] = 0.0  # a stretch with a median of 0: nothing is a spike against it
    se = rng.uniform(0.0, 0.05, size=400)
    se[::7] = np.nan
    want = []
    for i in range(10, len(d)):
        med = float(np.median(d[i - 10:i]))
        s = se[i] if np.isfinite(se[i]) else None
        if med > 0 and d[i] > 10 * med and (s is None or not s > 0 or d[i] - 10 * med > 3 * s):
            want.append((i, float(d[i]), med))
    assert len(want) >= 3  # the case is not empty
    out = PREDICATES["kl_spikes"](FindingData(_series(kl_to_previous=d, kl_to_previous_se=se)), window=10, factor=10,
                                  min_se=3)
    assert out.holds and out.onset == want[0][0] and out.evidence["n_spikes"] == len(want)
    assert [tuple(x) for x in out.evidence["spikes"]] == want[:5]


def test_clipping_saturation_on_most_recent_steps():
    un = np.r_[np.full(10, 0.5), np.full(15, 3.0)]
    data = FindingData(_series(grad_norm_unclipped=un, max_grad_norm=np.full(25, 1.0)))
    out = PREDICATES["clipping_saturation"](data, window=10, share=0.8)
    assert out.holds and out.onset == 17  # 8 of the last 10 clipped first at step 17
    calm = FindingData(_series(grad_norm_unclipped=np.full(25, 0.5), max_grad_norm=np.full(25, 1.0)))
    assert not PREDICATES["clipping_saturation"](calm, window=10, share=0.8).holds


def test_reward_plateau_when_the_last_third_buys_nothing():
    n = 45
    r = np.r_[np.linspace(0.0, 1.0, 15), np.full(30, 1.0)]
    data = FindingData(_series(reward_mean=r, kl_to_previous=np.full(n, 0.01)),
                       reward_se={i: 0.01 for i in range(n)})
    out = PREDICATES["reward_plateau"](data, window=5, fraction=0.25, z=2.0)
    assert out.holds and out.onset == 30
    still = FindingData(_series(reward_mean=np.linspace(0.0, 1.0, n), kl_to_previous=np.full(n, 0.01)),
                        reward_se={i: 0.01 for i in range(n)})
    assert not PREDICATES["reward_plateau"](still, window=5, fraction=0.25, z=2.0).holds


def test_too_little_to_judge_is_not_evaluated_never_clear():
    """Each predicate with a `min_steps`, one step short of it: not evaluated, saying what would
    enable it; at `min_steps` it judges. A number not resolved from noise is not judged either."""
    specs = load_findings()
    flat = {"entropy_collapse": dict(entropy=1.0, reward_mean=0.5), "advantage_collapse": dict(frac_reward_zero_std=0.1),
            "kl_spikes": dict(kl_to_previous=0.01), "clipping_saturation": dict(grad_norm_unclipped=0.5,
                                                                               max_grad_norm=1.0),
            "reward_plateau": dict(reward_mean=0.5, kl_to_previous=0.01)}
    from reward_lens.findings import evaluate_one

    for fid, cols in flat.items():
        spec = specs[fid]
        need = spec.params["min_steps"]
        for n, want in ((need - 1, "not_evaluated"), (need, None)):
            data = FindingData(_series(**{k: np.full(n, v) for k, v in cols.items()}),
                               reward_se={i: 0.01 for i in range(n)})
            out = evaluate_one(spec, data, [])
            if want:
                assert out.status == want and f"{need} " in out.missing[0] and f"has {n})" in out.missing[0], out
            else:
                assert out.status != "not_evaluated" or fid == "reward_plateau", out
    # a flat reward: the first third bought nothing resolved, so there is no plateau to judge
    n = 45
    flat_r = FindingData(_series(reward_mean=np.full(n, 0.5), kl_to_previous=np.full(n, 0.01)),
                         reward_se={i: 0.01 for i in range(n)})
    assert evaluate_one(specs["reward_plateau"], flat_r, []).status == "not_evaluated"
    # the last third's price resolved neither above zero nor under a quarter of the first's
    r = np.r_[np.linspace(0.0, 1.0, 15), np.linspace(1.0, 1.0 + 15 * 0.4 / 15, 15), 1.4 + 0.3 * np.arange(15) / 15]
    noisy = FindingData(_series(reward_mean=r, kl_to_previous=np.full(n, 0.01)),
                        reward_se={i: (0.01 if i < 30 else 0.3) for i in range(n)})
    assert evaluate_one(specs["reward_plateau"], noisy, []).status == "not_evaluated"


def test_spending_without_buying_clear_only_when_eta_is_resolved_above_its_threshold():
    from types import SimpleNamespace

    from reward_lens.findings import evaluate_one

    spec = load_findings()["spending_without_buying"]

    class Data(FindingData):
        def __init__(self, eta, iv, total):
            super().__init__({})
            rows = SimpleNamespace(kl_spent=[(total or 0) / 2] * 2, efficiency_debiased=[eta] * 2, step_pair=[(0, 1), (1, 2)])
            self.cost = SimpleNamespace(summary={"eta_run": eta, "eta_run_interval": iv, "d_t_total": total},
                                        efficiency=rows)

        def book(self, book_id):
            return self.cost if book_id == "cost" else None

    assert evaluate_one(spec, Data(0.03, [-0.08, 0.15], 4.8), []).status == "not_evaluated"  # issue #40's case
    assert evaluate_one(spec, Data(0.08, [0.03, 0.13], 4.8), []).status == "not_evaluated"  # across 5 %
    assert evaluate_one(spec, Data(0.36, [0.34, 0.39], 4.8), []).status == "clear"
    assert evaluate_one(spec, Data(0.02, [0.01, 0.03], 4.8), []).status == "holds"
    assert evaluate_one(spec, Data(0.03, [-0.08, 0.15], 0.05), []).status == "clear"  # spent under 0.1 nats
    none = evaluate_one(spec, Data(None, None, None), [])
    assert none.status == "not_evaluated" and "D_t" in none.missing[0]


def test_live_findings_on_the_taps_series_say_what_needs_rollouts():
    series = _series(frac_reward_zero_std=np.ones(12), grad_norm_unclipped=np.full(12, 0.1),
                     kl_to_previous=np.full(12, 0.01))
    found = {f.id: f for f in evaluate_live(series, {"max_grad_norm": 1.0})}
    assert found["advantage_collapse"].status == "holds" and found["advantage_collapse"].onset == 4
    assert found["clipping_saturation"].status == "clear" and found["kl_spikes"].status == "clear"
    assert found["entropy_collapse"].status == "not_evaluated" and "entropy" in found["entropy_collapse"].missing
    # the series alone cannot feed what reads each step's rollouts (LiveFindings hands them over)
    assert found["moving_against_reward"].status == "not_evaluated" and "rollout.advantage" in found[
        "moving_against_reward"].missing


# ---------------------------------------------------------------- on records
def test_the_healthy_task_record_has_no_warn_or_critical_finding():
    from reward_lens.examples import example_features, example_record
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    run = open_run(example_record("task"))
    report = build_report(run, features=features_from(str(example_features("task"))))
    assert exit_code(report.findings, "warn") == 0
    # a tapped record feeds every finding but one: its model sampled its own rollouts, so there is
    # no engine log-probability to compare (engine_mismatch). One more is not evaluated all the
    # same: its number is not resolved from noise against its threshold, and that is not "clear"
    undecided = [f for f in report.findings if f.status == "not_evaluated"]
    assert [f.id for f in undecided] == ["engine_mismatch", "spending_without_buying"]
    assert all(f.missing for f in undecided) and undecided[0].missing == ["rollout.logp_sampler"]
    counts = finding_counts(report.findings)
    assert report.findings_counts == counts and counts["checked"] == len(load_findings())
    # the card leads with the health sentence, counted in one place, the three outcomes apart
    assert report.card[0].startswith("**No warn or critical finding**")
    assert f"{counts['clear']} of {counts['checked']} checks clear" in report.card[0]
    assert (f"{counts['not_evaluated']} not evaluated (engine-trainer mismatch, spending without buying)"
            in report.card[0]), report.card[0]
    data = json.loads(report.model_dump_json())
    assert [f["id"] for f in data["findings"]] == list(load_findings())


def test_a_record_with_a_kl_spike_is_found_by_check(tmp_path, capsys):
    from tests.conftest import tiny_record, varied_completions

    kl = {s: 0.01 for s in range(24)}
    kl[18] = 0.6
    rec = tiny_record(tmp_path / "rec", {s: varied_completions(s, 8) for s in range(24)}, kl_to_previous=kl)
    assert cli.main(["check", str(rec), "--quiet", "--format", "json"]) == 1
    out = json.loads(capsys.readouterr().out)
    spike = next(f for f in out["findings"] if f["id"] == "kl_spikes")
    assert spike["status"] == "holds" and spike["onset"] == 18 and "step 18" in spike["evidence"]
    assert cli.main(["check", str(rec), "--quiet", "--fail-on", "critical"]) == 0  # a warn only
    assert cli.main(["check", str(rec), "--quiet", "--fail-on", "never"]) == 0


def _trl_output_without_completions(tmp_path: Path, steps: int = 14) -> Path:
    from tests.unit.test_importer import _trl_output

    out = _trl_output(tmp_path / "trl", steps=steps, grad=(2.0,))
    shutil.rmtree(out / "completions")
    state = json.loads((out / "trainer_state.json").read_text())
    for i, e in enumerate(x for x in state["log_history"] if "loss" in x):
        e.update(entropy=0.5 * 0.8 ** i, frac_reward_zero_std=min(1.0, 0.1 * i), reward=0.5)
    (out / "trainer_state.json").write_text(json.dumps(state))
    return out


def test_zero_setup_a_trl_output_directory_gets_its_scalar_findings(tmp_path, capsys):
    """No tap, no completions: TRL's logged entropy, reward, frac_reward_zero_std and grad_norm are
    enough for four findings; the rest are not evaluated, naming the field, never clear."""
    out = _trl_output_without_completions(tmp_path)
    before = sorted(p.name for p in out.iterdir())
    assert cli.main(["check", str(out), "--quiet", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    by = {f["id"]: f for f in data["findings"]}
    assert by["advantage_collapse"]["status"] == "holds" and by["entropy_collapse"]["status"] == "holds"
    assert by["clipping_saturation"]["status"] == "holds"
    assert by["kl_spikes"]["status"] == "not_evaluated" and by["kl_spikes"]["missing"] == ["kl_to_previous"]
    assert by["moving_against_reward"]["status"] == "not_evaluated"
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written into the user's folder


def test_the_audit_says_which_findings_a_config_supports(tmp_path):
    from reward_lens.audit import audit

    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_generations: 8\nper_device_train_batch_size: 16\nlogging_steps: 1\nmax_steps: 50\n"
                   "log_completions: true\n")
    plain = {f.finding: f for f in audit(cfg).findings}
    assert plain["kl_spikes"].verdict == "will not evaluate" and plain["kl_spikes"].missing == ["kl_to_previous"]
    assert plain["advantage_collapse"].verdict == "will evaluate"
    tapped = {f.finding: f for f in audit(cfg, with_tap=True).findings}
    # the two that read a declared target say so where none is declared (issue 57): never "will evaluate"
    from reward_lens.findings import TARGET

    needs = ("proxy_gaming", "paid_for_drift")
    # and the engine mismatch: TRL samples with the trained model itself here (no `use_vllm`), so
    # there is no engine's log-probability to compare
    assert all(f.verdict == "will evaluate" for fid, f in tapped.items() if fid not in needs + ("engine_mismatch",))
    assert all(tapped[fid].verdict == "will not evaluate" and tapped[fid].missing == [TARGET] for fid in needs)
    assert tapped["engine_mismatch"].verdict == "will not evaluate"
    assert tapped["engine_mismatch"].missing == ["rollout.logp_sampler"]
    aimed = tmp_path / "aimed.yaml"
    aimed.write_text(cfg.read_text() + "reward_lens: {target: correctness}\n")
    assert all(f.verdict == "will evaluate" for f in audit(aimed).findings if f.finding != "engine_mismatch")
    engine = tmp_path / "vllm.yaml"
    engine.write_text(cfg.read_text() + "use_vllm: true\n")
    assert {f.finding: f for f in audit(engine, with_tap=True).findings}["engine_mismatch"].verdict == "will evaluate"
    # TRL's default batch (8 completions, 8 per prompt) holds one prompt group a step on one process:
    # the sequential findings read a step from two or more, and the audit says so beforehand
    one = tmp_path / "one.yaml"
    one.write_text("num_generations: 8\nlogging_steps: 1\nmax_steps: 50\nlog_completions: true\n")
    single = {f.finding: f for f in audit(one, with_tap=True).findings}
    for fid in ("moving_against_reward", "collateral_behaviour", "length_drift"):
        assert single[fid].verdict == "will not evaluate" and "2 prompt groups a step" in single[fid].missing[0]
    assert single["advantage_collapse"].verdict == "will evaluate"
    r = subprocess.run(CLI + ["audit", str(cfg)], capture_output=True, text=True)
    assert "kl_spikes                 will not evaluate  kl_to_previous" in r.stdout


def test_a_finding_not_evaluated_is_never_counted_clear(tmp_path):
    from reward_lens.record import open_run
    from tests.conftest import tiny_record, varied_completions

    rec = tiny_record(tmp_path / "rec", {s: varied_completions(s, 8) for s in range(6)})
    found = {f.id: f for f in evaluate(open_run(rec))}
    assert found["kl_spikes"].status == "not_evaluated" and "kl_to_previous" in found["kl_spikes"].missing
    assert found["entropy_collapse"].status == "not_evaluated"
    counts = finding_counts(list(found.values()))
    assert counts["clear"] + counts["holds"] + counts["not_evaluated"] == counts["checked"]


@pytest.mark.parametrize("bad", ["predicate: nope", "severity: fatal", "inputs: [[no_such_field]]"])
def test_a_malformed_finding_spec_is_named(tmp_path, bad):
    from reward_lens_spec.errors import SpecError
    from reward_lens_spec.loader import _findings_cached

    root = tmp_path / "specs"
    shutil.copytree(REPO / "specs", root)
    path = root / "findings" / "kl_spikes.yaml"
    key = bad.split(":")[0]
    text = "\n".join(line if not line.startswith(key + ":") else bad for line in path.read_text().splitlines())
    path.write_text(text + "\n")
    if key == "predicate":
        spec = _findings_cached(str(root))["kl_spikes"]
        from reward_lens.findings import evaluate_one

        with pytest.raises(ValueError, match="unknown predicate 'nope'"):
            evaluate_one(spec, FindingData({}), [])
    else:
        with pytest.raises(SpecError, match="kl_spikes.yaml"):
            _findings_cached(str(root))


def test_book_findings_on_the_reference_records(tmp_path):
    """On `paired` (a lowercase reward, surface basis) completions lengthen with no selection on
    length: collateral and length drift hold; read in a basis of one behaviour the reward does not
    touch, nearly all the divergence goes unnamed: spending without buying holds."""
    from reward_lens.examples import example_record
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    run = open_run(example_record("paired"))
    found = {f.id: f for f in build_report(run).findings}
    assert found["collateral_behaviour"].status == "holds"
    assert "len_chars" in [x["feature"] for x in found["collateral_behaviour"].values["features"]]
    drift = found["length_drift"]
    assert drift.status == "holds" and all(abs(x["relative"]) >= 0.1 for x in drift.values["features"])
    assert found["spending_without_buying"].status == "clear"
    basis = tmp_path / "sevens.yaml"
    basis.write_text('name: sevens\nfeatures:\n  - name: n_sevens\n    kind: regex\n    pattern: "7"\n    count: raw\n')
    narrow = {f.id: f for f in build_report(run, features=load_basis(basis)).findings}
    spend = narrow["spending_without_buying"]
    assert spend.status == "holds" and spend.values["interval"][1] < 0.05
    # the nats its evidence quotes eta "of" are eta's own denominator, and the run's total beside it
    # where eta is read on fewer updates than D_t is summed over
    cost = [b for b in build_report(run, features=load_basis(basis)).books if b.id == "cost"][0].data_dict()["summary"]
    said = spend.evidence
    assert f"{cost['eta_d_t']:.3g}" in said
    if cost["eta_d_t"] != cost["d_t_total"]:
        assert "at the updates it is read on" in said and f"{cost['d_t_total']:.3g} in all" in said


def test_what_the_specs_say_they_were_validated_on():
    """The `validated` lines of specs/findings/ on the bundled records, one by one."""
    from reward_lens.examples import example_features, example_record
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    def found(name):
        spec = example_features(name)
        rep = build_report(open_run(example_record(name)), features=features_from(str(spec) if spec else None))
        return {f.id: f.status for f in rep.findings}

    task, paired, tapped = found("task"), found("paired"), found("tapped")
    assert tapped["advantage_collapse"] == "holds" and task["advantage_collapse"] == "clear"
    assert task["clipping_saturation"] == "holds" and task["reward_plateau"] == "holds"
    assert task["entropy_collapse"] == "clear" and task["collateral_behaviour"] == "clear"
    assert task["length_drift"] == "clear" and task["moving_against_reward"] == "clear"
    assert task["spending_without_buying"] == "not_evaluated"  # 9 % [-3 %, 20 %]: across 5 %
    assert paired["spending_without_buying"] == "clear" and tapped["spending_without_buying"] == "clear"
    assert paired["reward_plateau"] == "clear" and tapped["reward_plateau"] == "not_evaluated"  # 29 steps of 30
    assert {task["kl_spikes"], paired["kl_spikes"], tapped["kl_spikes"]} == {"clear"}


@pytest.mark.parametrize("name", ["long", "paired", "tapped"])
def test_the_reports_samples_give_the_findings_the_rewards_their_own_read_gives(name):
    """A report hands the findings its read of the rollouts: the per-step mean reward, its SE
    and the share of flat prompt groups from those samples equal the findings' own read of
    the record, and a null reward (a row that read drops, the samples keep) sends them back
    to their own read."""
    from dataclasses import replace

    from reward_lens.findings import _rollout_reward_stats, _sample_reward_stats
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    run = open_run(REPO / "tests" / "fixtures" / "grpo_run" / name)
    samples = steps_from_run(run, SurfaceFeatures())
    got, want = _sample_reward_stats(samples), _rollout_reward_stats(run)
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b) and len(a) > 5
        np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], rtol=1e-12, atol=1e-15)
    # the share of flat groups, written plainly from the record's rows
    rows = run.read_rollouts(["group_id", "reward"]).to_pylist()
    by: dict = {}
    for x in rows:
        by.setdefault(x["step"], {}).setdefault(x["group_id"], []).append(x["reward"])
    plain = {st: sum(max(v) == min(v) for v in g.values() if len(v) > 1) / sum(len(v) > 1 for v in g.values())
             for st, g in by.items() if any(len(v) > 1 for v in g.values())}
    assert sorted(plain) == sorted(got[2]) and all(plain[st] == pytest.approx(got[2][st], abs=1e-15) for st in plain)
    nulled = list(samples)
    nulled[2] = replace(nulled[2], rewards=np.where(np.arange(nulled[2].n) == 0, np.nan, nulled[2].rewards))
    assert _sample_reward_stats(nulled) is None
    assert _sample_reward_stats([replace(s, groups=None) for s in samples]) is None
