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
from reward_lens_spec.files import UnreadableFile, read_text

Loc = tuple[Any, ...]

# libyaml's safe loader where PyYAML was built with it (the same YAML, 5-10x faster: the
# report parses every book spec); the pure-Python one otherwise.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# A YAML document expands aliases: a few hundred bytes of nested aliases ("billion laughs")
# expand to billions of nodes, and an alias inside its own anchor to an infinite structure.
# Documents are checked on the composed node graph before anything walks the data: no
# cycles, and at most this many nodes once aliases are expanded (a trainer config or spec
# has hundreds).
MAX_EXPANDED_NODES = 100_000


class YamlTooLarge(ValueError):
    """A document whose aliases recurse or expand beyond MAX_EXPANDED_NODES."""


def duplicate_key(key: yaml.Node, first: yaml.Node) -> yaml.YAMLError:
    """A mapping key given twice. PyYAML keeps the last value silently (a ``target: higher`` then
    ``target: lower`` flips a target with nothing said, issue 61), so every document this project
    reads -- spec, basis, config -- refuses it, naming both lines (a YAMLError with the mark of
    the second, so each caller's message names the line as for any invalid YAML)."""
    return yaml.constructor.ConstructorError(
        None, None, f"duplicate key {key.value!r} (first given on line {first.start_mark.line + 1}; YAML keeps "
                    "only one of them)", key.start_mark)


def check_expansion(node: yaml.Node | None) -> None:
    """Raise YamlTooLarge (with the line) for a recursive alias or an expansion beyond the
    limit, and a YAMLError (``duplicate_key``) for a mapping key given twice; counts with
    memoisation, so the check itself is linear in the document."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise YamlTooLarge(f"line {n.start_mark.line + 1}: an alias refers to the node that contains it "
                               "(a recursive structure)")
        on_path.add(key)
        total = 1
        if isinstance(n, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Node] = {}
            for k, v in n.value:
                # merge keys (<<) may repeat; every other scalar key is unique within its mapping
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    ident = (k.tag, k.value)
                    if ident in seen:
                        raise duplicate_key(k, seen[ident])
                    seen[ident] = k
                total += size(k) + size(v)
        elif isinstance(n, yaml.SequenceNode):
            for v in n.value:
                total += size(v)
        on_path.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise YamlTooLarge(f"line {n.start_mark.line + 1}: aliases expand this document beyond "
                               f"{MAX_EXPANDED_NODES:,} nodes")
        sizes[key] = total
        return total

    if node is not None:
        size(node)


def safe_load_bounded(text: str) -> Any:
    """``yaml.safe_load`` after ``check_expansion``; raises yaml.YAMLError or YamlTooLarge."""
    node = yaml.compose(text, Loader=SafeLoader)
    check_expansion(node)
    return yaml.load(text, Loader=SafeLoader)


def json_loads_unique(text: str) -> Any:
    """``json.loads`` that refuses a key given twice in one object, as the YAML loader does: the
    standard library keeps the last value silently. Raises json.JSONDecodeError at the second
    occurrence of the key (its line and column), so every caller's message names where."""
    import json

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                quoted = json.dumps(key)
                first = text.find(quoted)
                second = text.find(quoted, first + len(quoted)) if first >= 0 else -1
                raise json.JSONDecodeError(f"the key {quoted} is given twice in one object (the first value "
                                           "would be dropped without a word)", text, max(second, 0))
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=pairs)


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[Loc, int]]:
    try:
        text = read_text(path)  # a FIFO is refused unopened; bytes that are not UTF-8 are named with the file
    except UnreadableFile as exc:
        raise SpecError(str(exc)) from None
    try:
        node = yaml.compose(text, Loader=SafeLoader)
        check_expansion(node)
        data = yaml.load(text, Loader=SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{path}:{line}: invalid YAML: {problem}") from None
    except (YamlTooLarge, RecursionError) as exc:
        raise SpecError(f"{path}: {exc if isinstance(exc, YamlTooLarge) else 'nested too deeply'}") from None
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
