"""Importers: convert what a framework leaves on disk into a reward-lens record."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from reward_lens.record.errors import RecordError


def finite_number(value: Any, where: str | Path, key: str, step: int) -> float:
    """A logged metric as a finite float, or a RecordError naming where, which key and step."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise RecordError(where, f"`{key}` is {value!r}, not a number", field=key, steps=[step]) from None
    if not math.isfinite(v):
        raise RecordError(where, f"`{key}` is {v}", field=key, steps=[step])
    return v
