"""Build the report of one record: the run summary and one section per book spec.

Rollouts are streamed by row group (``steps_from_run``): completion strings are turned
into feature vectors and dropped, so memory holds n x k floats, never every completion.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reward_lens import __version__
from reward_lens.measure.efficiency import cost_series, metric_g
from reward_lens.measure.efficiency.cost import CostBook, rollouts_refusal
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.price import ledger_series, learning_rates, steps_from_run, whole_run
from reward_lens.record.reader import Run, Window
from reward_lens.report.model import (
    BookOut,
    CostSection,
    EfficiencyOut,
    FeatureMeans,
    FeatureOut,
    FieldPresence,
    KlMinOut,
    MetricOut,
    RefusalOut,
    Report,
    RunSummary,
    SampleRollout,
)
from reward_lens_spec import Refusal, load_books, load_fields, load_refusal_codes
from reward_lens_spec.render import render_template

Progress = Callable[[str], None]
SAMPLES_PER_END = 6


def _summary(run: Run) -> RunSummary:
    spec = load_fields()
    steps = np.union1d(run.steps, np.unique(run.rollout_steps))
    roll_steps, counts = np.unique(run.rollout_steps, return_counts=True)
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


def _samples(run: Run) -> list[SampleRollout]:
    if not run.n_rollouts:
        return []
    steps = run.rollout_steps
    out = []
    for s in sorted({int(steps[0]), int(steps[-1])}):
        cols = [c for c in ("prompt", "completion", "reward", "advantage") if c in run.rollout_columns()]
        for table in run.iter_rollouts(cols, Window(s, s)):
            for row in table.slice(0, SAMPLES_PER_END - len([o for o in out if o.step == s])).to_pylist():
                out.append(SampleRollout(step=row["step"], prompt=row.get("prompt") or "",
                                         completion=row.get("completion") or "", reward=row.get("reward"),
                                         advantage=row.get("advantage")))
            if len([o for o in out if o.step == s]) >= SAMPLES_PER_END:
                break
    return out


def _cost_section(run: Run, progress: Progress) -> tuple[list[Refusal], CostSection | None]:
    features = SurfaceFeatures()
    if not run.n_rollouts:
        return [rollouts_refusal(run, [])], None
    window = whole_run(run)
    progress("reading rollouts and computing features")
    samples = steps_from_run(run, features, window=window)
    ledgers = ledger_series(samples, eta_by_step=learning_rates(run, window))
    if not ledgers:
        return [rollouts_refusal(run, samples)], None
    progress("estimating G and KL_min")
    # Per-step covariances where every step has enough rollouts (metric_g's "auto" rule),
    # else the window's pooled covariance; the metric's reading says which.
    g = metric_g(samples, method="covariance_bound", scope="auto")
    book: CostBook = cost_series(ledgers, g, run_=run)
    series = book.kl_min
    docs = features.docs()
    feats = [FeatureOut(name=n, doc=docs[n], status="priced" if n in g.active else g.excluded[n])
             for n in g.names]
    kl_rows = [KlMinOut(step_pair=r.step_pair, kl_min=r.kl_min, noise_floor=r.noise_floor,
                        clears_noise_floor=r.clears_noise_floor, leading_feature=r.leading_feature, shares=r.shares)
               for r in series.rows]
    eff = [EfficiencyOut(step_pair=r.step_pair, kl_min=r.kl_min, kl_spent=r.kl_spent, efficiency=r.efficiency,
                         source=r.kl_spent_source, resolved=r.resolved) for r in book.rows]
    means = [FeatureMeans(step=s.step, n=s.n, mean=s.z.mean(axis=0).tolist(),
                          se=(s.z.std(axis=0, ddof=1) / np.sqrt(s.n)).tolist() if s.n > 1 else [0.0] * len(g.names))
             for s in samples]
    totals = {a: sum(r.shares.get(a, 0.0) for r in series.rows) for a in g.active}
    summary = {
        "step_pairs": len(ledgers),
        "kl_min_rows": len(kl_rows),
        "clear_noise_floor": sum(r.clears_noise_floor for r in kl_rows),
        "median_kl_min": float(np.median([r.kl_min for r in kl_rows])) if kl_rows else None,
        "median_noise_floor": float(np.median([r.noise_floor for r in kl_rows])) if kl_rows else None,
        "efficiency_rows": len(eff),
        "median_efficiency": float(np.median([r.efficiency for r in eff])) if eff else None,
        "refused_pairs": sum(len(r.subject.step_pairs) for r in book.refusals),
    }
    top = max(totals, key=totals.get) if totals and max(totals.values()) > 0 else None
    still = None
    if book.refusals and kl_rows:
        still = render_template("report/cost_still_works.j2", {
            "n": len(kl_rows), "clear": summary["clear_noise_floor"], "top": top,
            "top_share": (totals[top] / sum(totals.values())) if top else None})
    section = CostSection(
        features=feats,
        metric=MetricOut(method=g.method, scope=g.scope, n=g.n, damping=g.damping, damping_stable=g.damping_stable,
                         reading=g.reading),
        kl_min=kl_rows, efficiency=eff, feature_means=means, summary=summary, still_works=still,
    )
    return list(book.refusals), section


BOOK_SECTIONS = {"cost": _cost_section}


def build_report(run: Run, progress: Progress | None = None) -> Report:
    progress = progress or (lambda _msg: None)
    books = []
    for book_id, spec in load_books().items():
        builder = BOOK_SECTIONS.get(book_id)
        if builder is None:
            raise RuntimeError(f"specs/books/{book_id}.yaml has no section builder in reward_lens.report.build")
        refusals, section = builder(run, progress)
        has_numbers = section is not None and bool(section.kl_min or section.efficiency)
        status = "computed" if not refusals else ("partial" if has_numbers else "refused")
        books.append(BookOut(id=spec.id, title=spec.title, series=spec.series, section=spec.section,
                             function=spec.function, status=status,
                             refusals=[refusal_out(r) for r in refusals], cost=section))
    return Report(generator=f"reward-lens {__version__}", run=_summary(run), books=books, samples=_samples(run))
