"""Screenshot the first screen of a report for the README (docs/assets/first-screen.png).

    .venv/bin/python tools/screenshot.py [--example NAME] [--out docs/assets/first-screen.png]

The example is by default the one the README's main command reports (``main_example``). Builds the
example's HTML report in a temporary folder and opens it in headless Chromium (the
system browser, as the browser tests do; Playwright's own download is never used) at 1280 x 800.

Beside the image it writes ``<image>.json``: the example, the viewport and a hash of what the
first screen shows (``first_screen_hash``: the page's style and everything above the run's
details -- the summary card, the headline figure's data, the books' statements, the findings --
as the current templates, specs and fixtures render it). tests/unit/test_docs.py recomputes the
hash and fails when the image is older than what it shows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "assets" / "first-screen.png"
VIEWPORT = (1280, 800)
_SVG = re.compile(r"<svg\b.*?</svg>", re.S)
_FLOAT = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def main_example(readme: Path = REPO / "README.md") -> str:
    """The bundled example the README's main command reports (its ``--example NAME``)."""
    block = re.search(r"<!-- main-command:start -->\n```\n(.+?)\n```", readme.read_text(), re.S)
    found = re.search(r"reward-lens report --example (\S+)", block.group(1)) if block else None
    if not found:
        raise SystemExit(f"{readme}: its main command reports no `--example NAME`")
    return found.group(1)


def first_screen(html: str, figure_json: str) -> str:
    """What the first screen of a report's HTML shows, as text to hash: the <head> (its style) and
    the body up to the run's details, the headline figure's SVG replaced by its data (numbers to 4
    significant digits: the picture, not the last bits of a float)."""
    top = html[:html.index('<details id="run-details">')]
    data = _FLOAT.sub(lambda m: f"{float(m.group()):.4g}", figure_json)
    return _SVG.sub(lambda _m: data, top)


def first_screen_hash(example: str) -> str:
    """sha256 of ``first_screen`` of the example's report as the current code renders it."""
    from reward_lens.examples import example_features, example_record
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.record import open_run
    from reward_lens.report import build_report, to_html

    spec = example_features(example)
    report = build_report(open_run(example_record(example)), features=features_from(str(spec) if spec else None))
    figure = report.headline_figure.model_dump_json() if report.headline_figure is not None else ""
    return hashlib.sha256(first_screen(to_html(report), figure).encode()).hexdigest()


def stamp_path(image: Path) -> Path:
    return image.with_suffix(".json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", help="a bundled example (default: the README's main command's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.example = args.example or main_example()

    from playwright.sync_api import sync_playwright

    from reward_lens.cli import main as cli

    chromium = os.environ.get("REWARD_LENS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        print("headless Chromium is needed: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        rc = cli(["report", "--example", args.example, "--out", str(out), "--format", "html", "--quiet",
                  "--fail-on", "never"])
        if rc != 0:
            print(f"report of --example {args.example} exited {rc}", file=sys.stderr)
            return rc
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True,
                                        args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": VIEWPORT[0], "height": VIEWPORT[1]}, color_scheme="light")
            page.goto((out / "report.html").as_uri())
            page.wait_for_load_state("load")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
    stamp = {"example": args.example, "viewport": list(VIEWPORT), "first_screen_sha256": first_screen_hash(args.example)}
    stamp_path(args.out).write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"wrote {args.out} and {stamp_path(args.out).name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
