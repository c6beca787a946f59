"""The `engine_mismatch` finding on hand-made series: its rule, onset, escalation to critical, its
words, and a record without D_t or without the engine's log-probabilities left not evaluated."""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.findings import FindingData, LiveFindings, evaluate_one, missing_inputs
from reward_lens.measure.mismatch import step_mismatch
from reward_lens_spec import load_findings

SPEC = load_findings()["engine_mismatch"]


def _mismatch(kl: list[float], spread: float = 0.01, groups: int = 8, seed: int = 0) -> dict:
    """Per step, rollouts whose gap has mean ``kl[s]`` (group means spread by ``spread``)."""
    rng = np.random.default_rng(seed)
    out = {}
    for s, k in enumerate(kl):
        codes = np.repeat(np.arange(groups), 4)
        gap = k + rng.normal(0.0, spread, size=len(codes))
        out[s] = step_mismatch(s, gap, codes, groups, np.full(len(codes), 10.0))
    return out


def _judge(kl: list[float], d_t: float = 0.2, **series):
    data = FindingData({"kl_to_previous": {s: d_t for s in range(len(kl))}, **series}, mismatch=_mismatch(kl))
    return evaluate_one(SPEC, data, [])


def test_clear_while_the_engine_matches_the_policy():
    f = _judge([0.0] * 10)
    assert f.status == "clear" and f.severity == "warn" and "stays under 10 %" in f.evidence


def test_holds_from_its_onset_at_warn_and_names_the_number_and_the_switches():
    f = _judge([0.0] * 4 + [0.06] * 6)  # 0.3 x D_t from step 4
    assert f.status == "holds" and f.severity == "warn" and f.onset == 4
    assert f.values["ratio"] == pytest.approx(0.3, abs=0.05)
    assert "From step 4" in f.evidence and "per token" in f.evidence
    assert "vllm_importance_sampling_correction" in f.remedy and "calculate_log_probs" in f.remedy


def test_one_step_over_the_line_is_not_a_finding():
    f = _judge([0.0] * 9 + [0.06])  # persist = 2: the last step alone
    # 20 series' SEs over the line, a t on its own degrees of freedom read as a normal score of 5.7:
    # the CUSUM at 4.7, under h = 5 (a score past h + k = 6 would carry the pooled rule alone)
    assert f.status == "clear" and f.values["cusum"] < 5.0, f.values


def test_critical_once_the_mismatch_is_the_size_of_the_updates():
    f = _judge([0.0] * 3 + [0.06] * 3 + [0.5] * 4)  # 2.5 x D_t from step 6
    assert f.status == "holds" and f.severity == "critical" and f.onset == 3
    assert f.values["critical_from"] == 6 and "as large as the updates" in f.evidence


def test_a_mismatch_that_differs_by_prompt_is_judged_on_the_steps_prompts():
    """A stale engine departs most on the prompts whose policy moved most: 8 prompt groups whose
    mismatch runs from 1 to 30 nats a sequence (mean 10, D_t = 1), each group's 8 completions
    0.5 either side of its own. Given the step's prompts the SE is the completions' (sqrt(8 x 0.25
    x 8/7 / 8) / 8 = 0.067), and from its first step the mismatch is past D_t itself by a hundred and more of
    them: critical at the second step (persist = 2), from the onset. The group means' spread across
    prompts (the SE before stop 67) bounds the score by 1 / (the relative SE), whatever the size:
    worked here, its t against D_t at each step is (10 - 1) / (sd / sqrt 8) = 2.27 (a normal score
    of 1.9 on 7 degrees of freedom), under 3, and two steps add 1.8 to the CUSUM, under 5."""
    from scipy import stats

    level = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 25.0, 30.0])
    codes = np.repeat(np.arange(8), 8)
    within = np.tile(np.array([-0.5, 0.5]), 32)  # the same completions' spread in every group
    mm = {s: step_mismatch(s, (level[codes] if s >= 3 else 0.0) + within, codes, 8) for s in range(5)}
    assert mm[3].kl_seq == pytest.approx(10.0) and mm[3].kl_seq_se == pytest.approx(np.sqrt(8 * 0.5 ** 2 * 8 / 7 / 8) / 8)
    across = level.std(ddof=1) / np.sqrt(8)
    t_across = (10.0 - 1.0) / across
    assert t_across == pytest.approx(2.27, abs=0.01) and stats.norm.isf(stats.t.sf(t_across, 7)) < 1.95
    data = FindingData({"kl_to_previous": {s: 1.0 for s in range(5)}}, mismatch=mm)
    f = evaluate_one(SPEC, data, [])
    assert f.status == "holds" and f.severity == "critical" and f.onset == 3 and f.values["critical_from"] == 3, f.values


def test_noise_the_size_of_the_threshold_is_not_resolved():
    # mean 0.03 (0.15 x D_t) but group means spread by 0.2: not beyond 3 SE of a tenth of D_t
    data = FindingData({"kl_to_previous": {s: 0.2 for s in range(10)}},
                       mismatch=_mismatch([0.03] * 10, spread=0.4))
    assert evaluate_one(SPEC, data, []).status == "clear"


def test_not_evaluated_without_d_t_or_the_engine_log_probabilities():
    f = evaluate_one(SPEC, FindingData({}, mismatch=_mismatch([0.1] * 5)), [])
    assert f.status == "not_evaluated" and "no step has D_t" in f.evidence
    # a framework's logged mismatch metrics are the other alternatives (tests/unit/test_engine_mismatch_logged.py)
    from reward_lens.measure.mismatch import LOGGED_FIELDS

    lacks = missing_inputs(SPEC, lambda name: name != "rollout.logp_sampler" and name not in LOGGED_FIELDS, None)
    assert lacks == ["rollout.logp_sampler"]


def test_live_reads_the_rollouts_as_check_does():
    """LiveFindings takes the tap's rows (Rollout objects) and D_t as it arrives, one step late."""
    from reward_lens.record.schema import Rollout

    live = LiveFindings()
    rng = np.random.default_rng(1)
    outs = []
    for s in range(6):
        gap = 0.08 if s >= 2 else 0.0
        rows = [Rollout(step=s, group_id=f"{s}:{g}", prompt="ab", completion="x" * 5, num_tokens=5, reward=float(i % 2),
                        logp_pre=-3.0, logp_sampler=-3.0 + gap + float(rng.normal(0, 0.005)))
                for g in range(4) for i in range(4)]
        tel = {s - 1: {"kl_to_previous": 0.2}} if s else None
        outs.append(next(f for f in live.observe(s, rows, None, tel) if f.id == "engine_mismatch"))
    # D_t of a step arrives with the next one: steps 0 and 1 are judged at the third look, clear
    assert [o.status for o in outs[:3]] == ["not_evaluated", "not_evaluated", "clear"]
    assert outs[-1].status == "holds" and outs[-1].onset == 2 and outs[-1].severity == "warn"


def _engine_record(path, gap_from: int = 3, gap: float = 0.08, steps: int = 8, d_t: float = 0.2):
    """A hand-made record whose engine departs from the policy by ``gap`` nats a sequence from
    step ``gap_from`` (its log-probabilities beside the trainer's), with D_t at every step."""
    from reward_lens.record import OptimizerTelemetry, Rollout, write_run

    rng = np.random.default_rng(3)
    tel = [OptimizerTelemetry(step=s, learning_rate=1e-3, kl_to_previous=d_t if s < steps - 1 else None,
                              kl_to_previous_estimator="test" if s < steps - 1 else None) for s in range(steps)]
    rol = []
    for s in range(steps):
        for g in range(4):
            for i in range(4):
                lp = -20.0 + float(rng.normal(0, 1))
                rol.append(Rollout(step=s, group_id=f"{s}:{g}", prompt=f"p{g}", completion="abc" * (i + 1),
                                   num_tokens=3 * (i + 1), reward=float(i % 2), logp_pre=lp,
                                   logp_sampler=lp + (gap if s >= gap_from else 0.0) + float(rng.normal(0, 0.005))))
    write_run(path, framework={"name": "test", "version": "0"}, model={"description": "hand-made"},
              telemetry=tel, rollouts=rol, optimizer="sgd")
    return path


def test_check_the_curves_and_the_first_screen_read_one_series(tmp_path):
    from reward_lens import cli
    from reward_lens.measure.mismatch import run_mismatch
    from reward_lens.record import open_run
    from reward_lens.report.curves import training_curves

    rec = _engine_record(tmp_path / "rec")
    run = open_run(rec)
    series = run_mismatch(run)
    assert sorted(series) == list(range(8)) and series[5].ratio == pytest.approx(0.4, abs=0.02)
    # `check` names it, at warn, from the step the engine departed
    assert cli.main(["check", str(rec), "--quiet", "--format", "json", "--fail-on", "warn"]) == 1
    from reward_lens.findings import evaluate

    f = next(x for x in evaluate(run) if x.id == "engine_mismatch")
    assert f.status == "holds" and f.onset == 3 and f.severity == "warn"
    # the D_t panel draws the same series beside D_t
    panel = next(p for fig in training_curves(run, []) for p in fig.panels if "engine mismatch" in (p.title or ""))
    line = next(s for s in panel.series if s.label == "engine mismatch")
    assert line.y == [series[s].kl_seq for s in range(8)]


def test_the_first_screen_says_it(tmp_path):
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    report = build_report(open_run(_engine_record(tmp_path / "rec", gap=0.5)))
    f = next(x for x in report.findings if x.id == "engine_mismatch")
    assert f.status == "holds" and f.severity == "critical"
    assert "Engine-trainer mismatch (critical, from step 3)" in report.card[0], report.card[0]


def test_the_findings_page_quotes_the_benchmark_as_its_script_prints_it():
    import re
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "tools"))
    import mismatch_runs

    sys.path.pop(0)
    import json

    page = (repo / "docs" / "findings.md").read_text()
    block = re.search(r"<!-- mismatch-table:start -->\n(.*?)\n<!-- mismatch-table:end -->", page, re.S).group(1)
    assert block == mismatch_runs.quote(json.loads(mismatch_runs.RESULTS.read_text())), \
        "python tools/mismatch_runs.py --quote"


# ------------------------------------------------------------------ the pooled rule (issue 59)
def _exact_groups(kl: list[float], offsets=(-0.3, -0.1, 0.1, 0.3)) -> dict:
    """Per step, one rollout per prompt group whose gap is ``kl[s]`` plus a fixed offset: group
    means known exactly, so the step's SE is too."""
    codes = np.arange(len(offsets))
    return {s: step_mismatch(s, k + np.array(offsets), codes, len(offsets)) for s, k in enumerate(kl)}


def test_a_persistent_mismatch_no_step_resolves_is_found_by_the_pooled_rule():
    """Worked by hand: 4 group means 0.4 -/+ 0.1, 0.3 against D_t = 1: the excess over a tenth of
    D_t is 0.3, its SE sd(-0.3, -0.1, 0.1, 0.3)/2 = 0.1291 (the step's own, and the series' too:
    pooling equal variances keeps them), t = 2.324 on 3 degrees of freedom, a one-sided tail of
    5.1 %: a normal score of 1.63, under 3 at every step (the old rule, 0.4 less 3 SE, is 0.013:
    under 0.1 too). Pooled, each step adds 1.63 - 1 to the CUSUM: 5 is passed at the 8th step
    (index 7), and the onset is the first step of the excursion, the mismatch's own."""
    from scipy import stats

    se = np.std([-0.3, -0.1, 0.1, 0.3], ddof=1) / 2
    t = (0.4 - 0.1 * 1.0) / se
    u = stats.norm.isf(stats.t.sf(t, 3))
    assert t == pytest.approx(2.324, abs=1e-3) and u == pytest.approx(1.63, abs=0.01)
    first = next(n for n in range(1, 40) if n * (u - 1.0) >= 5.0)  # steps over the line before it holds
    assert first == 8
    kl = [0.0] * 5 + [0.4] * 12  # from step 5
    for end in (2, 6, 9, 5 + first - 1, 5 + first, len(kl)):
        data = FindingData({"kl_to_previous": {s: 1.0 for s in range(end)}}, mismatch=_exact_groups(kl[:end]))
        f = evaluate_one(SPEC, data, [])
        assert f.values["kl_seq_se"] == pytest.approx(se)
        if end < 5 + first:
            assert f.status == "clear", (end, f.values)
        else:
            assert f.status == "holds" and f.onset == 5 and f.severity == "warn", (end, f.values)
            assert f.values["rule"] == "pooled" and f.values["cusum"] == pytest.approx((end - 5) * (u - 1.0), rel=1e-6)
            assert "pooled over the steps since 5" in f.evidence and "CUSUM" in f.evidence
    # the same stream with the mismatch gone again: the sum falls by k a step, and the finding clears
    kl2 = kl + [0.0] * 12
    data = FindingData({"kl_to_previous": {s: 1.0 for s in range(len(kl2))}}, mismatch=_exact_groups(kl2))
    assert evaluate_one(SPEC, data, []).status == "clear"


def test_a_clean_stream_stays_quiet_at_every_prefix():
    """No mismatch (engine noise only, 8 groups), D_t 0.2 nats: the finding is clear at every prefix
    of 120 steps, and its CUSUM never leaves zero (each step's score is far below zero)."""
    kl = [0.0] * 120
    mm = _mismatch(kl, spread=0.02, groups=8, seed=5)
    live = []
    for end in range(2, len(kl) + 1, 7):
        data = FindingData({"kl_to_previous": {s: 0.2 for s in range(end)}}, mismatch={s: mm[s] for s in range(end)})
        f = evaluate_one(SPEC, data, [])
        live.append((f.status, f.values["cusum"]))
    assert all(s == "clear" and c == 0.0 for s, c in live), live


def _boundary_runs(groups: int, runs: int, steps: int, transform: bool, seed: int = 0, moderate: bool = True,
                   pooled_dof: bool = False, level: float = 2.0, jump: int | None = None, per: int = 4,
                   hetero: float = 0.0) -> float:
    """Share of simulated runs on which the rule alarms at some step, checked at every step, the
    true mismatch of every step's prompts exactly a tenth of D_t (the worst case of the null),
    ``level`` SDs of a group mean above 0: per step, ``groups`` prompt groups of ``per``
    completions, each completion's gap the line plus normal noise (the prompts' own departures
    from the line cancel in the step's truth and in its estimate's error, so they are left out),
    each group's SD ``per ** 0.5`` times a lognormal factor of spread ``hetero``. The step's SE is
    the stratified one given its prompts (``measure.mismatch.group_kl``: sum of s_g^2 / n_g over
    G^2, Welch-Satterthwaite's degrees of freedom), and the series' (``moderate``: a step whose own
    95 % interval lies above 0 has its relative variance N (SE / kl)^2 half its own and half the
    mean over the resolved steps within 3 of it, within the prefix the check sees, and SE = kl
    sqrt(v / N); a step not resolved, and every step without ``moderate``, its own), scored
    through Student's t on the step's own degrees of freedom (``transform``; ``pooled_dof``: on the
    pooled SE's Welch-Satterthwaite ones) or read as a normal score as it stands. ``jump``: before
    that step the engine matches the policy (the mismatch 0, its noise a hundredth), the mismatch
    jumping to the line there. Written out here, not read from the package."""
    from scipy import special

    rng = np.random.default_rng(seed)
    n_all = groups * per
    kl, var, f = np.zeros((steps, runs)), np.zeros((steps, runs)), np.zeros((steps, runs))  # estimate, SE^2, dof
    c_final = np.zeros(runs)  # the CUSUM over the steps whose window the prefix already holds whole
    alarmed = np.zeros(runs, dtype=bool)

    def score(j: int, k: int) -> np.ndarray:  # step j's normal score as the check at the end of step k reads it
        v, dof = var[j], f[j]
        if moderate:
            res = {i: kl[i] > special.stdtrit(f[i], 0.975) * np.sqrt(var[i]) for i in range(max(0, j - 3), min(k, j + 3) + 1)}
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = {i: n_all * var[i] / kl[i] ** 2 for i in res}
                m = sum(r.astype(float) for r in res.values())  # resolved steps in the window, j among them where it is
                coef = {i: np.where(res[i], 0.5 / m + (0.5 if i == j else 0.0), 0.0) for i in res}
                pooled = sum(np.where(res[i], coef[i] * rel[i], 0.0) for i in res)
                wsd = pooled ** 2 / sum(np.where(res[i], (coef[i] * rel[i]) ** 2 / f[i], 0.0) for i in res)
            v = np.where(res[j], kl[j] ** 2 * pooled / n_all, v)
            if pooled_dof:
                dof = np.where(res[j], wsd, dof)
        t = (kl[j] - level) / np.sqrt(v)
        # the normal score of t's upper tail: ndtri(1 - tail) = -ndtri(tail), tail = stdtr(df, -t)
        return np.clip(-special.ndtri(special.stdtr(dof, -t)), -8.0, 8.0) if transform else np.clip(t, -8.0, 8.0)

    sd = np.sqrt(per) * np.exp(hetero * rng.normal(size=(runs, groups, 1)))  # each group's completion SD
    for k in range(steps):
        x = rng.normal(size=(runs, groups, per)) * sd
        x = 0.01 * x if jump is not None and k < jump else level + x
        w = x.var(2, ddof=1) / per  # each group mean's variance
        kl[k], var[k] = x.mean((1, 2)), w.sum(1) / groups ** 2
        f[k] = w.sum(1) ** 2 / ((w ** 2).sum(1) / (per - 1))
        if k >= 3:  # step k - 3's window is whole from here on
            c_final = np.maximum(0.0, c_final + score(k - 3, k) - 1.0)
        c = c_final
        last = {}
        for j in range(max(0, k - 2), k + 1):
            last[j] = score(j, k)
            c = np.maximum(0.0, c + last[j] - 1.0)
        over = (last[k] >= 3.0) & (last[k - 1] >= 3.0) if k >= 1 else np.zeros(runs, dtype=bool)
        alarmed |= over | (c >= 5.0)
    return float(alarmed.mean())


@pytest.mark.parametrize("groups", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_the_false_alarm_rate_over_a_run_is_what_the_docs_state(groups):
    """At the boundary of the null, over 1,000 steps checked at every step, the two rules together
    alarm on under 1.2 % of runs (docs/findings.md; the CUSUM's 0.94 % by Brook & Evans, the pair
    rule's 0.2 % by a union bound), each step's SE the series' (the stratified SE given the prompts,
    moderated across its neighbours) and its t read on the step's own degrees of freedom: 1,000
    simulated runs of 4 completions a group, each group's spread its own (a lognormal factor of
    spread 0.5), a binomial SE of 0.34 %, so the bound is 1.2 % + 3 SE. Without the t-to-normal
    scores, on each step's own SE (the first version of the finding), the same rules alarm on
    several times the bound: the transform is what holds the rate. (Before issue 59's SE given
    the prompts, the t stood on the groups less one, 3 at 4 groups, and read on the pooled degrees
    of freedom the rules alarmed over the bound; on the stratified SE's Welch-Satterthwaite ones,
    up to 12 here, they alarmed on 0.83 % of 600 runs at the line one SD above 0, measured once:
    the finding still reads the step's own.)"""
    from reward_lens.measure.sequential import false_alarm_probability

    assert false_alarm_probability(5.0, 1000) + 999 * 0.00135 ** 2 < 0.012
    assert _boundary_runs(groups, 1000, 1000, transform=True, hetero=0.5) < 0.012 + 3 * 0.0034
    if groups == 4:
        # the line half an SD of a group mean above 0: whether a step is resolved (and pools) is
        # itself chance there, and the rate still holds
        assert _boundary_runs(groups, 1000, 1000, transform=True, level=0.5, hetero=0.5) < 0.012 + 3 * 0.0034
        assert _boundary_runs(groups, 300, 1000, transform=False, moderate=False) > 0.05


def test_a_jump_to_the_line_raises_no_false_alarm_beyond_the_bound():
    """A matched engine for 20 steps, then a mismatch exactly at the line for 200 more, at 4 groups:
    the three steps after the jump borrow the matched steps' small variance (their SE as low as 0.79
    of their own: ``measure.mismatch``'s docstring), and the rules must still alarm on no more runs
    than the bound over a run (1.2 %; 2,000 runs, a binomial SE of 0.24 %). The same runs without
    the jump, for the difference it makes."""
    with_jump = _boundary_runs(4, 2000, 220, transform=True, seed=3, jump=20)
    assert with_jump < 0.012 + 3 * 0.0024, with_jump


def test_the_science_page_quotes_the_coverage_line_as_its_script_prints_it():
    import json
    import re
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "tools"))
    import mismatch_runs

    sys.path.pop(0)
    page = (repo / "docs" / "science.md").read_text()
    block = re.search(r"<!-- mismatch-coverage:start -->\n(.*?)\n<!-- mismatch-coverage:end -->", page, re.S).group(1)
    assert block == mismatch_runs.coverage_line(json.loads(mismatch_runs.COVERAGE.read_text())), \
        "python tools/mismatch_runs.py --quote"


def test_d_ts_se_is_moderated_as_the_cost_book_states_it(monkeypatch):
    """Critical compares the mismatch with D_t itself, so D_t's SE weighs in the score; it is read as
    the cost book reads it, each step's own moderated across its measured neighbours. Worked by hand
    (ledger.moderated: relative variances per group u = G (SE / D)^2 pooled half own, half the
    window's mean): three steps of D_t 1, 2, 4 with own SEs 0.01, 0.4, 0.8 on 4 groups, u = 0.0004,
    0.16, 0.16, their mean 0.10680; step 0: v = 0.0002 + 0.0534 = 0.0536, SE = sqrt(0.0536 / 4) =
    0.11576, eleven times its own. A step without an SE (5) takes no part; without ``tap_groups`` at
    every step the relative variances are read as they stand (equal counts: the same SEs here)."""
    from reward_lens.measure.ledger.moderated import moderated_by_step

    d_t, se = {0: 1.0, 1: 2.0, 2: 4.0, 5: 3.0}, {0: 0.01, 1: 0.4, 2: 0.8}
    got = moderated_by_step(d_t, se, {0: 4, 1: 4, 2: 4, 5: 4})
    assert sorted(got) == [0, 1, 2] and got[0] == pytest.approx(0.11576, abs=1e-5)
    assert moderated_by_step(d_t, se, {}) == pytest.approx(got)
    # the finding reads it: a mismatch 1.3 x D_t at steps 3 and 4, D_t's own SE 0.001 there (a
    # sample that missed the tail) beside neighbours whose relative SE is 0.4: critical on the own
    # SE, warn on the moderated one
    kl = [0.0] * 3 + [1.3] * 2
    own = {0: 0.4, 1: 0.4, 2: 0.4, 3: 0.001, 4: 0.001}
    data = FindingData({"kl_to_previous": {s: 1.0 for s in range(5)}, "kl_to_previous_se": own},
                       mismatch=_mismatch(kl, spread=0.01))
    f = evaluate_one(SPEC, data, [])
    assert f.status == "holds" and f.severity == "warn", f.values
    import reward_lens.findings as findings

    monkeypatch.setattr(findings, "moderated_by_step", lambda d_t, d_se, groups: dict(d_se))
    assert evaluate_one(SPEC, data, []).severity == "critical"
