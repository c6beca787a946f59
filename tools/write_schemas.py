"""Write the JSON Schemas of reward-lens's machine-readable outputs into specs/schemas/.

A test compares the committed files with what the models generate, so a change to an
output's shape is a reviewed change to its schema.
"""

from __future__ import annotations

import json
from pathlib import Path

from reward_lens.audit import json_schema as audit_schema
from reward_lens.measure.books import import_object
from reward_lens.report.check import CheckOut
from reward_lens.report.diff import Diff
from reward_lens_spec import load_books

ROOT = Path(__file__).resolve().parents[1] / "specs" / "schemas"


def main() -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        path = ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")


def schemas() -> dict[str, dict]:
    """Every machine-readable output's schema, by file name under specs/schemas/: the shape each
    is written in (serialization mode: a field the output leaves out is not in its schema)."""
    out = {"audit.schema.json": audit_schema(), "diff.schema.json": Diff.model_json_schema(mode="serialization"),
           "check.schema.json": CheckOut.model_json_schema(mode="serialization")}
    for book in load_books().values():
        if book.report is not None:  # a report's books[].data, per book
            out[f"books/{book.id}.schema.json"] = import_object(book.report.model).model_json_schema()
    return out


if __name__ == "__main__":
    main()
