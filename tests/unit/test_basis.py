"""A declared feature basis: every kind against an independent computation, the surface
basis unchanged, malformed bases named, and the basis id as a join key."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from reward_lens.measure.ledger.basis import load_basis
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.record import open_run
from reward_lens_spec import SpecError

REPO = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).with_name("reward-lens"))]
EOS = 2

EVERY_KIND = r"""
name: every-kind
features:
  - name: says_alpha
    kind: regex
    pattern: "\\balpha\\b"
  - name: exclaims
    kind: regex
    pattern: "!"
    count: true
  - name: n_answers
    kind: regex
    pattern: "<answer>"
    count: raw
  - name: length_chars
    kind: length
    of: characters
  - name: length_tokens
    kind: length
    of: tokens
  - name: length_words
    kind: length
    of: words
  - name: frac_digit
    kind: char_class
    class: "[0-9]"
  - name: ends_eos
    kind: ends_with_eos
  - name: cut_off
    kind: truncated
    cap: 4
  - name: reward_fmt
    kind: reward
    reward: fmt
  - name: is_json
    kind: json
  - name: vowels
    kind: callable
    function: "tests.unit.basis_helpers:vowels"
    unit: vowels
    meaning: "number of ASCII vowels"
"""

COMPLETIONS = ["alpha! beta!", "alphabet", "", '{"a": [1, 2]}', "<answer>12</answer><answer>3</answer> é!",
               "  null  ", "ALPHA alpha"]
IDS = [[5, 6, EOS], [5, 6, 7, 8], [], [9, EOS], [1, 1, 1, 1, 1], [3, 3, 3, EOS], [4]]
FMT = [1.0, 0.0, 0.5, -2.0, 1.0, 0.0, 0.25]


def _table():
    return pa.table({
        "step": pa.array([0] * len(COMPLETIONS), pa.int64()),
        "completion": COMPLETIONS,
        "completion_ids": pa.array(IDS, pa.list_(pa.int64())),
        "rewards": pa.array([[("fmt", f), ("other", 9.0)] for f in FMT], pa.map_(pa.string(), pa.float64())),
    })


def _independent(text: str, ids: list[int], fmt: float) -> list[float]:
    """The same features by plain Python, written from the definitions, not from the code."""
    n = len(text)
    try:
        json.loads(text)
        parses = 1.0
    except ValueError:
        parses = 0.0
    ends = 1.0 if ids and ids[-1] == EOS else 0.0
    return [
        1.0 if re.search(r"\balpha\b", text) else 0.0,
        text.count("!") * 100.0 / max(n, 1),
        float(text.count("<answer>")),
        float(n),
        float(len(ids)),
        float(len(re.findall(r"[^ \t\n\f\r]+", text))),
        sum(c in "0123456789" for c in text) / max(n, 1),
        ends,
        1.0 if len(ids) >= 4 and not ends else 0.0,
        fmt,
        parses,
        float(sum(c in "aeiou" for c in text)),
    ]


def test_every_kind_against_an_independent_computation(tmp_path):
    spec = tmp_path / "basis.yaml"
    spec.write_text(EVERY_KIND)
    basis = load_basis(spec)
    z = basis.compute(_table(), context={"eos_token_id": EOS})
    expected = np.array([_independent(t, i, f) for t, i, f in zip(COMPLETIONS, IDS, FMT)])
    np.testing.assert_allclose(z, expected, rtol=0, atol=1e-12)
    assert basis.units()["exclaims"] == "matches per 100 characters"
    assert basis.units()["length_tokens"] == "tokens" and basis.units()["vowels"] == "vowels"
    # tokens fall back to num_tokens when the record has no completion ids
    only_counts = pa.table({"num_tokens": pa.array([len(i) for i in IDS], pa.int64())})
    tok = load_basis(spec).defs[4]
    from reward_lens.measure.ledger.basis import FeatureBasis

    np.testing.assert_array_equal(FeatureBasis([tok]).compute(only_counts)[:, 0], [len(i) for i in IDS])


def test_the_issue_form_is_accepted(tmp_path):
    spec = tmp_path / "mine.yaml"
    spec.write_text('features:\n  - name: says_alpha\n    kind: regex\n    pattern: "\\\\balpha\\\\b"\n'
                    '  - name: exclaims\n    kind: regex\n    pattern: "!"\n    count: true\n'
                    '  - name: length_chars\n    kind: length\n    of: characters\n'
                    '  - name: reward_fmt\n    kind: reward\n    reward: fmt\n')
    b = load_basis(spec)
    assert b.names == ("says_alpha", "exclaims", "length_chars", "reward_fmt")
    assert b.compute(_table())[:, 0].tolist() == [1, 0, 0, 0, 0, 0, 1]


def _surface_by_hand(text: str) -> list[float]:
    n = max(len(text), 1)
    punct = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    words = len(re.findall(r"[^ \t\n\f\r]+", text))  # RE2's \S: not one of these five
    return [len(text), text.count("\n") + 1, words,
            sum("a" <= c <= "z" for c in text) / n, sum("A" <= c <= "Z" for c in text) / n,
            sum("0" <= c <= "9" for c in text) / n, sum(c in " \t\n\r\f\v" for c in text) / n,
            sum(c in punct for c in text) / n, sum(ord(c) > 127 for c in text) / n]


@pytest.mark.parametrize("record", ["long", "short", "tapped", "paired"])
def test_surface_features_unchanged_on_the_reference_records(record):
    run = open_run(REPO / "tests" / "fixtures" / "grpo_run" / record)
    table = run.read_rollouts(["completion"])
    z = SurfaceFeatures().compute(table)
    texts = table.column("completion").to_pylist()
    sample = list(range(0, len(texts), max(1, len(texts) // 400)))  # a spread of rows, every step range
    expected = np.array([_surface_by_hand(texts[i]) for i in sample])
    np.testing.assert_allclose(z[sample], expected, rtol=0, atol=1e-12)
    assert SurfaceFeatures().names == ("len_chars", "n_lines", "n_words", "frac_lower", "frac_upper", "frac_digit",
                                       "frac_space", "frac_punct", "frac_nonascii")


BAD = [
    ("unknown kind", "features:\n  - name: a\n    kind: regexx\n    pattern: x\n", r"bad\.yaml:2: .*unknown kind 'regexx'"),
    ("bad regex", 'features:\n  - name: a\n    kind: regex\n    pattern: "(open"\n', r"bad\.yaml:4: feature `a`: bad regex"),
    ("missing key", "features:\n  - name: a\n    kind: reward\n", r"bad\.yaml:2: features\.0\.reward \(feature `a`\): Field required"),
    ("unknown key", "features:\n  - name: a\n    kind: json\n    colour: red\n", r"bad\.yaml:4: .*colour"),
    ("twice", "features:\n  - name: a\n    kind: json\n  - name: a\n    kind: json\n", r"bad\.yaml:4: feature `a` is declared twice"),
    ("no import", 'features:\n  - name: a\n    kind: callable\n    function: "nomod:fn"\n', r"bad\.yaml:4: feature `a`: cannot import nomod:fn"),
    ("nan offset", "features:\n  - name: a\n    kind: regex\n    pattern: x\n    offset: .nan\n", r"bad\.yaml:5: .*offset.*finite"),
    ("inf offset", "features:\n  - name: a\n    kind: regex\n    pattern: x\n    offset: .inf\n", r"bad\.yaml:5: .*offset.*finite"),
    ("huge offset", "features:\n  - name: a\n    kind: regex\n    pattern: x\n    offset: 1e308\n", r"bad\.yaml:5: .*offset.*1000000"),
]


@pytest.mark.parametrize("name,body,message", BAD, ids=[b[0] for b in BAD])
def test_malformed_basis_is_one_line_naming_file_and_line(tmp_path, name, body, message):
    spec = tmp_path / "bad.yaml"
    spec.write_text(body)
    with pytest.raises(SpecError, match=message):
        load_basis(spec)
    paired = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    r = subprocess.run(CLI + ["report", str(paired), "--features", str(spec), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and re.search(message, r.stderr) and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("body,message", [
    ("features:\n  - name: f\n    kind: reward\n    reward: fmt\n",
     r"feature `f` reads reward function `fmt`, which no rollout has \(the record's reward functions: \['lowercase'\]\)"),
    ('features:\n  - name: f\n    kind: callable\n    function: "tests.unit.basis_helpers:too_short"\n',
     r"feature `f`: tests\.unit\.basis_helpers:too_short returned \d+ values for \d+ completions"),
    ('features:\n  - name: f\n    kind: callable\n    function: "tests.unit.basis_helpers:not_finite"\n',
     r"feature `f`: .* returned a non-finite value"),
])
def test_a_basis_the_record_cannot_feed_is_bad_input_naming_the_feature(tmp_path, body, message):
    spec = tmp_path / "b.yaml"
    spec.write_text(body)
    paired = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    r = subprocess.run(CLI + ["report", str(paired), "--features", str(spec), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and re.search(message, r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


def test_basis_id_is_a_join_key(tmp_path):
    from reward_lens.measure.efficiency import cost_series, metric_g
    from reward_lens.measure.ledger.price import StepSample, ledger_series

    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text("features:\n  - name: size\n    kind: length\n    of: characters\n")
    b.write_text("features:\n  - name: size\n    kind: length\n    of: words\n")
    ba, bb = load_basis(a), load_basis(b)
    assert ba.basis_id != bb.basis_id and ba.basis_id == load_basis(a).basis_id
    # the prose meaning is not part of the id; a definition is
    a.write_text("features:\n  - name: size\n    kind: length\n    of: characters\n    meaning: other words\n")
    assert load_basis(a).basis_id == ba.basis_id
    rng = np.random.default_rng(0)
    texts = [" ".join("w" * int(k) for k in rng.integers(1, 6, size=int(m))) for m in rng.integers(1, 9, size=64)]
    t = pa.table({"completion": texts})
    za, zb = ba.compute(t), bb.compute(t)
    sa = [StepSample(s, ba.names, za[s * 16:(s + 1) * 16]) for s in range(4)]
    sb = [StepSample(s, bb.names, zb[s * 16:(s + 1) * 16]) for s in range(4)]
    book = cost_series(ledger_series(sa), metric_g(sb, method="covariance_bound"), kl_spent={0: 1.0, 1: 1.0, 2: 1.0})
    (ref,) = [r for r in book.refusals if r.code == "UNIT_MISMATCH"]
    assert ba.basis_id in ref.detail and bb.basis_id in ref.detail
    assert not book.rows or all(r.efficiency is None for r in book.rows)


def test_report_json_carries_the_basis_with_units(tmp_path):
    spec = tmp_path / "b.yaml"
    spec.write_text("features:\n  - name: length_chars\n    kind: length\n    of: characters\n"
                    "  - name: exclaims\n    kind: regex\n    pattern: \"!\"\n    count: true\n")
    paired = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    r = subprocess.run(CLI + ["report", str(paired), "--features", str(spec), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["basis"]["id"] == load_basis(spec).basis_id
    units = {f["name"]: f["unit"] for f in next(b for b in data["books"] if b["id"] == "cost")["data"]["features"]}
    assert units == {"length_chars": "characters", "exclaims": "matches per 100 characters"}
    md = (tmp_path / "out" / "report.md").read_text()
    assert load_basis(spec).basis_id in md and "| matches per 100 characters |" in md


@pytest.mark.parametrize("fn,exc", [("raises_runtime", "RuntimeError: the user's bug"), ("raises_key", "KeyError"),
                                    ("exits", "SystemExit")])
def test_a_failing_callable_is_bad_input_naming_basis_feature_and_exception(tmp_path, fn, exc):
    """The user's code failing is exit 2 naming the basis file, the feature and the exception,
    not exit 3 'a bug in reward-lens'; sys.exit inside it does not end the command (issue 31)."""
    spec = tmp_path / "b.yaml"
    spec.write_text(f'features:\n  - name: f\n    kind: callable\n    function: "tests.unit.basis_helpers:{fn}"\n')
    paired = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    r = subprocess.run(CLI + ["report", str(paired), "--features", str(spec), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert str(spec) in r.stderr and "feature `f`" in r.stderr and exc in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_module_that_fails_on_import_is_named(tmp_path):
    (tmp_path / "brokenmod.py").write_text("def f(:\n")
    (tmp_path / "raisemod.py").write_text("raise RuntimeError('at import')\n")
    for mod, exc in (("brokenmod", "SyntaxError"), ("raisemod", "RuntimeError")):
        spec = tmp_path / f"{mod}.yaml"
        spec.write_text(f'features:\n  - name: f\n    kind: callable\n    function: "{mod}:f"\n')
        r = subprocess.run(CLI + ["report", "--example", "paired", "--features", str(spec), "--out",
                                  str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert r.returncode == 2 and f"{mod}.yaml:4" in r.stderr and exc in r.stderr, r.stderr


def test_a_basis_is_never_taken_from_a_record_or_a_report(tmp_path):
    """A callable runs code, so a basis comes only from the user's own --features: a record or a
    report that names a basis (even one with a callable) never makes reward-lens import it."""
    import shutil

    rec = tmp_path / "rec"
    shutil.copytree(REPO / "tests" / "fixtures" / "grpo_run" / "paired", rec)
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef f(c):\n    return [0] * len(c)\n")
    (rec / "features.yaml").write_text('features:\n  - name: f\n    kind: callable\n    function: "evil:f"\n')
    r = subprocess.run(CLI + ["report", str(rec), "--out", str(tmp_path / "out"), "--fail-on", "never"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    report["basis"]["source"] = str(rec / "features.yaml")
    (tmp_path / "out" / "report.json").write_text(json.dumps(report))
    r = subprocess.run(CLI + ["diff", str(tmp_path / "out"), str(rec), "--out", str(tmp_path / "d")],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode in (0, 1), r.stderr
    assert not marker.exists()


def test_a_basis_name_unit_and_meaning_are_text_in_markdown(tmp_path):
    """The basis file's free text is escaped in report.md and a published site's .md (issue 31)."""
    spec = tmp_path / "b.yaml"
    spec.write_text('name: "<img src=x onerror=alert(1)> | `x`"\nfeatures:\n  - name: vowels\n    kind: regex\n'
                    '    pattern: "[aeiou]"\n    unit: "<b>u</b>"\n    meaning: "a | b <script>x</script> `c`"\n')
    paired = REPO / "tests" / "fixtures" / "grpo_run" / "paired"
    r = subprocess.run(CLI + ["report", str(paired), "--features", str(spec), "--out", str(tmp_path / "out"),
                              "--fail-on", "never", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(CLI + ["publish", str(paired), "--features", str(spec), "--site", str(tmp_path / "site"),
                              "--quiet"], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    for md in [tmp_path / "out" / "report.md", *(tmp_path / "site").rglob("*.md")]:
        text = md.read_text()
        assert "<img" not in text and "<script" not in text and "<b>" not in text, md
    assert "&lt;img" in (tmp_path / "out" / "report.md").read_text()
