"""The cost book: KL_min per step pair, its Shapley shares, and efficiency eta = KL_min / D_t.

Seed section "The three numbers": KL_min = 1/2 dz^T G^-1 dz is the smallest policy
divergence consistent with the observed feature movement, so eta_t = KL_min / D_t lies in
[0, 1] whenever its premises hold. The book never hands out an eta outside that interval:
it refuses ENVELOPE_VIOLATED and names the failed premise. It never clips.

The half of the book that needs no denominator (KL_min, its shares, its noise floor) is
``kl_min_series``; ``cost_series`` adds D_t where some input supplies it, resolved through
``specs/books/cost.yaml``, and refuses RECORD_INCOMPLETE where none does.

Noise floor. Under sampling noise the observed dz~ has covariance Sigma_dz, and
E[1/2 dz~^T G^-1 dz~] = KL_min + 1/2 tr(G^-1 Sigma_dz). The second term is what a
quadratic form of pure noise reads; each row reports it. Under dz = 0 the form has standard
deviation sqrt(1/2 tr((G^-1 Sigma_dz)^2)) (Gaussian dz~), and a row *clears* the floor when
KL_min > floor + 2 sd, an approximately 95 % one-sided test.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reward_lens.measure.efficiency.metric import MetricG
from reward_lens.measure.efficiency.shapley import EXACT_MAX_FEATURES, kl_min as quad_kl_min, shapley_shares
from reward_lens.measure.ledger.price import Ledger
from reward_lens.record.reader import Run
from reward_lens_spec import Presence, Refusal, Subject, load_book, make_refusal, resolve

BOOK_ID = "cost"
# A row clears the noise floor when KL_min exceeds floor + NOISE_Z * sd(null): ~95 % one-sided.
NOISE_Z = 2.0


@dataclass(frozen=True)
class KlMinRow:
    """KL_min of one step pair, in nats per sequence, with its shares and noise floor."""

    step_pair: tuple[int, int]
    kl_min: float
    shares: dict[str, float]
    noise_floor: float
    noise_sd: float
    clears_noise_floor: bool
    leading_feature: str | None
    leading_delta: float | None
    leading_se: float | None
    n_pre: int
    n_post: int
    unpriced_movement: dict[str, float] = field(default_factory=dict)  # excluded feature -> dz

    @property
    def leading_t(self) -> float | None:
        if self.leading_delta is None or not self.leading_se:
            return None
        return self.leading_delta / self.leading_se


@dataclass(frozen=True)
class KlMinSeries(Sequence):
    """The denominator-free half of the book: a sequence of rows, plus any refusals."""

    rows: tuple[KlMinRow, ...]
    refusals: tuple[Refusal, ...]
    metric: MetricG

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def __iter__(self) -> Iterator[KlMinRow]:
        return iter(self.rows)


@dataclass(frozen=True)
class CostRow:
    step_pair: tuple[int, int]
    kl_min: float
    kl_spent: float  # D_t, nats per sequence
    efficiency: float  # in [0, 1], always
    kl_spent_source: str
    resolved: bool  # KL_min clears its noise floor
    shares: dict[str, float]


@dataclass(frozen=True)
class CostBook:
    rows: tuple[CostRow, ...]
    refusals: tuple[Refusal, ...]
    kl_min: KlMinSeries
    run_id: str | None = None

    def render(self, width: int = 90) -> str:
        """Plain text in the seed's layout: one block per refusal, then the computed rows."""
        blocks = [r.text(width) for r in self.refusals]
        if self.rows:
            lines = [f"cost_series  {len(self.rows)} step pair(s) with efficiency"]
            lines.append("    step pair      KL_min (nats)   D_t (nats)   efficiency   resolved")
            for r in self.rows:
                lines.append(f"    {r.step_pair[0]:>5d}->{r.step_pair[1]:<6d}  {r.kl_min:>13.4g}  {r.kl_spent:>11.4g}"
                             f"  {r.efficiency:>11.4f}   {'yes' if r.resolved else 'no (below noise floor)'}")
            blocks.append("\n".join(lines))
        if not blocks:
            blocks.append("cost_series  no step pairs")
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return self.render()


# ---------------------------------------------------------------------------- helpers
def _short(run_id: str | None) -> str:
    return (run_id[:12] + "...") if run_id else "(no run)"


def _subject(run_id: str | None, pairs: Sequence[tuple[int, int]]) -> Subject:
    return Subject(run_id=run_id, step_pairs=tuple(tuple(p) for p in pairs))


def _basis_refusal(ledgers: Sequence[Ledger], g: MetricG, run_id: str | None) -> Refusal | None:
    bad = [lg for lg in ledgers if lg.names != g.names]
    if not bad:
        return None
    a, b = bad[0].names, g.names
    pos = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    return make_refusal("UNIT_MISMATCH", load_book(BOOK_ID), _subject(run_id, [lg.step_pair for lg in bad]), {
        "kind": "basis", "n_pairs": len(bad), "run": _short(run_id),
        "ledger_names": list(a), "metric_names": list(b), "position": pos,
        "same_set": sorted(a) == sorted(b),
    })


def _rows(ledgers: Sequence[Ledger], g: MetricG) -> list[KlMinRow]:
    """Rows for every ledger, each priced by the metric of its step (``g.for_step``); pairs
    that share an active set are computed together (one vectorised Shapley sweep)."""
    groups: dict[tuple[str, ...], list[tuple[int, Ledger, MetricG]]] = {}
    for p, lg in enumerate(ledgers):
        sub = g.for_step(lg.step_pair[0])
        groups.setdefault(sub.active, []).append((p, lg, sub))
    rows: list[KlMinRow | None] = [None] * len(ledgers)
    for active, items in groups.items():
        idx = items[0][2].active_index
        if len(idx):
            dz = np.stack([lg.delta_z[idx] for _, lg, _ in items])
            gaa = np.stack([sub.matrix[np.ix_(idx, idx)] for _, _, sub in items])
            kl = np.atleast_1d(quad_kl_min(dz, gaa))
            shares = np.atleast_2d(shapley_shares(dz, gaa))
            ginv = np.linalg.inv(gaa)
        for q, (p, lg, sub) in enumerate(items):
            excluded_idx = [g.names.index(n) for n in sub.excluded]
            unpriced = {g.names[j]: float(lg.delta_z[j]) for j in excluded_idx if lg.delta_z[j] != 0}
            if not len(idx):  # nothing varies at this step: no movement can be priced
                rows[p] = KlMinRow(lg.step_pair, 0.0, {}, 0.0, 0.0, False, None, None, None, lg.n_pre, lg.n_post,
                                   unpriced)
                continue
            m = ginv[q] @ lg.cov_delta[np.ix_(idx, idx)]
            floor = 0.5 * float(np.trace(m))
            sd = math.sqrt(max(0.5 * float(np.trace(m @ m)), 0.0))
            lead = int(np.argmax(shares[q])) if kl[q] > 0 else None
            rows[p] = KlMinRow(
                step_pair=lg.step_pair, kl_min=float(kl[q]),
                shares={a: float(v) for a, v in zip(active, shares[q])},
                noise_floor=floor, noise_sd=sd, clears_noise_floor=bool(kl[q] > floor + NOISE_Z * sd),
                leading_feature=active[lead] if lead is not None else None,
                leading_delta=float(lg.delta_z[idx[lead]]) if lead is not None else None,
                leading_se=float(lg.se[idx[lead]]) if lead is not None else None,
                n_pre=lg.n_pre, n_post=lg.n_post, unpriced_movement=unpriced,
            )
    return [r for r in rows if r is not None]


def kl_min_series(ledgers: Sequence[Ledger], g: MetricG, *, run_id: str | None = None) -> KlMinSeries:
    """KL_min and its exact Shapley shares for every step pair. Needs no D_t."""
    refusal = _basis_refusal(ledgers, g, run_id)
    if refusal is not None:
        return KlMinSeries((), (refusal,), g)
    widest = max([len(g.active)] + [len(sub.active) for sub in g.by_step.values()])
    if widest > EXACT_MAX_FEATURES:
        ref = make_refusal("LIMIT_EXCEEDED", load_book(BOOK_ID), _subject(run_id, [lg.step_pair for lg in ledgers]),
                           {"what": "exact Shapley shares", "limit": EXACT_MAX_FEATURES, "k": widest,
                            "run": _short(run_id)})
        return KlMinSeries((), (ref,), g)
    missing = [lg.step_pair for lg in ledgers if g.scope == "per_step" and lg.step_pair[0] not in g.by_step]
    if missing:
        raise ValueError(f"the per-step metric has no estimate for the steps of pairs {missing[:5]}: build the "
                         "metric from the same StepSample list as the ledgers")
    return KlMinSeries(tuple(_rows(ledgers, g)), (), g)


# ---------------------------------------------------------------------------- denominator
def _supplied(run: Run | None, kl_spent: Mapping[int, float] | None, n_steps: int) -> dict[str, Presence]:
    sup = dict(run.fields()) if run is not None else {}
    if kl_spent:
        sup["kl_spent"] = Presence(len(kl_spent), max(n_steps, len(kl_spent)))
    return sup


def denominator_context(resolution, *, run_label: str, n_missing: int | None, n_total: int | None,
                        optimizer: str | None, betas: list[float], framework: str | None,
                        kl_spent_given: bool = False, audit: bool = False) -> dict[str, Any]:
    """The RECORD_INCOMPLETE context for the denominator, from a resolution: shared by the
    book (on a record) and the audit (on a logging config, before any run exists)."""
    status = resolution.status("denominator")
    return {
        "requirement": "denominator", "audit": audit, "run": run_label,
        "n_missing": n_missing, "n_total": n_total, "framework": framework, "optimizer": optimizer,
        "betas": betas, "kl_spent_given": kl_spent_given,
        "alternatives": [{"id": a.id, "describe": a.describe, "missing": list(a.missing), "partial": list(a.partial)}
                         for a in status.alternatives],
        "near_misses": [{"field": nm.spec.field, "present": nm.present, "why": nm.spec.why,
                         "count": nm.presence.count if nm.presence else 0,
                         "of": nm.presence.of if nm.presence else 0,
                         "applies": nm.applies, "only_for": nm.spec.only_for_optimizers}
                        for nm in status.near_misses],
    }


def rollouts_context(*, run_label: str, steps_with_rollouts: int | None, steps: int | None,
                     logging_steps: int | None, framework: str | None, audit: bool = False) -> dict[str, Any]:
    return {"requirement": "rollouts", "audit": audit, "run": run_label, "steps_with_rollouts": steps_with_rollouts,
            "steps": steps, "logging_steps": logging_steps, "framework": framework}


def rollouts_refusal(run: Run, samples: Sequence[Any]) -> Refusal:
    """RECORD_INCOMPLETE when no two consecutive steps both have rollouts (no ledger at all)."""
    ctx = rollouts_context(run_label=_short(run.run_id), steps_with_rollouts=len(samples),
                           steps=int(len(np.union1d(run.steps, np.unique(run.rollout_steps)))),
                           logging_steps=run.manifest.logging_steps, framework=run.manifest.framework.name)
    return make_refusal("RECORD_INCOMPLETE", load_book(BOOK_ID), _subject(run.run_id, []), ctx)


def _incomplete_context(run: Run | None, missing_pairs: list[tuple[int, int]], total: int, resolution,
                        kl_spent_given: bool) -> dict[str, Any]:
    return denominator_context(
        resolution, run_label=_short(run.run_id if run is not None else None), n_missing=len(missing_pairs),
        n_total=total, optimizer=run.manifest.optimizer if run is not None else None,
        betas=sorted(set(run.telemetry_column("beta").values())) if run is not None else [],
        framework=run.manifest.framework.name if run is not None else None, kl_spent_given=kl_spent_given)


def _denominators(ledgers: Sequence[Ledger], run: Run | None, kl_spent: Mapping[int, float] | None,
                  kl_spent_unit: str) -> tuple[dict[int, tuple[float, str]], Refusal | None]:
    """D_t per step from the caller or the record, in nats per sequence."""
    out: dict[int, tuple[float, str]] = {}
    if run is not None:
        est = run.telemetry_column("kl_to_previous_estimator")
        for s, v in run.telemetry_column("kl_to_previous").items():
            out[s] = (float(v), f"record kl_to_previous ({est.get(s, 'estimator not recorded')})")
    if kl_spent:
        if kl_spent_unit == "nats_per_sequence":
            for s, v in kl_spent.items():
                # A KlEstimate (whitebox) carries its estimator; a bare number is the caller's.
                est = getattr(v, "estimator", None)
                out[int(s)] = (float(v), f"kl_spent ({est})" if est else "caller kl_spent")
        elif kl_spent_unit == "nats_per_token":
            # Exact only as total-nats / total-tokens over the same sequences: per sequence it
            # is that mean times the mean completion length. Without token counts, refuse.
            fields = run.fields() if run is not None else {}
            if "rollout.num_tokens" not in fields:
                return out, make_refusal("UNIT_MISMATCH", load_book(BOOK_ID),
                                         _subject(run.run_id if run else None, [lg.step_pair for lg in ledgers]),
                                         {"kind": "per_token", "run": _short(run.run_id if run else None),
                                          "n_pairs": len(ledgers)})
            tokens = run.read_rollouts(["num_tokens"])
            steps = tokens.column("step").to_numpy()
            counts = tokens.column("num_tokens").to_numpy(zero_copy_only=False).astype(float)
            uniq, inverse = np.unique(steps, return_inverse=True)
            means = np.bincount(inverse, weights=counts) / np.bincount(inverse)
            mean_tokens = dict(zip(uniq.tolist(), means.tolist()))
            for s, v in kl_spent.items():
                if int(s) + 1 in mean_tokens:
                    out[int(s)] = (float(v) * mean_tokens[int(s) + 1],
                                   "caller kl_spent (per token x mean completion tokens of step t+1)")
        else:
            raise ValueError(f"kl_spent_unit must be 'nats_per_sequence' or 'nats_per_token', not {kl_spent_unit!r}")
    return out, None


def cost_series(
    ledgers: Sequence[Ledger],
    g: MetricG,
    run_: Run | None = None,
    kl_spent: Mapping[int, float] | None = None,
    *,
    kl_spent_unit: str = "nats_per_sequence",
) -> CostBook:
    """The cost book: eta_t = KL_min / D_t per step pair, or the refusals that replace it.

    D_t for the pair (t, t+1) is ``kl_spent[t]`` if given, else the record's
    ``kl_to_previous`` at step t (both nats per sequence; ``kl_spent_unit='nats_per_token'``
    converts exactly only with the record's token counts, and refuses UNIT_MISMATCH without
    them).
    """
    run_id = run_.run_id if run_ is not None else None
    book = load_book(BOOK_ID)
    series = kl_min_series(ledgers, g, run_id=run_id)
    if series.refusals:
        return CostBook((), series.refusals, series, run_id)
    denoms, unit_refusal = _denominators(ledgers, run_, kl_spent, kl_spent_unit)
    if unit_refusal is not None:
        return CostBook((), (unit_refusal,), series, run_id)
    by_pair = {r.step_pair: r for r in series.rows}
    lg_by_pair = {lg.step_pair: lg for lg in ledgers}
    rows: list[CostRow] = []
    refusals: list[Refusal] = []
    missing = [lg.step_pair for lg in ledgers if lg.step_pair[0] not in denoms]
    if missing:
        n_steps = len(run_.steps) if run_ is not None else len(ledgers)
        resolution = resolve(book, _supplied(run_, kl_spent, n_steps),
                             optimizer=run_.manifest.optimizer if run_ is not None else None)
        refusals.append(make_refusal("RECORD_INCOMPLETE", book, _subject(run_id, missing),
                                     _incomplete_context(run_, missing, len(ledgers), resolution, bool(kl_spent))))
    for pair, row in by_pair.items():
        if pair[0] not in denoms:
            continue
        d_t, source = denoms[pair[0]]
        violation = _envelope(row, lg_by_pair[pair], d_t)
        if violation is not None:
            refusals.append(make_refusal("ENVELOPE_VIOLATED", book, _subject(run_id, [pair]),
                                         {**violation, "run": _short(run_id), "source": source}))
            continue
        rows.append(CostRow(pair, row.kl_min, d_t, row.kl_min / d_t, source, row.clears_noise_floor, row.shares))
    return CostBook(tuple(rows), tuple(refusals), series, run_id)


def _envelope(row: KlMinRow, lg: Ledger, d_t: float) -> dict[str, Any] | None:
    """None when eta = KL_min / D_t is inside [0, 1]; else the failed premise, with numbers."""
    base = {"step_pair": list(row.step_pair), "kl_min": row.kl_min, "d_t": d_t, "noise_floor": row.noise_floor,
            "clears_noise_floor": row.clears_noise_floor, "leading_feature": row.leading_feature,
            "leading_delta": row.leading_delta, "leading_se": row.leading_se,
            "leading_t": row.leading_t, "n_pre": lg.n_pre, "n_post": lg.n_post,
            "max_abs_t": float(np.max(np.abs(lg.t))) if len(lg.t) else 0.0}
    if not math.isfinite(d_t):
        return {**base, "premise": "nonfinite_denominator", "ratio": None}
    if d_t <= 0:
        return {**base, "premise": "nonpositive_denominator", "ratio": None}
    ratio = row.kl_min / d_t
    if not (0.0 <= ratio <= 1.0):
        return {**base, "premise": "ratio_above_one", "ratio": ratio}
    return None


__all__ = ["CostBook", "CostRow", "KlMinRow", "KlMinSeries", "cost_series", "kl_min_series", "rollouts_refusal"]
