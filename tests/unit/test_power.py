"""Detection power (reward_lens/power.py): the delays the audit states and "clear" carries, checked
against the findings run directly on rollouts made here (not by the power module's simulator), the
zero-change sanity, the audit's sentence, and tools/power_vs_labelled.py on a hand-made file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

BASIS = """
name: power_check
features:
  - name: correct
    kind: reward
    reward: correctness
    unit: "indicator (0/1)"
    target: higher
"""
LENGTH_BASIS = """
name: power_length
features:
  - name: length_tokens
    kind: length
    of: tokens
"""


def _length_rollouts(step, mean, groups, per, rng, shape=4.0):
    """One step of rollouts whose token counts are Gamma with shape 4 about ``mean`` (SD half the
    mean at 200), rounded, the reward a fair coin that selects nothing, GRPO advantages."""
    from reward_lens.record import Rollout

    rows = []
    for g in range(groups):
        tokens = np.maximum(1, np.round(rng.gamma(shape, mean / shape, per))).astype(int)
        reward = (rng.random(per) < 0.5).astype(float)
        adv = (reward - reward.mean()) / (reward.std(ddof=1) + 1e-4)
        rows += [Rollout(step=step, group_id=f"{step}:{g}", prompt=f"q{g}", completion="x", completion_ids=[1] * int(k),
                         reward=float(w), advantage=float(a)) for k, w, a in zip(tokens, reward, adv)]
    return rows


def _rollouts(step, rate, groups, per, rng, pays_against=True, icc=0.0):
    """One step of rollouts made plainly: each completion right with probability ``rate``, the
    reward paying against it (1 for a wrong answer) or for it, GRPO advantages within each group."""
    from reward_lens.record import Rollout

    rows = []
    for g in range(groups):
        # prompts that differ (icc > 0): this group's own rate, Beta about the step's with that icc
        p = rng.beta(rate * (1 / icc - 1), (1 - rate) * (1 / icc - 1)) if icc > 0 and 0 < rate < 1 else rate
        right = (rng.random(per) < p).astype(float)
        reward = 1.0 - right if pays_against else right.copy()
        adv = (reward - reward.mean()) / (reward.std(ddof=1) + 1e-4)
        rows += [Rollout(step=step, group_id=f"{step}:{g}", prompt=f"q{g}", completion="a" if r else "b",
                         reward=float(w), rewards={"correctness": float(r)}, advantage=float(a))
                 for r, w, a in zip(right, reward, adv)]
    return rows


def _direct_delays(tmp_path, finding, change, groups, per, runs, before, horizon, seed, pays_against=True, icc=0.0,
                   shape=4.0):
    """The finding run as the tap runs it (``LiveFindings``: the basis computed on the rollout rows,
    the watch, the predicate) on ``runs`` streams: ``before`` quiet steps at 50 % (200 tokens for
    length drift), then the rate falls ``change`` points a step (the length grows ``change`` tokens
    a step); the changed steps seen when it first held (inf: not within ``horizon``), and its last
    outcome."""
    from reward_lens.findings import LiveFindings
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens_spec import load_findings

    length = finding == "length_drift"
    (tmp_path / "basis.yaml").write_text(LENGTH_BASIS if length else BASIS)
    basis = load_basis(tmp_path / "basis.yaml")
    spec = load_findings()[finding]
    rng = np.random.default_rng(seed)
    out, last = [], None
    for _ in range(runs):
        live = LiveFindings(basis, specs={finding: spec})
        found = np.inf
        for t in range(before + horizon):
            j = max(0, t - before + 1)
            rows = (_length_rollouts(t, 200.0 + change * j, groups, per, rng, shape) if length else
                    _rollouts(t, max(0.0, 0.5 - change * j / 100), groups, per, rng, pays_against, icc))
            res = live.observe(t, rows)[0]
            last = res
            if t >= before and res.status == "holds":
                found = t - before + 1
                break
        out.append(found)
    return np.array(out), last


def test_the_table_is_made_from_the_current_specs():
    """specs/power_table.yaml was generated (tools/power_table.py) from this specs/power.yaml and
    the findings' current predicates and parameters; every cell of the grid is there."""
    from reward_lens.power import load_power, load_table, source_digest

    table = load_table()
    assert table is not None, "specs/power_table.yaml is missing: run tools/power_table.py"
    assert table["source"] == source_digest(), "specs/power_table.yaml is stale: rerun tools/power_table.py"
    p = load_power()
    for f, sc in p.findings.items():
        assert sc.stated in sc.ladder
        for g in p.groups:
            for m in p.completions:
                assert set(table["cells"][f][f"{g}x{m}"]) == {f"{c:g}" for c in sc.ladder}


def test_the_findings_page_quotes_the_table():
    import re

    import power_table

    page = (REPO / "docs" / "findings.md").read_text()
    m = re.search(r"<!-- power-table:start -->\n(.*?)\n<!-- power-table:end -->", page, re.S)
    assert m and m.group(1) == power_table.docs_block(), "python tools/power_table.py --docs"


def test_grid_cell_reads_at_or_below():
    from reward_lens.power import grid_cell, power_at

    assert grid_cell(12, 8) == (8, 8)
    assert grid_cell(1000, 9) == (512, 8)
    assert grid_cell(1, 8) is None  # one prompt group a step: the findings are disabled
    assert grid_cell(8, 3) == (8, 2)
    assert grid_cell(8, 1) is None  # one completion a group: no selection within groups, not judged
    assert power_at("entropy_collapse", 8, 8) is None  # not a sequential finding


def test_zero_change_gives_false_alarms_only():
    """With no change, the finding holds on no simulated run (the CUSUM's chance to cross h = 5
    within 30 steps is about 0.03 % per behaviour and direction), and the stated false-alarm rate
    is Brook & Evans's 0.94 % over 1,000 steps, under the 1 % the audit says."""
    from reward_lens.power import false_alarms, simulate

    d = simulate("proxy_gaming", 8, 8, 0.0, runs=40, horizon=30)
    assert d.found == 0.0
    assert d.median is None and d.upper is None
    fa = false_alarms("proxy_gaming", 1000)
    assert 0.009 < fa < 0.01


@pytest.mark.parametrize("finding,change,pays_against", [("proxy_gaming", 8, True), ("moving_against_reward", 8, False),
                                                         ("length_drift", 10, False)])
def test_stated_delay_matches_the_finding_run_directly(tmp_path, finding, change, pays_against):
    """The delay the table states at 8 prompt groups x 8 completions (a rate falling 8 points a step
    from 50 %, or a length growing 10 tokens a step from 200, each with its scenario's reward),
    against the same finding run through LiveFindings on rollout rows made here: the
    direct median is within a step of the stated one, and 75 % or more of the direct runs are found
    within the stated 90 % delay (40 runs: a true 90 % gives fewer than 30 within 1 % of the time)."""
    from reward_lens.power import load_table

    median, upper, found = load_table()["cells"][finding]["8x8"][f"{change:g}"]
    assert found == 1.0 and median is not None and upper is not None
    direct, _ = _direct_delays(tmp_path, finding, change, 8, 8, runs=40, before=8, horizon=upper + 6, seed=7,
                               pays_against=pays_against)
    assert np.isfinite(direct).all(), direct
    assert abs(np.median(direct) - median) <= 1, (direct, median)
    assert (direct <= upper).mean() >= 0.75, (direct, upper)


@pytest.mark.parametrize("finding,change,disp", [("proxy_gaming", 8, {"icc": 0.3}), ("length_drift", 5, {"cv": 0.25})])
def test_a_stated_delay_at_a_given_dispersion_matches_the_finding_run_directly(tmp_path, finding, change, disp):
    """``simulate`` at a dispersion other than the table's (prompts differing at an icc of 0.3; a
    length's SD a quarter of its mean) against the finding run through LiveFindings on rollout rows
    made here at that dispersion: the medians within a step, 75 % of direct runs within the
    simulated 90 % delay."""
    from reward_lens.power import simulate

    d = simulate(finding, 8, 8, change, runs=60, **disp)
    assert d.found == 1.0 and d.upper is not None
    shape = 1 / disp["cv"] ** 2 if "cv" in disp else 4.0
    direct, _ = _direct_delays(tmp_path, finding, change, 8, 8, runs=40, before=8, horizon=d.upper + 6, seed=11,
                               icc=disp.get("icc", 0.0), shape=shape)
    assert np.isfinite(direct).all(), direct
    assert abs(np.median(direct) - d.median) <= 1, (direct, d.median)
    assert (direct <= d.upper).mean() >= 0.75, (direct, d.upper)


def test_clear_carries_its_power(tmp_path):
    """A quiet run (no change) of 8 x 8: proxy gaming is clear, and its evidence says the smallest
    change the table finds within 10 steps at this batch, with the batch; the report's JSON values
    carry the same numbers."""
    from reward_lens.power import power_at

    _, last = _direct_delays(tmp_path, "proxy_gaming", 0, 8, 8, runs=1, before=6, horizon=1, seed=3)
    assert last.status == "clear"
    pw = power_at("proxy_gaming", 8, 8)
    assert last.values["power"]["smallest"] == pw.smallest
    assert last.values["power"]["groups"] == 8 and last.values["power"]["completions"] == 8
    assert "At this run's batch (8 prompt groups a step, 8 completions each)" in last.evidence
    if pw.smallest is not None:
        assert f"falling {pw.smallest:g} point" in last.evidence and "within 10 steps" in last.evidence
    # the run's own dispersion beside the table's: prompts alike (icc 0) simulated, so its target's
    # step SE is about the table's (within what 7 steps of 8 groups estimate)
    own = last.values["power"]["own"]
    assert [o["feature"] for o in own] == ["correct"] and last.values["power"]["icc"] == 0
    assert own[0]["se_ratio"] < 1.5 and own[0]["icc"] < 0.1
    assert "The simulation had prompts alike in difficulty; on this run `correct`'s step SE is" in last.evidence


def test_clear_states_a_runs_own_prompt_difficulty():
    """A run whose prompts differ (icc 0.3 simulated at 8 x 8) reads its own dispersion off its
    watch: the icc within sampling error, and its step SE about sqrt(1 + 7 x 0.3) = 1.76x prompts
    alike."""
    import numpy as np

    from reward_lens.measure.sequential import RunWatch, step_block
    from reward_lens.power import _basis, _stream, own_dispersion, scenario

    sc = scenario("proxy_gaming", icc=0.3)
    watch = RunWatch(_basis(sc))
    watch.observe_block(step_block(_stream(sc, 8, 8, 0.0, 60, 0, 60, np.random.default_rng(1))))
    own = own_dispersion("proxy_gaming", watch, 8)
    assert [o["feature"] for o in own] == ["correct"]
    assert own[0]["icc"] == pytest.approx(0.3, abs=0.06)
    assert own[0]["se_ratio"] == pytest.approx(np.sqrt(1 + 7 * 0.3), abs=0.15)


def _audit_text(tmp_path, capsys, body: str) -> tuple[dict, str]:
    from reward_lens.cli import main

    cfg = tmp_path / "config.yaml"
    cfg.write_text(body)
    capsys.readouterr()
    assert main(["audit", str(cfg), "--format", "json"]) in (0, 1)  # 1: a book will refuse
    out = json.loads(capsys.readouterr().out)
    assert main(["audit", str(cfg)]) in (0, 1)
    return out, capsys.readouterr().out


def test_the_audit_states_the_delay_at_the_configs_batch(tmp_path, capsys):
    """A TRL config with the tap (64 completions a device, 8 per prompt: 8 prompt groups), a target
    declared: each sequential finding states its delay from the table's 8 x 8 cell; TRL's defaults
    (8 completions, 8 per prompt: one prompt group) still say the sequential findings will not
    evaluate, and state no delay."""
    from reward_lens.power import load_power, load_table

    out, text = _audit_text(tmp_path, capsys, "num_generations: 8\nper_device_train_batch_size: 64\nmax_steps: 100\n"
                                      "reward_lens:\n  target: correctness\n")
    cells = load_table()["cells"]
    p = load_power()
    seen = {f["finding"]: f for f in out["findings"]}
    for finding, sc in p.findings.items():
        det = seen[finding]["detection"]
        assert seen[finding]["verdict"] == "will evaluate" and det is not None, finding
        median, upper, _ = cells[finding]["8x8"][f"{sc.stated:g}"]
        assert (det["median"], det["within_90"], det["read_at"]) == (median, upper, "8x8")
        assert det["prompt_groups"] == 8 and det["completions"] == 8
        assert f"`{finding}`" in det["says"] and "false alarms below 1 % over 1,000 steps" in det["says"]
    assert seen["entropy_collapse"]["detection"] is None
    gaming = seen["proxy_gaming"]["detection"]["says"]
    assert "a target falling 2 points a step (at a 50 % rate" in gaming
    assert "one step's SE 6.2 points at 8 prompt groups × 8 completions" in gaming  # 100 sqrt(.25 / 64)
    # the dispersion the statement assumed is stated with it
    assert "prompts alike in difficulty; prompts that differ make it larger and the catch later" in gaming
    assert "a completion's length SD 0.5 of its mean" in seen["length_drift"]["detection"]["says"]
    assert "How early the sequential findings catch" in text and "- `proxy_gaming`:" in text

    out, text = _audit_text(tmp_path, capsys, "num_generations: 8\nmax_steps: 100\nreward_lens:\n  target: correctness\n")
    seen = {f["finding"]: f for f in out["findings"]}
    for finding in p.findings:
        assert seen[finding]["verdict"] == "will not evaluate" and seen[finding]["detection"] is None
        assert any("2 prompt groups a step" in m for m in seen[finding]["missing"])
    assert "How early" not in text


def test_verl_counts_prompts_itself(tmp_path, capsys):
    """veRL's `data.train_batch_size` counts a step's prompts: 32 prompts x `rollout.n` 8 read at
    the table's 32 x 8."""
    out, _ = _audit_text(tmp_path, capsys, "algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  rollout:\n    n: 8\n"
                                   "data:\n  train_batch_size: 32\ntrainer:\n  rollout_data_dir: /tmp/r\n")
    det = {f["finding"]: f["detection"] for f in out["findings"]}["moving_against_reward"]
    assert det is not None and det["read_at"] == "32x8" and det["prompt_groups"] == 32


# ------------------------------------------------------------------------------------ power_vs_labelled
def _labelled(tmp_path, detected, onset_rule=True):
    """A hand-made format-only run: `correct` at 0.6 for 8 steps, then falling 4 points a step (the
    ground-truth onset: the first of three steps below 3/4 of the base, 0.45: step 11, at 0.44)."""
    series = [0.6] * 8 + [0.6 - 0.04 * j for j in range(1, 13)]
    onset = next(i for i in range(3, len(series) - 2) if all(x < 0.45 for x in series[i:i + 3]))
    run = {"batch": "8x8", "groups": 8, "completions": 8, "mode": "format_only", "seed": 1, "onset": onset,
           "detected_step": detected, "finding": "proxy_gaming", "series": {"correct": series}, "steps": len(series)}
    healthy = {**run, "mode": "healthy", "onset": None, "detected_step": None}
    path = tmp_path / "labelled.json"
    path.write_text(json.dumps([run, healthy]))
    return path, onset


def test_power_vs_labelled_reads_the_change_a_run_showed(tmp_path):
    from power_vs_labelled import compare, fitted_change, load, shown_change

    path, onset = _labelled(tmp_path, None)
    assert onset == 11
    for read in (shown_change, fitted_change):  # a flat base, then a line: both read it exactly
        ch = read(load(path)[0]["series"]["correct"], onset, "rate")
        assert ch["slope"] == pytest.approx(-4.0) and ch["base"] == pytest.approx(0.6) and ch["began"] == 8
    # an accelerating change (a fall of 1, 2, 4, 8 ... points from step 8): a line fits it from where
    # it turns steep, the slow first steps (1 to 7 points off) counted with the base
    series = [0.6] * 8 + [0.6 - 0.01 * (2 ** j - 1) for j in range(1, 7)] + [0.0] * 4
    onset = next(i for i in range(3, len(series) - 2) if all(x < 0.45 for x in series[i:i + 3]))
    fit = fitted_change(series, onset, "rate")
    assert onset == 11 and fit["began"] == 11 and fit["slope"] < 0
    assert fit["base"] == pytest.approx((8 * 0.6 + 0.59 + 0.57 + 0.53) / 11)  # the mean before it began

    from reward_lens.power import simulate

    d = simulate("proxy_gaming", 8, 8, 4.0, base=0.6, runs=60)
    path, _ = _labelled(tmp_path, 8 + d.median - 1)  # found at the simulated median: within the range
    rows = compare(load(path), n_sim=60)
    assert len(rows) == 1  # the healthy run has no delay to compare
    assert rows[0]["measured"] == d.median and rows[0]["verdict"] == "within"
    path, _ = _labelled(tmp_path, 8 + 40)  # found 41 changed steps in: later than any simulated run
    assert compare(load(path), n_sim=60)[0]["verdict"] == "later"


def test_power_vs_labelled_refuses_a_bad_file(tmp_path):
    path, _ = _labelled(tmp_path, 14)
    runs = json.loads(path.read_text())
    del runs[0]["series"]
    path.write_text(json.dumps(runs))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "power_vs_labelled.py"), str(path)], capture_output=True,
                       text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert "run 0 (format_only seed 1) lacks ['series']" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------ the dispersion
def test_step_se_follows_the_stated_dispersion():
    """By hand: at 8 completions a group an icc of 1/7 doubles a step level's variance
    (1 + (m - 1) icc = 2), so its SE grows by sqrt 2; a length's SD is cv x mean, so doubling cv
    doubles the SE."""
    import math

    from reward_lens.power import scenario, step_se

    alike = step_se("proxy_gaming", 8, 8)
    assert alike == pytest.approx(100 * math.sqrt(0.25 / 64))
    assert step_se("proxy_gaming", 8, 8, scenario("proxy_gaming", icc=1 / 7)) == pytest.approx(alike * math.sqrt(2))
    narrow = step_se("length_drift", 8, 8, scenario("length_drift", cv=0.25))
    assert narrow == pytest.approx(200 * 0.25 / 8)
    assert step_se("length_drift", 8, 8, scenario("length_drift", cv=0.5)) == pytest.approx(2 * narrow)


def test_a_simulated_stream_has_the_dispersion_it_was_given():
    """``dispersion`` (what power_vs_labelled reads off a record) recovers the icc and cv a
    simulated stream was made with, step by step."""
    import numpy as np

    from reward_lens.power import _stream, dispersion, scenario

    rng = np.random.default_rng(0)
    for finding, kw, key, want in (("proxy_gaming", {"icc": 0.1}, "icc", 0.1), ("proxy_gaming", {"icc": 0.0}, "icc", 0.0),
                                    ("length_drift", {"cv": 0.3}, "cv", 0.3)):
        sc = scenario(finding, **kw)
        steps = _stream(sc, 32, 8, 0.0, 40, 0, 40, rng)
        j = list(steps[0].names).index(sc.feature)
        got = np.mean([dispersion(s.z[:, j], s.groups)[key] for s in steps])
        assert got == pytest.approx(want, abs=0.02), (finding, kw, got)


def test_prompt_difficulty_makes_a_change_slower_to_find():
    """The same change, read against a larger step SE (prompts that differ: icc 3/7 at 8 completions
    doubles it), is found later; the defaults (icc 0) draw the table's numbers."""
    from reward_lens.power import simulate

    alike = simulate("proxy_gaming", 8, 8, 4, runs=30)
    spread = simulate("proxy_gaming", 8, 8, 4, runs=30, icc=3 / 7)
    assert spread.median > alike.median
    assert list(simulate("proxy_gaming", 8, 8, 4, runs=30, icc=0.0).delays) == list(alike.delays)


def test_scenario_refuses_a_dispersion_it_cannot_simulate():
    from reward_lens.power import scenario

    with pytest.raises(ValueError, match="icc"):
        scenario("proxy_gaming", icc=1.0)
    with pytest.raises(ValueError, match="cv"):
        scenario("length_drift", cv=0)
    with pytest.raises(ValueError, match="proxy_gaming"):
        scenario("proxy_gaming", kind="length")
    sc = scenario("paid_for_drift", kind="rate", base=0.08)
    assert (sc.kind, sc.reward, sc.base) == ("rate", "behaviour", 0.08)


def test_power_vs_labelled_reads_a_runs_own_record(tmp_path):
    """--records: a run's folder found by batch, mode and seed; its behaviours' dispersion per step
    is power.dispersion of that step's rollouts (checked here on the task record's first step, by
    hand: the one-way ANOVA icc and the SD over mean); a finding that does not hold names no
    behaviour; a run without a folder is refused by name."""
    import numpy as np

    from power_vs_labelled import BadInput, compare, from_record, load, record_of

    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.price import sample_codes, steps_from_run
    from reward_lens.record import open_run

    task = Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run" / "task"
    (tmp_path / "8x8").mkdir()
    (tmp_path / "8x8" / "format_only-1").symlink_to(task)
    path, onset = _labelled(tmp_path, None)
    run = load(path)[0]
    assert record_of(tmp_path, run) == tmp_path / "8x8" / "format_only-1"
    got = from_record(record_of(tmp_path, run), run)
    assert got["held"] is None  # never detected: no behaviour to name
    basis = load_basis(Path(__file__).resolve().parents[2] / "examples" / "features" / "task.yaml")
    first = steps_from_run(open_run(task), basis, heldout=False)[0]
    x = first.z[:, basis.names.index("correct")].astype(float)
    codes, g = sample_codes(first)
    m = len(x) // g
    gm = np.array([x[codes == i].mean() for i in range(g)])
    ms_b = m * gm.var(ddof=1)
    ms_w = np.mean([x[codes == i].var(ddof=1) for i in range(g)])
    d = got["dispersion"]["correct"][int(first.step)]
    assert d["icc"] == pytest.approx(max(0.0, (ms_b - ms_w) / (ms_b + (m - 1) * ms_w)))
    lengths = first.z[:, basis.names.index("length_tokens")].astype(float)
    assert got["dispersion"]["length_tokens"][int(first.step)]["cv"] == pytest.approx(lengths.std(ddof=1) / lengths.mean())
    with pytest.raises(BadInput, match="format_only seed 1 at 8x8"):
        compare(load(path), n_sim=5, records=tmp_path / "nowhere")
