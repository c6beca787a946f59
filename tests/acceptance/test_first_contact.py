"""First contact (issue #40): on every bundled example, each behaviour reads one verdict on every
page (the summary card, the agreement book, the cause book's direct selection, the findings, the
Markdown, the HTML and report.json); no finding is "clear" on evidence of too little to judge;
nothing literal of Markdown (``**``, backticks, ``<p><p>``) reaches a reader of the HTML or of
the Markdown; and the first screen speaks plain words."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest

from reward_lens.examples import example_features, example_names, example_record
from reward_lens.measure import decisions
from reward_lens.measure.ledger.features import features_from
from reward_lens.record import open_run
from reward_lens.report import build_report, to_html, to_json, to_markdown

EXAMPLES = example_names()


@pytest.fixture(scope="module", params=EXAMPLES)
def example(request):
    name = request.param
    spec = example_features(name)
    report = build_report(open_run(example_record(name)), features=features_from(str(spec) if spec else None))
    return name, report, to_markdown(report), to_html(report), json.loads(to_json(report))


def test_every_bundled_example_is_checked():
    assert {"long", "short", "tapped", "paired", "task"} <= set(EXAMPLES)


class _Text(HTMLParser):
    """The text a reader sees, per element id: everything outside <script>, <style> and <svg>,
    and apart from it the text inside elements whose ids are ``record_ids`` (record text, shown as
    written). Table rows with a ``data-feature`` keep each cell's text by class."""

    VOID = {"br", "img", "meta", "link", "input", "hr", "col", "area", "base", "wbr", "source"}

    def __init__(self, record_ids=("samples", "browser")):
        super().__init__()
        self.record_ids = set(record_ids)
        self.stack: list[tuple[str, str | None]] = []
        self.text: list[str] = []
        self.cells: dict[tuple[str, str, str], str] = {}  # (table id, feature, cell class) -> text
        self._row: tuple[str, str] | None = None
        self._cell: str | None = None
        self._table: str | None = None

    def _hidden(self) -> bool:
        return any(t in ("script", "style", "svg") or i in self.record_ids for t, i in self.stack)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in self.VOID:
            return
        self.stack.append((tag, a.get("id")))
        if tag == "table":
            self._table = a.get("id")
        if tag == "tr" and a.get("data-feature"):
            self._row = (self._table or "", a["data-feature"])
        if tag == "td" and self._row and a.get("class"):
            self._cell = a["class"]
            self.cells[(*self._row, self._cell)] = ""

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break
        if tag == "td":
            self._cell = None
        if tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._hidden():
            return
        self.text.append(data)
        if self._row and self._cell:
            self.cells[(*self._row, self._cell)] += data


def _read(html: str) -> _Text:
    t = _Text()
    t.feed(html)
    return t


def _plain(words: str) -> str:
    """Prose as a reader sees it rendered: code spans without their backticks."""
    return re.sub(r"`([^`]+)`", r"\1", words)


def _md_rows(md: str, header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header row starts with ``header``, by feature."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows[cells[0].strip("`")] = cells
    return rows


# The card's sentence about what the reward asked for, clause by clause: the words that name each
# verdict (templates/report/card.j2).
CARD_CLAUSES = {"moved as asked": decisions.BOUGHT,
                "showed no net change over the run (asked for, not bought)": decisions.NOT_BOUGHT,
                "moved the other way (asked for, moved the other way)": decisions.OTHER_WAY,
                "moved along with what it asked for": decisions.CARRIED,
                "moved against the way the reward selects": decisions.AGAINST,
                "moved without the reward selecting on": decisions.COLLATERAL}


def _card_verdicts(card: list[str]) -> tuple[dict[str, str], set[str], set[str]]:
    """From the summary card: each behaviour's verdict key as its sentence files it, the behaviours
    it says were asked for directly, and those asked for jointly."""
    para = next((p for p in card if p.startswith("The reward [asked for]") or
                 p.startswith("The reward asked for none")), None)
    if para is None:
        return {}, set(), set()
    clauses = re.split(r"; |(?<=\))\. |(?<=[a-z])\. ", para)
    asked_clause = clauses[0]
    head, _, tail = asked_clause.partition(", and ")
    jointly = set(re.findall(r"`([^`]+)`", tail if " jointly" in asked_clause and tail else
                             (head if " jointly" in head else "")))
    directly = set(re.findall(r"`([^`]+)`", head)) - jointly
    out: dict[str, str] = {}
    for clause in clauses[1:]:
        keys = [k for words, k in CARD_CLAUSES.items() if words in clause]
        names = re.findall(r"`([^`]+)`", clause.split(" (", 1)[0] if keys == [decisions.CARRIED] else clause)
        assert len(keys) <= 1, clause
        for n in names:
            assert n not in out, (n, clause)
            if keys:
                out[n] = keys[0]
    return out, directly, jointly


def test_one_verdict_per_behaviour_on_every_page(example):
    name, report, md, html, data = example
    agreement = next(b for b in data["books"] if b["id"] == "agreement")
    cause = next(b for b in data["books"] if b["id"] == "cause")
    if agreement["data"] is None:
        pytest.skip(f"{name}: no agreement book")  # every bundled record has one; guarded below
    verdicts = {f["feature"]: f for f in agreement["data"]["features"]}
    assert set(verdicts) == set(report.basis.model_dump()["features"][i]["name"]
                                for i in range(len(report.basis.features)))
    selected = {x["feature"]: x for x in cause["data"]["selected"]}
    page = _read(html)
    md_agreement = _md_rows(md, "| feature | unit | share of KL_min |")
    md_cause = _md_rows(md, "| feature | gradient β |")
    card, directly, jointly = _card_verdicts(report.card)
    for f, v in verdicts.items():
        words, key = v["verdict"], v["verdict_key"]
        # the cause book's direct selection is the verdict's first half, in the same words
        assert selected[f]["asked"] == v["asked"] and selected[f]["asked_for"] == v["asked_for"], f
        assert (v["asked"] == decisions.ASKED_JOINTLY) == bool(v["jointly_with"]), f
        if v["target"] is not None:  # a declared target: its own verdict, on its own card line (issue 57)
            assert key in decisions.TARGET_VERDICTS and words.startswith(f"your target `{f}` ")
            assert any(words[:1].upper() + words[1:] in line for line in report.card), (f, words)
            assert page.cells[("agreement-table", f, "verdict")] == _plain(words), f
            assert md_agreement[f][-1] == words, f
            assert card.get(f) is None and f not in directly and f not in jointly, f
            continue
        assert key in decisions.VERDICTS and words
        assert (key in decisions.ASKED_VERDICTS) == (v["asked"] != decisions.NOT_ASKED), f
        # the agreement book and the cause book, in the HTML and in the Markdown
        assert page.cells[("agreement-table", f, "verdict")] == _plain(words), f
        assert page.cells[("agreement-table", f, "asked")] == _plain(v["asked_for"]), f
        assert page.cells[("cause-selected-table", f, "asked")] == _plain(v["asked_for"]), f
        assert md_agreement[f][-1] == words and md_agreement[f][4] == v["asked_for"], f
        assert md_cause[f][3] == v["asked_for"], f
        # the summary card files it under its verdict (a behaviour that neither moved nor was asked
        # for is not named there)
        assert card.get(f) == (None if key == decisions.NEITHER else key), (f, card.get(f), key)
        assert (f in directly) == (v["asked"] == decisions.ASKED_DIRECTLY), f
        assert (f in jointly) == (v["asked"] == decisions.ASKED_JOINTLY), f
        # the sign of the selection: never carried along against it
        if key == decisions.CARRIED:
            assert v["selected"] and (v["drift"] > 0) == (v["selection"] > 0), f
        if key in (decisions.BOUGHT, decisions.OTHER_WAY):
            assert ((v["drift"] > 0) == (v["direction"] > 0)) == (key == decisions.BOUGHT), f
    _sequential_findings_agree(data)


def _sequential_findings_agree(data: dict) -> dict[str, set[str]]:
    """The sequential findings (a sustained, sized movement, judged at every step: docs/findings.md)
    name a subset of what the run-level verdicts say, and never contradict them: a behaviour moving
    against what the reward selects is never one the verdict files as moving with it, and one that
    moved with no selection explaining it has no resolved selection differential in the cause book.
    Returns the behaviours each finding named (what was checked): on the bundled examples
    ``moving_against_reward`` holds on none, so the case below makes one where it does."""
    agreement = next(b for b in data["books"] if b["id"] == "agreement")
    cause = next(b for b in data["books"] if b["id"] == "cause")
    verdicts = {f["feature"]: f for f in agreement["data"]["features"]}
    selected = {x["feature"]: x for x in cause["data"]["selected"]}
    found = {x["id"]: x for x in data["findings"]}

    def named(fid):
        return {x["feature"] for x in found[fid]["values"].get("features", [])} if found[fid]["status"] == "holds" \
            else set()

    checked = {fid: named(fid) for fid in ("moving_against_reward", "collateral_behaviour", "length_drift")}
    for f in checked["moving_against_reward"]:
        assert verdicts[f]["verdict_key"] not in (decisions.BOUGHT, decisions.CARRIED, decisions.NEITHER), f
    for f in checked["collateral_behaviour"] | checked["length_drift"]:
        assert not selected[f]["selected"], f
        assert verdicts[f]["verdict_key"] not in (decisions.BOUGHT, decisions.CARRIED, decisions.NEITHER), f
    return checked


def test_the_sequential_findings_agree_with_the_verdicts_where_they_hold(tmp_path):
    """The check above on a run where the findings it reads hold (tests/unit/test_live_findings.py's
    hacked run: correctness falls against its selection, an exclamation mark no reward pays for
    spreads), so its loops run over behaviours, not over an empty set."""
    from reward_lens.measure.ledger.basis import load_basis
    from tests.unit.test_live_findings import BASIS, hacked_record

    (tmp_path / "basis.yaml").write_text(BASIS)
    report = build_report(open_run(hacked_record(tmp_path / "record")), features=load_basis(tmp_path / "basis.yaml"))
    checked = _sequential_findings_agree(json.loads(to_json(report)))
    assert checked["moving_against_reward"] == {"correct"}, checked
    assert checked["collateral_behaviour"], checked


def test_the_collinear_behaviours_of_the_task_are_asked_for_jointly():
    """`format_ok` and `reward_format` are too alike within prompt groups to tell apart: one verdict
    of their own, the same on every page; the zero gradient of the one the fit gave no weight has
    p = 1 of its own, not the p = 0 of an SE of rounding."""
    spec = example_features("task")
    report = build_report(open_run(example_record("task")), features=features_from(str(spec)))
    agreement = {f.feature: f for f in next(b for b in report.books if b.id == "agreement").data.features}
    cause = {x.feature: x for x in next(b for b in report.books if b.id == "cause").data.selected}
    assert agreement["format_ok"].asked == "jointly" and agreement["format_ok"].jointly_with == ["reward_format"]
    assert agreement["format_ok"].verdict == "asked for jointly with `reward_format`, and bought"
    assert agreement["reward_format"].verdict == "asked for jointly with `format_ok`, and bought"
    assert cause["format_ok"].gradient == 0.0 and cause["format_ok"].gradient_p == 1.0
    assert cause["format_ok"].joint_p < 0.05 and not cause["format_ok"].direct and cause["format_ok"].jointly
    # `correct` is the task basis's declared target: judged against what the user wants (issue 57); the
    # reward asked for more of it, so no net change is all it is, not "selected against"
    assert agreement["correct"].verdict == "your target `correct` showed no net change"
    assert agreement["correct"].asked_for == "yes (more)"
    headline = next(b for b in report.books if b.id == "cause").headline
    assert "more `correct` directly" in headline and "more `format_ok` and `reward_format` jointly" in headline
    # the share of a behaviour with no net change, reconciled in words beside it
    assert any("`correct` took 78 %" in line and "`correct` took its share with no net change over the run" in line
               for line in report.card)


TOO_LITTLE = ("too_short", "first_unresolved", "last_unresolved", "straddles", "no_eta", "no_verdicts")


def test_no_finding_is_clear_on_too_little_to_judge(example):
    name, report, md, html, data = example
    for f in data["findings"]:
        if f["status"] == "clear":
            assert not any(f["values"].get(k) for k in TOO_LITTLE), (name, f["id"], f["values"])
            assert not re.search(r"too few|not judged|not resolved", f["evidence"], re.I), (name, f["id"])
        if f["status"] == "not_evaluated":
            assert f["missing"], (name, f["id"])  # what would evaluate it
    counts = data["findings_counts"]
    assert counts["clear"] + counts["holds"] + counts["not_evaluated"] == counts["checked"]
    assert f"{counts['clear']} of {counts['checked']} checks clear" in report.card[0]
    assert (f"{counts['not_evaluated']} not evaluated" in report.card[0]) == bool(counts["not_evaluated"])


def test_no_raw_markdown_reaches_a_reader(example):
    name, report, md, html, data = example
    text = "".join(_read(html).text)
    assert "**" not in text and "`" not in text, (name, re.findall(r".{40}(?:\*\*|`).{40}", text)[:3])
    assert "<p><p>" not in html and "</p></p>" not in html
    # the Markdown: text from templates and YAML keeps its code spans, never escaped into
    # literal backticks (record text, the sample rollouts, is escaped and stays so)
    outside_samples = md.split("## Sample rollouts")[0]
    assert "\\`" not in outside_samples, re.findall(r".{30}\\`.{30}", outside_samples)[:3]
    assert outside_samples.count("**") % 2 == 0


# Section and specification ids, in any page a user reads (a model's "torch seed 1234" is not one).
IDS = (r"§", r"\bthe seed\b", r"seed's", r"\brung[ -]?\d", r"series F\d")
JARGON = (r"\bBH\b", r"Benjamini", r"\bcells?\b", r"paired ledger", r"unpaired ledger", *IDS)


def test_the_first_screen_speaks_plain_words(example):
    """The summary card, the books' one-line statements and the findings: no test's initials, no
    "cells", no ledger's name, no seed or section ids; η only beside what it means."""
    name, report, md, html, data = example
    page = _Text(record_ids=("samples", "browser", "run-details", "glossary"))
    first = html[:html.index('<details id="run-details">')]  # the card, the books' statements, the findings
    page.feed(first)
    text = "".join(page.text)
    for pattern in JARGON:
        assert not re.search(pattern, text), (name, pattern, re.findall(rf".{{40}}{pattern}.{{40}}", text)[:2])
    for line in report.card:
        if "η" in line:
            assert "the share of the divergence" in line and "(#g-eta)" in line, line
    card = first[first.index('<section id="summary-card"'):first.index("</section>")]
    assert 'href="#glossary"' in card  # the glossary one click away
    for pattern in IDS:  # nowhere a user reads
        assert not re.search(pattern, "".join(_read(html).text)), (name, pattern)
        assert not re.search(pattern, md.split("## Sample rollouts")[0]), (name, pattern)


def test_the_headline_curve_of_what_was_needed_never_dips_below_zero(example):
    name, report, md, html, data = example
    fig = report.headline_figure
    if fig is None:
        return
    needed = [s for p in fig.panels for s in p.series if (s.label or "").startswith("needed")]
    assert needed, name
    for s in needed:
        assert min(s.y) >= 0 and (s.lo is None or min(s.lo) >= 0), (name, s.label, min(s.y))


def test_the_needed_curve_of_a_short_noisy_run_is_its_positive_part():
    """Three updates whose debiased KL_min is noise below zero at first: the sum is -0.01, -0.03,
    +0.02 nats; the curve is drawn at 0, 0, 0.02, its band from the rows' variances, clipped at 0."""
    from types import SimpleNamespace

    import numpy as np

    from reward_lens.report.build import required_so_far

    est = [SimpleNamespace(kl_min_debiased=k, cov=np.array([[v, 0.0], [0.0, 1.0]]))
           for k, v in ((-0.01, 1e-4), (-0.02, 1e-4), (0.05, 1e-4))]
    lo, mid, hi = required_so_far(est)
    assert mid == pytest.approx([0.0, 0.0, 0.02])
    se = np.sqrt([1e-4, 2e-4, 3e-4])
    assert hi == pytest.approx(np.maximum(np.array([-0.01, -0.03, 0.02]) + 1.96 * se, 0).tolist())
    assert lo == [0.0, 0.0, 0.0] and min(hi) >= 0


def test_the_needed_band_of_paired_updates_covers_their_summed_correction_as_the_runs_interval_does():
    """Two paired updates whose jackknife took 0.03 and then 0.01 nats out of KL_min: the band
    around the sums 0.10 and 0.15 is the bias-aware half-width on the sums' SE with a bound of
    0.03 and then 0.04 (by scipy's root finder), where an unpaired band is 1.96 SE."""
    from types import SimpleNamespace

    import numpy as np

    from reward_lens.report.build import required_so_far
    from tests.unit.interval_helpers import bias_aware_half

    est = [SimpleNamespace(kind="paired", kl_min=k + c, kl_min_debiased=k, cov=np.array([[v, 0.0], [0.0, 1.0]]))
           for k, c, v in ((0.10, 0.03, 4e-4), (0.05, 0.01, 5e-4))]
    lo, mid, hi = required_so_far(est)
    se = np.sqrt([4e-4, 9e-4])
    halves = [bias_aware_half(np.inf, s, b) for s, b in zip(se, (0.03, 0.04))]
    assert mid == pytest.approx([0.10, 0.15])
    assert hi == pytest.approx([m + h for m, h in zip(mid, halves)], rel=1e-9)
    assert lo == pytest.approx([max(m - h, 0.0) for m, h in zip(mid, halves)], rel=1e-9, abs=1e-12)
    plain = required_so_far([SimpleNamespace(kl_min_debiased=e.kl_min_debiased, cov=e.cov) for e in est])
    assert plain[2] == pytest.approx((np.array(mid) + 1.96 * se).tolist())  # no kind: no bound
    # the columns the report hands it (``CostBook.estimates``) give the same band; none, none
    from reward_lens.measure.efficiency.eta import EtaColumns, EtaEstimate

    rows = [EtaEstimate(step_pair=(i, i + 1), kind="paired", kl_min=e.kl_min, kl_min_debiased=e.kl_min_debiased,
                        d_t=1.0, p_value=0.01, cov=e.cov, groups_varying=8) for i, e in enumerate(est)]
    cols = required_so_far(EtaColumns.of(rows, "paired"))
    assert cols[0] == pytest.approx(lo, abs=1e-12) and cols[2] == pytest.approx(hi, rel=1e-12)
    assert required_so_far(EtaColumns.of(rows[:0], "paired")) == ([], [], [])


def test_the_diff_keeps_its_headlines_code_spans(tmp_path):
    """diff.md quoted the books' headlines with escaped backticks (\\`frac\\_lower\\`): they are
    prose from templates, and keep their code spans; the HTML shows them as code."""
    from reward_lens.cli import main as cli

    out = tmp_path / "diff"
    assert cli(["diff", str(example_record("tapped")), str(example_record("paired")), "--out", str(out),
                "--quiet"]) in (0, 1)
    md = (out / "diff.md").read_text()
    assert "\\`" not in md and "`frac_lower`" in md
    text = "".join(_read((out / "diff.html").read_text()).text)
    assert "`" not in text and "**" not in text
