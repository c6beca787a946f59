"""Open the report and the site index in headless Chromium, as a person would.

Uses the system Chromium (Debian's `chromium`; `.ci/run` installs it through the README's
test command) driven by Playwright; Playwright's own browser download is never used.
Screenshots land in test-artifacts/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from reward_lens.record import open_run
from reward_lens.report import build_report, to_html
from reward_lens.report.site import publish
from tests.acceptance.test_reports import _hostile_record
from tests.conftest import LONG, SHORT

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


def _chromium() -> str:
    path = os.environ.get("REWARD_LENS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, ("headless Chromium is needed for this test: `apt-get install chromium` (the README's test "
                  "command does this), or point REWARD_LENS_CHROMIUM at a Chromium binary")
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        yield b
        b.close()


def _open(browser, path: Path, shot: str):
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
    return page, errors, requests


def test_report_renders_offline_with_plots_and_remedy(browser, tmp_path):
    out = tmp_path / "report.html"
    out.write_text(to_html(build_report(open_run(LONG))), encoding="utf-8")
    page, errors, requests = _open(browser, out, "report-long.png")
    assert errors == []
    assert requests == [out.as_uri()]  # no fonts, scripts, styles or images fetched
    for fig in ("cost-plot-kl-min", "cost-plot-shares", "cost-plot-means", "effect-plot-effect-t", "run-curves"):
        assert page.locator(f"#{fig} svg").count() == 1, fig
    assert page.locator("#cost-plot-efficiency").count() == 0  # no eta: refused
    box = page.locator("#cost-plot-kl-min svg").bounding_box()
    assert box and box["width"] > 300 and box["height"] > 80
    body = page.inner_text("body")
    assert "RECORD_INCOMPLETE" in body and "Remedy." in body and "Record the run with the reward-lens tap" in body
    # a remedy shows its first sentence; the rest is one click away
    ref = page.locator("#refusal-cost-record_incomplete")
    assert ref.count() == 1 and "Log the per-step KL" not in ref.inner_text()
    ref.locator("details.remedy-rest summary").first.click()
    assert "Log the per-step KL" in ref.inner_text()
    page.close()


def test_injected_script_does_not_run(browser, tmp_path):
    out = tmp_path / "hostile.html"
    out.write_text(to_html(build_report(open_run(_hostile_record(tmp_path)))), encoding="utf-8")
    page, errors, requests = _open(browser, out, "report-hostile.png")
    assert page.evaluate("window.__pwned") is None
    # only the report's own two scripts: the browser's JSON data and its hashed code
    assert page.locator("script").count() == 2 and page.locator("img").count() == 0
    assert "<script>window.__pwned = 1</script>" in page.inner_text("#samples")
    assert "<script>window.__pwned = 1</script>" in page.inner_text("#browser-rows")
    assert errors == [] and requests == [out.as_uri()]
    page.close()


def test_site_index_links_to_reports(browser, tmp_path):
    site = tmp_path / "site"
    publish([open_run(LONG), open_run(SHORT)], site)
    page, errors, requests = _open(browser, site / "index.html", "site-index.png")
    assert errors == [] and requests == [(site / "index.html").as_uri()]
    links = page.locator("#runs a")
    assert links.count() == 6
    page.locator("#runs a").first.click()
    page.wait_for_load_state("load")
    assert page.url.endswith("/report.html") and "The cost book" in page.inner_text("body")
    page.close()


RECORDS = ["long", "short", "tapped", "paired", "task", "gamed"]


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("name", RECORDS)
def test_summary_card_first_and_the_rollout_browser_filters(browser, tmp_path, name, scheme):
    from reward_lens.examples import example_features, example_record
    from reward_lens.measure.ledger.features import features_from

    run = open_run(example_record(name))
    spec = example_features(name)
    out = tmp_path / f"{name}.html"
    out.write_text(to_html(build_report(run, features=features_from(str(spec) if spec else None))), encoding="utf-8")
    page = browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme=scheme)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(out.as_uri())
    page.wait_for_load_state("load")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"first-screen-{name}-{scheme}.png"))
    assert errors == []
    card = page.locator("#summary-card").bounding_box()
    assert card is not None and card["y"] >= 0 and card["y"] + card["height"] <= 800, card  # no scrolling
    assert page.locator("#summary-card p").count() >= 2
    assert "`" not in page.inner_text("#summary-card")  # code spans rendered, never literal backticks
    if name in ("tapped", "paired", "task", "gamed"):  # records with D_t: the headline figure is on the first screen
        fig = page.locator("#headline-figure svg").bounding_box()
        assert fig is not None and fig["y"] + fig["height"] <= 800, fig
    dark = page.evaluate("matchMedia('(prefers-color-scheme: dark)').matches")
    assert dark == (scheme == "dark")
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert (bg == "rgb(18, 21, 27)") == (scheme == "dark")
    # the browser: every row at first, then only the steps asked for, then sorted by a feature
    rows = page.locator("#browser-rows tr")
    total = rows.count()
    assert total > 0 and f"{total} of {total} rollouts" in page.inner_text("#browser-count")
    steps = [int(t) for t in page.locator("#browser-rows tr td:first-child").all_inner_texts()]
    cut = sorted(set(steps))[len(set(steps)) // 2]
    page.fill("#browser-step-min", str(cut))
    kept = [int(t) for t in page.locator("#browser-rows tr td:first-child").all_inner_texts()]
    assert kept and all(s >= cut for s in kept) and len(kept) < total
    page.fill("#browser-step-min", "")
    first_feature = page.locator("#browser-sort option").nth(1).get_attribute("value")
    page.select_option("#browser-sort", first_feature)
    page.select_option("#browser-order", "asc")
    vals = [float(t) for t in page.locator("#browser-rows tr td:last-child").all_inner_texts() if t not in ("", "—")]
    assert vals == sorted(vals) and len(vals) > 1
    page.close()


def _main_command_first_screen(browser, tmp_path, shot: str):
    """The README's main command (its `reward-lens report ...` part, run as written), its
    report.json and its HTML opened at 1280 x 800, with the summary card checked to sit on the first
    screen without a page error: (the command's arguments, report.json, the page, the card, its text)."""
    import json
    import re
    import shlex

    from reward_lens.cli import main as cli

    readme = (REPO / "README.md").read_text()
    main = re.search(r"<!-- main-command:start -->\n```\n(.+?)\n```", readme, re.S).group(1)
    args = shlex.split(main.split("reward-lens ", 1)[1])
    out = tmp_path / "out"
    args[args.index("--out") + 1] = str(out)
    assert cli(args + ["--quiet"]) == 0
    data = json.loads((out / "report.json").read_text())
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto((out / "report.html").as_uri())
    page.wait_for_load_state("load")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / shot))
    assert errors == []
    card = page.locator("#summary-card")
    box = card.bounding_box()
    assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 800, box  # no scrolling
    return args, data, page, card, card.inner_text()


def test_the_main_commands_first_screen_shows_eta_the_shares_and_the_verdicts(browser, tmp_path):
    """The README's main command (its `reward-lens report ...` part, run as written) and its HTML's
    first screen at 1280 x 800, as a new user sees it: the run-level η with what it means, the
    shares, every behaviour's verdict, and no raw Markdown anywhere on the page outside record
    text."""
    import re

    _, data, page, card, text = _main_command_first_screen(browser, tmp_path, "first-screen-main-command.png")
    g = data["glance"]
    eta = f"η = {round(100 * g['eta_run'])} % [{round(100 * g['eta_run_interval'][0])} %, " \
          f"{round(100 * g['eta_run_interval'][1])} %], the share of the divergence the named behaviours needed"
    assert eta in text
    for s in g["shares"][:3]:
        assert f"{s['feature']} took {round(100 * s['share'])} %" in text, s
    words = {"bought": "moved as asked", "not_bought": "(asked for, not bought)", "carried": "carried along",
             "other_way": "moved the other way", "against": "moved against", "collateral": "collateral",
             # a declared target's own verdict (templates/report/verdict.j2's target macro)
             "target_against_selected": "the reward selected against it", "target_against": "against what you want",
             "target_selected_against": "while the reward selected against it", "target_met": "as you want",
             "target_still": "showed no net change"}
    for key, names in g["verdicts"].items():
        if key != "neither":
            assert words[key] in text and all(n in text for n in names), (key, names)
    for names in g["asked_jointly"]:
        assert " and ".join(names) + " jointly" in text
    # no raw Markdown on the page a reader sees (record text, the samples and the browser, aside)
    seen = page.evaluate("""() => { const b = document.body.cloneNode(true);
        b.querySelectorAll('#samples, #browser, script, style').forEach(e => e.remove()); return b.innerText; }""")
    assert "**" not in seen and "`" not in seen, re.findall(r".{30}(?:\*\*|`).{30}", seen)[:3]
    page.close()


def test_the_main_commands_first_screen_names_the_gaming_and_the_target_with_resolved_numbers(browser, tmp_path):
    """Issue #57: the README's main command (its `reward-lens report ...` part, run as written) shows,
    on its HTML's first screen at 1280 x 800, the gaming finding with the step it began, the declared
    target by name with its own verdict, and the run-level numbers resolved (η: no "Not resolved from
    noise"; the price resolved, in report.json)."""
    from reward_lens.examples import example_features
    from reward_lens.measure.ledger.basis import load_basis

    args, data, page, card, text = _main_command_first_screen(browser, tmp_path,
                                                              "first-screen-main-command-gaming.png")
    example = args[args.index("--example") + 1]
    spec = example_features(example)
    assert spec is not None, f"the main command's example {example!r} has no basis of its own to declare a target"
    targets = list(load_basis(spec).targets)
    assert targets, f"{spec} declares no target"

    # the gaming finding, named with its onset, leads the first screen
    gaming = [f for f in data["findings"] if f["id"] in ("proxy_gaming", "paid_for_drift") and f["status"] == "holds"
              and f["severity"] in ("warn", "critical")]
    assert gaming, [(f["id"], f["status"]) for f in data["findings"]]
    for f in gaming:
        assert f"{f['title']} ({f['severity']}, from step {f['onset']})".lower() in text.lower(), (f["id"], text)

    # the target, by name, with its own verdict (decided once: report.json's glance), a wrong-way
    # one (never "asked for and bought"), in bold on the card
    verdicts = {v["feature"]: v for v in data["glance"]["targets"]}
    assert set(targets) <= set(verdicts), (targets, verdicts)
    strong = card.locator("strong").all_inner_texts()
    for t in targets:
        assert t in text, t
        assert verdicts[t]["wrong"] and verdicts[t]["key"] in ("target_against", "target_against_selected"), verdicts[t]
        words = verdicts[t]["words"].replace("`", "")
        assert words[0].upper() + words[1:] in text, (words, text)
        assert any(t in x and "fell" in x for x in strong), strong

    # the run-level numbers resolved: eta (an interval above zero, no "Not resolved from noise") and the price
    g = data["glance"]
    assert "Not resolved from noise" not in text
    lo, hi = g["eta_run_interval"]
    assert 0 < lo <= g["eta_run"] <= hi <= 1, (lo, g["eta_run"], hi)
    assert f"η = {round(100 * g['eta_run'])} % [{round(100 * lo)} %, {round(100 * hi)} %]" in text
    assert g["reward_resolved"] and g["reward_per_nat"] > 0
    price = next(b for b in data["books"] if b["id"] == "price")
    assert price["status"] == "computed" and "reward units per nat" in page.inner_text("body")
    page.close()
