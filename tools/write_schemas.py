"""Write the JSON Schemas of reward-lens's machine-readable outputs into specs/schemas/.

A test compares the committed files with what the models generate, so a change to an
output's shape is a reviewed change to its schema.
"""

from __future__ import annotations

import json
from pathlib import Path

from reward_lens.audit import json_schema as audit_schema

ROOT = Path(__file__).resolve().parents[1] / "specs" / "schemas"


def main() -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / "audit.schema.json").write_text(json.dumps(audit_schema(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {ROOT / 'audit.schema.json'}")


if __name__ == "__main__":
    main()
