"""Importers: convert what a framework leaves on disk into a reward-lens record."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from reward_lens.record.errors import RecordError


def shown(value: Any, limit: int = 80) -> str:
    """A value from a user's file as it appears in an error line: its repr, cut to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 1]}… ({len(text):,} characters)"


def finite_number(value: Any, where: str | Path, key: str, step: int) -> float:
    """A logged metric as a finite float, or a RecordError naming where, which key and step."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise RecordError(where, f"`{key}` is {shown(value)}, not a number", field=key, steps=[step]) from None
    except OverflowError:  # an int beyond float range
        raise RecordError(where, f"`{key}` is {shown(value)}, beyond a float's range", field=key, steps=[step]) from None
    if not math.isfinite(v):
        raise RecordError(where, f"`{key}` is {v}", field=key, steps=[step])
    return v


# Steps and counts are stored as int64.
INT64_MAX = 2 ** 63 - 1


def whole_number(value: Any, where: str | Path, key: str, *, minimum: int = 0) -> int:
    """A config or log value that must be a whole number (a step, a count), or a RecordError
    naming where and which key: not a bool, not a list, not 1e400, not beyond int64."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(where, f"`{key}` is {shown(value)}, not a whole number", field=key)
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise RecordError(where, f"`{key}` is {value!r}, not a whole number", field=key)
    v = int(value)
    if not minimum <= v <= INT64_MAX:
        raise RecordError(where, f"`{key}` is {v}, outside [{minimum}, 2^63 - 1]", field=key)
    return v
