"""The agreement book: do the cost, effect and cause books agree, feature by feature?

For each feature of the basis:

- **share** -- its share of KL_min summed over the step pairs whose KL_min is resolved from
  noise (the cost book; null when none is);
- **moved?** -- the effect book's run-level drift is resolved (BH over the features);
- **selected?** -- the cause book's run-level selection differential is resolved (BH over the
  features): the reward asked for it, in the direction of the sign;
- **verdict** -- moved and selected in the same direction: *asked for and bought*; moved but not
  selected: *bought but not asked for (collateral)*; selected but not moved: *asked for, not
  bought*; neither: *neither*. Moved against the selected direction is *asked for, moved the
  other way* (a disagreement too).

Disagreements (collateral, not bought, the other way) are the headline of this book.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure.books import BookResult, RunContext
from reward_lens_spec.render import render_template

AGREE = "asked for and bought"
COLLATERAL = "bought but not asked for (collateral)"
NOT_BOUGHT = "asked for, not bought"
OTHER_WAY = "asked for, moved the other way"
NEITHER = "neither"
DISAGREEMENTS = (COLLATERAL, NOT_BOUGHT, OTHER_WAY)
SUMMARY_KEYS = {AGREE: "asked_for_and_bought", COLLATERAL: "collateral", NOT_BOUGHT: "asked_for_not_bought",
                OTHER_WAY: "asked_for_moved_the_other_way", NEITHER: "neither"}


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FeatureVerdict(_M):
    feature: str
    unit: str
    share: float | None = Field(description="share of KL_min over the resolved step pairs (0..1)")
    moved: bool | None
    drift: float | None
    selected: bool | None
    selection: float | None = Field(description="sum over steps of Cov(z, A) within groups")
    verdict: str | None = Field(description="null when a book it needs is refused")


class AgreementSection(_M):
    features: list[FeatureVerdict]
    summary: dict[str, float | int | str | None]


def verdict(moved: bool, drift: float, selected: bool, selection: float) -> str:
    if moved and selected:
        return AGREE if (drift > 0) == (selection > 0) else OTHER_WAY
    if moved:
        return COLLATERAL
    if selected:
        return NOT_BOUGHT
    return NEITHER


def agreement_table(features: Sequence[str], units: dict[str, str], shares: dict[str, float] | None,
                    drift: dict[str, tuple[bool, float]] | None,
                    selection: dict[str, tuple[bool, float]] | None) -> AgreementSection:
    """``drift`` and ``selection``: feature -> (resolved, value); None when that book is refused."""
    out = []
    for n in features:
        mv = drift.get(n) if drift is not None else None
        sl = selection.get(n) if selection is not None else None
        v = verdict(mv[0], mv[1], sl[0], sl[1]) if mv is not None and sl is not None else None
        out.append(FeatureVerdict(feature=n, unit=units.get(n, ""), share=shares.get(n) if shares else None,
                                  moved=mv[0] if mv else None, drift=mv[1] if mv else None,
                                  selected=sl[0] if sl else None, selection=sl[1] if sl else None, verdict=v))
    summary = {"features": len(out), "disagreements": sum(f.verdict in DISAGREEMENTS for f in out),
               **{key: sum(f.verdict == v for f in out) for v, key in SUMMARY_KEYS.items()}}
    return AgreementSection(features=out, summary=summary)


def agreement_section(ctx: RunContext) -> BookResult:
    effect, cause, cost = ctx.result("effect"), ctx.result("cause"), ctx.result("cost")
    names = list(ctx.features.names)
    units = ctx.features.units()
    drift = {d.feature: (d.moved, d.drift) for d in effect.data.drift} if effect.data is not None else None
    selection = ({x.feature: (x.selected, x.total) for x in cause.data.selected}
                 if cause.data is not None and cause.data.selected else None)
    shares = None
    if cost.data is not None:
        total, by_feature = cost.data.kl_min.resolved_totals()
        if total > 0:
            shares = {n: by_feature.get(n, 0.0) / total for n in names}
    sec = agreement_table(names, units, shares, drift, selection)
    refusals = [r for b in (effect, cause) if b.data is None for r in b.refusals]
    if drift is None or selection is None:
        status = "refused" if drift is None and selection is None else "partial"
    else:  # something to agree on needs something resolved: a move or an ask
        status = "computed" if any(f.moved or f.selected for f in sec.features) else "unresolved"
    ctxt = {"a": sec, "s": sec.summary, "dis": [f for f in sec.features if f.verdict in DISAGREEMENTS],
            "agree": [f for f in sec.features if f.verdict == AGREE], "status": status}
    headline = render_template("report/books/agreement.headline.j2", ctxt).strip()
    card = render_template("report/books/agreement.card.j2", ctxt).strip() or None
    # the refusals belong to the books that made them: this one only says it depends on them
    return BookResult(status, headline, refusals, sec, [], card)
