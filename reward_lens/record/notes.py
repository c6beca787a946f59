"""Notes a record's manifest carries that later layers look for by their first words.

They live in the record layer (which imports nothing above it) so that the findings and the
report read them without importing an importer.
"""

from __future__ import annotations

from collections.abc import Sequence

# The note a record carries when the importer had to assume the reward weights (its first words
# are how a reader of the record finds it: ``assumed_reward_weights``).
ASSUMED_WEIGHTS = "reward weights assumed"


def assumed_reward_weights(notes: Sequence[str]) -> str | None:
    """The record's note that its reward weights were assumed at import, if it has one."""
    return next((n for n in notes if n.startswith(ASSUMED_WEIGHTS)), None)


# The note a record carries when its rollouts' advantages were derived at import (veRL dumps none;
# for GRPO they follow from score and group), not read from what the trainer's loss used.
DERIVED_ADVANTAGES = "advantages derived"


def derived_advantages(notes: Sequence[str]) -> str | None:
    """The record's note that its advantages were derived at import, if it has one."""
    return next((n for n in notes if n.startswith(DERIVED_ADVANTAGES)), None)
