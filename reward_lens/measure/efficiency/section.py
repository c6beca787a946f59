"""The cost book's section of a report: its data model, figures and builder.

Moved here from ``reward_lens/report/`` so that the report knows no book: ``specs/books/cost.yaml``
names ``cost_section`` (builder) and ``CostSection`` (model) under ``report:``.
"""

from __future__ import annotations

import functools
from typing import Annotated, Literal

from typing_extensions import TypedDict

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure.books import BookResult, RunContext, status_of
from reward_lens.measure.efficiency.cost import CostBook, rollouts_refusal
from reward_lens.measure.efficiency.metric import step_sums
from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.record.schema import tap_floor
from reward_lens_spec import Refusal, Subject, load_book, make_refusal
from reward_lens_spec.render import render_template


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FeatureOut(_M):
    name: str
    doc: str
    unit: str = Field(description="the feature's unit (shares and KL_min are in nats whatever it is)")
    status: str = Field(description="'priced', or why the feature is excluded from KL_min (a per-step metric: at how "
                                    "many of its steps, templates/report/feature_status.j2)")
    steps: int | None = Field(None, description="per-step metric: the steps it priced (null: one pooled metric)")
    steps_priced: int | None = Field(None, description="of them, the steps whose active set holds the feature")
    steps_constant: int | None = Field(None, description="of them, the steps where its within-group variance is zero")
    steps_collinear: int | None = Field(None, description="of them, the steps where earlier features explain it")
    priced: bool = Field(False, description="priced at one step or more: its shares have a column")


class MetricOut(_M):
    method: str
    scope: str = Field(description="'pooled' over the window, or 'per_step' (each step its own estimate)")
    n: int = Field(description="rollouts the estimate uses, over all steps")
    damping: float
    damping_stable: bool
    reading: str


class KlMinRows(_M):
    """Every step pair's KL_min row, as columns: entry i of every list belongs to
    ``step_pair[i]`` (one list per quantity and feature: 10,000 step pairs are a few lists, not
    10,000 objects)."""

    step_pair: list[tuple[int, int]]
    kl_min: list[float] = Field(description="nats per sequence: 1/2 dz^T G^-1 dz")
    noise_floor: list[float] = Field(description="nats per sequence: 1/2 tr(G^-1 Sigma_dz)")
    clears_noise_floor: list[bool] = Field(description="KL_min > floor + 2 null SD (a per-row test, no "
                                                       "multiplicity control)")
    p_value: list[float] = Field(description="of dz = 0 (unpaired: Hotelling T^2; paired: F-test of r on z "
                                             "within groups)")
    resolved: list[bool] = Field(description="rejected by Benjamini-Hochberg at q = 0.05 across the book's rows")
    leading_feature: list[str | None]
    shares: dict[str, list[float | None]] = Field(description="nats per sequence, by feature (null where the "
                                                              "feature is not priced at that step pair); a row's "
                                                              "shares sum to its kl_min")
    shares_inexact: list[bool] = Field(description="the share sum misses kl_min by more than 1e-6 relative "
                                                   "(G ill-conditioned: see condition)")
    condition: list[float] = Field(description="condition number of the active correlation matrix of G")

    def __len__(self) -> int:
        return len(self.step_pair)


class EfficiencyRows(_M):
    """Every row of the efficiency table (a step pair, or a window when steps > 1), as columns:
    entry i of every list belongs to ``step_pair[i]``."""

    step_pair: list[tuple[int, int]] = Field(description="first and last step of the row (a window when steps > 1)")
    steps: list[int] = Field(description="step pairs the row prices (its window)")
    status: list[Literal["resolved", "unresolved", "nothing_priced"]]
    kl_min: list[float] = Field(description="nats per sequence (paired: the exact I-projection on the sample)")
    kl_spent: list[float] = Field(description="D_t, nats per sequence: the denominator of this eta")
    kl_spent_se: list[float | None] = Field(description="D_t's standard error, nats per sequence: paired, the "
                                            "sample's own (conditional on the prompts; with the sampling of the "
                                            "prompt groups added where the budget measured a subset of them) "
                                            "moderated across the "
                                            "neighbouring updates (a window's members' added); unpaired, the "
                                            "record's as recorded; null where none")
    kl_spent_interval: list[tuple[float, float] | None] = Field(description="95 % interval of kl_spent (t on the "
                                                                "moderated SE's degrees of freedom), its lower end "
                                                                "at 0 at least (a KL is never negative); paired, "
                                                                "its upper end raised by the tail allowance (what "
                                                                "the sample of a sharpened prompt group did not "
                                                                "hold, allowed the largest token KL it saw); null "
                                                                "where kl_spent_se is")
    kl_spent_tail: list[float | None] = Field(description="nats by which kl_spent_interval's upper "
                                              "end was raised for that tail (a window's members' summed): 0 where "
                                              "nothing was added (no prompt group sharpened, or the unpaired "
                                              "ledger's interval, the record's as recorded); null where "
                                              "kl_spent_interval is")
    efficiency: list[Annotated[float, Field(ge=0.0)] | None] = Field(
        description="KL_min / D_t as the sample gives it, dimensionless, >= 0 (validated); unpaired rows are in "
                    "[0, 1] (the seed's envelope); paired rows divide by an independent D_t and may exceed 1 by "
                    "noise (beyond 3 SE they are refused); null when nothing was priced")
    efficiency_null: list[float | None] = Field(description="what sampling noise added to eta in expectation")
    efficiency_debiased: list[float | None] = Field(description="eta with that noise taken out (paired: the "
                                                                "jackknife's; unpaired: the noise floor); may be "
                                                                "below 0")
    interval: list[tuple[float, float] | None] = Field(description="95 % interval of efficiency_debiased, t on "
                                                       "its SE's degrees of freedom (a paired row of one step "
                                                       "pair: the jackknife's SE pooled with the neighbouring "
                                                       "updates', and widened to cover a bias up to the row's "
                                                       "own bias correction, |efficiency - efficiency_debiased|, "
                                                       "either way; a window of pairs: its own SE), its lower "
                                                       "end allowing for kl_spent's tail allowance (D_t may be "
                                                       "that much larger, eta that much smaller); null where "
                                                       "nothing was priced or no_interval")
    no_interval: list[bool] = Field(description="priced, but a priced behaviour varies in one prompt group only: the "
                                                "jackknife's spread is the estimate itself, so eta states no interval "
                                                "and is left out of eta_median")
    p_value: list[float | None]
    source: list[str]
    resolved: list[bool]
    d_t_checks: list[dict[str, tuple[float, float | None]]] = Field(
        description="D_t by source (nats per sequence, SE): same_sample, token_kl, record")
    d_t_disagrees: list[bool] = Field(description="token_kl and record differ by more than 3 combined SEs")

    def __len__(self) -> int:
        return len(self.step_pair)


class FeatureMeans(_M):
    """Each step's feature means and their standard errors, as columns: entry i of every list
    belongs to ``step[i]`` (one list per feature, not one object per step)."""

    step: list[int]
    n: list[int] = Field(description="rollouts of the step")
    mean: dict[str, list[float]] = Field(description="by feature, in the feature's unit")
    se: dict[str, list[float]] = Field(description="by feature: the standard error of the step's mean")


_Count = Annotated[int, Field(ge=0)]
_Pair = Annotated[list[float], Field(min_length=2, max_length=2)]


class CostSummary(TypedDict):
    """The cost book's counts and run-level numbers (a dict in Python, each key typed: a report
    whose summary holds text where a number belongs is not a report of this version)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]

    ledger: Literal["paired", "unpaired"]
    window: str
    ledger_fallback: str | None
    two_sided: _Count
    rows_total: _Count
    rows_resolved: _Count
    rows_unresolved: _Count
    rows_refused: _Count
    rows_nothing_priced: _Count
    rows_no_interval: _Count
    eta_run: float | None
    eta_run_interval: _Pair | None
    eta_run_rows: _Count
    kl_min_total: float | None
    d_t_total: float | None
    d_t_updates: _Count
    eta_d_t: float | None
    eta_updates: _Count
    eta_median: float | None
    eta_interval: _Pair | None
    false_discoveries_expected: float | None
    step_pairs: _Count
    kl_min_rows: _Count
    kl_min_resolved: _Count
    median_kl_min: float | None
    median_noise_floor: float | None


class EtaWindowOut(_M):
    """eta over consecutive updates pooled as one ratio of sums (``measure.decisions.EtaWindow``)."""

    first: int = Field(description="the first step the window spans (t of its first update)")
    last: int = Field(description="the last step it spans (t+1 of its last update)")
    updates: int = Field(description="priced updates pooled in it")
    span: int = Field(description="updates between first and last, pooled or not (not measured by the tap, "
                                  "refused or with nothing priced: they add nothing to either sum)")
    eta: float = Field(description="sum KL_min (debiased) / sum D_t over its updates, dimensionless")
    interval: tuple[float, float] | None = Field(description="95 % interval of eta (``eta.window``: the members' "
                                                             "jackknife covariances added, a bias up to the sums' "
                                                             "correction covered); a window of one update: its row's")
    resolved: bool = Field(description="eta resolved from 0: the interval's lower end is above 0")
    short: bool = Field(description="the run's last updates, which never reached the target half-width")
    kl_min: float = Field(description="sum of KL_min (debiased) over its updates, nats per sequence")
    d_t: float = Field(description="sum of D_t over its updates, nats per sequence")


class EtaHeadlineOut(_M):
    """What leads eta on the first screen and in the cost book (``measure.decisions.headline_of``)."""

    lead: Literal["rows", "windows"] = Field(description="rows: the book's own rows (single updates by default); "
                                                         "windows: windows of consecutive updates")
    why: Literal["rows_resolve", "rows_precise", "windows", "never_precise", "run_not_positive", "unpaired",
                 "windowed_book", "few"] = Field(description="the rule that decided it (measure.decisions.Headline)")
    target: float | None = Field(None, description="the half-width windows are pooled to: WINDOW_PRECISION (0.5) "
                                                   "times the run's eta")
    row_half_width: float | None = Field(None, description="median half-width of the single updates' 95 % "
                                                           "intervals (null where none has one)")
    windows: list[EtaWindowOut] = Field(default_factory=list, description=(
        "the priced updates in step order cut into windows, each pooled until its half-width is at most target: "
        "where the windows lead only (empty where the rows lead)"))
    windows_resolved: int = Field(0, description="windows whose eta is resolved from 0")


def eta_headline_out(h) -> EtaHeadlineOut | None:
    """The report's view of the run's ``Decisions.headline`` (None where it has none)."""
    if h is None:
        return None
    finite = lambda x: x if x is not None and np.isfinite(x) else None  # noqa: E731
    return EtaHeadlineOut(
        lead=h.lead, why=h.why, target=finite(h.target), row_half_width=finite(h.row_half_width),
        windows=[EtaWindowOut(first=w.first, last=w.last, updates=w.updates, span=w.span, eta=w.eta,
                              interval=w.interval, resolved=w.resolved, short=w.short, kl_min=w.kl_min, d_t=w.d_t)
                 for w in h.windows], windows_resolved=h.resolved)


class CostSection(_M):
    features: list[FeatureOut]
    metric: MetricOut
    kl_min: KlMinRows
    efficiency: EfficiencyRows
    feature_means: FeatureMeans
    summary: CostSummary = Field(description=(
        "ledger ('paired' | 'unpaired'), window, rows_total, rows_resolved, rows_unresolved, rows_refused, "
        "rows_nothing_priced, rows_no_interval (priced rows whose eta has no interval: one prompt group varies), "
        "eta_run (sum KL_min / sum D_t over every priced row, debiased: the headline; null "
        "when none is priced), eta_run_interval ([lo, hi]; paired: covering a bias up to the sums' jackknife "
        "correction, |sum KL_min - sum KL_jk| / sum D_t, and the lower end allowing for the rows' D_t tail "
        "allowances, summed), kl_min_total and eta_d_t (nats over those rows) and eta_updates (the updates they "
        "cover); d_t_total (nats) over d_t_updates: D_t summed over every usable update that has one, the run's "
        "spend, the same in every basis (the decisions'; eta's rows are the subset of them where a named behaviour "
        "varies and the row is not refused), "
        "eta_median (debiased, resolved rows with an interval only: selected on significance, so it leans high; kept for "
        "comparison), eta_interval, false_discoveries_expected, and the KL_min half's counts"))
    still_works: str | None = Field(description="what part of the book is readable despite its refusals")
    tap: TapOut | None = Field(None, description="what the tap measured of each step pair under its cost budget, "
                                                 "where the record has the tap's own telemetry")
    eta_headline: EtaHeadlineOut | None = Field(None, description="what leads eta: single updates, or windows of "
                                                                  "consecutive updates (the first screen's too)")


class TapOut(_M):
    """The tap's budget and what it bought, from its per-step telemetry (``tap_*`` fields)."""

    budget: float | None = Field(description="the tap's time as a fraction of an untapped step (null: no budget)")
    step_pairs: int = Field(description="step pairs the tap planned a measurement for (a next generation followed)")
    two_sided: int = Field(description="of them, measured on completions of both policies")
    one_sided: int = Field(description="of them, measured on the next generation's rollouts alone")
    skipped: int = Field(description="of them, not measured (the budget covered a share of them)")
    groups: float | None = Field(description="prompt groups measured on a measured pair (median)")
    groups_total: float | None = Field(description="prompt groups a generation had (median)")
    per_group: float | None = Field(description="completions per group and policy on a two-sided pair (median)")
    share: float | None = Field(description="the tap's own time over the untapped step's (median over steps)")
    floored: int = Field(0, description="step pairs planned at the budget's floor: the allowance covered less than "
                                        "min_share of them, and min_share were measured anyway")
    min_share: float = Field(0.25, description="the least share of the step pairs the budget measures at "
                                               "the run's completions per group (reward_lens.record.schema."
                                               "tap_floor: a quarter at 2 + 2 or one-sided, an eighth at 4 + 4)")
    sentence: str = Field(description="the same, in words")


def tap_summary(run) -> TapOut | None:
    """What the tap measured and what it cost, from the record's telemetry; None for a record
    without it (an import, or a tap before the budget)."""
    groups = run.telemetry_column("tap_groups")
    if not groups:
        return None
    total, per = run.telemetry_column("tap_groups_total"), run.telemetry_column("tap_per_group")
    budgets = sorted(set(run.telemetry_column("tap_budget").values()))
    tap_s, step_s = run.telemetry_column("tap_seconds"), run.telemetry_column("step_seconds")
    last = max(run.steps.tolist()) if len(run.steps) else -1
    pairs = [t for t in sorted(groups) if t < last]
    measured = [t for t in pairs if groups[t] > 0]
    two = [t for t in measured if (per.get(t) or 0) > 0]
    shares = [tap_s[t] / (step_s[t] - tap_s[t]) for t in tap_s if t in step_s and step_s[t] > tap_s[t]]
    prob = run.telemetry_column("tap_probability")
    med = lambda xs: float(np.median(xs)) if len(xs) else None  # noqa: E731
    # the floor's probability is tap_floor's at the pairs' completions per group (a share the
    # allowance covers is above it); a skipped pair records no shape, so the run's are read
    floors = {tap_floor(k) for k in {per.get(t) or 0 for t in measured} | {0}}
    floored = sum(1 for t in pairs if prob.get(t) in floors)
    min_share = tap_floor(med([per[t] for t in two]) if two else 0)
    out = dict(budget=budgets[0] if len(budgets) == 1 else None, step_pairs=len(pairs), two_sided=len(two),
               one_sided=len(measured) - len(two), skipped=len(pairs) - len(measured),
               groups=med([groups[t] for t in measured]), groups_total=med([total[t] for t in measured if t in total]),
               per_group=med([per[t] for t in two]), share=med(shares), floored=floored, min_share=min_share)
    return TapOut(**out, sentence=render_template("report/cost_tap.j2", {"t": out}).strip())


def _gaps(pairs: list[tuple[int, int]]) -> list[float]:
    """x values after which a line breaks: where step pair i does not start where i-1 ended."""
    return [float(pairs[i - 1][0]) for i in range(1, len(pairs)) if pairs[i][0] != pairs[i - 1][1]]


def cost_figures(c: CostSection) -> list[FigureOut]:
    figs = []
    x_label = "step t (pair t → t+1)"
    k = c.kl_min
    if len(k):
        pairs = [tuple(p) for p in k.step_pair]
        x = [float(p[0]) for p in pairs]
        res = [i for i, r in enumerate(k.resolved) if r]
        figs.append(FigureOut(id="kl-min", x_label=x_label, caption=(
            "KL_min per step pair, with its noise floor (nats per sequence, log scale)."), panels=[Panel(
                y_label="nats per sequence", log_y=True, series=[
                    Series(label="KL_min", x=x, y=k.kl_min, gaps=_gaps(pairs), color="#1f5fa8"),
                    Series(label="noise floor ½ tr(G⁻¹Σ_Δz)", x=x, y=k.noise_floor,
                           style="dashed", gaps=_gaps(pairs), color="#c0392b"),
                    Series(label="resolved (BH, q = 0.05)", x=[x[i] for i in res],
                           y=[k.kl_min[i] for i in res], style="points", color="#1f5fa8")])]))
        names = [f.name for f in c.features if f.priced]
        shares = {n: [v or 0.0 for v in k.shares.get(n, [])] for n in names}
        if any(v > 0 for n in names for v in shares[n]):
            figs.append(FigureOut(id="shares", x_label=x_label, caption=(
                "Exact Shapley shares of KL_min by feature, stacked (nats per sequence)."), panels=[Panel(
                    y_label="share of KL_min (nats per sequence)",
                    series=[Series(label=n, x=x, y=shares[n], style="stack") for n in names])]))
    e = c.efficiency
    rows = [i for i, v in enumerate(e.efficiency_debiased) if v is not None]
    if rows:
        pairs = [tuple(e.step_pair[i]) for i in rows]
        x = [float(p[0]) for p in pairs]
        y = [e.efficiency_debiased[i] for i in rows]
        lo = [e.interval[i][0] if e.interval[i] else v for i, v in zip(rows, y)]
        hi = [e.interval[i][1] if e.interval[i] else v for i, v in zip(rows, y)]
        res = [e.status[i] == "resolved" for i in rows]
        figs.append(FigureOut(id="efficiency", x_label=x_label, caption=(
            "Debiased efficiency per row with its 95 % interval: filled points are resolved, hollow points "
            "unresolved; lines are not drawn across refused rows."), panels=[Panel(
                y_label="η debiased (dimensionless)", zero_line=True, series=[
                    Series(x=x, y=y, gaps=_gaps(pairs), color="#9aa5a0"),
                    Series(x=x, y=y, lo=lo, hi=hi, style="interval", color="#9aa5a0"),
                    Series(label="resolved", x=[a for a, k in zip(x, res) if k], y=[b for b, k in zip(y, res) if k],
                           style="points", color="#1f7a4d"),
                    Series(label="unresolved", x=[a for a, k in zip(x, res) if not k],
                           y=[b for b, k in zip(y, res) if not k], style="hollow", color="#8a8a8a")])]))
    if c.feature_means.step:
        fm = c.feature_means
        steps = [float(s) for s in fm.step]
        panels = []
        for f in c.features:
            mean, se = np.array(fm.mean[f.name]), np.array(fm.se[f.name])
            panels.append(Panel(title=f"{f.name} ({f.unit})", y_label=f.unit, series=[
                Series(x=steps, y=(mean - se).tolist(), lo=(mean - se).tolist(), hi=(mean + se).tolist(), style="band",
                       color="#9bbce0"),
                Series(x=steps, y=mean.tolist(), color="#1f5fa8")]))
        figs.append(FigureOut(id="means", x_label="step (mean ± one standard error)", columns=3, panels=panels,
                              caption="Feature means per step, ± one standard error, in each feature's unit."))
    return figs


def feature_statuses(g, docs: dict[str, str], units: dict[str, str]) -> list[FeatureOut]:
    """Each feature's place in KL_min. A pooled metric has one active set: priced, or its reason
    for exclusion. A per-step metric has one per step: the feature's steps are counted by what
    each step's set did with it (priced, constant within prompt groups, collinear), and it is
    called constant only where it is constant at every step -- never from one step's reason (the
    task record's ``reward_format``, collinear at 82 steps and constant at 15, read "constant"
    because the last step's reason stood for all of them)."""
    if g.scope != "per_step" or not len(g.by_step):
        return [FeatureOut(name=n, doc=docs[n], unit=units[n], priced=n in g.active,
                           status="priced" if n in g.active else g.excluded.get(n, "excluded")) for n in g.names]
    steps = list(g.by_step)
    count = {n: [0, 0, 0] for n in g.names}  # priced, constant, collinear
    for t in steps:
        for n in g.active_of(t):
            count[n][0] += 1
        for n, why in g.excluded_of(t).items():
            count[n][1 if why.startswith("constant") else 2] += 1
    out = []
    for n in g.names:
        priced, constant, collinear = count[n]
        status = render_template("report/feature_status.j2", {
            "steps": len(steps), "priced": priced, "constant": constant, "collinear": collinear}).strip()
        out.append(FeatureOut(name=n, doc=docs[n], unit=units[n], status=status, steps=len(steps), steps_priced=priced,
                              steps_constant=constant, steps_collinear=collinear, priced=priced > 0))
    return out


def cost_section(ctx: RunContext) -> BookResult:
    """The cost book of the run in ``ctx``, as the report shows it."""
    run, features = ctx.run, ctx.features
    spec = ctx.specs["cost"]
    if not run.n_rollouts:
        return _result([rollouts_refusal(run, [])], None, spec)
    samples = ctx.samples
    priced = ctx.priced
    extra = not_formed_refusals(run, priced)
    if priced.book is None:
        return _result(extra or [rollouts_refusal(run, samples)], None, spec)
    book: CostBook = priced.book
    g = priced.metric
    docs, units = features.docs(), features.units()
    feats = feature_statuses(g, docs, units)
    kl_rows, totals = _kl_min_rows(book.kl_min.columns, g.names, set(ctx.decisions.usable))
    rows = book.columns  # the rows as columns: one list per quantity, made from arrays
    eff = EfficiencyRows(  # validated: a few lists, not one model per row
        **{f: rows.lists(f) for f in ("step_pair", "steps", "status", "kl_min", "kl_spent", "kl_spent_se",
                                      "kl_spent_interval", "kl_spent_tail", "efficiency", "efficiency_null", "efficiency_debiased",
                                      "interval", "p_value", "resolved", "d_t_checks", "d_t_disagrees", "no_interval")},
        source=rows.lists("source"))
    sums, squares = step_sums(samples)  # each step's mean and standard error, all steps at once
    ns = np.array([s.n for s in samples], dtype=float)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        se = np.where(ns > 1, np.sqrt(squares / (ns - 1) / ns), 0.0)
    means = FeatureMeans(step=[s.step for s in samples], n=[s.n for s in samples],
                         mean=dict(zip(samples[0].names, (sums / ns).T.tolist())),
                         se=dict(zip(samples[0].names, se.T.tolist())))
    counts = book.counts()
    counts["refused"] += sum(len(r.subject.step_pairs) for r in extra)
    eta_median, eta_interval = book.headline()
    run_est = book.run_level()
    d = ctx.decisions
    summary = {
        "ledger": book.ledger, "window": str(book.window), "ledger_fallback": d.fallback,
        "two_sided": sum(getattr(lg, "n_heldout", 0) > 0 for lg in priced.ledgers),
        "rows_total": sum(counts.values()), "rows_resolved": counts["resolved"],
        "rows_unresolved": counts["unresolved"], "rows_refused": counts["refused"],
        "rows_nothing_priced": counts["nothing_priced"],
        "rows_no_interval": int(rows.no_interval.sum()),
        "eta_run": run_est.eta_debiased if run_est is not None else None,
        "eta_run_interval": list(run_est.interval()) if run_est is not None else None,
        "eta_run_rows": len(book._estimates) if book._estimates is not None else 0,
        "kl_min_total": run_est.kl_min_debiased if run_est is not None else None,
        "eta_d_t": run_est.d_t if run_est is not None else None,
        "eta_updates": int(sum(book._estimates.columns.steps)) if run_est is not None else 0,
        "d_t_total": d.d_t_total, "d_t_updates": d.d_t_updates,
        "eta_median": eta_median, "eta_interval": list(eta_interval) if eta_interval else None,
        "false_discoveries_expected": book.false_discoveries_expected,
        "step_pairs": d.n_pairs,
        "kl_min_rows": len(d.priced),
        "kl_min_resolved": len(d.resolved),
        "median_kl_min": float(np.median(kl_rows.kl_min)) if len(kl_rows) else None,
        "median_noise_floor": float(np.median(kl_rows.noise_floor)) if len(kl_rows) else None,
    }
    top = max(totals, key=totals.get) if totals and max(totals.values()) > 0 else None
    still = None
    if book.refusals and len(kl_rows):
        still = render_template("report/cost_still_works.j2", {
            "n": len(kl_rows), "resolved": summary["kl_min_resolved"], "top": top,
            "top_share": (totals[top] / sum(totals.values())) if top else None})
    section = CostSection(
        features=feats,
        metric=MetricOut(method=g.method, scope=g.scope, n=g.n, damping=g.damping, damping_stable=g.damping_stable,
                         reading=g.reading),
        kl_min=kl_rows, efficiency=eff, feature_means=means, summary=summary, still_works=still,
        tap=tap_summary(run), eta_headline=eta_headline_out(d.headline),
    )
    return _result([*extra, *book.refusals], section, spec)


def _kl_min_rows(cols, names: tuple[str, ...], usable: set | None = None) -> tuple[KlMinRows, dict[str, float]]:
    """The KL_min rows of the book's columns -- of the ``usable`` step pairs only: a refused
    pair's KL_min is not stated -- and each feature's share summed over them."""
    if cols is not None and usable is not None:
        keep = np.array([tuple(p) in usable for p in cols.step_pair.tolist()], dtype=bool)
        if not keep.all():
            cols = _rows_of(cols, keep)
    if cols is None:
        return KlMinRows(step_pair=[], kl_min=[], noise_floor=[], clears_noise_floor=[], p_value=[], resolved=[],
                         leading_feature=[], shares={n: [] for n in names}, shares_inexact=[], condition=[]), \
            {n: 0.0 for n in names}
    lead = [None, *names]  # leading index -1 -> None
    shares = np.where(cols.priced, cols.shares, np.nan)
    rows = KlMinRows.model_construct(  # every value is made here, from arrays of its type
        step_pair=[tuple(p) for p in cols.step_pair.tolist()], kl_min=cols.kl_min.tolist(),
        noise_floor=cols.noise_floor.tolist(), clears_noise_floor=cols.clears_noise_floor.tolist(),
        p_value=cols.p_value.tolist(), resolved=cols.resolved.tolist(),
        leading_feature=[lead[i + 1] for i in cols.leading.tolist()],
        shares={n: [None if v != v else v for v in shares[:, j].tolist()] for j, n in enumerate(names)},
        shares_inexact=cols.shares_inexact.tolist(), condition=cols.condition.tolist())
    totals = {n: sum(col) for n, col in zip(names, cols.shares.T.tolist())}  # in row order, as the rows added
    return rows, totals


def premise_refusals(run, priced, book_id: str) -> list[Refusal]:
    """PREMISE_FAILED in book ``book_id`` for the step pairs whose sample fails a premise of the
    estimate (the cost book makes its own), one per premise: the books that read dz say, by
    name, which step pairs they state nothing about."""
    from reward_lens.measure.efficiency.cost import _premise_numbers, premise_refusal

    series = priced.book.kl_min if priced is not None and priced.book is not None else None
    if series is None:
        return []
    ledgers = {tuple(lg.step_pair): lg for lg in priced.ledgers}
    by: dict[str, list] = {}
    for pair, why in sorted(series.premises.items()):
        if why != "no_token_kl":
            by.setdefault(why, []).append(_premise_numbers(ledgers[pair]))
    return [premise_refusal(load_book(book_id), run.run_id, why, items) for why, items in by.items()]


def _rows_of(cols, keep: np.ndarray):
    """The KL_min columns of the rows where ``keep``."""
    import dataclasses

    return dataclasses.replace(cols, **{f.name: getattr(cols, f.name)[keep] for f in dataclasses.fields(cols)
                                        if isinstance(getattr(cols, f.name), np.ndarray)},
                               kind=tuple(k for k, on in zip(cols.kind, keep.tolist()) if on))


def not_formed_refusals(run, priced, book_id: str = "cost") -> list[Refusal]:
    """RECORD_INCOMPLETE for the step pairs no ledger could be formed for, one per reason."""
    by_reason: dict[str, list[tuple[tuple[int, int], object]]] = {}
    for pair, why in sorted(priced.not_formed.items()):
        by_reason.setdefault(why.reason, []).append((pair, why))
    out = []
    for reason, items in by_reason.items():
        pairs = [p for p, _ in items]
        shown = ", ".join(f"{a}->{b}" for a, b in pairs[:5]) + (f" and {len(pairs) - 5} more" if len(pairs) > 5 else "")
        steps = [{"step": w.step, "count": w.count} for _, w in items]
        steps = [dict(t) for t in {tuple(d.items()) for d in steps}]  # a step can touch two pairs
        context = {"requirement": "ledger", "ledger": priced.ledger, "run": run.short_id,
                   "n_pairs": len(pairs), "pairs_shown": shown, "reason": reason,
                   "steps": sorted(steps, key=lambda d: d["step"]), "framework": run.manifest.framework.name}
        if reason == "not_measured":  # the tap's budget left them: what it bought, what more would buy
            tap = tap_summary(run)
            context["tap"] = tap.model_dump(exclude={"sentence"}) if tap is not None else None
            context["curve"] = larger_budgets(tap.budget if tap is not None else None)
        out.append(make_refusal("RECORD_INCOMPLETE", load_book(book_id), Subject(run_id=run.run_id, step_pairs=tuple(pairs)),
                                context))
    return out


@functools.cache
def _cost_precision() -> dict:
    """specs/cost_precision.yaml: what each budget bought on the truth harness's moderate run
    (written by tools/cost_precision.py --save)."""
    import yaml

    from reward_lens_spec.paths import specs_dir

    return yaml.safe_load((specs_dir() / "cost_precision.yaml").read_text())


def larger_budgets(budget: float | None) -> dict:
    """The cost-precision curve's two-sided rows at budgets above ``budget`` (``budget=None`` last):
    the precision a larger budget bought on the truth harness's run, which a tapped record's remedy
    quotes. Empty where the record's budget is None (nothing larger)."""
    data = _cost_precision()
    rows = [r for r in data["rows"] if not r.get("own") and budget is not None
            and (r["budget"] is None or r["budget"] > budget)]
    return {"run": data["run"], "rows": rows}




def _result(refusals: list[Refusal], section: CostSection | None, spec) -> BookResult:
    has_numbers = section is not None and bool(len(section.kl_min) or len(section.efficiency))
    resolved = section is not None and bool(section.summary.get("rows_resolved"))
    status = status_of(has_numbers, refusals, resolved)
    s = section.summary if section else {}
    headline = render_template("report/cost_headline.j2", {
        "status": status, "s": s, "codes": sorted({r.code for r in refusals}),
        "h": section.eta_headline if section is not None else None}).strip()
    return BookResult(status=status, headline=headline, refusals=refusals, data=section,
                      figures=cost_figures(section) if section is not None else [])
