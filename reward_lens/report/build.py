"""Build the report of one record: the run summary and one section per book spec.

Rollouts are streamed by row group (``steps_from_run``): completion strings are turned
into feature vectors and dropped, so memory holds n x k floats, never every completion.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reward_lens import __version__
from reward_lens.measure.efficiency.cost import CostBook, rollouts_refusal
from reward_lens.measure.efficiency.of_run import price_run
from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.measure.ledger.price import steps_from_run, whole_run
from reward_lens.record.reader import Run, Window
from reward_lens.report.model import (
    BasisFeature,
    BasisOut,
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
from reward_lens_spec import Refusal, Subject, load_book, load_books, load_fields, load_refusal_codes, make_refusal
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


# Sample text shown in a report is capped: a 5 MB completion would otherwise be embedded
# whole in the HTML and the JSON. The mark says how much was left out.
SAMPLE_TEXT_MAX = 2000


def _capped(text: str) -> str:
    if len(text) <= SAMPLE_TEXT_MAX:
        return text
    return text[:SAMPLE_TEXT_MAX] + f" … [truncated: {len(text) - SAMPLE_TEXT_MAX} more characters]"


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


def _cost_section(run: Run, progress: Progress, *, ledger: str = "auto", window: int | str = 1,
                  features: FeatureBasis) -> tuple[list[Refusal], CostSection | None]:
    if not run.n_rollouts:
        return [rollouts_refusal(run, [])], None
    window_ = whole_run(run)
    progress("reading rollouts and computing features")
    samples = steps_from_run(run, features, window=window_)
    progress(f"pricing steps ({ledger} ledger)")
    priced = price_run(run, samples, ledger=ledger, window=window)
    formed = [] if priced.book is None else priced.book.kl_min.rows
    extra = _not_formed_refusals(run, priced)
    if priced.book is None:
        return extra or [rollouts_refusal(run, samples)], None
    book: CostBook = priced.book
    g = priced.metric
    docs, units = features.docs(), features.units()
    excluded = {n: why for sub in [g, *g.by_step.values()] for n, why in sub.excluded.items()}
    feats = [FeatureOut(name=n, doc=docs[n], unit=units[n], status="priced" if n in g.active else excluded.get(n, "excluded"))
             for n in g.names]
    kl_rows = [KlMinOut(step_pair=r.step_pair, kl_min=r.kl_min, noise_floor=r.noise_floor,
                        clears_noise_floor=r.clears_noise_floor, p_value=r.p_value, resolved=r.resolved,
                        leading_feature=r.leading_feature, shares=r.shares, shares_inexact=r.shares_inexact,
                        condition=r.condition)
               for r in formed]
    eff = [EfficiencyOut(step_pair=r.step_pair, steps=r.steps, status=r.status, kl_min=r.kl_min, kl_spent=r.kl_spent,
                         efficiency=r.efficiency, efficiency_null=r.efficiency_null,
                         efficiency_debiased=r.efficiency_debiased, interval=r.interval, p_value=r.p_value,
                         source=r.kl_spent_source, resolved=r.resolved, d_t_checks=r.d_t_checks,
                         d_t_disagrees=r.d_t_disagrees)
           for r in book.rows]
    means = [FeatureMeans(step=s.step, n=s.n, mean=s.z.mean(axis=0).tolist(),
                          se=(s.z.std(axis=0, ddof=1) / np.sqrt(s.n)).tolist() if s.n > 1 else [0.0] * len(g.names))
             for s in samples]
    totals = {a: sum(r.shares.get(a, 0.0) for r in formed) for a in g.names}
    counts = book.counts()
    counts["refused"] += sum(len(r.subject.step_pairs) for r in extra)
    eta_median, eta_interval = book.headline()
    summary = {
        "ledger": book.ledger, "window": str(book.window),
        "rows_total": sum(counts.values()), "rows_resolved": counts["resolved"],
        "rows_unresolved": counts["unresolved"], "rows_refused": counts["refused"],
        "rows_nothing_priced": counts["nothing_priced"],
        "eta_median": eta_median, "eta_interval": list(eta_interval) if eta_interval else None,
        "false_discoveries_expected": book.false_discoveries_expected,
        "step_pairs": len(formed),
        "kl_min_rows": len(kl_rows),
        "kl_min_resolved": sum(r.resolved for r in kl_rows),
        "median_kl_min": float(np.median([r.kl_min for r in kl_rows])) if kl_rows else None,
        "median_noise_floor": float(np.median([r.noise_floor for r in kl_rows])) if kl_rows else None,
    }
    top = max(totals, key=totals.get) if totals and max(totals.values()) > 0 else None
    still = None
    if book.refusals and kl_rows:
        still = render_template("report/cost_still_works.j2", {
            "n": len(kl_rows), "resolved": summary["kl_min_resolved"], "top": top,
            "top_share": (totals[top] / sum(totals.values())) if top else None})
    section = CostSection(
        features=feats,
        metric=MetricOut(method=g.method, scope=g.scope, n=g.n, damping=g.damping, damping_stable=g.damping_stable,
                         reading=g.reading),
        kl_min=kl_rows, efficiency=eff, feature_means=means, summary=summary, still_works=still,
    )
    return [*extra, *book.refusals], section


def _not_formed_refusals(run: Run, priced) -> list[Refusal]:
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
        out.append(make_refusal("RECORD_INCOMPLETE", load_book("cost"), Subject(run_id=run.run_id, step_pairs=tuple(pairs)),
                                {"requirement": "ledger", "ledger": priced.ledger, "run": run.short_id,
                                 "n_pairs": len(pairs), "pairs_shown": shown, "reason": reason,
                                 "steps": sorted(steps, key=lambda d: d["step"]),
                                 "framework": run.manifest.framework.name}))
    return out


BOOK_SECTIONS = {"cost": _cost_section}


def build_report(run: Run, progress: Progress | None = None, *, ledger: str = "auto",
                 window: int | str = 1, features: FeatureBasis | None = None) -> Report:
    """Every book of ``run``, computed in the feature basis ``features`` (default: the surface
    basis of specs/features/surface.yaml)."""
    progress = progress or (lambda _msg: None)
    features = features if features is not None else SurfaceFeatures()
    books = []
    for book_id, spec in load_books().items():
        builder = BOOK_SECTIONS.get(book_id)
        if builder is None:
            raise RuntimeError(f"specs/books/{book_id}.yaml has no section builder in reward_lens.report.build")
        refusals, section = builder(run, progress, ledger=ledger, window=window, features=features)
        has_numbers = section is not None and bool(section.kl_min or section.efficiency)
        resolved = section is not None and bool(section.summary.get("rows_resolved"))
        if not has_numbers:
            status = "refused"
        elif refusals:
            status = "partial"
        else:
            status = "computed" if resolved else "unresolved"
        headline = render_template("report/cost_headline.j2", {
            "status": status, "s": section.summary if section else {},
            "codes": sorted({r.code for r in refusals})}).strip() if book_id == "cost" else None
        books.append(BookOut(id=spec.id, title=spec.title, series=spec.series, section=spec.section,
                             function=spec.function, status=status, headline=headline,
                             refusals=[refusal_out(r) for r in refusals], cost=section))
    basis = BasisOut(id=features.basis_id, name=features.label, source=features.source,
                     features=[BasisFeature(**d) for d in features.describe()])
    return Report(generator=f"reward-lens {__version__}", run=_summary(run), basis=basis, books=books,
                  samples=_samples(run))
