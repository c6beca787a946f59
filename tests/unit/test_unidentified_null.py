"""A (step pair, behaviour) cell whose dz is not identified -- the behaviour is constant within
every prompt group of the sample -- is null in report.json: dz, SE, t, p and moved alike (issue
62, item 3; it was dz 0.0 and SE 0.0 beside a null t, which a consumer reads as "no change,
exactly"). The effect book's JSON Schema says so, and the page still shows no number for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from jsonschema import Draft202012Validator

from reward_lens.examples import example_record
from reward_lens.record.reader import open_run
from reward_lens.report import build_report
from reward_lens.report.render import to_json

SCHEMA = Path(__file__).resolve().parents[2] / "specs" / "schemas" / "books" / "effect.schema.json"


def test_unidentified_cells_are_null_and_the_schema_says_so():
    report = build_report(open_run(example_record("tapped")))
    data = {b["id"]: b["data"] for b in json.loads(to_json(report))["books"]}["effect"]
    rows = data["rows"]
    unseen = seen = 0
    for name, t in rows["t"].items():
        for i, ti in enumerate(t):
            cell = [rows[c][name][i] for c in ("delta_z", "se", "t", "p", "moved")]
            if ti is None:
                assert cell == [None] * 5, (name, rows["step_pair"][i], cell)
                unseen += 1
            else:
                assert all(v is not None for v in cell) and cell[1] > 0, (name, rows["step_pair"][i], cell)
                seen += 1
    assert unseen == data["summary"]["cells_not_identified"] > 0 and seen > 0
    schema = json.loads(SCHEMA.read_text())
    errors = list(Draft202012Validator(schema).iter_errors(data))
    assert not errors, errors[0].message
    for col in ("delta_z", "se"):  # null is a declared value of a cell, not an accident of the validator
        items = schema["$defs"]["EffectRows"]["properties"][col]["additionalProperties"]["items"]
        assert {"type": "null"} in items["anyOf"]
