"""Build the report of one record: the run summary and one section per book spec.

Rollouts are streamed by row group (``steps_from_run``): completion strings are turned
into feature vectors and dropped, so memory holds n x k floats, never every completion.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reward_lens import __version__
from reward_lens.measure.books import RunContext
from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.record.reader import Run, Window
from reward_lens.report.curves import training_curves
from reward_lens.record.errors import RecordError
from reward_lens.report.model import (
    BasisFeature,
    BrowserRow,
    BasisOut,
    BookOut,
    FieldPresence,
    RefusalOut,
    Report,
    RunSummary,
    SampleRollout,
)
from reward_lens_spec import Refusal, load_books, load_fields, load_refusal_codes
from reward_lens_spec.render import first_sentence, render_template

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


def _browser(run: Run, features: FeatureBasis, context: dict) -> list[BrowserRow]:
    """A spread of rollouts for the HTML browser: up to BROWSER_PER_STEP rollouts of up to
    BROWSER_STEPS steps spread over the run, with their features in the report's basis."""
    if not run.n_rollouts:
        return []
    steps = np.unique(run.rollout_steps)
    chosen = set(steps[np.unique(np.linspace(0, len(steps) - 1, min(BROWSER_STEPS, len(steps))).astype(int))].tolist())
    available = set(run.rollout_columns())
    cols = [c for c in ("prompt", "completion", "reward", "advantage") if c in available]
    cols += [c for c in features.columns if c in available and c not in cols]
    taken: dict[int, int] = {}
    out = []
    for table in run.iter_rollouts(cols, steps=sorted(chosen)):  # only the chosen steps' rows
        s = table.column("step").to_numpy()
        # each row's rank among its step's rows (stable: in record order), after those kept before
        order = np.argsort(s, kind="stable")
        ss = s[order]
        starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
        rank = np.empty(len(s), dtype=np.int64)
        rank[order] = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
        before = np.array([taken.get(v, 0) for v in s.tolist()], dtype=np.int64)
        ok = rank + before < BROWSER_PER_STEP
        keep = np.flatnonzero(ok).tolist()
        for v, c in zip(*np.unique(s[ok], return_counts=True)):
            taken[int(v)] = taken.get(int(v), 0) + int(c)
        if not keep:
            continue
        sub = table.take(keep)
        try:
            z = features.compute(sub, context=context)
        except RecordError:
            z = np.full((sub.num_rows, len(features.names)), np.nan)
        rows = sub.to_pylist()
        for row, zi in zip(rows, z):
            out.append(BrowserRow(step=row["step"], prompt=_capped(row.get("prompt") or "", BROWSER_TEXT_MAX),
                                  completion=_capped(row.get("completion") or "", BROWSER_TEXT_MAX),
                                  reward=row.get("reward"), advantage=row.get("advantage"),
                                  features={n: float(v) for n, v in zip(features.names, zi) if np.isfinite(v)}))
    return out


def build_report(run: Run, progress: Progress | None = None, *, ledger: str = "auto",
                 window: int | str = 1, features: FeatureBasis | None = None) -> Report:
    """Every book of ``run`` (one per spec in specs/books/, in their ``report.order``),
    computed in the feature basis ``features`` (default: specs/features/surface.yaml)."""
    features = features if features is not None else SurfaceFeatures()
    ctx = RunContext(run, features, ledger=ledger, window=window, progress=progress)
    ctx.specs = {k: v for k, v in load_books().items() if v.report is not None}
    books, card_order = [], {}
    for spec in sorted(ctx.specs.values(), key=lambda b: (b.report.order, b.id)):
        card_order[spec.id] = spec.report.card_order
        res = ctx.result(spec.id)
        books.append(BookOut(id=spec.id, title=spec.title, series=spec.series, section=spec.section,
                             function=spec.function, status=res.status, headline=res.headline,
                             refusals=[refusal_out(r) for r in res.refusals], card=res.card,
                             data=res.data,
                             figures=res.figures))
    basis = BasisOut(id=features.basis_id, name=features.label, source=features.source,
                     features=[BasisFeature(**d) for d in features.describe()])
    from reward_lens.measure.ledger.price import feature_context

    return Report(generator=f"reward-lens {__version__}", run=_summary(run), basis=basis, books=books,
                  samples=_samples(run), curves=training_curves(run),
                  browser=_browser(run, features, feature_context(run)),
                  card=summary_card(sorted(books, key=lambda b: card_order[b.id])))


def summary_card(books: list[BookOut]) -> list[str]:
    """Three to five sentences a person can act on: each book's own sentence (in page order),
    then what could not be computed and the one change that would compute most of it."""
    lines = [b.card for b in books if b.card][:4]
    missing = [b for b in books if b.status in ("refused", "partial")]
    if missing:
        remedies: dict[str, list[str]] = {}
        for b in missing:
            for r in b.refusals:
                remedies.setdefault(first_sentence(r.remedy), []).append(b.id)
        best = max(remedies, key=lambda k: len(set(remedies[k]))) if remedies else None
        lines.append(render_template("report/card_missing.j2", {
            "missing": missing, "remedy": best, "remedy_books": len(set(remedies[best])) if best else 0}))
    return lines[:5]
