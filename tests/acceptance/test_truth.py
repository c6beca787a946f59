"""Truth first (tools/truth.py): on three tapped TRL runs with every policy kept -- a moderate one,
one whose correctness collapses and one of a sharp policy that trains without breaking -- every
estimate the record gives is checked against a truth measured another way, from fresh samples of
both policies of every step pair. The docs quote this harness's output (docs/science.md, kept
equal below).

Each regime is one training run, and a run is one trajectory of the CPU kernels it ran on: the
same code and seeds train another run on other kernels (``truth.machine``). A floor below is set
under what the runs measured on both kernels the harness has run on (AVX2 and AVX512), so that
it fails on a regression rather than on the kernels; where it sits below issue 41's target, the
docstring says so and the target is the strict xfail or the docs' line, not hidden."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# Oracle samples per prompt and policy: the test's budget (the docs quote the same runs). The
# moderate regime's policy is slower to sample (its completions run to 32 tokens).
N = {"moderate": 64, "collapse": 128, "sharpened": 128}


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(REPO / "tools"))
    import truth

    return truth


@pytest.fixture(scope="module")
def moderate(harness, tmp_path_factory):
    return harness.run_regime("moderate", tmp_path_factory.mktemp("moderate"), n=N["moderate"], replicates=20, budget=None)


@pytest.fixture(scope="module")
def collapse(harness, tmp_path_factory):
    return harness.run_regime("collapse", tmp_path_factory.mktemp("collapse"), n=N["collapse"], replicates=20, budget=None)


@pytest.fixture(scope="module")
def sharpened(harness, tmp_path_factory):
    return harness.run_regime("sharpened", tmp_path_factory.mktemp("sharpened"), n=N["sharpened"], replicates=20,
                              budget=None)


def test_moderate_eta_intervals_cover_the_truth_and_the_headline_is_not_selected(moderate):
    """The record's per-pair intervals cover the truth on nine in ten priced pairs. Its resolved
    rows read within a tenth of the truth at the median: issue 41 asks for a twentieth, which the
    record meets on one kernel (+0.049, AVX512) and misses on another (+0.086, AVX2), and which
    the redrawn runs miss in every regime (+0.057 moderate: the rows are selected on their own
    noise; the strict xfail below)."""
    covered, priced = moderate.eta_coverage()
    assert priced >= 30 and covered >= 0.9 * priced
    bias = moderate.resolved_bias()
    assert bias is not None and -0.1 <= bias <= 0.1


def test_moderate_run_level_eta_interval_covers_the_truth(moderate):
    e, (lo, hi), truth = moderate.eta_run
    assert lo <= truth <= hi  # the run-level eta (sum KL_min / sum D_t) covers the oracle's


def test_eta_intervals_cover_the_truth_over_redraws_of_the_taps_sampling(moderate, collapse, sharpened):
    """The 95 % intervals of eta over 100 redraws of the tap's 4 + 4 completions per prompt, each
    row's SE pooled with its neighbouring updates' as the book pools it (``eta.moderate``) and
    widened by its bias bound: at or above their rate on the moderate and sharpened runs (the
    sharpened run's jackknife SE was already wider than the spread), and nine in ten on the
    collapsing run (93.9 % on AVX2; 92.7 % without the bias bound, 91.4 % without the lower end's
    allowance for D_t's tail as well; the jackknife's own SE covered 87.7 %: with t on G - 1 it was
    68 %). Neither pooling nor the bound ever covers less often than the row's own SE."""
    for res, floor in ((moderate, 0.93), (collapse, 0.9), (sharpened, 0.93)):
        cal, own = res.calibration["eta"], res.calibration["eta_own"]
        assert cal["draws"] == own["draws"] >= 2500 and cal["covered"] >= floor * cal["draws"]
        assert cal["covered"] >= own["covered"] and cal["covered"] >= cal["unbounded"]


def test_the_run_level_eta_of_redrawn_runs(moderate, collapse, sharpened):
    """The run-level eta (a ratio of sums over every priced pair) of each redrawn run against the
    truth over the same pairs: centred within a twentieth, its real spread at most a quarter
    above its SE, and its 95 % interval covering on at least four runs in five in every regime
    (the moderate run's 85 % on AVX512, 82 % on AVX2: the sums add the pairs' small residual lean
    while their noise adds in quadrature, so the interval is narrow against it; on the sharpened
    run the SE is wider than the spread and it covers every run, 98 before the run's interval
    covered its sums' correction; on the collapsing run, with the lower end allowing for D_t's
    tail, every redrawn run)."""
    for res in (moderate, collapse, sharpened):
        er = res.calibration["eta_run"]
        assert er["runs"] == 100 and er["covered"] >= 80
        assert abs(er["median_error"]) <= 0.05
    # both ways: the real spread against the SE, within [0.8, 1.25] where the harness measured it so
    # (1.12 moderate, 0.97 collapsing, AVX512); an interval too wide is as wrong as one too narrow
    for res in (moderate, collapse):
        er = res.calibration["eta_run"]
        assert 0.8 <= er["sd_over_se"] <= 1.25, (res.regime, er["sd_over_se"])
    # the sharpened run's SE is wider than its spread (0.61 AVX512, 0.71 at the default budget on
    # AVX2): a known miss (the strict xfail below), bounded here so that a wider one fails
    er = sharpened.calibration["eta_run"]
    assert 0.5 <= er["sd_over_se"] <= 1.25, er["sd_over_se"]


def test_the_row_level_eta_se_is_its_real_spread_for_the_prompts(moderate, collapse):
    """eta's SE as the book states it (moderated, the bias bound's widening aside) against the real
    spread of eta over 100 redraws of the tap's sampling for the same prompts: the median ratio
    over updates within [0.8, 1.25] (measured 0.99 moderate, 1.04 collapsing; the jackknife's own SE
    1.01, 1.15). Coverage alone cannot tell an interval too wide from a right one."""
    import numpy as np

    for res in (moderate, collapse):
        for key in ("eta", "eta_own"):
            ratio = float(np.median(res.calibration[key]["ratio"]))
            assert 0.8 <= ratio <= 1.25, (res.regime, key, ratio)


def test_the_sharpened_runs_eta_se_is_too_wide_by_no_more_than_measured(sharpened):
    """The sharpened run's eta SE is wider than the spread (median real SD / SE 0.67 moderated,
    0.69 the jackknife's own, AVX512; its intervals cover 99.3 %): the strict xfail below states
    the target; this, the measured miss as a bound that a wider SE (or a narrower one) fails."""
    import numpy as np

    for key in ("eta", "eta_own"):
        ratio = float(np.median(sharpened.calibration[key]["ratio"]))
        assert 0.55 <= ratio <= 1.25, (key, ratio)


@pytest.mark.xfail(strict=True, reason="a known miss: on the sharpened run eta's SE is wider than its real spread "
                   "(median SD / SE 0.67, run-level 0.61, AVX512); the intervals over-cover (99.3 %)")
def test_the_sharpened_runs_eta_se_is_its_real_spread(sharpened):
    import numpy as np

    assert 0.8 <= float(np.median(sharpened.calibration["eta"]["ratio"])) <= 1.25
    assert 0.8 <= sharpened.calibration["eta_run"]["sd_over_se"] <= 1.25


def test_eta_over_every_row_of_redrawn_runs_is_centred(moderate, collapse, sharpened):
    """eta over the redrawn runs' rows that state an interval, every one of them (not selected on
    significance): the median error within 0.06 in every regime. (The resolved rows' lean, the
    winner's curse of a test that reads eta's own sample, is the strict xfail below.)"""
    for res in (moderate, collapse, sharpened):
        sel = res.calibration["eta_selection"]
        assert sel["n"] >= 2500 and sel["n_resolved"] >= 500
        assert abs(sel["every"]) <= 0.06


def test_one_records_median_over_its_resolved_rows_is_too_noisy_to_decide_a_twentieth(moderate, collapse,
                                                                                    sharpened):
    """The acceptance's |median (eta - truth)| <= 0.05 over resolved rows, taken on one record, is
    one draw of a figure whose spread from one redrawn run to the next is close to the bound
    itself or above it in every regime (each run's median over the rows it resolves, ``per_run``): the record's
    figure cannot tell an estimator within the bound from one outside it; the median over the
    redrawn runs' rows (the strict xfail below) can. docs/science.md says so."""
    import numpy as np

    for res in (moderate, collapse, sharpened):
        runs = np.asarray(res.calibration["eta_selection"]["per_run"])
        assert len(runs) >= 90
        assert runs.std(ddof=1) >= 0.025


@pytest.mark.xfail(strict=True, reason="a known miss (issue 41): the resolved rows are selected on their own noise "
                   "(the winner's curse): over the redrawn runs they read +0.06 (moderate) and +0.10 to +0.13 "
                   "(collapsing: AVX2, AVX512) above the truth, where every row with an interval reads +0.02 and "
                   "+0.05 to +0.06")
def test_the_resolved_rows_read_within_a_twentieth_of_the_truth_over_redrawn_runs(moderate, collapse, sharpened):
    for res in (moderate, collapse, sharpened):
        assert abs(res.calibration["eta_selection"]["resolved"]) <= 0.05


def test_the_resolved_rows_lean_no_more_than_measured(moderate, collapse, sharpened):
    """The strict xfail above hides any lean at all: the measured one as a bound that a larger bias
    fails (+0.058 moderate, +0.126 collapsing, +0.014 sharpened on AVX512; the collapsing run's
    +0.10 on AVX2)."""
    for res, bound in ((moderate, 0.09), (collapse, 0.16), (sharpened, 0.06)):
        lean = res.calibration["eta_selection"]["resolved"]
        assert abs(lean) <= bound, (res.regime, lean)


def test_collapse_run_level_eta_interval_covers_the_truth(collapse):
    """The record's first updates, of several nats each, drew high (the redrawn runs' run-level
    eta reads a few hundredths above the truth at the median, the record's +0.14 on AVX2 and
    +0.15 on AVX512), and its symmetric interval missed. Its lower end allows for D_t's tail on
    the updates of the sharpened policy (``eta.tail_low``: the run's allowance is its updates'
    sum), which covered the truth on AVX2 and not on AVX512 (0.358 [0.210, 0.459] against 0.206);
    and its interval covers a bias up to its sums' jackknife correction, as each row's does
    (``eta.window``: 0.114 of a plug-in 0.472 on AVX512), which covers it on both. The estimate
    and its SE are unchanged (issue 41's last line)."""
    e, (lo, hi), truth = collapse.eta_run
    assert lo <= truth <= hi
    assert e - lo > hi - e  # it is the lower end that moved


def test_collapse_eta_intervals_cover_the_truth(collapse):
    """The collapsing run's per-pair intervals cover the truth on nine priced pairs in ten once each
    row's interval covers a bias up to its own correction (``EtaEstimate.bias_bound``): 53 of 56 on
    AVX2, 50 without the bound (the strict xfail this test was until then). The bound never covers
    fewer."""
    covered, priced = collapse.eta_coverage()
    assert priced >= 30 and covered >= 0.9 * priced
    assert covered >= collapse.eta_coverage(bound=False)[0]


def test_the_oracles_own_error_in_eta_is_measured_and_counted_where_the_samples_are_independent(collapse):
    """The record's samples are independent of the oracle's, so its per-pair intervals are
    checked against the oracle's eta with the oracle's own error added (its bootstrap SD, as D_t
    and dz add their SEs): never fewer covered than against its eta alone, and the error is
    measured on every priced pair."""
    priced = [collapse.truths[r[0]] for r in collapse.eta_rows if r[3] is not None]
    assert priced and all(t.eta_sd == t.eta_sd and t.eta_sd >= 0 for t in priced)
    assert collapse.eta_coverage()[0] >= collapse.eta_coverage(oracle_error=False)[0]


def test_collapse_every_dz_a_book_reports_is_within_three_se_of_the_truth(collapse):
    """Nearly every dz the books report lies within 3 combined SEs of the truth: 98.4 % of 187 on
    AVX2, 94.8 % of 191 on AVX512 (ten cells outside, where a calibrated SE leaves about one)."""
    reported = collapse.reported()
    within = sum(c.within for c in reported)
    assert len(reported) >= 0.5 * len(collapse.cells) and within >= 0.94 * len(reported)
    # every other cell is refused by name: a failed premise, a pair with no ledger, or a feature
    # constant in every prompt group (its movement invisible to the sample)
    from reward_lens.measure.decisions import REASONS

    assert set(collapse.refused()) <= set(REASONS) | {"constant in every group", "not formed"}


def test_two_sided_samples_remove_the_bias_of_a_sharpening_step(collapse, moderate):
    """The replicates: the one-sided ledger (8 rollouts of pi_{t+1} per prompt) is biased in
    many cells of the collapsing run; with 4 held-out completions of pi_t, almost none."""
    one, two = collapse.replicates[0], collapse.replicates[4]
    assert one["biased"] >= 0.1 * one["cells"]
    # against the oracle's own number (the draws are subsets of its samples), 20 draws detect the
    # small bias a self-normalised estimate has at 4 + 4 rows in about one cell in twenty: a
    # fifth of a standard deviation at the median, a quarter of the one-sided ledger's
    assert one["biased"] >= 3 * two["biased"] * one["cells"] / two["cells"]
    assert one["median_bias_over_sd"] >= 3 * two["median_bias_over_sd"]
    for res in (collapse, moderate):
        assert res.replicates[4]["biased"] <= 0.1 * res.replicates[4]["cells"]
        assert res.replicates[4]["median_bias_over_sd"] <= 0.3
    # intervals that say how far an estimate can be off: the collapsing run's cover 92.2 % (AVX2)
    # and 92.9 % (AVX512) of 20 draws a cell, the moderate run's 95 %
    for res in (collapse, moderate):
        assert res.replicates[4]["coverage"] >= 0.91


def test_the_docs_quote_this_harness(moderate, collapse, sharpened, harness):
    """docs/science.md quotes the output of ``tools/truth.py --quote``, between markers: its first
    line names the torch build and CPU kernels of the run, and on the same ones the rest is
    these runs' summary lines exactly. On other kernels the training samples other tokens and
    the runs differ (``truth.machine``): the quote must then still be this harness's output, the
    same lines in the same order, each read up to its first number -- the rest of a line follows
    the data (a clause for rows with no interval where there are some, "covers" or "MISSES", a
    median or "(none)") -- and the acceptance above is asserted on the runs made here. The runs
    measure every step pair whole (``budget=None``): a budget sizes the measurement from timing,
    and no two such runs sample the same tokens (the run at the tap's default budget is quoted
    beside it as it was saved: tests/unit/test_docs.py)."""
    import re

    text = (REPO / "docs" / "science.md").read_text()
    quoted = re.search(r"<!-- truth:start -->\n```\n(.*?)\n```\n<!-- truth:end -->", text, re.S)
    assert quoted, "docs/science.md has no truth block"
    first, _, rest = quoted.group(1).partition("\n")
    lines = "\n".join(harness.summary_lines(moderate) + harness.summary_lines(collapse)
                      + harness.summary_lines(sharpened))
    assert first.startswith("run with torch "), "paste the output of python tools/truth.py --quote"

    def labels(t):
        return [re.split(r"[-+]?\d", line, maxsplit=1)[0] for line in t.splitlines()]

    # line by line up to each line's first number, on any kernels
    assert labels(rest) == labels(lines), "paste the output of python tools/truth.py --quote"
    # number for number on the kernels the quote names (elsewhere the runs are other trajectories):
    # skipped, and so reported, on other kernels; never an assert that silently does not run
    if first != harness.machine():
        pytest.skip(f"the quote was made on {first!r}, this host is {harness.machine()!r}: compared line by line only")
    assert rest == lines, "paste the output of python tools/truth.py --quote"


def test_d_t_is_measured_on_independent_samples(moderate, collapse, harness):
    """The record's kl_to_previous against the oracle's: within [0.8, 1.25] of it on at least
    90 % of the moderate run's pairs. On the collapsing run the policy is nearly deterministic
    and the KL of its smallest updates sits in sequences it rarely samples: the record's D_t is
    centred on the truth there too (the replicates), but its spread puts about a fifth of the
    draws outside a 25 % band, mostly on updates under 0.05 nats (docs/science.md says so). The
    in-sample estimate it replaced misses by far more."""
    ok, n = moderate.d_t_within(0)
    assert ok >= 0.9 * n
    ok_c, n_c = collapse.d_t_within(0)
    old_c, _ = collapse.d_t_within(1)
    # the in-sample one misses half as often again at least: 16 against 6 updates (AVX2), 22
    # against 12 (AVX512)
    assert ok_c >= 0.75 * n_c and n_c - old_c >= 1.5 * (n_c - ok_c)
    # its 95 % intervals (the SE conditional on the prompts moderated across neighbouring updates,
    # t on its degrees of freedom, the oracle's own error added) cover the truth on most updates of
    # both runs, and never fewer than with the sample's own SE (issue 41 asks for 90 %: the moderate
    # run's record is at 35 of 39, its redraws at 95 %)
    for res in (moderate, collapse):
        covered, total = res.d_t_coverage()
        assert covered >= 0.85 * total and covered >= res.d_t_coverage(own=True)[0]
    for res in (moderate, collapse):  # no bias: a miss is the sample's spread
        assert 0.95 <= res.replicates[4]["d_t_mean_over_truth"] <= 1.05
    assert moderate.replicates[4]["d_t_in_band"] >= 0.95
    # on updates of 0.05 nats or more the band holds on the collapsing run too
    large = [v for v in collapse.d_t.values() if v[0] is not None and v[2] >= harness.SMALL_D_T]
    lo, hi = harness.D_T_BAND
    assert len(large) >= 0.5 * n_c and sum(lo <= v[0] / v[2] <= hi for v in large) >= 0.85 * len(large)
    # the record's own misses are the rate its sampling predicts, not worse
    assert (n_c - ok_c) / n_c <= 1 - collapse.replicates[4]["d_t_in_band"] + 0.1


def test_the_standard_error_of_d_t_is_its_real_spread_for_the_prompts(moderate, collapse, sharpened):
    """The SE of D_t against the estimate's real spread when the tap's sampling is redrawn for
    the same prompts (100 draws an update, each draw of every update one redrawn run): the median
    ratio (the real SD over the root mean square of the SE) within [0.8, 1.25] in every regime,
    for the sample's own SE (conditional on the prompts: the stratified jackknife over each
    prompt's completions of each policy; the between-prompt SE before it was about four times
    the spread on the collapsing run) and for the one the report states, moderated across
    neighbouring updates."""
    import numpy as np

    for res in (moderate, collapse, sharpened):
        for key in ("d_t_own", "d_t"):
            cal = res.calibration[key]
            assert 0.8 <= float(np.median(cal["ratio"])) <= 1.25, key


def test_the_moderated_intervals_of_d_t_cover_the_truth_over_redraws(moderate, collapse, sharpened):
    """Against the oracle's own number (the draws are subsets of its samples, so its error is
    not added: ``truth._calibration``): the sample's own SE is small exactly on the draws that
    missed the tail of the token KL, and its intervals cover 84 %, 64 % and 87 % of the draws;
    moderated across neighbouring updates, at their rate on the moderate and sharpened runs and
    far more often on the collapsing one (82.2 % on AVX2, 81.7 % on AVX512, before the tail
    allowance below)."""
    for res, floor in ((moderate, 0.93), (sharpened, 0.93), (collapse, 0.8)):
        own, mod = res.calibration["d_t_own"], res.calibration["d_t"]
        assert mod["draws"] == own["draws"] >= 3000
        assert mod["covered_no_tail"] >= floor * mod["draws"]
        assert mod["covered_no_tail"] >= own["covered"] + 0.05 * own["draws"]


def test_the_intervals_of_d_t_cover_the_truth_over_redraws_in_every_regime(moderate, collapse, sharpened):
    """Issue 41's line: the 95 % intervals the report states cover the truth on at least 90 % of
    the redraws in every regime, small updates included. On the collapsed policy a small update's
    KL sits in sequences a 4 + 4 sample seldom holds (on the worst updates one completion in 128
    of the oracle's carries most of it), which neither the sample's SE nor its neighbours' show:
    moderated, the intervals covered about 82 % of the collapsing run's draws. The upper end's
    tail allowance (``ledger.paired.tail_allowance``: the pi_{t+1} mass a sharpened prompt group's
    sample did not hold, at the largest token KL it saw) brings that to 91 % on AVX2; a policy
    that still spreads (the moderate run) is allowed nothing, and its coverage is unchanged.
    Counted over all updates: the collapsing run's updates under 0.05 nats alone are covered
    less often (about four in five; the harness prints it), which docs/science.md says."""
    for res in (moderate, collapse, sharpened):
        cal = res.calibration["d_t"]
        assert cal["covered"] >= 0.9 * cal["draws"], res.regime
        assert cal["covered"] >= cal["covered_no_tail"]
    # nothing is allowed where no prompt group's sample holds half of pi_{t+1}'s mass
    assert moderate.calibration["d_t"]["covered"] == moderate.calibration["d_t"]["covered_no_tail"]
    # it is the allowance that does it, on the run whose tail the sample misses
    cal = collapse.calibration["d_t"]
    assert cal["covered"] >= cal["covered_no_tail"] + 0.05 * cal["draws"]
    # and it is given where a prompt group's sample holds half of the mass, never on the moderate run
    assert moderate.calibration["d_t"]["allowed"] == 0 < cal["allowed"]
    # the small updates alone: better than without it, short of the rate (not claimed)
    assert cal["small_draws"] >= 1000 and cal["small_covered"] >= 0.7 * cal["small_draws"]


def test_the_standard_error_of_dz_is_its_real_spread_for_the_prompts(moderate, collapse, sharpened):
    """The SE of each behaviour's dz, conditional on the prompts, against its real spread over the
    draws where the book states one (a behaviour constant in every prompt group is refused, not
    reported): the median ratio within [0.8, 1.25], and the 95 % intervals covering the truth on
    at least 92 % of the draws in every regime. Issue 41 asks for 93 %: the moderate and sharpened
    runs meet it (95 %, 94 %), the collapsing run's sits on it, 93.3 % on AVX2 and 92.6 % on
    AVX512."""
    import numpy as np

    for res in (moderate, collapse, sharpened):
        cal = res.calibration["dz"]
        assert 0.8 <= float(np.median(cal["ratio"])) <= 1.25
        assert cal["covered"] >= 0.92 * cal["draws"]
