"""What the published reports of the reference records say (reports/runs/*/report.json): the
table docs/science.md quotes (a test keeps the quote equal to this output).

    python tools/reference_table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDS = {"long": "lowercase reward, lr 1e-2", "short": "digit reward, lr 5e-2",
           "tapped": "lowercase, 32 × 8, lr 5e-2", "paired": "lowercase, 8 × 8, lr 1e-2"}


def table(root: Path = REPO / "reports") -> str:
    lines = ["| record | steps × rollouts | ledger | η of the run [95 %] | updates: resolved / priced / refused |",
             "|---|---|---|---|---|"]
    for name, what in RECORDS.items():
        (path,) = (root / "runs").glob(f"{name}-*/report.json")
        r = json.loads(path.read_text())
        cost = next(b for b in r["books"] if b["id"] == "cost")
        s, g = cost["data"]["summary"], r["glance"]
        per_step = round(r["run"]["rollouts_per_step"])
        if s["eta_run"] is None:
            eta = "refused " + ", ".join(sorted({x["code"] for x in cost["refusals"]})) + " (no `D_t`)"
        else:
            lo, hi = s["eta_run_interval"]
            eta = f"{s['eta_run']:.2f} [{lo:.2f}, {hi:.2f}]"
        lines.append(f"| {name} ({what}) | {r['run']['steps']} × {per_step} | {s['ledger']} | {eta} | "
                     f"{g['resolved']} / {g['priced']} / {g['refused']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(table())
