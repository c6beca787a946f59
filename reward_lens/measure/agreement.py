"""The agreement book: do the cost, effect and cause books agree, feature by feature?

For each feature of the basis:

- **share** -- its share of KL_min summed over the step pairs whose movement is resolved (the
  run's decisions: the one place a share is computed; null when none is);
- **moved?** -- the effect book's run-level drift is resolved (BH over the features);
- **asked for?** -- the cause book's selection *gradient* is resolved (BH over the features):
  the reward selected on this feature itself, in the direction of its sign;
- **selected?** -- the selection *differential* is resolved: the reward selected on it directly
  or through a feature it correlates with;
- **verdict** -- moved and asked for in the same direction: *asked for and bought*; in the
  opposite one: *asked for, moved the other way*; asked for, not moved: *asked for, not
  bought*; moved with a resolved differential but no direct selection, or against its direct
  selection but with its resolved total selection: *carried along* (it moved with what was asked
  for); moved with neither: *collateral* (the reward-hacking
  signature in the named basis); none of these: *neither*.

Disagreements (collateral, not bought, the other way) are the headline of this book. Hand-made
cases are in tests/unit/test_books.py: a feature that only correlates with the rewarded one is
carried along, not asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure.books import BookResult, RunContext
from reward_lens_spec.render import render_template

AGREE = "asked for and bought"
CARRIED = "carried along"
COLLATERAL = "collateral"
NOT_BOUGHT = "asked for, not bought"
OTHER_WAY = "asked for, moved the other way"
NEITHER = "neither"
DISAGREEMENTS = (COLLATERAL, NOT_BOUGHT, OTHER_WAY)
SUMMARY_KEYS = {AGREE: "asked_for_and_bought", CARRIED: "carried_along", COLLATERAL: "collateral",
                NOT_BOUGHT: "asked_for_not_bought", OTHER_WAY: "asked_for_moved_the_other_way", NEITHER: "neither"}


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FeatureVerdict(_M):
    feature: str
    unit: str
    share: float | None = Field(description="share of KL_min over the resolved step pairs (0..1)")
    moved: bool | None
    drift: float | None
    asked: bool | None = Field(None, description="the selection gradient is resolved: the reward asked for it directly")
    gradient: float | None = Field(None, description="beta, advantage per feature unit")
    selected: bool | None = Field(description="the selection differential is resolved (directly or indirectly)")
    selection: float | None = Field(description="sum over steps of Cov(z, A) within groups")
    verdict: str | None = Field(description="null when a book it needs is refused")


class AgreementSection(_M):
    features: list[FeatureVerdict]
    summary: dict[str, float | int | str | None]


def verdict(moved: bool, drift: float, asked: bool, gradient: float | None, selected: bool,
            selection: float | None = None) -> str:
    """The agreement of one feature: moved (its drift resolved), asked for (its selection
    gradient resolved, in the direction of the gradient's sign), selected (its differential
    resolved: directly or through a correlated feature). A feature asked for in one direction
    whose total selection (the differential, ``selection``) points the other way -- direct
    selection outweighed by selection on what it correlates with -- and that moved with the total
    was carried along, not moved against the reward: only a movement against both is."""
    if asked:
        if not moved:
            return NOT_BOUGHT
        if (drift > 0) == ((gradient or 0.0) > 0):
            return AGREE
        if selected and selection is not None and (drift > 0) == (selection > 0):
            return CARRIED
        return OTHER_WAY
    if moved:
        return CARRIED if selected else COLLATERAL
    return NEITHER


def agreement_table(features: Sequence[str], units: dict[str, str], shares: dict[str, float] | None,
                    drift: dict[str, tuple[bool, float]] | None,
                    selection: dict[str, tuple[bool, float, bool, float | None]] | None) -> AgreementSection:
    """``drift``: feature -> (resolved, value); ``selection``: feature -> (differential resolved,
    sum of differentials, gradient resolved, gradient); None when that book is refused."""
    out = []
    for n in features:
        mv = drift.get(n) if drift is not None else None
        sl = selection.get(n) if selection is not None else None
        v = verdict(mv[0], mv[1], sl[2], sl[3], sl[0], sl[1]) if mv is not None and sl is not None else None
        out.append(FeatureVerdict(feature=n, unit=units.get(n, ""), share=shares.get(n) if shares else None,
                                  moved=mv[0] if mv else None, drift=mv[1] if mv else None,
                                  asked=sl[2] if sl else None, gradient=sl[3] if sl else None,
                                  selected=sl[0] if sl else None, selection=sl[1] if sl else None, verdict=v))
    summary = {"features": len(out), "disagreements": sum(f.verdict in DISAGREEMENTS for f in out),
               **{key: sum(f.verdict == v for f in out) for v, key in SUMMARY_KEYS.items()}}
    return AgreementSection(features=out, summary=summary)


def agreement_section(ctx: RunContext) -> BookResult:
    effect, cause = ctx.result("effect"), ctx.result("cause")
    names = list(ctx.features.names)
    units = ctx.features.units()
    drift = {d.feature: (d.moved, d.drift) for d in effect.data.drift} if effect.data is not None else None
    selection = ({x.feature: (x.selected, x.total, x.direct, x.gradient) for x in cause.data.selected}
                 if cause.data is not None and cause.data.selected else None)
    sec = agreement_table(names, units, ctx.decisions.resolved_shares, drift, selection)
    refusals = [r for b in (effect, cause) if b.data is None for r in b.refusals]
    if drift is None or selection is None:
        status = "refused" if drift is None and selection is None else "partial"
    else:  # something to agree on needs something resolved: a move or an ask
        status = "computed" if any(f.moved or f.asked for f in sec.features) else "unresolved"
    ctxt = {"a": sec, "s": sec.summary, "dis": [f for f in sec.features if f.verdict in DISAGREEMENTS],
            "agree": [f for f in sec.features if f.verdict == AGREE],
            "carried": [f for f in sec.features if f.verdict == CARRIED], "status": status}
    headline = render_template("report/books/agreement.headline.j2", ctxt).strip()
    # the refusals belong to the books that made them: this one only says it depends on them
    return BookResult(status, headline, refusals, sec, [])
