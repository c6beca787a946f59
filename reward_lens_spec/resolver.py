"""Which alternative of each requirement a run (or a logging config) supplies.

The input is a map ``field -> Presence`` (on how many steps the field is present, out of
how many), produced by ``reward_lens.record.Run.fields()`` for a record, or by the audit
from a logging config before training. The output says, per requirement, which alternative
is satisfied, which fields each alternative lacks, and which near misses are present: the
facts a remedy is rendered from. The resolver never computes a book.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reward_lens_spec.models import BookSpec, NearMiss, Requirement


@dataclass(frozen=True)
class Presence:
    """A field present on ``count`` of ``of`` steps (``of`` = steps in the run)."""

    count: int
    of: int

    @property
    def full(self) -> bool:
        return self.of > 0 and self.count >= self.of

    @property
    def any(self) -> bool:
        return self.count > 0


@dataclass(frozen=True)
class AlternativeStatus:
    id: str
    fields: tuple[str, ...]
    missing: tuple[str, ...]
    partial: tuple[str, ...]
    describe: str | None

    @property
    def satisfied(self) -> bool:
        return not self.missing and not self.partial


@dataclass(frozen=True)
class NearMissStatus:
    spec: NearMiss
    present: bool
    presence: Presence | None
    applies: bool  # False when the near miss only helps for optimizers this run did not use


@dataclass(frozen=True)
class RequirementStatus:
    requirement: Requirement
    alternatives: tuple[AlternativeStatus, ...]
    near_misses: tuple[NearMissStatus, ...]

    @property
    def satisfied_by(self) -> str | None:
        for alt in self.alternatives:
            if alt.satisfied:
                return alt.id
        return None

    @property
    def partially_by(self) -> str | None:
        for alt in self.alternatives:
            if not alt.missing and alt.partial:
                return alt.id
        return None


@dataclass(frozen=True)
class Resolution:
    book: BookSpec
    requirements: tuple[RequirementStatus, ...] = field(default_factory=tuple)

    def status(self, requirement_id: str) -> RequirementStatus:
        for st in self.requirements:
            if st.requirement.id == requirement_id:
                return st
        raise KeyError(requirement_id)

    @property
    def computable(self) -> bool:
        return all(st.satisfied_by is not None for st in self.requirements)


def resolve(book: BookSpec, supplied: dict[str, Presence], optimizer: str | None = None) -> Resolution:
    statuses = []
    for req in book.requires:
        alts = []
        for alt in req.alternatives:
            missing = tuple(f for f in alt.fields if f not in supplied or not supplied[f].any)
            partial = tuple(f for f in alt.fields if f in supplied and supplied[f].any and not supplied[f].full)
            alts.append(AlternativeStatus(alt.id, tuple(alt.fields), missing, partial, alt.describe))
        near = []
        for nm in req.near_misses:
            pres = supplied.get(nm.field)
            applies = nm.only_for_optimizers is None or (
                optimizer is not None and optimizer.lower() in {o.lower() for o in nm.only_for_optimizers}
            )
            near.append(NearMissStatus(nm, bool(pres and pres.any), pres, applies))
        statuses.append(RequirementStatus(req, tuple(alts), tuple(near)))
    return Resolution(book, tuple(statuses))
