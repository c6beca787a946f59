"""Build the report of one record: the run summary and one section per book spec.

Rollouts are streamed by row group (``steps_from_run``): completion strings are turned
into feature vectors and dropped, so memory holds n x k floats, never every completion.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from reward_lens import __version__
from reward_lens.measure.books import RunContext
from reward_lens.measure.ledger.basis import FeatureBasis
from reward_lens.measure.ledger.features import SurfaceFeatures
from reward_lens.record.reader import Run, Window
from reward_lens.report.curves import RolloutCurves, training_curves
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
                 window: int | str = 1, features: FeatureBasis | None = None) -> Report:
    """Every book of ``run`` (one per spec in specs/books/, in their ``report.order``),
    computed in the feature basis ``features`` (default: specs/features/surface.yaml)."""
    from reward_lens.measure.ledger.price import feature_context

    features = features if features is not None else SurfaceFeatures()
    browser, curves = BrowserRows(run, features, feature_context(run)), RolloutCurves(run)
    ctx = RunContext(run, features, ledger=ledger, window=window, progress=progress, collectors=[browser, curves])
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
    if not ctx.collected:  # no book read the samples: the browser and the curves read for themselves
        browser.read(run)
        curves.read(run)
    return Report(generator=f"reward-lens {__version__}", run=_summary(run), basis=basis, books=books,
                  samples=_samples(run), curves=training_curves(run, curves.panels()), browser=browser.rows,
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
