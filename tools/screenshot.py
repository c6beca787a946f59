"""Screenshot the first screen of a report for the README (docs/assets/first-screen.png).

    .venv/bin/python tools/screenshot.py [--example task] [--out docs/assets/first-screen.png]

Builds the example's HTML report in a temporary folder and opens it in headless Chromium (the
system browser, as the browser tests do; Playwright's own download is never used) at 1280 x 800.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default="task")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "assets" / "first-screen.png")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    args = ap.parse_args(argv)

    from playwright.sync_api import sync_playwright

    from reward_lens.cli import main as cli

    chromium = os.environ.get("REWARD_LENS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        print("headless Chromium is needed: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        rc = cli(["report", "--example", args.example, "--out", str(out), "--format", "html",
                  "--fail-on", "never"])
        if rc not in (0, 1):
            print(f"report of --example {args.example} exited {rc}", file=sys.stderr)
            return rc
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True,
                                        args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            page.goto((out / "report.html").as_uri())
            page.wait_for_load_state("load")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
