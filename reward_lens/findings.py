"""Findings: is this run healthy, what went wrong from which step, and what to change.

Each finding is one YAML file in ``specs/findings/`` (``reward_lens_spec.FindingSpec``): the
question, a severity, the record fields it reads (alternatives), the books whose output it
reads, a named predicate from ``PREDICATES`` with its parameters, and Jinja templates for the
evidence it cites and the remedy. A predicate returns an ``Outcome``: whether the finding holds
at the end of what it was given, the first step of the stretch over which it holds (its
*onset*, evaluated as the run goes), and the numbers its templates cite.

Three outcomes, each with a strict meaning: *holds*; *clear* -- judged, and resolved as not
holding; *not evaluated* -- the record lacks an input, the run is too short for the predicate
(fewer than its ``min_steps``), or the number it judges on is not resolved from noise; it names
what would enable it (the spec's ``needs``) and is never counted as clear. A refusal about the method (heavy-tailed weights, too few groups, an
envelope violation) is a property of the estimate, not of the run: no finding reads one.

The same predicates run after the run (``reward-lens check``, and at the top of every report)
and while it trains (the tap evaluates the ``live`` findings on the steps so far, from the
telemetry it records).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure import decisions
from reward_lens_spec import load_findings
from reward_lens_spec.models import FindingSpec
from reward_lens_spec.render import render_template

SEVERITIES = ("info", "warn", "critical")
RANK = {s: i for i, s in enumerate(SEVERITIES)}


class FindingOut(BaseModel):
    """One finding, evaluated: ``holds``; ``clear`` (judged, and resolved as not holding); or
    ``not_evaluated`` (too little to judge: an input missing, too few steps, a number not resolved
    from noise), with what would enable it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    title: str
    question: str
    severity: Literal["info", "warn", "critical"]
    status: Literal["holds", "clear", "not_evaluated"]
    onset: int | None = Field(None, description="the first step of the stretch over which it holds")
    evidence: str = Field("", description="what it cites: steps, features, numbers")
    remedy: str | None = Field(None, description="what to change (only where it holds)")
    reference: str | None = None
    missing: list[str] = Field(default_factory=list, description=(
        "not evaluated: what would enable it -- the fields or books it lacks (one alternative), or, where the "
        "record has them, what would let it judge (more steps, a number resolved from noise)"))
    values: dict[str, Any] = Field(default_factory=dict, description="the numbers the evidence cites")


@dataclass
class Outcome:
    """What a predicate decided. ``judged`` False: it could not decide (too few steps, a number not
    resolved from noise); the finding is then not evaluated, whatever ``holds`` says."""

    holds: bool
    onset: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    judged: bool = True


def unjudged(**evidence: Any) -> Outcome:
    """A predicate that cannot decide: not evaluated, with what it saw (the spec's ``needs`` says
    what would let it decide)."""
    return Outcome(False, None, evidence, judged=False)


def _too_short(n: int, min_steps: int, structural: int, name: str) -> Outcome | None:
    """Not evaluated when fewer than ``min_steps`` steps feed the predicate; a spec that sets
    ``min_steps`` below what the predicate's windows need (``structural``) is a spec error."""
    if min_steps < structural:
        raise ValueError(f"specs/findings: {name}: min_steps = {min_steps} is under the {structural} steps its "
                         "windows need")
    return unjudged(steps=n, min_steps=min_steps, too_short=True) if n < min_steps else None


# ------------------------------------------------------------------------------------ data
class FindingData:
    """What the predicates read: per-step series (``series``), the run's record, and the report's
    books (None while training). Series come from the record's telemetry, or where a telemetry
    field is absent and the rollouts hold it, from the rollouts (reward mean, zero-spread share)."""

    def __init__(self, series: Mapping[str, Mapping[int, float]], *, report=None, config: Mapping[str, Any] | None = None,
                 reward_se: Mapping[int, float] | None = None):
        self._series = {k: dict(v) for k, v in series.items()}
        self.report = report
        self.config = dict(config or {})
        self.reward_se = dict(reward_se or {})

    def series(self, name: str) -> dict[int, float]:
        return self._series.get(name, {})

    def book(self, book_id: str):
        if self.report is None:
            return None
        b = next((x for x in self.report.books if x.id == book_id), None)
        return b.typed() if b is not None and b.data is not None else None

    @classmethod
    def from_run(cls, run, report=None, samples=None) -> FindingData:
        """``samples``: the report's own read of the rollouts (``steps_from_run``, every step),
        whose rewards and groups are taken instead of a read of their own where they have them."""
        names = ("entropy", "reward_mean", "frac_reward_zero_std", "kl_to_previous", "kl_to_previous_se",
                 "grad_norm_unclipped", "max_grad_norm")
        series = {n: {int(s): float(v) for s, v in run.telemetry_column(n).items()} for n in names}
        reward_se: dict[int, float] = {}
        if run.n_rollouts and {"reward", "group_id"} <= set(run.rollout_columns()):
            stats = _sample_reward_stats(samples) if samples else None
            mean, se, zero = stats if stats is not None else _rollout_reward_stats(run)
            series["reward_mean"] = {**mean, **series["reward_mean"]} if not series["reward_mean"] else series["reward_mean"]
            if not series["frac_reward_zero_std"]:
                series["frac_reward_zero_std"] = zero
            reward_se = se
        cfg = dict(run.manifest.trainer_config or {})
        if not series["max_grad_norm"] and isinstance(cfg.get("max_grad_norm"), (int, float)):
            series["max_grad_norm"] = {s: float(cfg["max_grad_norm"]) for s in series["grad_norm_unclipped"]}
        return cls(series, report=report, config=cfg, reward_se=reward_se)


def _sample_reward_stats(samples) -> tuple[dict[int, float], dict[int, float], dict[int, float]] | None:
    """Per step: the mean reward and its SE as the price book states them (``step_rewards``, prompt
    groups as the units, worked out once for both), and the share of prompt groups of two or
    more rollouts whose rewards have zero spread; from samples where every one has groups and
    finite rewards, else None (a report's read keeps a row without a reward, which
    ``_rollout_reward_stats`` drops)."""
    from reward_lens.measure.ledger.price import stacked, unit_ids
    from reward_lens.measure.price_book import step_rewards

    if not all(s.rewards is not None and s.groups is not None for s in samples):
        return None
    rewards = np.asarray(stacked(samples, "rewards"), dtype=float)
    if not np.isfinite(rewards).all():
        return None
    stats = step_rewards(samples)
    uid, gs = unit_ids(samples)  # each step's prompt groups, numbered across the steps
    order = np.argsort(uid, kind="stable")
    starts = np.flatnonzero(np.r_[True, uid[order][1:] != uid[order][:-1]])
    flat = np.maximum.reduceat(rewards[order], starts) == np.minimum.reduceat(rewards[order], starts)
    sized = np.bincount(uid, minlength=int(gs.sum())) > 1
    step_of = np.repeat(np.arange(len(samples)), gs)
    n_sized = np.bincount(step_of, weights=sized, minlength=len(samples))
    n_flat = np.bincount(step_of, weights=sized & flat, minlength=len(samples))
    zero = {s.step: float(f / n) for s, f, n in zip(samples, n_flat.tolist(), n_sized.tolist()) if n}
    return ({st: m for st, (m, _) in stats.items()}, {st: se for st, (_, se) in stats.items()}, zero)


def _rollout_reward_stats(run) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """``_sample_reward_stats`` from a read of its own (a record without a report's read: ``check``):
    the rollouts' step, group and reward columns, rows without a reward dropped, each step's
    groups coded in one segmented pass."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from reward_lens.measure.ledger.price import StepSample, segment_codes

    tables = list(run.iter_rollouts(["group_id", "reward"]))
    if not tables:
        return {}, {}, {}
    steps = np.concatenate([t.column("step").to_numpy() for t in tables]).astype(np.int64)
    groups = pa.chunked_array([c for t in tables for c in t.column("group_id").cast(pa.string()).chunks],
                              type=pa.string())
    codes = pc.index_in(groups, value_set=pc.unique(groups)).to_numpy(zero_copy_only=False).astype(np.int64)
    rewards = np.concatenate([pc.fill_null(t.column("reward"), float("nan")).to_numpy(zero_copy_only=False)
                              for t in tables]).astype(float)
    ok = np.isfinite(rewards)
    steps, codes, rewards = steps[ok], codes[ok], rewards[ok]
    if not len(rewards):
        return {}, {}, {}
    order = np.lexsort((codes, steps))  # by step, then group
    steps, codes, rewards = steps[order], codes[order], rewards[order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    local, counts = segment_codes(starts, len(steps), codes)  # each step's groups, 0..G-1
    cut = starts[1:]
    samples = [StepSample(int(steps[a]), ("reward",), r[:, None], rewards=r, groups=g, n_groups=int(c))
               for a, r, g, c in zip(starts, np.split(rewards, cut), np.split(local, cut), counts.tolist())]
    return _sample_reward_stats(samples) or ({}, {}, {})


def _ordered(series: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
    steps = np.array(sorted(series), dtype=np.int64)
    return steps, np.array([series[int(s)] for s in steps], dtype=float)


def _rolling(x: np.ndarray, w: int) -> np.ndarray:
    """Mean of the last ``w`` values at each position (fewer at the start)."""
    c = np.cumsum(np.r_[0.0, x])
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - w, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _final_stretch(steps: np.ndarray, holds: np.ndarray) -> tuple[bool, int | None]:
    """Whether the condition holds at the last step, and the first step of the stretch of
    consecutive holding steps that ends there (the onset)."""
    if not len(holds) or not holds[-1]:
        return False, None
    i = len(holds) - 1
    while i > 0 and holds[i - 1]:
        i -= 1
    return True, int(steps[i])


# ------------------------------------------------------------------------------------ predicates
def entropy_collapse(d: FindingData, window: int = 5, min_fall: float = 0.5, min_steps: int = 10) -> Outcome:
    """The policy's token entropy fell by ``min_fall`` of its starting level (a mean over the
    first ``window`` steps) while the reward bought with it did not rise: R = -a e^H + b (Cui
    et al. 2025) says entropy is what RL spends to buy reward; spent without a gain, it is lost
    exploration."""
    steps, h = _ordered(d.series("entropy"))
    rs = d.series("reward_mean")
    steps = np.array([s for s in steps if int(s) in rs], dtype=np.int64)
    if (short := _too_short(len(steps), min_steps, 2 * window, "entropy_collapse")) is not None:
        return short
    h = np.array([d.series("entropy")[int(s)] for s in steps])
    r = np.array([rs[int(s)] for s in steps])
    h0, r0 = float(h[:window].mean()), float(r[:window].mean())
    hk, rk = _rolling(h, window), _rolling(r, window)
    cond = (hk <= (1 - min_fall) * h0) & (rk - r0 <= 0)
    cond[:window] = False
    holds, onset = _final_stretch(steps, cond)
    return Outcome(holds, onset, {"h0": h0, "h_end": float(hk[-1]), "fall": 1 - float(hk[-1]) / h0 if h0 else None,
                                  "r0": r0, "r_end": float(rk[-1]), "window": window, "min_fall": min_fall})


def advantage_collapse(d: FindingData, window: int = 5, share: float = 0.5, min_steps: int = 5) -> Outcome:
    """Over the last ``window`` steps, at least ``share`` of the prompt groups had rewards with
    zero spread: their advantages are zero and they give no gradient."""
    steps, z = _ordered(d.series("frac_reward_zero_std"))
    if (short := _too_short(len(steps), min_steps, window, "advantage_collapse")) is not None:
        return short
    zk = _rolling(z, window)
    cond = zk >= share
    cond[: window - 1] = False
    holds, onset = _final_stretch(steps, cond)
    return Outcome(holds, onset, {"share_end": float(zk[-1]), "share": share, "window": window,
                                  "share_max": float(z.max())})


def kl_spikes(d: FindingData, window: int = 10, factor: float = 10.0, min_se: float = 3.0,
              min_steps: int = 11) -> Outcome:
    """D_t at a step exceeds ``factor`` times the median of the previous ``window`` steps' D_t,
    by more than ``min_se`` of its own standard error where one is recorded. A step is judged
    only after ``window`` steps before it: a run of ``window`` steps or fewer is not evaluated."""
    steps, x = _ordered(d.series("kl_to_previous"))
    if (short := _too_short(len(steps), min_steps, window + 1, "kl_spikes")) is not None:
        return short
    se = d.series("kl_to_previous_se")
    spikes = []
    if len(x) > window:  # the median of the previous ``window`` steps of each step past the first ones
        meds = np.median(np.lib.stride_tricks.sliding_window_view(x, window)[:-1], axis=1)
        over = np.flatnonzero((meds > 0) & (x[window:] > factor * meds))
        for j, med in zip(over.tolist(), meds[over].tolist()):
            i = window + j
            limit = factor * med
            s = se.get(int(steps[i]))
            if s is None or not s > 0 or (x[i] - limit) > min_se * s:
                spikes.append((int(steps[i]), float(x[i]), med))
    if not spikes:
        return Outcome(False, evidence={"steps": len(steps), "factor": factor, "window": window})
    return Outcome(True, spikes[0][0], {"spikes": spikes[:5], "n_spikes": len(spikes), "factor": factor,
                                        "window": window})


def clipping_saturation(d: FindingData, window: int = 10, share: float = 0.8, min_steps: int = 10) -> Outcome:
    """The gradient norm before clipping exceeded ``max_grad_norm`` on at least ``share`` of the
    last ``window`` steps: the update's size is set by the clip, not by the gradient."""
    un = d.series("grad_norm_unclipped")
    mx = d.series("max_grad_norm")
    steps = np.array(sorted(s for s in un if s in mx and mx[s] > 0), dtype=np.int64)
    if (short := _too_short(len(steps), min_steps, window, "clipping_saturation")) is not None:
        return short
    clipped = np.array([un[int(s)] > mx[int(s)] for s in steps], dtype=float)
    ck = _rolling(clipped, window)
    cond = ck >= share
    cond[: window - 1] = False
    holds, onset = _final_stretch(steps, cond)
    return Outcome(holds, onset, {"share_end": float(ck[-1]), "share": share, "window": window,
                                  "max_grad_norm": float(mx[int(steps[-1])]),
                                  "median_unclipped": float(np.median([un[int(s)] for s in steps[-window:]]))})


def reward_plateau(d: FindingData, window: int = 5, fraction: float = 0.25, z: float = 2.0,
                   min_steps: int = 30) -> Outcome:
    """Reward per nat falling to zero: the first third of the run bought reward (its price,
    the reward change per nat of D_t, is above ``z`` standard errors), and the last third's
    price is below ``fraction`` of it and not resolved above zero. Clear only when the last
    third's price is resolved above zero (it still buys reward); not evaluated when the first
    third's purchase is not resolved (there is no rate to fall from), or when the last third's
    price is resolved neither above zero nor under ``fraction`` of the first's."""
    r, kl = d.series("reward_mean"), d.series("kl_to_previous")
    steps = np.array(sorted(s for s in r if s in kl), dtype=np.int64)
    n = len(steps)
    if (short := _too_short(n, min_steps, 6 * window, "reward_plateau")) is not None:
        return short

    def price(lo: int, hi: int) -> tuple[float, float]:
        a, b = steps[lo:lo + window], steps[hi - window:hi]
        ra, rb = np.mean([r[int(s)] for s in a]), np.mean([r[int(s)] for s in b])
        va = np.nansum([d.reward_se.get(int(s), np.nan) ** 2 for s in a]) / window ** 2
        vb = np.nansum([d.reward_se.get(int(s), np.nan) ** 2 for s in b]) / window ** 2
        spent = float(sum(kl[int(s)] for s in steps[lo:hi - 1]))
        if spent <= 0:
            return float("nan"), float("nan")
        return float((rb - ra) / spent), float(math.sqrt(va + vb) / spent)

    third = n // 3
    p1, s1 = price(0, third)
    p3, s3 = price(n - third, n)
    seen = {"price_first": p1, "se_first": s1, "price_last": p3, "se_last": s3, "fraction": fraction}
    first_bought = s1 > 0 and p1 / s1 > z
    still_buys = s3 > 0 and p3 / s3 > z
    if not first_bought:
        return unjudged(**seen, first_unresolved=True)
    if still_buys:
        return Outcome(False, None, seen)
    if p3 < fraction * p1:
        return Outcome(True, int(steps[n - third]), seen)
    return unjudged(**seen, last_unresolved=True)


def _no_verdicts(d: FindingData) -> Outcome | None:
    """Not evaluated when no behaviour has a verdict (no report, or the books it needs refused)."""
    agreement = d.book("agreement")
    if agreement is None or all(f.verdict is None for f in agreement.features):
        return unjudged(no_verdicts=True)
    return None


def _agreement_features(d: FindingData, verdicts: Sequence[str]) -> list:
    """The behaviours whose verdict (``measure.decisions``, by key) is one of ``verdicts``."""
    agreement = d.book("agreement")
    if agreement is None:
        return []
    return [f for f in agreement.features if f.verdict_key in verdicts]


def _cumulative_onset(d: FindingData, feature: str, sign: float, z: float) -> int | None:
    """The first step u at which the movement of ``feature`` summed over the usable step pairs
    (t, u) so far is ``z`` standard errors from zero in the direction ``sign`` (a sequential
    test: the sum's SE from the pairs' SEs; ``z`` = 3 allows for looking at every step). The
    run-level verdict is the effect book's: this only dates it. Later noisy pairs widen the
    sum's SE, so the first crossing is the onset, not a stretch that lasts to the end."""
    effect = d.book("effect")
    if effect is None or feature not in effect.rows.delta_z:
        return None
    dz = np.array([v if v is not None else 0.0 for v in effect.rows.delta_z[feature]], dtype=float)
    se = np.array([v if v is not None and v == v else 0.0 for v in effect.rows.se[feature]], dtype=float)
    steps = np.array([p[1] for p in effect.rows.step_pair], dtype=np.int64)
    if not len(dz):
        return None
    s, v = np.cumsum(dz), np.cumsum(se ** 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(v > 0, s / np.sqrt(v), 0.0)
    crossed = np.flatnonzero(sign * t >= z)
    return int(steps[crossed[0]]) if len(crossed) else None


def moving_against_reward(d: FindingData, z: float = 3.0) -> Outcome:
    """A feature the reward selects on directly (the cause book's selection gradient, resolved)
    moved the other way over the run (the effect book's drift, resolved)."""
    if (none := _no_verdicts(d)) is not None:
        return none
    feats = _agreement_features(d, (decisions.OTHER_WAY,))
    if not feats:
        return Outcome(False)
    rows, onsets = [], []
    effect = d.book("effect")
    ends = {x.feature: (x.first, x.last) for x in effect.drift} if effect is not None else {}
    for f in feats:
        onset = _cumulative_onset(d, f.feature, 1.0 if f.drift > 0 else -1.0, z)
        onsets.append(onset)
        first, last = ends.get(f.feature, (None, None))
        rows.append({"feature": f.feature, "drift": f.drift, "unit": f.unit, "asked": "more" if (f.direction or 0) > 0
                     else "less", "jointly_with": f.jointly_with, "onset": onset, "first": first, "last": last})
    known = [o for o in onsets if o is not None]
    return Outcome(True, min(known) if known else None, {"features": rows, "z": z})


def collateral(d: FindingData, z: float = 3.0) -> Outcome:
    """A feature moved over the run (resolved) with neither direct nor indirect selection on it:
    the reward-hacking signature in the named basis."""
    if (none := _no_verdicts(d)) is not None:
        return none
    feats = _agreement_features(d, (decisions.COLLATERAL,))
    if not feats:
        return Outcome(False)
    rows = []
    for f in feats:
        onset = _cumulative_onset(d, f.feature, 1.0 if f.drift > 0 else -1.0, z)
        rows.append({"feature": f.feature, "drift": f.drift, "unit": f.unit, "onset": onset})
    known = [r["onset"] for r in rows if r["onset"] is not None]
    return Outcome(True, min(known) if known else None, {"features": rows, "z": z})


def length_drift(d: FindingData, min_relative: float = 0.1, z: float = 3.0) -> Outcome:
    """A length feature moved (resolved) by at least ``min_relative`` of its starting mean with
    no direct selection on it (not asked for: carried along or collateral)."""
    if (none := _no_verdicts(d)) is not None:
        return none
    lengths = {f.name for f in d.report.basis.features if f.kind == "length"}
    effect = d.book("effect")
    first = {x.feature: x.first for x in effect.drift} if effect is not None else {}
    rows = []
    for f in _agreement_features(d, (decisions.CARRIED, decisions.AGAINST, decisions.COLLATERAL)):
        base = abs(first.get(f.feature) or 0.0)
        if f.feature in lengths and base > 0 and abs(f.drift) / base >= min_relative:
            onset = _cumulative_onset(d, f.feature, 1.0 if f.drift > 0 else -1.0, z)
            rows.append({"feature": f.feature, "drift": f.drift, "unit": f.unit, "first": first.get(f.feature),
                         "relative": f.drift / base, "verdict": f.verdict, "onset": onset})
    if not rows:
        return Outcome(False, evidence={"min_relative": min_relative})
    known = [r["onset"] for r in rows if r["onset"] is not None]
    return Outcome(True, min(known) if known else None, {"features": rows, "min_relative": min_relative})


def spending_without_buying(d: FindingData, max_eta: float = 0.05, min_nats: float = 0.1) -> Outcome:
    """The run spent at least ``min_nats`` of D_t and the upper end of the run-level eta's 95 %
    interval is below ``max_eta``: nearly all of the divergence went to behaviour the basis does
    not name. Clear when the run spent less than ``min_nats``, or when the interval's lower end is
    at or above ``max_eta`` (resolved as not holding); an interval across ``max_eta`` is not
    evaluated, and so is a run with no run-level eta."""
    cost = d.book("cost")
    s = cost.summary if cost is not None else {}
    eta, iv, total = s.get("eta_run"), s.get("eta_run_interval"), s.get("d_t_total")
    if eta is None or not iv or total is None:
        return unjudged(no_eta=True)
    seen = {"eta": eta, "interval": list(iv), "d_t_total": total, "max_eta": max_eta, "min_nats": min_nats}
    if total >= min_nats and iv[0] < max_eta <= iv[1]:
        return unjudged(**seen, straddles=True)
    holds = bool(iv[1] < max_eta and total >= min_nats)
    onset = None
    if holds:
        rows = cost.efficiency
        dt = np.array(rows.kl_spent, dtype=float)
        kl = np.array([e * k if e is not None else 0.0 for e, k in zip(rows.efficiency_debiased, rows.kl_spent)])
        if len(dt):
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(np.cumsum(dt) > 0, np.cumsum(kl) / np.cumsum(dt), np.nan)
            steps = np.array([p[1] for p in rows.step_pair], dtype=np.int64)
            _, onset = _final_stretch(steps, ratio < max_eta)
    return Outcome(holds, onset, seen)


PREDICATES: dict[str, Callable[..., Outcome]] = {f.__name__: f for f in (
    entropy_collapse, advantage_collapse, kl_spikes, clipping_saturation, reward_plateau, moving_against_reward,
    collateral, length_drift, spending_without_buying)}


# ------------------------------------------------------------------------------------ evaluation
def missing_inputs(spec: FindingSpec, present: Callable[[str], bool], book_status: Mapping[str, str] | None) -> list[str]:
    """What the finding lacks: empty when one alternative of its inputs is present and its books
    computed; else the fields of the alternative closest to present, and the books not computed."""
    best: list[str] | None = None
    for alt in spec.inputs:
        lack = [f for f in alt if not present(f)]
        if best is None or len(lack) < len(best):
            best = lack
    out = list(best or [])
    if book_status is not None and not out:  # the books' own refusals name what they lack
        out += [f"the {b} book ({book_status.get(b, 'not computed')})" for b in spec.books
                if book_status.get(b) not in ("computed", "partial", "unresolved")]
    return out


def evaluate_one(spec: FindingSpec, data: FindingData, missing: list[str]) -> FindingOut:
    base = dict(id=spec.id, title=spec.title, question=spec.question, severity=spec.severity,
                reference=spec.reference)
    if missing:
        return FindingOut(**base, status="not_evaluated", missing=missing,
                          evidence=f"Not evaluated: needs {', '.join(missing)}.")
    fn = PREDICATES.get(spec.predicate)
    if fn is None:
        raise ValueError(f"specs/findings/{spec.id}.yaml: unknown predicate {spec.predicate!r}; known: "
                         f"{', '.join(sorted(PREDICATES))}")
    out = fn(data, **spec.params)
    holds = out.holds and out.judged
    ctx = {"e": _Evidence(out.evidence), "onset": out.onset, "holds": holds, "judged": out.judged, "p": spec.params}
    evidence = " ".join(render_template_string(spec.evidence, ctx).split())
    if not out.judged:
        if not spec.needs:
            raise ValueError(f"specs/findings/{spec.id}.yaml: its predicate can leave it undecided, and the spec "
                             "has no `needs` saying what would decide it")
        needs = " ".join(render_template_string(spec.needs, ctx).split())
        return FindingOut(**base, status="not_evaluated", evidence=evidence, missing=[needs],
                          values=_jsonable(out.evidence))
    remedy = " ".join(render_template_string(spec.remedy, ctx).split()) if holds else None
    return FindingOut(**base, status="holds" if holds else "clear", onset=out.onset, evidence=evidence,
                      remedy=remedy, values=_jsonable(out.evidence))


def evaluate(run, report=None, specs: Mapping[str, FindingSpec] | None = None, samples=None) -> list[FindingOut]:
    """Every finding on a finished record (with its report's books where a finding reads them,
    and its read of the rollouts, ``samples``, where it made one)."""
    specs = specs if specs is not None else load_findings()
    fields = run.fields()
    data = FindingData.from_run(run, report, samples)
    status = {b.id: b.status for b in report.books} if report is not None else {}

    def present(f: str) -> bool:
        if f in ("reward_mean", "frac_reward_zero_std") and not (fields.get(f) and fields[f].any):
            return bool(data.series(f))  # computed from the rollouts
        if f == "max_grad_norm" and data.series(f):
            return True
        p = fields.get(f)
        return bool(p is not None and p.any)

    return [evaluate_one(s, data, missing_inputs(s, present, status)) for s in specs.values()]


def evaluate_live(series: Mapping[str, Mapping[int, float]], config: Mapping[str, Any] | None = None,
                  specs: Mapping[str, FindingSpec] | None = None) -> list[FindingOut]:
    """The ``live`` findings on the steps so far (the tap's telemetry), while training."""
    specs = specs if specs is not None else load_findings()
    data = FindingData(series, config=config)
    if not data.series("max_grad_norm") and isinstance((config or {}).get("max_grad_norm"), (int, float)):
        data._series["max_grad_norm"] = {s: float(config["max_grad_norm"]) for s in data.series("grad_norm_unclipped")}
    out = []
    for s in specs.values():
        if not s.live:
            continue
        out.append(evaluate_one(s, data, missing_inputs(s, lambda f: bool(data.series(f)), None)))
    return out


def findings_table(specs: Mapping[str, FindingSpec] | None = None) -> str:
    """The findings as a Markdown table (the README and docs/findings.md quote it)."""
    specs = specs if specs is not None else load_findings()
    return render_template("report/findings_table.md.j2", {"specs": list(specs.values())}, prose=False).strip()


def finding_counts(findings: Sequence[FindingOut]) -> dict[str, int]:
    """The counts every page states about the findings, made here only."""
    out = {"checked": len(findings)}
    for status in ("holds", "clear", "not_evaluated"):
        out[status] = sum(f.status == status for f in findings)
    for sev in SEVERITIES:
        out[f"holds_{sev}"] = sum(f.status == "holds" and f.severity == sev for f in findings)
    return out


def worst(findings: Sequence[FindingOut]) -> str | None:
    held = [f.severity for f in findings if f.status == "holds"]
    return max(held, key=RANK.__getitem__) if held else None


def exit_code(findings: Sequence[FindingOut], fail_on: str) -> int:
    """0 when no finding at or above ``fail_on`` holds, else 1 (``never``: always 0)."""
    if fail_on == "never":
        return 0
    return 1 if any(f.status == "holds" and RANK[f.severity] >= RANK[fail_on] for f in findings) else 0


class _Evidence(dict):
    """A predicate's evidence for the templates: a key it did not set reads as none."""

    def __missing__(self, key):
        return None


def render_template_string(text: str, ctx: dict[str, Any]) -> str:
    from reward_lens_spec.render import _env
    from reward_lens_spec.paths import templates_dir

    return _env(str(templates_dir())).from_string(text).render(**ctx)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


__all__ = ["FindingOut", "FindingData", "Outcome", "PREDICATES", "evaluate", "evaluate_live", "exit_code",
           "worst", "render_template"]
