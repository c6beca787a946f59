"""The effect book: which behaviours moved, per step pair and over the run.

Per step pair, ``dz_j`` with its standard error and ``t = dz/SE`` from the same ledger the
cost book priced on (the paired ledger where the record supports it: step t's movement read on
samples independent of the step, its standard error conditional on the step's prompts -- the
stratified jackknife over each prompt's completions of each policy -- and t on its
Welch-Satterthwaite degrees of freedom; otherwise two samples of consecutive steps, read as
normal). Which step pairs are usable, which
cells are identified and which moved are the run's decisions (``measure.decisions``), made once:
a step pair refused by a premise gets no row here and no direction; a feature constant in
every prompt group of a step pair's sample is "not identified" there (its movement is invisible
to the sample), never "moved by 0".

Over the run, the drift of each feature is its mean over the last tenth of the steps minus its
mean over the first tenth (at least one step each), with a standard error that counts prompt
groups as the independent units where the record has groups (rollouts otherwise), and a
two-sided normal p-value; *moved over the run* is BH at q = 0.05 over the features. The drift
is read from the rollouts themselves (no weights), and is what the agreement book reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import special

from reward_lens.measure.books import BookResult, RunContext, status_of
from reward_lens.measure.efficiency.cost import rollouts_refusal
from reward_lens.measure.efficiency.eta import FDR_Q, benjamini_hochberg
from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.measure.decisions import Decisions
from reward_lens.measure.ledger.price import StepSample, sample_codes
from reward_lens_spec.render import render_template


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EffectRows(_M):
    """Every usable step pair's movement, as columns: ``t[f][i]`` is feature f's t at
    ``step_pair[i]`` (one list per feature and quantity: 10,000 step pairs are 36 lists, not
    10,000 objects, and ``pandas.DataFrame(rows["t"])`` reads them as a table). A cell whose
    feature is constant in every prompt group of the sample is not identified: null delta_z, se,
    t, p, moved (a 0 with an SE of 0 would read "no change, exactly", which the sample cannot
    show; the pages show a dash)."""

    step_pair: list[tuple[int, int]]
    delta_z: dict[str, list[float | None]] = Field(description="feature units; null: not identified (the feature is "
                                                               "constant within every prompt group of the sample)")
    se: dict[str, list[float | None]] = Field(description="standard error of delta_z; null: not identified")
    t: dict[str, list[float | None]]
    p: dict[str, list[float | None]]
    moved: dict[str, list[bool | None]] = Field(description="BH rejects dz = 0 for the feature at this step pair "
                                                            "(q over the identified cells); null: not identified")


class RefusedPairs(_M):
    """Step pairs no direction is stated for, by reason (``measure.decisions.REASONS``)."""

    reason: str
    words: str
    step_pairs: list[tuple[int, int]]


class DriftOut(_M):
    feature: str
    unit: str
    first: float = Field(description="mean over the first steps (first_steps)")
    last: float = Field(description="mean over the last steps (last_steps)")
    drift: float
    se: float | None = Field(description="null where it cannot be estimated (one prompt group on a side)")
    t: float | None
    p: float
    moved: bool = Field(description="BH at q = 0.05 over the features rejects drift = 0; never where se is null")
    rows_moved: int = Field(description="step pairs at which the feature moved")


class EffectSection(_M):
    ledger: str
    first_steps: list[int]
    last_steps: list[int]
    rows: EffectRows
    refused: list[RefusedPairs] = Field(default_factory=list)
    drift: list[DriftOut]
    summary: dict[str, float | int | str | None]


def _unit_means(samples: Sequence[StepSample]) -> np.ndarray:
    """The independent units of a set of steps: prompt-group means where groups exist (each
    step's groups are its own), rollouts otherwise; in step order, each step's groups in code
    order. One bincount per feature over ids numbered across the steps (the same sums, in the
    same order, as one per step)."""
    ids, offset = [], 0
    for s in samples:
        codes, g = sample_codes(s) if s.groups is not None else (np.arange(s.n), s.n)
        ids.append(codes + offset)
        offset += g
    uid = np.concatenate(ids)
    z = np.concatenate([s.z for s in samples])
    size = np.bincount(uid, minlength=offset).astype(float)
    return np.stack([np.bincount(uid, weights=z[:, j], minlength=offset) for j in range(z.shape[1])], 1) / size[:, None]


def drift(samples: Sequence[StepSample], names: Sequence[str], units: dict[str, str]) -> tuple[list[DriftOut], list[int], list[int]]:
    ordered = sorted(samples, key=lambda s: s.step)
    w = max(1, round(0.1 * len(ordered)))
    first, last = ordered[:w], ordered[-w:]
    uf, ul = _unit_means(first), _unit_means(last)
    mf = np.vstack([s.z for s in first]).mean(axis=0)
    ml = np.vstack([s.z for s in last]).mean(axis=0)
    se = np.sqrt(uf.var(axis=0, ddof=1) / len(uf) + ul.var(axis=0, ddof=1) / len(ul)) if min(len(uf), len(ul)) > 1 \
        else np.full(len(names), np.nan)
    d = ml - mf
    with np.errstate(divide="ignore", invalid="ignore"):  # no SE (one unit a side): no test, not moved
        t = np.where(np.isnan(se), np.nan, np.where(se > 0, d / se, np.where(d == 0, 0.0, np.inf)))
    p = 2 * special.ndtr(-np.abs(t))
    p = np.where(np.isfinite(p), p, 1.0)
    moved = benjamini_hochberg(p, FDR_Q) if len(ordered) > 1 else np.zeros(len(names), bool)
    out = [DriftOut(feature=n, unit=units.get(n, ""), first=float(mf[j]), last=float(ml[j]), drift=float(d[j]),
                    se=float(se[j]) if np.isfinite(se[j]) else None,
                    t=None if np.isnan(t[j]) else float(t[j]) if np.isfinite(t[j]) else float(np.sign(d[j]) * 1e300),
                    p=float(p[j]), moved=bool(moved[j]), rows_moved=0)
           for j, n in enumerate(names)]
    return out, [s.step for s in first], [s.step for s in last]


def effect_series(decisions: Decisions, samples: Sequence[StepSample], units: dict[str, str] | None = None
                  ) -> EffectSection:
    """What moved: per usable step pair from the run's ``decisions``, over the run from ``samples``."""
    from reward_lens.measure.decisions import REASONS

    units = units or {}
    d = decisions
    names = list(d.names)

    def columns(a: np.ndarray, mask: np.ndarray | None = None) -> dict[str, list]:
        if mask is None:
            return dict(zip(names, a.T.tolist()))
        return {n: [v if ok else None for v, ok in zip(col, m)] for n, col, m in zip(names, a.T.tolist(), mask.T.tolist())}

    rows = EffectRows(step_pair=list(d.usable), delta_z=columns(d.delta_z, d.identified), se=columns(d.se, d.identified),
                      t=columns(d.t, d.identified), p=columns(d.p, d.identified),
                      moved=columns(d.moved, d.identified))
    dr, first, last = drift(samples, names, units)
    dr = [x.model_copy(update={"rows_moved": d.cells_moved(x.feature)}) for x in dr]
    refused = [RefusedPairs(reason=why, words=REASONS.get(why, why), step_pairs=pairs)
               for why, pairs in d.refused_by_reason().items()]
    counts = d.summary()
    summary = {"rows": counts["usable"], "rows_refused": counts["refused"], "step_pairs": counts["step_pairs"],
               "rows_resolved": counts["resolved"],
               "rows_with_movement": counts["moved"], "cells": counts["cells"],
               "cells_not_identified": counts["cells"] - counts["cells_identified"],
               "cells_moved": counts["cells_moved"], "features_moved": sum(x.moved for x in dr), "features": len(dr),
               "false_discoveries_expected": FDR_Q * counts["cells_moved"]}
    return EffectSection(ledger=d.ledger, first_steps=first, last_steps=last, rows=rows, refused=refused, drift=dr,
                         summary=summary)


def effect_figures(e: EffectSection) -> list[FigureOut]:
    if not e.rows.step_pair:
        return []
    x = [float(pair[0]) for pair in e.rows.step_pair]
    panels = []
    for d in e.drift:
        n = d.feature
        t, moved = e.rows.t[n], e.rows.moved[n]
        seen = [i for i, v in enumerate(t) if v is not None]  # identified cells only: no t of an unseen movement
        panels.append(Panel(title=f"{n} ({d.unit})", y_label="t = Δz / SE", zero_line=True, series=[
            Series(x=[x[i] for i in seen], y=[t[i] for i in seen], color="#9aa5a0"),
            Series(x=[x[i] for i in seen if moved[i]], y=[t[i] for i in seen if moved[i]], style="points",
                   color="#c0392b")]))
    return [FigureOut(id="effect-t", x_label="step t (pair t → t+1)", columns=3, panels=panels, caption=(
        "Each feature's movement per step pair in standard errors (t = Δz/SE); red points moved "
        "(Benjamini–Hochberg at q = 0.05 over the identified cells). Refused step pairs and features "
        "constant in every prompt group are not drawn."))]


def effect_section(ctx: RunContext) -> BookResult:
    from reward_lens.measure.efficiency.section import not_formed_refusals, premise_refusals

    run = ctx.run
    if not run.n_rollouts:
        return BookResult("refused", "No rollouts: nothing can be said to have moved.", [rollouts_refusal(run, [])])
    priced = ctx.priced
    ledgers = priced.ledgers if priced is not None else []
    refusals = ([*not_formed_refusals(run, priced, "effect"), *premise_refusals(run, priced, "effect")]
                if priced is not None else [])
    if not ledgers:
        refusals = refusals or [rollouts_refusal(run, ctx.samples)]
        return BookResult("refused", "No step pair has a feature movement.", refusals)
    sec = effect_series(ctx.decisions, ctx.samples, ctx.features.units())
    status = status_of(True, refusals, sec.summary["rows_with_movement"] > 0 or sec.summary["features_moved"] > 0)
    moved = sorted((d for d in sec.drift if d.moved), key=lambda d: -abs(d.t))
    headline = render_template("report/books/effect.headline.j2", {"s": sec.summary, "moved": moved, "e": sec})
    return BookResult(status, headline.strip(), refusals, sec, effect_figures(sec))
