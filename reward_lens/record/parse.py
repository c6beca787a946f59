"""Parsing what a run leaves as text -- a trainer config (JSON or YAML), a JSON-lines dump --
into Python objects, with every failure a RecordError naming the file (and line). One place for
the importers and the audit, so that a bad file reads the same whichever command met it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from reward_lens.record.errors import RecordError
from reward_lens_spec.files import UnreadableFile, require_regular
from reward_lens_spec.yamlload import YamlTooLarge, json_loads_unique, safe_load_bounded


def config_mapping(path: Path, text: str, *, what: str, mapping: str) -> dict[str, Any]:
    """``text`` (read from ``path``) as a config mapping: JSON where the file is ``.json``, else
    YAML (aliases bounded), a key given twice refused in either. ``what`` names the config in the
    too-deep message; ``mapping`` is the message where the document is not a mapping."""
    is_json = path.suffix == ".json"
    try:
        data = json_loads_unique(text) if is_json else safe_load_bounded(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise RecordError(path, f"not valid {'JSON' if is_json else 'YAML'} ({msg})") from None
    except YamlTooLarge as exc:
        raise RecordError(path, str(exc)) from None
    except RecursionError:
        raise RecordError(path, f"nested too deeply to be {what}") from None
    if not isinstance(data, dict):
        raise RecordError(path, mapping)
    return data


def jsonl_objects(path: Path, *, corrupt: str, nested: str, line: str) -> Iterator[tuple[int, str, dict]]:
    """(line number, ``file:line``, object) for each non-blank line of a JSON-lines file (a regular
    file: a FIFO is refused, never waited on). ``corrupt`` follows "not valid JSON (...): " for a
    line that does not parse, ``nested`` completes "JSON nested too deeply to be ...", and ``line``
    names what a line is ("a dump line") where one is not a JSON object."""
    try:
        require_regular(path)
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(where, f"not UTF-8 text (byte {exc.start + 1} of the line)") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)  # NaN and Infinity parse as floats: Python's json.dumps writes them
            except json.JSONDecodeError as exc:
                raise RecordError(where, f"not valid JSON ({exc.msg}): {corrupt}") from None
            except RecursionError:
                raise RecordError(where, f"JSON nested too deeply to be {nested}") from None
            if not isinstance(obj, dict):
                raise RecordError(where, f"{line} is a JSON object, not {type(obj).__name__}")
            yield lineno, where, obj
