"""Reports as a person meets them: the files, their determinism, escaping, atomicity, the
published site in reports/ kept current, and the CLI's exit codes through its entry point."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reward_lens.record import open_run
from reward_lens.report import build_report, to_html, to_json, to_markdown
from reward_lens.report.model import Report
from reward_lens.report.site import site_files
from tests.conftest import LONG, PAIRED, SHORT, TAPPED, tiny_record, varied_completions

REPO = Path(__file__).resolve().parents[2]
SVG = re.compile(r"<svg.*?</svg>", re.S)
CLI = [str(Path(sys.executable).with_name("reward-lens"))]


def _json_close(a, b, path="$"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _json_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _json_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def test_published_reports_are_current():
    """reports/ is the published site of the reference records; regenerate it with
    `rm -r reports && reward-lens publish tests/fixtures/grpo_run/long tests/fixtures/grpo_run/short
    tests/fixtures/grpo_run/tapped tests/fixtures/grpo_run/paired --site reports`."""
    fresh = site_files([open_run(LONG), open_run(SHORT), open_run(TAPPED), open_run(PAIRED)])
    on_disk = {p.relative_to(REPO / "reports").as_posix(): p.read_text(encoding="utf-8")
               for p in (REPO / "reports").rglob("*") if p.is_file() and p.name != ".reward-lens"}
    assert sorted(on_disk) == sorted(fresh), "reports/ has other files than publish writes: regenerate it"
    for name, text in fresh.items():
        if name.endswith(".json"):
            _json_close(json.loads(on_disk[name]), json.loads(text), name)
        else:
            # SVG bytes depend on the matplotlib version; the text around them must match exactly.
            assert SVG.sub("<svg/>", on_disk[name]) == SVG.sub("<svg/>", text), f"reports/{name} is stale"


def test_golden_markdown_of_the_long_record():
    md = (REPO / "reports" / "runs").glob("long-*/report.md")
    text = next(md).read_text()
    assert "| optimizer | adamw\\_torch\\_fused |" in text
    assert "| steps | 200 (0–199) |" in text and "| rollouts | 1600 (8 per step) |" in text
    assert "### RECORD_INCOMPLETE: The record lacks an input the book needs" in text
    assert "199 step pair(s) of run run:" in text and "**Remedy.** Record the run with the reward-lens tap" in text
    assert "Log the per-step KL" in text
    assert "What still works: `KL_min` and its per-feature Shapley shares need no denominator" in text
    rows = [l for l in text.splitlines() if re.match(r"^\| \d+→\d+ \|", l)]
    assert len(rows) == 199 and all(l.count(" | ") == rows[0].count(" | ") for l in rows)


def test_report_json_round_trips_and_the_schema_file_is_current():
    path = next((REPO / "reports" / "runs").glob("long-*/report.json"))
    report = Report.model_validate_json(path.read_text())
    (cost,) = [b for b in report.books if b.id == "cost"]
    assert report.schema_version == "7.5" and cost.status == "partial"
    assert len(cost.typed().kl_min) == 199 and len(cost.typed().efficiency) == 0
    schema = json.loads((REPO / "reports" / "report.schema.json").read_text())
    assert schema == json.loads(json.dumps(Report.model_json_schema()))


def test_outputs_are_deterministic():
    run = open_run(SHORT)
    a, b = build_report(run), build_report(open_run(SHORT))
    assert to_html(a) == to_html(b) and to_markdown(a) == to_markdown(b) and to_json(a) == to_json(b)


HOSTILE = ["<script>window.__pwned = 1</script>", "a | b | c\n| d |", "`code` **bold** [x](javascript:y)",
           "<img src=x onerror=\"window.__pwned=2\">", "\x00\x1b[31mred\x07", "&amp; &lt;"]


def _hostile_record(tmp_path) -> Path:
    steps = {s: HOSTILE + varied_completions(s) for s in range(4)}
    return tiny_record(tmp_path / "hostile", steps)


def test_record_text_is_escaped(tmp_path):
    report = build_report(open_run(_hostile_record(tmp_path)))
    html = to_html(report)
    # the page's only scripts are its own two (the browser's JSON and its hashed code)
    assert html.count("<script") == 2 and "<script>window.__pwned" not in html
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert "\\u003cscript\\u003ewindow.__pwned = 1\\u003c/script\\u003e" in html  # in the browser's JSON
    assert "<img src=x" not in html and "\x00" not in html and "\\x00" in html
    md = to_markdown(report)
    sample_rows = [l for l in md.split("## Sample rollouts")[1].splitlines() if l.startswith("| 0 |")]
    assert sample_rows
    for line in sample_rows:  # every row keeps exactly its five cells
        assert len(re.findall(r"(?<!\\)\|", line)) == 6, line
    assert "<script>" not in md and "&lt;script&gt;" in md


def test_interrupted_report_leaves_the_previous_set(tmp_path, monkeypatch):
    rec = _hostile_record(tmp_path)
    out = tmp_path / "out"
    from reward_lens import cli

    assert cli.main(["report", str(rec), "--out", str(out), "--quiet", "--fail-on", "never"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import reward_lens.report.output as output

    real = output._write
    calls = []

    def flaky(path, text):
        calls.append(path)
        if len(calls) == 3:  # the marker and one report file are written, then the disk fills
            raise OSError("disk full")
        return real(path, text)

    monkeypatch.setattr(output, "_write", flaky)
    with pytest.raises(OSError):
        output.replace_dir_atomically(out, {"report.md": "new", "report.html": "new", "report.json": "{}"})
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after == before  # the whole old set, untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


# ---------------------------------------------------------------- the CLI, as installed
def _cli(*args, cwd=None):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, cwd=cwd)


def test_help_documents_exit_codes():
    out = _cli("report", "--help")
    assert out.returncode == 0
    for line in ("0  computed", "1  refused", "2  bad input"):
        assert line in out.stdout
    assert "--fail-on" in out.stdout


def test_exit_codes(tmp_path):
    # 1: the reference record's cost book is refused (RECORD_INCOMPLETE).
    r = _cli("report", str(LONG), "--out", str(tmp_path / "a"), "--quiet")
    assert r.returncode == 1 and r.stdout == "" and r.stderr == ""
    # ... which --fail-on can gate differently.
    assert _cli("report", str(LONG), "--out", str(tmp_path / "b"), "--quiet", "--fail-on", "violated").returncode == 0
    assert _cli("report", str(LONG), "--out", str(tmp_path / "c"), "--quiet", "--fail-on", "never").returncode == 0
    # 0: a record whose every step pair has a D_t large enough and a movement well resolved
    # (completions lengthen by 12 characters a step against a spread of ~4).
    steps = {s: [w + "x" * (12 * s) for w in varied_completions(s, n=40)] for s in range(6)}
    rec = tiny_record(tmp_path / "full", steps, kl_to_previous={s: 1e4 for s in range(6)}, reward_slope=1.0)
    r = _cli("report", str(rec), "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cost_series: computed" in r.stdout
    data = json.loads((tmp_path / "d" / "report.json").read_text())
    assert len(next(b for b in data["books"] if b["id"] == "cost")["data"]["efficiency"]["step_pair"]) == 5
    # 1 under --fail-on violated: a D_t far too small for the movement.
    rec2 = tiny_record(tmp_path / "small", steps, kl_to_previous={s: 1e-9 for s in range(6)})
    r = _cli("report", str(rec2), "--out", str(tmp_path / "e"), "--quiet", "--fail-on", "violated")
    assert r.returncode == 1
    # 1: numbers, but none resolved from noise, is not "computed" (and says so in one line).
    noise = {s: varied_completions(s, n=40) for s in range(6)}
    rec3 = tiny_record(tmp_path / "noise", noise, kl_to_previous={s: 50.0 for s in range(6)})
    r = _cli("report", str(rec3), "--out", str(tmp_path / "f"), "--fail-on", "refused")
    assert r.returncode == 1 and "cost_series: unresolved: η is not resolved from noise" in r.stdout
    # ... which the default, --fail-on incomplete, does not count: the record lacks nothing
    assert _cli("report", str(rec3), "--out", str(tmp_path / "g"), "--quiet").returncode == 0


def test_bad_input_is_one_line_and_exit_two(tmp_path):
    shutil.copytree(LONG, tmp_path / "rec")
    p = tmp_path / "rec" / "rollouts.parquet"
    p.write_bytes(p.read_bytes()[:1000])
    r = _cli("report", str(tmp_path / "rec"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("reward-lens: error: ") and "rollouts.parquet" in r.stderr and "truncated" in r.stderr
    assert not (tmp_path / "o").exists()
    r = _cli("report", str(tmp_path / "nothing-here"))
    assert r.returncode == 2 and "not a directory" in r.stderr
    r = _cli("--debug", "report", str(tmp_path / "rec"), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_example_runs_from_anywhere(tmp_path):
    r = _cli("report", "--example", "short", "--out", "out", "--fail-on", "never", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "out" / "report.html").is_file()
    assert _cli("report", "--example", "nope", cwd=tmp_path).returncode == 2


def test_progress_is_silent_when_not_a_terminal(tmp_path):
    r = _cli("report", str(SHORT), "--out", str(tmp_path / "o"), "--fail-on", "never")
    assert r.stderr == ""  # stderr is a pipe here: no progress bar


def test_publish_site_links_are_relative(tmp_path):
    r = _cli("publish", str(LONG), str(SHORT), "--site", str(tmp_path / "site"))
    assert r.returncode == 0
    index = (tmp_path / "site" / "index.html").read_text()
    links = re.findall(r'href="([^"]+)"', index)
    assert links and all(not l.startswith(("/", "http", "file:")) for l in links)
    for l in links:
        assert (tmp_path / "site" / l).is_file(), l


def test_publish_reads_every_run_in_the_declared_basis_and_refuses_bad_options_before_writing(tmp_path):
    from reward_lens.measure.ledger.basis import load_basis

    task, spec = REPO / "tests" / "fixtures" / "grpo_run" / "task", REPO / "examples" / "features" / "task.yaml"
    site, again = tmp_path / "site", tmp_path / "task_again"
    shutil.copytree(task, again)
    r = _cli("publish", str(task), str(again), "--site", str(site), "--features", str(spec), "--quiet")
    assert r.returncode == 0, r.stderr
    reports = sorted(site.glob("runs/*/report.json"))
    assert len(reports) == 2
    for path in reports:  # both runs in the task basis, not the surface default
        data = json.loads(path.read_text())
        assert data["basis"]["id"] == load_basis(spec).basis_id
        names = [f["name"] for f in data["basis"]["features"]]
        assert names == list(load_basis(spec).names)
    # the same record published without --features is read in the surface basis
    plain = tmp_path / "plain"
    assert _cli("publish", str(task), "--site", str(plain), "--quiet").returncode == 0
    (page,) = plain.glob("runs/*/report.json")
    assert json.loads(page.read_text())["basis"]["id"] != load_basis(spec).basis_id
    # a run that cannot feed the basis is bad input naming its file; no site is written
    r = _cli("publish", str(task), str(SHORT), "--site", str(tmp_path / "mixed"), "--features", str(spec))
    assert r.returncode == 2 and "short/rollouts.parquet" in r.stderr and "correctness" in r.stderr
    assert not (tmp_path / "mixed").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("features:\n  - name: a\n    kind: regexx\n    pattern: x\n")
    for extra, message in ((["--features", str(bad)], r"bad\.yaml:2: .*unknown kind"),
                           (["--ledger", "sideways"], "--ledger takes one of"),
                           (["--window", "0"], "--window takes a positive number")):
        out = tmp_path / "refused"
        r = _cli("publish", str(task), "--site", str(out), *extra)
        assert r.returncode == 2 and re.search(message, r.stderr), (extra, r.stderr)
        assert not out.exists()


def test_progress_shows_on_a_terminal_and_not_under_quiet(monkeypatch, tmp_path):
    import io

    from reward_lens import cli

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for quiet, expect in ((False, True), (True, False)):
        err = Tty()
        monkeypatch.setattr(sys, "stderr", err)
        args = ["report", str(SHORT), "--out", str(tmp_path / f"o{quiet}"), "--fail-on", "never"]
        assert cli.main(args + (["--quiet"] if quiet else [])) == 0
        text = err.getvalue()
        assert ("reading rollouts and computing features" in text) is expect
        if expect:
            assert text.endswith("\r\033[K")  # the line is cleared when done


def test_efficiency_plot_marks_unresolved_rows_and_never_joins_across_a_refused_pair():
    from reward_lens.measure.efficiency.section import _gaps
    from reward_lens.measure.figures import Series
    from reward_lens.report.plots import _broken

    # (3, 4) refused: the line stops at 2 (pair 2->3) and starts again at 4.
    pairs = [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6)]
    assert _gaps(pairs) == [2.0]
    x, y = _broken(Series(x=[0, 1, 2, 4, 5], y=[1, 2, 3, 4, 5], gaps=_gaps(pairs)))
    assert np.isnan(y[3]) and y[:3].tolist() == [1, 2, 3] and y[4:].tolist() == [4, 5]
    report = build_report(open_run(PAIRED))
    html = to_html(report)
    fig = html[html.index('id="cost-plot-efficiency"'):]
    fig = fig[:fig.index("</figure>")]
    assert "resolved" in fig and "unresolved" in fig  # both kinds are drawn, and told apart


def test_markdown_and_json_reports_never_import_matplotlib(tmp_path):
    code = ("import sys; from reward_lens.cli import main; "
            f"rc = main(['report', {str(PAIRED)!r}, '--out', {str(tmp_path / 'o')!r}, '--format', 'md,json', "
            "'--quiet', '--fail-on', 'never']); "
            "assert rc == 0, rc; assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "o" / "report.json").read_text()
    assert "\n" not in text.rstrip("\n") and json.loads(text)["schema_version"] == "7.5"  # compact


def test_a_report_renders_the_same_from_its_section_models_and_from_their_json():
    """A built report holds each book's section model (no dump to dicts); one read back from
    report.json holds dicts. Every format is byte-identical either way."""
    built = build_report(open_run(PAIRED))
    assert all(b.data is None or not isinstance(b.data, dict) for b in built.books)
    as_dicts = built.model_copy(update={"books": [b.model_copy(update={"data": b.data_dict()}) for b in built.books]})
    assert all(b.data is None or isinstance(b.data, dict) for b in as_dicts.books)
    assert to_json(built) == to_json(as_dicts)
    assert to_markdown(built) == to_markdown(as_dicts)
    assert to_html(built) == to_html(as_dicts)
    back = Report.model_validate_json(to_json(built))
    assert [b.typed() == c.typed() for b, c in zip(back.books, built.books)] == [True] * len(built.books)


def test_the_browser_keeps_the_first_rollouts_of_each_chosen_step_in_record_order(monkeypatch):
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import feature_context
    from reward_lens.record import reader
    from reward_lens.report import build

    from reward_lens.measure.ledger.price import steps_from_run

    run = open_run(PAIRED)
    monkeypatch.setattr(reader, "ROWS_PER_READ", 20)  # a step's rows span several reads
    monkeypatch.setattr(build, "BROWSER_STEPS", 7)
    features = SurfaceFeatures()
    alone = build.BrowserRows(run, features, feature_context(run))
    alone.read(run)  # a pass of its own over the chosen steps' row groups
    fed = build.BrowserRows(run, features, feature_context(run))
    samples = {s.step: s for s in steps_from_run(run, features, collectors=[fed])}  # the report's one pass
    # the rule written plainly: over every rollout in record order, the first BROWSER_PER_STEP
    # of each chosen step (steps spread over the run)
    steps = np.unique(run.rollout_steps)
    chosen = set(steps[np.unique(np.linspace(0, len(steps) - 1, 7).astype(int))].tolist())
    table = run.read_rollouts(["completion"])
    want, taken = [], {}
    for s, text in zip(table.column("step").to_pylist(), table.column("completion").to_pylist()):
        if s in chosen and taken.get(s, 0) < build.BROWSER_PER_STEP:
            taken[s] = taken.get(s, 0) + 1
            want.append((s, text[:build.BROWSER_TEXT_MAX], taken[s] - 1))
    for rows in (alone.rows, fed.rows):
        assert [(r.step, r.completion[:build.BROWSER_TEXT_MAX]) for r in rows] == [w[:2] for w in want]
        assert len(want) == 7 * 4
        for r, (s, _, i) in zip(rows, want):  # the features the books priced, row for row
            assert r.features == dict(zip(features.names, samples[s].z[i].tolist()))


def test_per_step_numbers_are_columns_aligned_with_their_steps():
    """report.json keeps the effect and cause books' per-step-pair numbers and the cost book's
    feature means as columns (one list per quantity and feature). Entry i of every column belongs
    to step_pair[i] (or step[i]): checked against each step's feature means and within-group
    covariance with the advantage, computed here from the record with numpy."""
    from reward_lens.measure.ledger.features import SurfaceFeatures

    path = next((REPO / "reports" / "runs").glob("long-*/report.json"))
    books = {b["id"]: b["data"] for b in json.loads(path.read_text())["books"]}
    effect, cause, means = books["effect"]["rows"], books["cause"]["rows"], books["cost"]["feature_means"]
    run = open_run(LONG)
    table = run.read_rollouts(["completion", "advantage", "group_id"])
    f = SurfaceFeatures()
    z = f.compute(table)
    step = table.column("step").to_numpy()
    a = table.column("advantage").to_numpy()
    groups = np.array(table.column("group_id").to_pylist(), dtype=object)
    mean = {s: z[step == s].mean(axis=0) for s in np.unique(step).tolist()}
    n = len(effect["step_pair"])
    assert n == 199 and [tuple(p) for p in effect["step_pair"]] == [(t, t + 1) for t in range(199)]
    assert cause["step_pair"] == effect["step_pair"]
    for j, name in enumerate(f.names):
        for col in ("delta_z", "se", "t", "p", "moved"):
            assert len(effect[col][name]) == n
        assert len(cause["selection"][name]) == len(cause["se"][name]) == n
        want = [mean[t1][j] - mean[t0][j] for t0, t1 in effect["step_pair"]]
        # a cell not identified (constant within every prompt group) is null in dz, SE, t, p and
        # moved alike; every other dz is the difference of the steps' means
        unseen = [v is None for v in effect["t"][name]]
        for col in ("delta_z", "se", "p", "moved"):
            assert [v is None for v in effect[col][name]] == unseen, (name, col)
        got = [v for v, u in zip(effect["delta_z"][name], unseen) if not u]
        assert got == pytest.approx([w for w, u in zip(want, unseen) if not u], rel=1e-9, abs=1e-12)
    for i in (0, 57, 198):  # s_t = mean over the step's rollouts of (z - group mean)(A - group mean)
        t0 = effect["step_pair"][i][0]
        rows = step == t0
        zc, ac = z[rows].copy(), a[rows].copy()
        for g in set(groups[rows]):
            m = groups[rows] == g
            zc[m] -= zc[m].mean(axis=0)
            ac[m] -= ac[m].mean()
        s = (zc * ac[:, None]).mean(axis=0)
        got = [cause["selection"][name][i] for name in f.names]
        assert got == pytest.approx(s.tolist(), rel=1e-9, abs=1e-12)
    for key in ("cosine", "kl_quad", "kl_along", "kl_collateral", "resolved"):
        assert len(cause[key]) == n
    assert means["step"] == sorted(mean) and means["n"] == [int((step == s).sum()) for s in means["step"]]
    for j, name in enumerate(f.names):
        assert means["mean"][name] == pytest.approx([mean[s][j] for s in means["step"]], rel=1e-9, abs=1e-12)
        se = [z[step == s, j].std(ddof=1) / np.sqrt((step == s).sum()) for s in means["step"]]
        assert means["se"][name] == pytest.approx(se, rel=1e-6, abs=1e-12)


def test_publishing_fewer_runs_keeps_the_others_unless_pruned(tmp_path):
    """A site that holds runs A and B, published again with A alone: B stays, listed in the
    index with its numbers (it used to vanish without a word); --prune drops it."""
    site = tmp_path / "site"
    assert _cli("publish", str(LONG), str(PAIRED), "--site", str(site), "--quiet").returncode == 0
    before = sorted(p.name for p in (site / "runs").iterdir())
    r = _cli("publish", str(PAIRED), "--site", str(site))
    assert r.returncode == 0 and "kept 1 run(s) already on the site" in r.stdout and "--prune" in r.stdout
    assert sorted(p.name for p in (site / "runs").iterdir()) == before
    index = (site / "index.md").read_text()
    paired = next(n for n in before if n.startswith("paired"))
    glance = json.loads((site / "runs" / paired / "report.json").read_text())["glance"]
    # the index states each run's numbers: the paired run's eta, as its own report writes it
    assert f"{round(100 * glance['eta_run'])} %" in index and f"{glance['resolved']} of {glance['priced']}" in index
    assert all(n in index for n in before)
    assert _cli("publish", str(PAIRED), "--site", str(site), "--prune", "--quiet").returncode == 0
    assert [p.name for p in (site / "runs").iterdir()] == [paired]


def test_a_long_run_s_tables_are_cut_on_the_page_and_whole_in_the_json(monkeypatch):
    """A report's tables of a row per step pair show every row up to TABLE_WHOLE, and past it
    the first and last TABLE_ENDS with the count of those left out; report.json keeps every
    row. The paired example's 79 step pairs, with the bound lowered to 50 and 10: every row the
    pages show is, cell for cell and class for class, the row the whole table has."""
    from reward_lens.report import render

    report = build_report(open_run(PAIRED))
    as_dicts = report.model_copy(update={"books": [b.model_copy(update={"data": b.data_dict()}) for b in report.books]})
    whole_md, whole_html, whole_json = to_markdown(report), to_html(report), to_json(report)
    monkeypatch.setattr(render, "TABLE_WHOLE", 50)
    monkeypatch.setattr(render, "TABLE_ENDS", 10)
    md, html = to_markdown(report), to_html(report)
    assert to_json(report) == whole_json
    assert (to_markdown(as_dicts), to_html(as_dicts)) == (md, html)  # a report read back from its JSON
    cost = next(b for b in report.books if b.id == "cost").data
    pairs = [f"{a}→{b}" for a, b in cost.efficiency.step_pair]
    assert len(pairs) == 79
    note = ("The first 10 and the last 10 of 79 step pairs are shown (59 between them are left out here; "
            "the report in JSON holds every row).")
    # the efficiency, KL_min and price tables, each in both pages
    assert md.count(note) == 3 and html.count(note) == 3 and note not in whole_md and note not in whole_html
    assert html.count("(79 rows") == whole_html.count("(79 rows") == 2  # the collapsed tables' summaries
    md_rows_ = re.findall(r"^\| (\d+→\d+) \|.*$", md, re.M)
    html_rows_ = re.findall(r"<tr[^>]*><td>(\d+→\d+)</td>.*?</tr>", html)
    assert md_rows_ == html_rows_ == (pairs[:10] + pairs[-10:]) * 3
    assert re.findall(r"^\| (\d+→\d+) \|", whole_md, re.M) == pairs * 3
    whole_md_lines = set(whole_md.splitlines())
    for line in re.findall(r"^\| \d+→\d+ \|.*$", md, re.M):
        assert line in whole_md_lines, line
    for row in re.findall(r"<tr[^>]*><td>\d+→\d+</td>.*?</tr>", html):
        assert row in whole_html, row
    # each gap row has as many cells as its table's header
    gaps = 0
    for line in md.splitlines():
        if line.startswith("|---"):
            header = line
        elif line.startswith("| … "):
            gaps += 1
            assert line.count("…") == header.count("---"), line
    for table in html.split("<table>")[1:]:
        for gap in re.findall(r'<tr class="gap">.*?</tr>', table.split("</table>")[0]):
            gaps += 1
            assert gap.count("<td") == table.split("</tr>")[0].count("<th"), gap
    assert gaps == 6
    assert md.count("\n| … |") == 3 and html.count('<tr class="gap">') == 3
    # the figures still cover every step pair: the pages' svg is unchanged
    assert re.findall(r"<svg.*?</svg>", html, re.S) == re.findall(r"<svg.*?</svg>", whole_html, re.S) != []
