"""Declared targets: what the user wants of the policy, applied to the basis a book reads.

A target is named where the user already is: the tap's ``target=`` (recorded in the manifest's
``targets``, specs/fields.yaml), ``reward-lens report|check --target NAME[:higher|lower]``, or a
basis file's ``target:`` on a feature. Each is one of

- a reward function (``of: reward``): its per-rollout score, ``rewards.NAME``;
- a feature (``of: feature``): one of the basis's, or one of specs/features/surface.yaml's;
- a check the reward does not pay for (``of: check``): scored by the tap into ``targets.NAME``.

``with_targets`` marks each in the basis (``target: higher|lower``), adding the feature where the
basis lacks it (a feature of the basis that reads the same reward function or check is marked
instead of adding a copy): a target is read in the same basis as every other behaviour, so the findings that
tell gaming from learning (proxy_gaming, paid_for_drift) and the agreement book see it. A target
added to the basis is a feature of it, so it is in the basis id; a target set on a feature the
basis already has is not (basis.py: targets are not part of the id).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from reward_lens.measure.ledger.basis import CheckDef, FeatureBasis, RewardDef, surface_definitions
from reward_lens.record.schema import TargetDecl

WANTS = ("higher", "lower")
_SPEC = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_.]*)(?::(?P<want>[A-Za-z]+))?$")


def parse_target(text: str, *, where: str = "--target") -> tuple[str, str]:
    """``NAME`` or ``NAME:higher|lower`` -> (name, want); ValueError naming ``where``."""
    m = _SPEC.match(text.strip()) if isinstance(text, str) else None
    if m is None or (m.group("want") is not None and m.group("want") not in WANTS):
        raise ValueError(f"{where} takes NAME or NAME:higher or NAME:lower (a reward function, a feature of the "
                         f"basis, or a check the tap recorded), not {text!r}")
    return m.group("name"), m.group("want") or "higher"


def resolve(name: str, want: str, basis: FeatureBasis, declared: Sequence[TargetDecl],
            reward_names: Iterable[str] | None = None) -> TargetDecl:
    """A target named without saying what it is: a feature of ``basis``, a target the record
    declared, a reward function the record has (``reward_names``, when known), a surface feature;
    else, with the reward functions unknown, a reward function (the basis names the record's own
    when none has it)."""
    if name in basis.names:
        return TargetDecl(name=name, want=want, of="feature")
    for d in declared:
        if d.name == name:
            return TargetDecl(name=name, want=want, of=d.of)
    rewards = set(reward_names) if reward_names is not None else None
    if rewards is not None and name in rewards:
        return TargetDecl(name=name, want=want, of="reward")
    if name in surface_definitions()[0]:
        return TargetDecl(name=name, want=want, of="feature")
    if rewards is not None:
        raise ValueError(f"target `{name}` is neither a reward function ({sorted(rewards) or 'none'}) nor a feature "
                         f"of the basis ({', '.join(basis.names)}) nor of specs/features/surface.yaml")
    return TargetDecl(name=name, want=want, of="reward")


def merged(declared: Sequence[TargetDecl], extra: Sequence[TargetDecl]) -> list[TargetDecl]:
    """The record's targets with ``extra`` (``--target``) laid over them: same name, extra's."""
    out = {d.name: d for d in declared}
    out.update({d.name: d for d in extra})
    return list(out.values())


def with_targets(basis: FeatureBasis, targets: Sequence[TargetDecl]) -> FeatureBasis:
    """``basis`` with each target marked (added where the basis lacks it). The same basis
    object when there is nothing to change. ValueError for a feature target that neither the
    basis nor the surface basis defines."""
    if not targets:
        return basis
    defs = list(basis.defs)
    index = {d.name: i for i, d in enumerate(defs)}
    surface = surface_definitions()[0]
    changed = False
    for t in targets:
        # a feature of the basis that already reads this reward function or check is the target
        # (a second copy would be a column collinear with it)
        same = next((d.name for d in defs if (t.of == "reward" and d.kind == "reward" and d.reward == t.name)
                     or (t.of == "check" and d.kind == "check" and d.check == t.name)), None)
        if t.name in index or same is not None:
            i = index[t.name if t.name in index else same]
            d = defs[i]
            if d.target != t.want:
                defs[i] = d.model_copy(update={"target": t.want})
                changed = True
            continue
        if t.of == "reward":
            new = RewardDef(kind="reward", name=t.name, reward=t.name, target=t.want)
        elif t.of == "check":
            new = CheckDef(kind="check", name=t.name, check=t.name, target=t.want)
        elif t.name in surface:
            new = surface[t.name].model_copy(update={"target": t.want})
        else:
            raise ValueError(f"target `{t.name}` names a feature that neither the basis ({', '.join(basis.names)}) "
                             "nor specs/features/surface.yaml defines")
        index[t.name] = len(defs)
        defs.append(new)
        changed = True
    if not changed:
        return basis
    return FeatureBasis(defs, source=basis.source, name=basis.label)


__all__ = ["WANTS", "merged", "parse_target", "resolve", "with_targets"]
