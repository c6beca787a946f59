"""Copy what the benchmark scripts saved (``--save``: bench/results/*.txt) into the blocks of the
docs that quote them, so a page says exactly what its script printed (tests/unit/test_docs.py
keeps them equal).

    python tools/bench_quotes.py
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# (page, block, saved output, fenced as code)
QUOTES = [("docs/benchmarks.md", "tap-forward", "tap_forward.txt", True),
          ("docs/recording.md", "tap-overhead", "tap_overhead.txt", True),
          ("docs/recording.md", "cost-precision", "cost_precision.txt", False),
          ("docs/science.md", "truth-default-budget", "truth_default_budget.txt", True),
          ("docs/benchmarks.md", "report-large", "report_large.txt", True),
          ("docs/benchmarks.md", "report-large-tapped", "report_large_tapped.txt", True),
          ("docs/benchmarks.md", "report-large-paired", "report_large_paired.txt", True),
          ("docs/benchmarks.md", "report-phases", "report_phases.txt", True),
          ("docs/benchmarks.md", "report-tapped-vs-before", "report_tapped_vs_before.txt", True)]


def quoted(saved: str, fenced: bool) -> str:
    text = (RESULTS / saved).read_text().strip()
    return f"```\n{text}\n```" if fenced else text


def main() -> None:
    for page, block, saved, fenced in QUOTES:
        path = REPO / page
        if not (RESULTS / saved).exists():
            print(f"{saved}: not saved yet (run its script with --save)")
            continue
        text = path.read_text()
        new = re.sub(rf"(<!-- {block}:start -->\n).*?(<!-- {block}:end -->)",
                     lambda m: m.group(1) + quoted(saved, fenced) + "\n" + m.group(2), text, flags=re.S)
        path.write_text(new)
        print(f"{page}: {block} <- bench/results/{saved}")


if __name__ == "__main__":
    main()
