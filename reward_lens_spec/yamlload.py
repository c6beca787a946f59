"""YAML loading that remembers where each value came from.

``yaml.safe_load`` loses line numbers, so a pydantic error on a spec could only say *what*
is wrong. Here the document is composed into nodes first (still the safe loader: no
arbitrary tags), and every mapping key's line is recorded under its path, so that an error
at ``loc = ('requires', 1, 'alternatives')`` can be reported as ``cost.yaml:37``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from reward_lens_spec.errors import SpecError

Loc = tuple[Any, ...]


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[Loc, int]]:
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{path}:{line}: invalid YAML: {problem}") from None
    lines: dict[Loc, int] = {}
    if node is not None:
        _walk(node, (), lines)
    return data, lines


def _walk(node: yaml.Node, loc: Loc, lines: dict[Loc, int]) -> None:
    lines.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            lines[loc + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, loc + (key,), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[loc + (i,)] = item.start_mark.line + 1
            _walk(item, loc + (i,), lines)


def line_for(loc: Loc, lines: dict[Loc, int]) -> int:
    """The line of the deepest prefix of ``loc`` that the document has."""
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get((), 1)
