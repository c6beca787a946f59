"""The price book: what the reward gain cost, in nats of D_t.

Per step pair (t, t+1): the change of the mean reward, ``dR_t = mean R_{t+1} - mean R_t``, with
a standard error that counts prompt groups as units (rollouts where there are none), and the
reward per nat ``dR_t / D_t``. Rows are *resolved* when BH at q = 0.05 over the rows rejects
dR_t = 0. The run's price is a ratio of sums over the step pairs that have both (sum dR / sum
D_t), whose numerator telescopes over each run of consecutive pairs.

The frontier: cumulative reward change ``R(T) = mean R_T - mean R_first`` against the run's path
length in root-nats, ``d(T) = sum_{t<T} sqrt(D_t)`` (to second order an upper bound on
``sqrt(2 KL(pi_T || pi_first))``), with ``R(d) = d (alpha - beta log d)`` fitted by least squares
(the functional form Gao et al. 2022 found for RL against a reward model, there with d the root
KL to the initial policy: here a description of this run, not a law). Best-of-n sampling
with the run's n generations per prompt spends ``log n - (n-1)/n`` nats (the analytic KL of
best-of-n, Gao et al. eq. 1): its root is drawn as a reference, labelled as such.

Needs D_t: the same refusal as the cost book when the record has none. D_t is the run's decisions'
(``Decisions.spent``: every usable update's, read on no feature), so the book's total is the card's
and the cost book's, over the same updates, in every basis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from scipy import special

from reward_lens.measure.books import BookResult, RunContext, status_of
from reward_lens.measure.efficiency.cost import run_denominator_context
from reward_lens.measure.efficiency.eta import FDR_Q, benjamini_hochberg
from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.measure.ledger.price import StepSample, stacked, step_moment_arrays
from reward_lens_spec import Subject, load_book, make_refusal, resolve
from reward_lens_spec.render import render_template


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PriceRow(_M):
    step_pair: tuple[int, int]
    reward_change: float = Field(description="reward units")
    se: float
    d_t: float = Field(description="nats per sequence")
    reward_per_nat: float
    p_value: float
    resolved: bool


_ROWS = TypeAdapter(list[PriceRow])


class FrontierOut(_M):
    d: list[float] = Field(description="cumulative sqrt(D_t), root-nats")
    reward: list[float] = Field(description="cumulative reward change, reward units")
    alpha: float | None
    beta: float | None
    r2: float | None
    best_of_n: int | None
    best_of_n_kl: float | None = Field(description="log n - (n-1)/n, nats")


class PriceSection(_M):
    rows: list[PriceRow]
    frontier: FrontierOut
    summary: dict[str, float | int | str | None]


def step_rewards(samples: Sequence[StepSample]) -> dict[int, tuple[float, float]]:
    """Each step's mean reward and its standard error, with prompt groups as the units
    (``step_moments`` on the reward as a one-feature sample): the moments of all steps with two
    or more rollouts in one segmented pass (``step_moment_arrays`` on the samples' rewards
    stacked, a view of the report's one read where the samples are its own), no Python per step; NaN SE for a
    step of one rollout. Worked out once per run of samples (the price book and the findings
    both state them)."""
    # a step with a reward that is not a number (null in the record: a diverged value the tap or an
    # importer kept as data) has no stated mean: its rows' reward change is not read (issue 61)
    samples = [s for s in samples if s.rewards is not None and bool(np.isfinite(np.asarray(s.rewards, float)).all())]

    def make() -> dict[int, tuple[float, float]]:
        out = {s.step: (float(np.asarray(s.rewards, float).mean()), float("nan")) for s in samples if s.n < 2}
        two = [s for s in samples if s.n >= 2]
        if two:
            means, covs, _ = step_moment_arrays(two, np.asarray(stacked(two, "rewards"), dtype=float)[:, None])
            ses = np.sqrt(covs[:, 0, 0])
            for s, m, se in zip(two, means[:, 0].tolist(), ses.tolist()):
                out[s.step] = (m, se)
        return out
    stack = samples[0].stack if samples else None
    return stack.memo("step_rewards", samples, make) if stack is not None else make()


def fit_frontier(d: np.ndarray, r: np.ndarray) -> tuple[float | None, float | None, float | None]:
    """Least squares of r = alpha d - beta d log d over d > 0; (alpha, beta, R^2)."""
    ok = d > 0
    if ok.sum() < 3:
        return None, None, None
    x = np.column_stack([d[ok], -d[ok] * np.log(d[ok])])
    coef, *_ = np.linalg.lstsq(x, r[ok], rcond=None)
    fit = x @ coef
    ss = float(((r[ok] - r[ok].mean()) ** 2).sum())
    r2 = 1 - float(((r[ok] - fit) ** 2).sum()) / ss if ss > 0 else None
    return float(coef[0]), float(coef[1]), r2


def best_of_n_kl(n: int) -> float:
    return math.log(n) - (n - 1) / n


def price_series(samples: Sequence[StepSample], kl_spent: Mapping[int, float], n_generations: int | None = None
                 ) -> PriceSection:
    means = step_rewards([s for s in samples if s.rewards is not None])
    pairs = [(t, t + 1) for t in sorted(means) if t + 1 in means and t in kl_spent]
    rows = []
    for t, u in pairs:
        (a, sa), (b, sb) = means[t], means[u]
        rows.append((t, u, b - a, math.sqrt(sa ** 2 + sb ** 2), float(kl_spent[t])))
    # each pair's p-value, the normal tail of every testable pair in one call (the same ufunc on
    # the same numbers); no SE (one prompt group at a step): not testable, never resolved
    dr_all = np.array([r[2] for r in rows], dtype=np.float64)
    se_all = np.array([r[3] for r in rows], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = (2 * special.ndtr(-np.abs(dr_all) / se_all)).tolist()
    p = [1.0 if math.isnan(se) else tail[i] if se > 0 else (0.0 if dr else 1.0)
         for i, (_, _, dr, se, _) in enumerate(rows)]
    rej = benjamini_hochberg(p, FDR_Q).tolist()
    # every row validated in one call of pydantic's core over the list (a third of the time of a
    # model_construct per row, which validates nothing)
    out = _ROWS.validate_python([{"step_pair": (t, u), "reward_change": dr, "se": se, "d_t": d,
                                  "reward_per_nat": dr / d if d > 0 else float("nan"), "p_value": pv, "resolved": res}
                                 for (t, u, dr, se, d), pv, res in zip(rows, p, rej)])
    total_d = sum(r.d_t for r in out)
    total_r = sum(r.reward_change for r in out)
    # the numerator telescopes within runs of consecutive pairs: its variance is the ends'
    ends_var = 0.0
    for i, r in enumerate(out):
        starts = i == 0 or out[i - 1].step_pair[1] != r.step_pair[0]
        stops = i == len(out) - 1 or out[i + 1].step_pair[0] != r.step_pair[1]
        if starts:
            ends_var += means[r.step_pair[0]][1] ** 2
        if stops:
            ends_var += means[r.step_pair[1]][1] ** 2
    per_nat = total_r / total_d if total_d > 0 else None
    per_nat_se = math.sqrt(ends_var) / total_d if total_d > 0 and not math.isnan(ends_var) else None
    per_nat_p = (float(2 * special.ndtr(-abs(total_r) / math.sqrt(ends_var))) if ends_var > 0 and not math.isnan(ends_var)
                 else None)
    # frontier along the first contiguous stretch from the first step with rewards
    d_cum, r_cum = [0.0], [0.0]
    if out:
        start = out[0].step_pair[0]
        for r in out:
            if r.step_pair[0] != start + len(d_cum) - 1:
                break
            d_cum.append(d_cum[-1] + math.sqrt(max(r.d_t, 0.0)))
            r_cum.append(means[r.step_pair[1]][0] - means[start][0])
    alpha, beta, r2 = fit_frontier(np.asarray(d_cum), np.asarray(r_cum))
    frontier = FrontierOut(d=d_cum, reward=r_cum, alpha=alpha, beta=beta, r2=r2, best_of_n=n_generations,
                           best_of_n_kl=best_of_n_kl(n_generations) if n_generations and n_generations > 1 else None)
    summary = {"rows": len(out), "rows_resolved": int(sum(rej)) if len(rej) else 0,
               "reward_per_nat": per_nat, "reward_per_nat_se": per_nat_se, "reward_per_nat_p": per_nat_p,
               "total_reward_change": total_r, "total_d": total_d,
               "resolved": bool(per_nat_p is not None and per_nat_p < 0.05)}
    return PriceSection(rows=out, frontier=frontier, summary=summary)


def price_figures(p: PriceSection) -> list[FigureOut]:
    f = p.frontier
    if len(f.d) < 2:
        return []
    series = [Series(label="this run", x=f.d, y=f.reward, color="#1f5fa8")]
    if f.alpha is not None:
        xs = np.linspace(max(min(x for x in f.d if x > 0), 1e-9), max(f.d), 200)
        series.append(Series(label=f"fit d(α − β log d), R² = {f.r2:.2f}" if f.r2 is not None else "fit",
                             x=xs.tolist(), y=(xs * (f.alpha - f.beta * np.log(xs))).tolist(), style="dashed",
                             color="#c0392b"))
    v = [(math.sqrt(f.best_of_n_kl), f"best-of-{f.best_of_n} KL (reference)")] if f.best_of_n_kl else []
    return [FigureOut(id="price-frontier", x_label="cumulative √D_t (root-nats; the run's path length)", caption=(
        "Cumulative reward change against the run's path length Σ√D_t, with R(d) = d(α − β log d) fitted on "
        "the run (the form of Gao et al. 2022) and the KL best-of-n would spend, as a reference."), panels=[Panel(
            y_label="reward change (reward units)", zero_line=True, series=series, v_lines=v)])]


def price_section(ctx: RunContext) -> BookResult:
    run = ctx.run
    book = load_book("price")
    samples = ctx.samples
    # D_t as the run's decisions hold it (``Decisions.spent``): the updates and the nats the card and
    # the cost book quote, the same in every basis; a step pair (t, t+1) is filed under t
    d = ctx.decisions
    kl = {t: v for (t, u), v in d.spent.items() if u == t + 1}
    refusals = []
    has_rewards = any(s.rewards is not None for s in samples)
    if not has_rewards:
        refusals.append(make_refusal("RECORD_INCOMPLETE", book, Subject(run_id=run.run_id), {
            "requirement": "rewards", "run": run.short_id, "framework": run.manifest.framework.name}))
    if not kl:
        pairs = max(len(run.steps) - 1, 0)
        ctx_d = run_denominator_context(run, pairs, pairs, resolve(book, run.fields(), optimizer=run.manifest.optimizer))
        refusals.append(make_refusal("RECORD_INCOMPLETE", book, Subject(run_id=run.run_id), ctx_d))
    if refusals:
        return BookResult("refused", "No price: " + "; ".join(sorted({r.context["requirement"] for r in refusals}))
                          + " missing.", refusals)
    n = (run.manifest.trainer_config or {}).get("num_generations")
    sec = price_series(samples, kl, int(n) if n else None)
    # a row needs a reward at both steps: where some update with a D_t has none, the book says it
    # covers part of the run's spend rather than quoting another total
    sec = sec.model_copy(update={"summary": {**sec.summary, "d_t_total": d.d_t_total, "d_t_updates": d.d_t_updates}})
    status = status_of(bool(sec.rows), [], bool(sec.summary["resolved"]))
    ctxt = {"s": sec.summary, "p": sec}
    return BookResult(status, render_template("report/books/price.headline.j2", ctxt).strip(), [], sec,
                      price_figures(sec))
