"""What every book hands the report, and the run context books share.

A book is one YAML in ``specs/books/`` (its inputs, refusals, and under ``report:`` the
function that builds its section, the model of its data and its templates), one module under
``reward_lens/measure/`` and its templates. The report iterates over the specs and calls each
``report.builder`` with a ``RunContext``; nothing in ``reward_lens/report/`` knows a book.

``RunContext`` computes what several books read once, on first use: the step samples in the
report's feature basis, the priced run (ledgers, the metric G, the cost book), and the run's
decisions (which step pairs are refused, usable, priced, resolved; which features moved:
``measure.decisions``), which every book, the card and the diff read instead of deciding
again. A book that needs another's result asks the context for it (``ctx.result("cost")``) and
names it in its spec (``report.needs``): ``results`` builds the books whose needs are met
concurrently, on threads (their arithmetic is numpy's, which releases the GIL), each shared input
still computed once (``cached`` holds a lock per key while it computes).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from reward_lens.measure.figures import FigureOut
from reward_lens_spec import Refusal
from reward_lens_spec.models import BookSpec

STATUSES = ("computed", "unresolved", "partial", "refused")


@dataclass
class BookResult:
    """status: computed (numbers, no refusal, something resolved from noise) | unresolved
    (numbers, none resolved) | partial (numbers and refusals) | refused (no numbers)."""

    status: str
    headline: str | None
    refusals: list[Refusal]
    data: BaseModel | None = None
    figures: list[FigureOut] = field(default_factory=list)


def status_of(has_numbers: bool, refusals: list[Refusal], resolved: bool) -> str:
    if not has_numbers:
        return "refused"
    if refusals:
        return "partial"
    return "computed" if resolved else "unresolved"


def unmeasured_features(samples: Sequence, features) -> list[dict[str, Any]]:
    """Per feature not a finite number on some rollouts of ``samples``: its name, how many
    rollouts, the first step, and why where the basis says (a reward function with no score)."""
    import numpy as np

    rows: dict[int, int] = {}
    first: dict[int, int] = {}
    names: Sequence[str] = ()
    for smp in samples:
        z = np.asarray(smp.z, dtype=float)
        if not z.size:
            continue
        names = smp.names
        bad = (~np.isfinite(z)).sum(axis=0)
        for j in np.flatnonzero(bad).tolist():
            rows[j] = rows.get(j, 0) + int(bad[j])
            first.setdefault(j, int(smp.step))
    reward_of = {d.name: d.reward for d in getattr(features, "defs", ()) if getattr(d, "kind", None) == "reward"}
    out = []
    for j in sorted(rows):
        name = names[j]
        fn = reward_of.get(name)
        out.append({"feature": name, "rows": rows[j], "first_step": first[j],
                    "reason": f"reward function `{fn}` gave no score there" if fn else None})
    return out


def unmeasured_result(ctx, spec: BookSpec) -> BookResult:
    """A book refused whole because features of the basis are not measured on every rollout."""
    from reward_lens_spec import make_refusal
    from reward_lens_spec.refusal import Subject
    from reward_lens_spec.render import render_template

    run_id = ctx.run.run_id
    short = run_id[:12] + "..." if run_id else "(no run)"
    ref = make_refusal("RECORD_INCOMPLETE", spec, Subject(run_id=run_id, step_pairs=()),
                       {"requirement": "measured_features", "run": short, "unmeasured": ctx.unmeasured})
    headline = render_template("report/unmeasured_headline.j2", {"unmeasured": ctx.unmeasured}).strip()
    return BookResult(status="refused", headline=headline, refusals=[ref], data=None)


def import_object(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class RunContext:
    """One record, read once, for every book of a report."""

    def __init__(self, run, features, *, ledger: str = "auto", window: int | str = 1,
                 progress: Callable[[str], None] | None = None, collectors: Sequence = ()):
        self.run = run
        self.features = features
        self.ledger = ledger
        self.window = window
        self.progress = progress or (lambda _msg: None)
        self.collectors = list(collectors)  # fed by the pass that reads the samples (RowCollector)
        self.collected = False
        self._cache: dict[str, Any] = {}
        self.specs: dict[str, BookSpec] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._lock = threading.Lock()
        self._failed: dict[str, Exception] = {}

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, once per key: a book on another thread that asks for the same key while
        it is being computed waits for it instead of computing it again; and where ``make()``
        failed, every later asker gets that error, not another try (a bad record read once)."""
        if key in self._cache:
            return self._cache[key]
        with self._lock:
            lock = self._locks.setdefault(key, threading.RLock())
        with lock:
            if key in self._failed:
                raise self._failed[key]
            if key not in self._cache:
                try:
                    self._cache[key] = make()
                except Exception as e:
                    self._failed[key] = e
                    raise
        return self._cache[key]

    @property
    def samples(self):
        from reward_lens.measure.ledger.price import steps_from_run, whole_run

        def make():
            if not self.run.n_rollouts:
                return []
            self.progress("reading rollouts and computing features")
            out = steps_from_run(self.run, self.features, window=whole_run(self.run), collectors=self.collectors)
            self.collected = True
            return out
        return self.cached("samples", make)

    @property
    def watch(self):
        """The findings' sequential watch of the samples (``measure.sequential``), in the
        report's basis: it reads the samples alone, so a report makes it while the books are
        priced (``beside_books``)."""
        from reward_lens.measure.sequential import WatchBasis, watch_samples

        return self.cached("watch", lambda: watch_samples(self.samples, WatchBasis.of(self.features))
                           if self.samples else None)

    def beside_books(self) -> threading.Thread:
        """What reads the samples alone, made on a thread of its own while the books are priced
        (started, returned): the findings' ``watch`` and the cause book's selection
        differentials; then the record's field presence (``Run.fields``, a second read of its
        partly null columns, after the samples' read), which the summary and the findings ask
        for at the end. The samples are read once, by whichever asks first; an error is kept for
        the one that asks for the same thing next (``cached``, the read's ``memo``; ``fields``
        raises it again when asked)."""
        from reward_lens.measure.cause import selection_of_run

        def make():
            try:
                self.watch
                selection_of_run(self.samples)
            except Exception:  # noqa: BLE001 -- raised again where the book or the findings ask
                pass
            try:
                self.run.fields()
            except Exception:  # noqa: BLE001 -- not cached: raised again where it is asked for
                pass
        t = threading.Thread(target=make, name="reward-lens-watch", daemon=True)
        t.start()
        return t

    @property
    def priced(self):
        from reward_lens.measure.efficiency.of_run import price_run

        def make():
            if not self.samples:
                return None
            self.progress(f"pricing steps ({self.ledger} ledger)")
            return price_run(self.run, self.samples, ledger=self.ledger, window=self.window)
        return self.cached("priced", make)

    @property
    def decisions(self):
        """The run's decisions (``measure.decisions``): made once, read by every book."""
        from reward_lens.measure.decisions import decide

        return self.cached("decisions", lambda: decide(self.priced, self.features.names))

    def result(self, book_id: str) -> BookResult:
        """Another book's result (computed now if it has not been)."""
        return self.cached(f"book:{book_id}", lambda: self._build(book_id))

    @property
    def unmeasured(self) -> list[dict[str, Any]]:
        """The basis's features that are not a finite number on some rollouts (a ``reward`` feature
        whose reward function gave no score there): each with its rollouts and first step. Every
        book reads each feature on every rollout of a step, so the books refuse such a basis by
        name and the findings that read the features are not evaluated (issue 61)."""
        return self.cached("unmeasured", lambda: unmeasured_features(self.samples, self.features))

    def _build(self, book_id: str) -> BookResult:
        spec = self.specs[book_id]
        if spec.report is None:
            raise RuntimeError(f"specs/books/{book_id}.yaml names no report builder")
        if self.unmeasured:
            return unmeasured_result(self, spec)
        return import_object(spec.report.builder)(self)

    def results(self, book_ids: Sequence[str], workers: int | None = None) -> dict[str, BookResult]:
        """Every book of ``book_ids``: those whose ``report.needs`` are built, on threads at
        once, then those that needed them (an error is raised as the book's own, first in
        ``book_ids`` order among the books built together)."""
        from reward_lens.measure.ledger.price import in_threads

        pending = list(book_ids)
        while pending:
            ready = [b for b in pending if all(f"book:{n}" in self._cache for n in self._needs(b))]
            if not ready:  # needs outside book_ids, or a cycle: built in order, as ``result`` would
                ready = pending[:1]
            for _ in in_threads(iter(ready), self.result, workers=workers if workers is not None else len(ready)):
                pass
            pending = [b for b in pending if f"book:{b}" not in self._cache]
        return {b: self.result(b) for b in book_ids}

    def _needs(self, book_id: str) -> list[str]:
        spec = self.specs.get(book_id)
        return list(spec.report.needs) if spec is not None and spec.report is not None else []
