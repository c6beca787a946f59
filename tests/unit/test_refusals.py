"""Every refusal code in the catalogue has a fixture that triggers exactly that code, and a
refusal's views (text, Markdown, HTML, JSON) render the same data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reward_lens.measure.efficiency import cost_series, kl_min_series, metric_g
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.price import StepSample, ledger_series, steps_from_run
from reward_lens.record import open_run
from reward_lens_spec import Subject, load_book, load_refusal_codes, make_refusal
from tests.conftest import LONG


def _long():
    run = open_run(LONG)
    samples = steps_from_run(run, SurfaceFeatures())
    return run, samples, ledger_series(samples), metric_g(samples)


def trigger_record_incomplete():
    run, _, ledgers, g = _long()
    return cost_series(ledgers, g, run_=run).refusals


def trigger_unit_mismatch():
    run, samples, ledgers, _ = _long()
    names = tuple(reversed(samples[0].names))
    g = metric_g([StepSample(s.step, names, s.z[:, ::-1]) for s in samples])
    return cost_series(ledgers, g, run_=run).refusals


def trigger_envelope_violated():
    run, _, ledgers, g = _long()
    return cost_series(ledgers[:1], g, run_=run, kl_spent={0: 1e-9}).refusals


def trigger_premise_failed():
    """A paired step pair whose importance weights are Cauchy-tailed (one-sided, 64 rollouts)."""
    from reward_lens.measure.efficiency.metric import within_group_metric
    from reward_lens.measure.ledger.paired import paired_ledger

    rng = np.random.default_rng(5)
    codes = np.repeat(np.arange(8), 8)
    z = rng.normal(size=(64, 2))
    r = 3.0 * rng.standard_cauchy(64)
    lg = paired_ledger(StepSample(1, ("f1", "f2"), z, groups=codes, logp=r, logp_prev=np.zeros(64),
                                  kl_prev=0.5 * r ** 2))
    return cost_series([lg], within_group_metric([lg])).refusals


def trigger_limit_exceeded():
    rng = np.random.default_rng(0)
    k = 21
    names = tuple(f"f{i}" for i in range(k))
    samples = [StepSample(s, names, rng.normal(size=(40, k))) for s in range(2)]
    return kl_min_series(ledger_series(samples), metric_g(samples)).refusals


def trigger_proxy_refused():
    from reward_lens.measure.whitebox.fisher import kl_spent_from_empirical_fisher

    rng = np.random.default_rng(1)
    scores = rng.normal(size=(8, 500))
    return (kl_spent_from_empirical_fisher(scores, scores.sum(axis=0) * 1e-3, run_id="run:" + "0" * 64, step=0),)


FIXTURES = {
    "RECORD_INCOMPLETE": trigger_record_incomplete,
    "UNIT_MISMATCH": trigger_unit_mismatch,
    "ENVELOPE_VIOLATED": trigger_envelope_violated,
    "LIMIT_EXCEEDED": trigger_limit_exceeded,
    "PREMISE_FAILED": trigger_premise_failed,
    "PROXY_REFUSED": trigger_proxy_refused,
}


def test_every_code_has_a_fixture():
    assert set(FIXTURES) == set(load_refusal_codes().codes)


@pytest.mark.parametrize("code", sorted(FIXTURES))
def test_fixture_triggers_exactly_its_code(code):
    refusals = FIXTURES[code]()
    assert refusals and {r.code for r in refusals} == {code}
    for r in refusals:
        assert r.detail and r.remedy and r.book == "cost" and r.function == "cost_series"


def test_views_of_one_refusal():
    (r,) = trigger_record_incomplete()
    text = r.text()
    assert text.splitlines()[0] == "cost_series  RECORD_INCOMPLETE"
    assert all(line.startswith("    ") for line in text.splitlines()[1:])
    assert max(len(line) for line in text.splitlines()) <= 90
    assert "    Remedy: " in text
    md = r.markdown()
    assert "**RECORD_INCOMPLETE**" in md and "`kl_min_series`" in md
    data = json.loads(r.model_dump_json())
    assert data["code"] == "RECORD_INCOMPLETE" and data["subject"]["step_pairs"][0] == [0, 1]
    assert len(data["subject"]["step_pairs"]) == 199
    assert data["context"]["optimizer"] == "adamw_torch_fused"
    html = r.html()
    assert '<code>kl_min_series</code>' in html and 'id="refusal-cost-record_incomplete"' in html


def test_html_view_escapes_record_text():
    r = make_refusal("UNIT_MISMATCH", load_book("cost"), Subject(run_id="run:x"), {
        "kind": "basis", "n_pairs": 1, "run": "<script>alert(1)</script>",
        "ledger_names": ["<b>a</b>"], "metric_names": ["b"], "position": 0, "same_set": False})
    html = r.html()
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<code>&lt;b&gt;a&lt;/b&gt;</code>" in html
    assert "<script>" not in r.markdown()


def test_unknown_code_is_a_spec_error():
    from reward_lens_spec import SpecError

    with pytest.raises(SpecError, match="not defined"):
        make_refusal("NOT_A_CODE", load_book("cost"), Subject(), {})


def test_missing_context_is_a_spec_error_not_a_blank():
    from reward_lens_spec import SpecError

    with pytest.raises(SpecError, match="missing from the refusal context"):
        make_refusal("LIMIT_EXCEEDED", load_book("cost"), Subject(), {"what": "x"})


def test_a_refusals_context_is_made_json_alike_by_the_encoder_and_by_hand():
    """``_jsonable`` copies plain JSON types as they are (a refusal may name 10,000 step pairs),
    takes the C encoder's way for the rest, and gives what the walk by hand gives: string keys,
    lists for tuples, Python numbers for numpy scalars, NaN kept, anything else as its ``str``;
    a key the encoder cannot take (a tuple) goes the way by hand. The result is a copy: the
    refusal does not share the caller's dicts."""
    from pathlib import Path

    from reward_lens_spec.refusal import _jsonable, _jsonable_slow

    ctx = {"pairs": [{"step_pair": (1, 2), "pareto_k": np.float64(0.8), "n": np.int64(64), "ok": np.bool_(True),
                      "d_t": float("nan"), "sides": "one-sided", "none": None}] * 3,
           3: [np.float32(0.5), (np.int32(7), "x")], "path": Path("a/b"), "nested": {"k": {"j": [1, 2.5]}}}
    fast, slow = _jsonable(ctx), _jsonable_slow(ctx)
    assert json.dumps(fast, sort_keys=True) == json.dumps(slow, sort_keys=True)
    assert fast["3"] == [0.5, [7, "x"]] and fast["path"] == "a/b" and type(fast["pairs"][0]["n"]) is int
    assert fast["pairs"][0]["d_t"] != fast["pairs"][0]["d_t"]  # NaN stays NaN
    assert _jsonable({(1, 2): np.int64(3)}) == {"(1, 2)": 3}
    assert _jsonable({True: 1, None: 2, 1.5: 3}) == {"true": 1, "null": 2, "1.5": 3}  # as JSON spells them
    plain = {"pairs": [{"step_pair": [1, 2], "d_t": 0.25, "sides": "two-sided", "ok": True, "n": None}] * 2,
             "n_pairs": 2}
    copy = _jsonable(plain)
    assert copy == json.loads(json.dumps(plain))
    copy["pairs"][0]["step_pair"].append(3)
    assert plain["pairs"][0]["step_pair"] == [1, 2]
