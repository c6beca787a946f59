"""The one error a bad record raises."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class RecordError(ValueError):
    """A record (or an input being imported) is missing, corrupt or inconsistent.

    The message names the file, and where it applies the field and the step(s), so that a
    person can find the problem without a debugger.
    """

    def __init__(self, file: str | Path, problem: str, *, field: str | None = None,
                 steps: Iterable[int] | None = None):
        self.file = str(file)
        self.field = field
        self.steps = tuple(int(s) for s in steps) if steps is not None else ()
        where = self.file
        if field:
            where += f": field `{field}`"
        if self.steps:
            shown = ", ".join(str(s) for s in self.steps[:8])
            more = f" and {len(self.steps) - 8} more" if len(self.steps) > 8 else ""
            where += f" at step{'s' if len(self.steps) > 1 else ''} {shown}{more}"
        super().__init__(f"{where}: {problem}")
