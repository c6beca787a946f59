"""The one error a bad record raises."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class RecordError(ValueError):
    """A record (or an input being imported) is missing, corrupt or inconsistent.

    The message names the file, and where it applies the field and the step(s), so that a
    person can find the problem without a debugger.

    ``steps`` are the record's 0-based steps, unless ``step_key`` names the key of the user's own
    file they were read from (an importer: TRL's ``step`` is 1-based, after the update); then
    the message quotes them as that key's values ("at `step` 5"), the number the user will find.
    """

    def __init__(self, file: str | Path, problem: str, *, field: str | None = None,
                 steps: Iterable[int] | None = None, step_key: str | None = None):
        self.file = str(file)
        self.field = field
        self.steps = tuple(int(s) for s in steps) if steps is not None else ()
        self.step_key = step_key
        where = self.file
        if field:
            where += f": field `{field}`"
        if self.steps:
            shown = ", ".join(str(s) for s in self.steps[:8])
            more = f" and {len(self.steps) - 8} more" if len(self.steps) > 8 else ""
            label = f"`{step_key}`" if step_key else f"step{'s' if len(self.steps) > 1 else ''}"
            where += f" at {label} {shown}{more}"
        super().__init__(f"{where}: {problem}")
