"""Reading a framework spec's conditions (``Condition``: ``rejects``, ``supplies``, ``settings``)
against a configuration.

One reading, shared by the audit (before a run) and the importers (a record layer that imports
nothing above it): a condition that holds for the audit holds for the import.
"""

from __future__ import annotations

from typing import Any

from reward_lens_spec.models import Condition


def config_value(cfg: dict[str, Any], dotted: str, defaults: dict[str, Any]) -> tuple[Any, str]:
    """The value of a dotted key in a nested config and where it came from: ``"config"``, the
    spec's ``"default"``, or ``"unset"`` (None)."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return (defaults[dotted], "default") if dotted in defaults else (None, "unset")
        node = node[part]
    return node, "config"


def empty(value: Any) -> bool:
    """No value: null, an empty string, or an empty list or mapping (transformers reads an
    empty `fsdp` list as FSDP off)."""
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def holds(cond: Condition | list[Condition], cfg: dict[str, Any], defaults: dict[str, Any]) -> bool:
    """Whether a condition (a list: all of them) holds for ``cfg``, a spec default filling a key
    the config leaves out."""
    if isinstance(cond, list):
        return all(holds(c, cfg, defaults) for c in cond)
    v, _ = config_value(cfg, cond.key, defaults)
    if cond.op == "set":
        return not empty(v) and v is not False
    if cond.op == "unset":
        return empty(v)
    if cond.op == "eq":
        return v == cond.value
    if cond.op == "ne":
        return v != cond.value
    try:
        x = float(v)
    except (TypeError, ValueError):
        return False
    return x > float(cond.value) if cond.op == "gt" else x < float(cond.value)
