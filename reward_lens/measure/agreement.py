"""The agreement book: do the cost, effect and cause books agree, feature by feature?

For each feature of the basis:

- **share** -- its share of KL_min summed over the step pairs whose movement is resolved (the
  run's decisions: the one place a share is computed; null when none is);
- **moved?** -- the effect book's run-level drift is resolved (BH over the features);
- **asked for?** -- the cause book's selection *gradient* is resolved (BH over the features):
  the reward selected on this feature itself, in the direction of its sign; or, for features so
  collinear within prompt groups that their gradients cannot be told apart, their joint test is
  resolved: asked for *jointly* with them;
- **selected?** -- the selection *differential* is resolved: the reward selected on it directly
  or through a feature it correlates with;
- **verdict** -- one per behaviour, decided once (``measure.decisions.verdict_of``) and read the
  same by every page, sign-aware: a behaviour is judged against the direction the reward selects
  it in. Asked for (directly, or jointly with behaviours too collinear to tell apart) and moved
  that way: *asked for and bought*; the other way: *asked for, moved the other way*; not moved:
  *asked for, not bought*. Not asked for but selected through a correlated behaviour, and moved
  with that selection: *carried along*; against it: *moved against what the reward selects*
  (never carried along). Moved with no selection on it at all: *collateral* (the reward-hacking
  signature in the named basis); none of these: *neither*.

A declared target (``target: higher|lower``: what the user wants) is judged against what the user
wants instead (``decisions.target_verdict_of``): it moved the wrong way, with the reward selecting
against it or not; no net change while the reward selects against it; moved as wanted; no net
change. Never "asked for and bought".

Disagreements (not bought, the other way, against, collateral, a target moved or pushed the wrong
way) are the headline of this book.
Hand-made cases are in tests/unit/test_books.py: a feature that only correlates with the
rewarded one is carried along, not asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure import decisions
from reward_lens.measure.books import BookResult, RunContext
from reward_lens.measure.decisions import Selection, asked_words, target_verdict_of, verdict_of
from reward_lens_spec.render import render_template

# The verdicts' words where no behaviour is asked for jointly (``templates/report/verdict.j2``).
AGREE = "asked for and bought"
CARRIED = "carried along"
COLLATERAL = "collateral"
NOT_BOUGHT = "asked for, not bought"
OTHER_WAY = "asked for, moved the other way"
AGAINST = "moved against what the reward selects"
NEITHER = "neither"
SUMMARY_KEYS = {decisions.BOUGHT: "asked_for_and_bought", decisions.CARRIED: "carried_along",
                decisions.COLLATERAL: "collateral", decisions.NOT_BOUGHT: "asked_for_not_bought",
                decisions.OTHER_WAY: "asked_for_moved_the_other_way", decisions.AGAINST: "moved_against_selection",
                decisions.NEITHER: "neither", decisions.TARGET_FELL_SELECTED_AGAINST: "target_selected_against_and_moved",
                decisions.TARGET_FELL: "target_moved_against_want",
                decisions.TARGET_SELECTED_AGAINST: "target_selected_against", decisions.TARGET_MET: "target_met",
                decisions.TARGET_STILL: "target_no_net_change"}


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FeatureVerdict(_M):
    feature: str
    unit: str
    share: float | None = Field(description="share of KL_min over the resolved step pairs (0..1)")
    moved: bool | None
    drift: float | None
    asked: Literal["directly", "jointly", "no"] | None = Field(None, description=(
        "what the reward asked for of it (the selection gradient): directly, jointly with the features it is "
        "collinear with, or no"))
    asked_for: str | None = Field(None, description="``asked`` in words, with the direction: yes (more), jointly "
                                                    "with ... (less), no")
    direction: int | None = Field(None, description="the direction asked for: +1 more, -1 less, 0 not asked")
    jointly_with: list[str] = Field(default_factory=list)
    gradient: float | None = Field(None, description="beta, advantage per feature unit")
    selected: bool | None = Field(description="the selection differential is resolved (directly or indirectly)")
    selection: float | None = Field(description="sum over steps of Cov(z, A) within groups")
    verdict_key: str | None = Field(None, description="one of measure.decisions.VERDICTS; null when a book it needs "
                                                      "is refused")
    verdict: str | None = Field(description="the verdict in words, the same on every page; null when a book it "
                                            "needs is refused")
    target: Literal["higher", "lower"] | None = Field(None, description=(
        "a declared target (what the user wants of it): its verdict is judged against that, not against what "
        "the reward asks (measure.decisions.target_verdict_of)"))


class AgreementSection(_M):
    features: list[FeatureVerdict]
    summary: dict[str, float | int | str | None]


def agreement_table(features: Sequence[str], units: dict[str, str], shares: dict[str, float] | None,
                    drift: dict[str, tuple[bool, float]] | None, selection: dict[str, Selection] | None,
                    gradients: dict[str, float | None] | None = None,
                    targets: dict[str, str] | None = None) -> AgreementSection:
    """``drift``: feature -> (resolved, value); ``selection``: feature -> what the reward selected
    of it (``decisions.Selection``); None when that book is refused. The verdicts are
    ``decisions.verdict_of``'s."""
    out = []
    for n in features:
        mv = drift.get(n) if drift is not None else None
        sl = selection.get(n) if selection is not None else None
        want = (targets or {}).get(n)
        if mv is None or sl is None:
            v = None
        elif want is not None:
            v = target_verdict_of(n, want, mv[0], mv[1], sl)
        else:
            v = verdict_of(mv[0], mv[1], sl)
        out.append(FeatureVerdict(target=want,
            feature=n, unit=units.get(n, ""), share=shares.get(n) if shares else None,
            moved=mv[0] if mv else None, drift=mv[1] if mv else None, asked=sl.asked if sl else None,
            asked_for=asked_words(sl) if sl else None, direction=sl.direction if sl else None,
            jointly_with=list(sl.jointly_with) if sl else [], gradient=(gradients or {}).get(n),
            selected=sl.selected if sl else None, selection=sl.differential if sl else None,
            verdict_key=v.key if v else None, verdict=v.words if v else None))
    summary = {"features": len(out), "disagreements": sum(f.verdict_key in decisions.DISAGREEMENTS for f in out),
               "asked_jointly": sum(f.asked == decisions.ASKED_JOINTLY for f in out),
               **{key: sum(f.verdict_key == v for f in out) for v, key in SUMMARY_KEYS.items()}}
    return AgreementSection(features=out, summary=summary)


def selection_from_cause(x) -> Selection:
    """The cause book's row of one behaviour (``cause.SelectedOut``) as a ``decisions.Selection``."""
    return Selection(x.asked, x.direction, tuple(x.collinear_with) if x.asked == decisions.ASKED_JOINTLY else (),
                     x.selected, x.total)


def agreement_section(ctx: RunContext) -> BookResult:
    effect, cause = ctx.result("effect"), ctx.result("cause")
    names = list(ctx.features.names)
    units = ctx.features.units()
    drift = {d.feature: (d.moved, d.drift) for d in effect.data.drift} if effect.data is not None else None
    rows = cause.data.selected if cause.data is not None and cause.data.selected else None
    selection = {x.feature: selection_from_cause(x) for x in rows} if rows else None
    sec = agreement_table(names, units, ctx.decisions.resolved_shares, drift, selection,
                          {x.feature: x.gradient for x in rows} if rows else None, targets=ctx.features.targets)
    refusals = [r for b in (effect, cause) if b.data is None for r in b.refusals]
    if drift is None or selection is None:
        status = "refused" if drift is None and selection is None else "partial"
    else:  # something to agree on needs something resolved: a move or an ask
        status = "computed" if any(f.moved or f.asked != decisions.NOT_ASKED for f in sec.features) else "unresolved"
    ctxt = {"a": sec, "s": sec.summary, "dis": [f for f in sec.features if f.verdict_key in decisions.DISAGREEMENTS],
            "agree": [f for f in sec.features if f.verdict_key == decisions.BOUGHT],
            "carried": [f for f in sec.features if f.verdict_key == decisions.CARRIED], "status": status}
    headline = render_template("report/books/agreement.headline.j2", ctxt).strip()
    # the refusals belong to the books that made them: this one only says it depends on them
    return BookResult(status, headline, refusals, sec, [])
