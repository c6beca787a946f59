"""Build the report of one record: the run summary and one section per book spec.

Rollouts are streamed by row group (``steps_from_run``): completion strings are turned
into feature vectors and dropped, so memory holds n x k floats, never every completion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from reward_lens import __version__
from reward_lens.measure.books import RunContext
from reward_lens.measure.decisions import ASKED_DIRECTLY, ASKED_JOINTLY, TARGET_WRONG
from reward_lens.measure.efficiency.section import eta_headline_out
from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.record.reader import Run, Window
from reward_lens.record.schema import TargetDecl
from reward_lens.report.curves import RolloutCurves, training_curves
from reward_lens.record.errors import RecordError
from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.report.model import (
    BasisFeature,
    BrowserRow,
    BasisOut,
    BookOut,
    FieldPresence,
    Glance,
    RefusalOut,
    Report,
    RunSummary,
    SampleRollout,
    Share,
    TargetLine,
)
from reward_lens_spec import Refusal, load_books, load_fields, load_refusal_codes
from reward_lens_spec.render import first_sentence, render_template

Progress = Callable[[str], None]
SAMPLES_PER_END = 6
# The summary card states the largest shares of what the behaviours needed, this many.
CARD_SHARES = 3


def _summary(run: Run) -> RunSummary:
    spec = load_fields()
    steps = np.union1d(run.steps, run.rollout_step_values)
    counts = np.diff(np.r_[np.searchsorted(run.rollout_steps, run.rollout_step_values), len(run.rollout_steps)])
    fields = [FieldPresence(field=name, unit=spec.fields[name].unit, steps_present=p.count, steps_total=p.of)
              for name, p in sorted(run.fields().items())]
    m = run.manifest
    return RunSummary(
        run_id=run.run_id, framework=m.framework.name, framework_version=m.framework.version,
        model=m.model.description, n_parameters=m.model.n_parameters, optimizer=m.optimizer,
        steps=len(steps), first_step=int(steps[0]) if len(steps) else None,
        last_step=int(steps[-1]) if len(steps) else None, rollouts=run.n_rollouts,
        rollouts_per_step=float(counts.mean()) if len(counts) else None,
        telemetry_per_step=m.telemetry_per_step, fields=fields, notes=list(m.notes),
    )


def refusal_out(r: Refusal) -> RefusalOut:
    code = load_refusal_codes().codes[r.code]
    return RefusalOut(code=r.code, severity=code.severity, title=code.title, book=r.book, function=r.function,
                      run_id=r.subject.run_id, step_pairs=[tuple(p) for p in r.subject.step_pairs],
                      detail=r.detail, remedy=r.remedy, context=r.context)


# Sample text shown in a report is capped: a 5 MB completion would otherwise be embedded
# whole in the HTML and the JSON. The mark says how much was left out.
SAMPLE_TEXT_MAX = 2000


def _capped(text: str, limit: int = SAMPLE_TEXT_MAX) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f" … [truncated: {len(text) - limit} more characters]"


def _samples(run: Run) -> list[SampleRollout]:
    if not run.n_rollouts:
        return []
    steps = run.rollout_steps
    out = []
    for s in sorted({int(steps[0]), int(steps[-1])}):
        cols = [c for c in ("prompt", "completion", "reward", "advantage") if c in run.rollout_columns()]
        for table in run.iter_rollouts(cols, Window(s, s)):
            for row in table.slice(0, SAMPLES_PER_END - len([o for o in out if o.step == s])).to_pylist():
                out.append(SampleRollout(step=row["step"], prompt=_capped(row.get("prompt") or ""),
                                         completion=_capped(row.get("completion") or ""), reward=row.get("reward"),
                                         advantage=row.get("advantage")))
            if len([o for o in out if o.step == s]) >= SAMPLES_PER_END:
                break
    return out


BROWSER_STEPS = 120
BROWSER_PER_STEP = 4
BROWSER_TEXT_MAX = 600


class BrowserRows:
    """A spread of rollouts for the HTML browser: up to BROWSER_PER_STEP rollouts (the first, in
    record order) of up to BROWSER_STEPS steps spread over the run, with their features in the
    report's basis. A ``RowCollector``: fed by the pass that computes the samples' features, or
    by a pass of its own over the chosen steps' row groups (``read``)."""

    def __init__(self, run: Run, features: FeatureBasis, context: dict):
        self.features, self.context = features, context
        available = set(run.rollout_columns()) if run.n_rollouts else set()
        cols = [c for c in ("prompt", "completion", "reward", "advantage") if c in available]
        self.columns = tuple(cols + [c for c in features.columns if c in available and c not in cols])
        steps = run.rollout_step_values if run.n_rollouts else np.zeros(0, np.int64)
        picks = np.unique(np.linspace(0, len(steps) - 1, min(BROWSER_STEPS, len(steps))).astype(int))
        self.chosen = np.sort(steps[picks]) if len(steps) else steps
        self.taken = np.zeros(len(self.chosen), dtype=np.int64)  # rows kept so far, by chosen step
        self.rows: list[BrowserRow] = []

    def take(self, table, z: np.ndarray) -> None:
        s = table.column("step").to_numpy()
        chosen = np.isin(s, self.chosen)
        if not chosen.any():
            return
        # each row's rank among its step's rows (stable: in record order), after those kept before
        order = np.argsort(s, kind="stable")
        ss = s[order]
        starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
        rank = np.empty(len(s), dtype=np.int64)
        rank[order] = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
        where = np.minimum(np.searchsorted(self.chosen, s), len(self.chosen) - 1)  # exact for chosen rows
        keep = np.flatnonzero(chosen & (rank + self.taken[where] < BROWSER_PER_STEP))
        np.add.at(self.taken, where[keep], 1)
        if not len(keep):
            return
        names = self.features.names
        for row, zi in zip(table.select([c for c in ("step", *self.columns) if c in table.column_names])
                           .take(keep).to_pylist(), z[keep].tolist()):
            self.rows.append(BrowserRow(step=row["step"], prompt=_capped(row.get("prompt") or "", BROWSER_TEXT_MAX),
                                        completion=_capped(row.get("completion") or "", BROWSER_TEXT_MAX),
                                        reward=row.get("reward"), advantage=row.get("advantage"),
                                        features={n: v for n, v in zip(names, zi) if math.isfinite(v)}))

    def read(self, run: Run) -> None:
        """A pass of its own: only the row groups of the chosen steps."""
        if not run.n_rollouts:
            return
        for table in run.iter_rollouts(self.columns, steps=self.chosen.tolist()):
            try:
                z = self.features.compute(table, context=self.context)
            except RecordError:
                z = np.full((table.num_rows, len(self.features.names)), np.nan)
            self.take(table, z)


def build_report(run: Run, progress: Progress | None = None, *, ledger: str = "auto",
                 window: int | str = 1, features: FeatureBasis | None = None,
                 targets: Sequence[TargetDecl] = ()) -> Report:
    """Every book of ``run`` (one per spec in specs/books/, in their ``report.order``),
    computed in the feature basis ``features`` (default: specs/features/surface.yaml) with the
    record's declared targets (its manifest's ``targets``) and ``targets`` (``--target``, laid
    over them) marked in it (``measure.ledger.targets``)."""
    from reward_lens.measure.ledger.price import feature_context
    from reward_lens.measure.ledger.targets import merged, with_targets

    features = features if features is not None else SurfaceFeatures()
    features = with_targets(features, merged(run.manifest.targets, targets))
    browser, curves = BrowserRows(run, features, feature_context(run)), RolloutCurves(run)
    ctx = RunContext(run, features, ledger=ledger, window=window, progress=progress, collectors=[browser, curves])
    ctx.specs = {k: v for k, v in load_books().items() if v.report is not None}
    books = []
    ordered = sorted(ctx.specs.values(), key=lambda b: (b.report.order, b.id))
    watching = ctx.beside_books() if run.n_rollouts else None  # what reads the samples alone, beside the books
    try:
        results = ctx.results([spec.id for spec in ordered])  # the books that need none of each other at once
    finally:  # a book's error leaves no thread computing behind it
        if watching is not None:
            watching.join()
    for spec in ordered:
        res = results[spec.id]
        books.append(BookOut(id=spec.id, title=spec.title, series=spec.series, section=spec.section,
                             function=spec.function, status=res.status, headline=res.headline,
                             refusals=[refusal_out(r) for r in res.refusals],
                             data=res.data,
                             figures=res.figures))
    basis = BasisOut(id=features.basis_id, name=features.label, source=features.source,
                     features=[BasisFeature(**d) for d in features.describe()])
    if not ctx.collected:  # no book read the samples: the browser and the curves read for themselves
        browser.read(run)
        curves.read(run)
    # a basis with features not measured on every rollout prices nothing (every book refused by name)
    measured = bool(run.n_rollouts) and not ctx.unmeasured
    at_a_glance = glance(ctx, {b.id: b for b in books}) if measured else None
    report = Report(generator=f"reward-lens {__version__}", run=_summary(run), basis=basis, books=books,
                    samples=_samples(run), curves=training_curves(run, curves.panels()), browser=browser.rows,
                    glance=at_a_glance, card=summary_card(at_a_glance, books),
                    headline_figure=headline_figure(ctx, {b.id: b for b in books}) if measured else None)
    return with_findings(run, report, ctx.samples if ctx.collected else None, ctx.watch if ctx.collected else None)


def with_findings(run: Run, report: Report, samples=None, watch=None) -> Report:
    """The report with its findings evaluated on its books (and on its read of the rollouts,
    ``samples``, where it made one, with their sequential watch ``watch`` where it made that),
    counted once, and the health sentence leading the summary card."""
    from reward_lens.findings import evaluate, finding_counts

    found = evaluate(run, report, samples=samples, watch=watch)
    counts = finding_counts(found)
    line = " ".join(render_template("report/health.j2", {"f": found, "n": counts}).split())
    return report.model_copy(update={"findings": found, "findings_counts": counts, "card": [line, *report.card]})


def glance(ctx: RunContext, books: dict[str, BookOut]) -> Glance:
    """The first screen's numbers: the run's decisions, the cost book's run-level ratio, the
    price book's total and the agreement book's verdicts -- each read once, here."""
    from reward_lens.measure.decisions import REASONS

    d = ctx.decisions
    cost = books.get("cost")
    c = cost.data.summary if cost is not None and cost.data is not None else {}
    est = ctx.priced.book.estimates.sorted_columns() if (
        ctx.priced is not None and ctx.priced.book is not None) else None
    price = books.get("price")
    p = price.data.summary if price is not None and price.data is not None else {}
    agreement = books.get("agreement")
    verdicts: dict[str, list[str]] = {}
    directly: list[str] = []
    jointly: list[list[str]] = []
    still: set[str] = set()
    targets: list[TargetLine] = []
    if agreement is not None and agreement.data is not None:
        for f in agreement.data.features:
            if f.verdict_key is None:
                continue
            verdicts.setdefault(f.verdict_key, []).append(f.feature)
            if f.moved is False:
                still.add(f.feature)
            if f.target is not None:  # its own verdict leads the card; not among what the reward asked for
                targets.append(TargetLine(feature=f.feature, want=f.target, key=f.verdict_key, words=f.verdict,
                                          wrong=f.verdict_key in TARGET_WRONG))
                continue
            if f.asked == ASKED_DIRECTLY:
                directly.append(f.feature)
            elif f.asked == ASKED_JOINTLY and not any(f.feature in c for c in jointly):
                jointly.append([n for n in ctx.features.names if n == f.feature or n in f.jointly_with])
    effect = books.get("effect")
    moved = [x.feature for x in effect.data.drift if x.moved] if effect is not None and effect.data is not None else []
    shares = sorted((d.resolved_shares or {}).items(), key=lambda kv: -kv[1])
    stated = [Share(feature=n, share=v) for n, v in shares if v > 0][:CARD_SHARES]
    interval = c.get("eta_run_interval")
    return Glance(
        ledger=d.ledger, ledger_fallback=d.fallback, features=len(d.names), updates=d.n_pairs, usable=len(d.usable), refused=len(d.refused),
        refused_reasons=[(REASONS.get(k, k), len(v)) for k, v in d.refused_by_reason().items()],
        priced=len(d.priced), resolved=len(d.resolved), d_t_updates=d.d_t_updates, d_t_median=d.d_t_median,
        d_t_total=d.d_t_total, eta_rows=len(est) if est is not None else 0, eta_updates=c.get("eta_updates") or 0,
        eta_d_t=c.get("eta_d_t"), kl_min_total=c.get("kl_min_total"), eta_run=c.get("eta_run"),
        eta_run_interval=tuple(interval) if interval else None, eta_headline=eta_headline_out(d.headline),
        shares=[Share(feature=n, share=v) for n, v in shares if v > 0],
        reward_change=p.get("total_reward_change"), reward_per_nat=p.get("reward_per_nat"),
        reward_per_nat_se=p.get("reward_per_nat_se"), reward_resolved=bool(p.get("resolved")), moved=moved,
        verdicts=verdicts, asked_directly=directly, asked_jointly=jointly,
        targets_declared=list(ctx.features.targets), targets=sorted(targets, key=lambda t: not t.wrong),
        no_net_change=[s for s in stated if s.feature in still])


def summary_card(g: Glance | None, books: list[BookOut]) -> list[str]:
    """The first screen in sentences (``templates/report/card.j2``, from ``glance`` only), then
    what could not be computed and the one change that would compute most of it."""
    lines = [s for s in render_template("report/card.j2", {"g": g}).split("\n\n") if s.strip()] if g else []
    if g is not None:  # what the user wants leads: its verdict, or that none is declared and how to declare one
        lines = [render_template("report/card_target.j2", {"g": g}), *lines]
    missing = [b for b in books if b.status in ("refused", "partial")]
    real = [b for b in missing if any(r.code != "PREMISE_FAILED" for r in b.refusals)]
    if real:
        remedies: dict[str, list[str]] = {}
        for b in real:
            for r in b.refusals:
                if r.code != "PREMISE_FAILED":
                    remedies.setdefault(first_sentence(r.remedy), []).append(b.id)
        best = max(remedies, key=lambda k: len(set(remedies[k]))) if remedies else None
        lines.append(render_template("report/card_missing.j2", {
            "missing": real, "remedy": best, "remedy_books": len(set(remedies[best])) if best else 0}))
    return [" ".join(line.split()) for line in lines]


def required_so_far(est) -> tuple[list[float], list[float], list[float]]:
    """What the named behaviours needed, summed over the updates so far, with a 95 % band: the sum
    of the debiased KL_min (noise's expected share taken out) and its SE from the rows' variances
    (independent rows: they add). Paired estimates' band also covers a bias up to the sum's own
    jackknife correction so far, |sum KL_min - sum KL_jk|, the bound the run's eta interval carries
    (``eta.window``; here ``bias_aware_halves`` on the normal, on KL's variance alone): the curve
    does not claim what the card's interval does not. A KL is never negative, so neither is the
    curve: where noise takes the debiased sum below 0 it is drawn at 0 (the positive part, which is
    never further from the truth than the sum itself), and so is the band's lower edge."""
    from reward_lens.measure.efficiency.eta import EtaColumns, bias_aware_halves

    if isinstance(est, EtaColumns):  # the estimates as columns (``CostBook.estimates``)
        k, var = est.kl_min_debiased, est.cov[:, 0, 0]
        paired = est.kind == "paired"
        corr = est.kl_min - est.kl_min_debiased if paired else None
    else:
        k, var = [e.kl_min_debiased for e in est], np.array([float(e.cov[0, 0]) for e in est], dtype=np.float64)
        paired = bool(est) and all(getattr(e, "kind", None) == "paired" for e in est)
        corr = np.array([e.kl_min - e.kl_min_debiased for e in est], dtype=np.float64) if paired else None
    mid = np.cumsum(k, dtype=np.float64)
    se = np.sqrt(np.cumsum(np.where(0.0 > var, 0.0, var)))  # max(v, 0.0) of each, as Python's max takes it
    if corr is not None and len(mid):
        half = bias_aware_halves(np.full(len(mid), np.inf), se, np.abs(np.cumsum(corr, dtype=np.float64)))
    else:
        half = 1.96 * se
    return (np.maximum(mid - half, 0.0).tolist(), np.maximum(mid, 0.0).tolist(),
            np.maximum(mid + half, 0.0).tolist())


def headline_figure(ctx: RunContext, books: dict[str, BookOut]) -> FigureOut | None:
    """What each update spent and what the named behaviours required, cumulated over the run,
    beside the reward gained against the run's path length (the price book's frontier)."""
    priced = ctx.priced if ctx.run.n_rollouts else None
    est = priced.book.estimates.sorted_columns() if (priced is not None and priced.book is not None) else None
    panels = []
    if est is not None and len(est):
        x = est.step_pair[:, 1].astype(np.float64).tolist()
        # what was spent: every update's D_t, the run's decisions' (the card's total, in every
        # basis); what was needed: over the updates eta is read on
        spent_of = ctx.decisions.spent
        x_spent = [float(p[1]) for p in spent_of]
        spent = np.cumsum(list(spent_of.values())).tolist()
        lo, mid, hi = required_so_far(est)
        panels.append(Panel(title="nats spent (Σ D_t, solid) and needed (Σ KL_min, dashed, 95 % band)",
                            y_label="nats per sequence", series=[
                                Series(label="needed: 95 % band", x=x, y=mid, lo=lo, hi=hi, color="#1f7a4d",
                                       style="band"),
                                Series(label="spent: Σ D_t", x=x_spent, y=spent, color="#1f5fa8"),
                                Series(label="needed: Σ KL_min", x=x, y=mid, color="#1f7a4d", style="dashed")]))
    price = books.get("price")
    if price is not None and price.data is not None and len(price.data.frontier.d) > 1:
        f = price.data.frontier
        panels.append(Panel(title="reward gained against the path length Σ√D_t",
                            y_label="reward change (reward units)", zero_line=True,
                            series=[Series(label="this run", x=f.d, y=f.reward, color="#b0561f")]))
    if not panels:
        return None
    return FigureOut(id="headline", x_label="left: step; right: cumulative √D_t (root-nats)", columns=len(panels),
                     panels=panels, caption=(
                         "Left: what the updates spent and what the named behaviours needed, summed (a KL is never "
                         "below 0); the gap went to behaviour the basis does not name. Right: reward gained against "
                         "path length."))
