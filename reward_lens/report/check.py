"""``reward-lens check --format json``: the shape of its one JSON object.

Its JSON Schema is ``specs/schemas/check.schema.json`` (tools/write_schemas.py; a test keeps it
current and validates the command's output against it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from reward_lens.findings import FindingOut

CHECK_SCHEMA_VERSION = "1.0"


class CheckOut(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal["1.0"] = CHECK_SCHEMA_VERSION
    run_id: str
    source: str = Field(description="what was read: the record directory, or the TRL output directory and which "
                                    "trainer_state.json")
    counts: dict[str, int] = Field(description="checked, holds, clear, not_evaluated, and holds by severity")
    findings: list[FindingOut]
    required_not_evaluated: list[str] = Field(default_factory=list, description=(
        "the findings named by --require that are not evaluated (each makes the command exit 1)"))
