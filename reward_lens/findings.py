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
and while it trains: the tap hands each step's rollouts and telemetry to ``LiveFindings``, which
evaluates the ``live`` findings on the steps so far. The book-grounded ones (moving against the
reward, proxy gaming, paid-for drift, collateral behaviour, length drift) read one sequential rule
(``measure.sequential``: a self-starting CUSUM on each behaviour's per-step level, the selection
differential summed over the steps), built from each step's rollouts once: live, at the cost of
that step; after the run, over the same steps in order, so both say the same at every prefix. Two
of them read the *targets* the feature basis declares (``target:``) and are not evaluated
without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure.ledger.moderated import moderated_by_step
from reward_lens.measure.mismatch import (logged_mismatch, logged_source, mismatch_of_table, run_logged_mismatch, run_mismatch,
                                          series_se)
from reward_lens.measure.sequential import RunWatch, WatchBasis, final_stretch, step_stats, watch_samples
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
    # where it holds at a higher severity than its spec's (a finding that escalates, such as
    # ``engine_mismatch`` at the size of the updates): that severity; None: the spec's
    severity: str | None = None


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
                 reward_se: Mapping[int, float] | None = None, watch: RunWatch | None = None,
                 non_finite: Sequence[Any] = (), mismatch: Mapping[int, Any] | None = None,
                 logged: tuple[Mapping[int, Any], str | None] = ({}, None)):
        self._series = {k: dict(v) for k, v in series.items()}
        self.non_finite = list(non_finite)  # the record's NonFiniteValue entries (manifest.non_finite)
        self.report = report
        self.config = dict(config or {})
        self.reward_se = dict(reward_se or {})
        self.watch = watch  # the sequential watch of the rollouts (measure.sequential), step by step
        # the engine-trainer mismatch by step (measure.mismatch.StepMismatch), where the rollouts
        # hold the sampler's log-probabilities
        self.mismatch = dict(mismatch or {})
        # the mismatch as the framework logged it (measure.mismatch.LoggedMismatch by step), and which framework
        self.logged_mismatch, self.framework = dict(logged[0]), logged[1]

    def series(self, name: str) -> dict[int, float]:
        return self._series.get(name, {})

    def book(self, book_id: str):
        if self.report is None:
            return None
        b = next((x for x in self.report.books if x.id == book_id), None)
        return b.typed() if b is not None and b.data is not None else None

    @classmethod
    def from_run(cls, run, report=None, samples=None, watch: RunWatch | None = None) -> FindingData:
        """``samples``: the report's own read of the rollouts (``steps_from_run``, every step),
        whose rewards and groups are taken instead of a read of their own where they have them;
        ``watch``: the sequential watch of those samples where it was made already (the report
        makes it while the books are priced), else it is made here."""
        names = ("entropy", "reward_mean", "frac_reward_zero_std", "kl_to_previous", "kl_to_previous_se",
                 "tap_groups", "grad_norm_unclipped", "max_grad_norm")
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
        if watch is None and samples and report is not None:
            watch = watch_samples(samples, WatchBasis.of(report.basis))
        return cls(series, report=report, config=cfg, reward_se=reward_se, watch=watch,
                   non_finite=run.manifest.non_finite, mismatch=run_mismatch(run), logged=run_logged_mismatch(run))


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
    holds, onset = final_stretch(steps, cond)
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
    holds, onset = final_stretch(steps, cond)
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
    holds, onset = final_stretch(steps, cond)
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


# ------------------------------------------------------------------------- sequential (the watch)
# The book-grounded findings below read the run's sequential watch (``measure.sequential``): each
# behaviour's level and the reward's, step by step, against a reference from before any change,
# with the selection differential summed over the steps so far. They hold while a one-sided CUSUM
# is at ``h`` or above, so the false-alarm rate is held over every look (docs/findings.md), and
# their onset is where the sustained movement began, not where the sum crossed ``h``.
def _watch_short(d: FindingData, min_steps: int, min_groups: int) -> Outcome | None:
    """Not evaluated on fewer than ``min_steps`` steps of rollouts: a step's level is read against
    the steps before it, so one step alone says nothing (2 at the least). A step is read from its
    prompt groups (``min_groups``, the spec's statement of the watch's own ``MIN_GROUPS``, which
    the audit reads to say beforehand that a run of one prompt a step will not be judged)."""
    from reward_lens.measure.sequential import MIN_GROUPS

    if min_groups != MIN_GROUPS:
        raise ValueError(f"specs/findings: min_groups = {min_groups}, but the sequential watch reads a step "
                         f"from {MIN_GROUPS} prompt groups or more")
    n = d.watch.steps if d.watch is not None else 0
    return _too_short(n, min_steps, 2, "sequential findings")


def _no_selection(d: FindingData) -> Outcome | None:
    """Not evaluated where no within-group selection can be read at all: every prompt group one
    completion (veRL PPO with n=1, lost group ids) or advantages that never differ within a group.
    A selection differential of 0 with no standard error is then not "nothing selected": the
    findings that judge what the reward selects, or that nothing explains a movement, cannot say
    (issue 61: they read clear, or held "with no selection explaining it", on such records)."""
    w = d.watch
    if w.selection is None or not bool((np.asarray(w.selection_var, dtype=float) > 0).any()):
        return unjudged(no_selection=True)
    return None


def _constant_targets(d: FindingData) -> Outcome | None:
    """Not evaluated where every declared target is constant within every step (no spread): its
    movement cannot be sized, so "no target moved" would be read from a target that cannot."""
    targets = list(d.watch.basis.targets)
    flat = [t for t in targets if t in d.watch.series and not d.watch.series[t].spread]
    if targets and len(flat) == len(targets):
        return unjudged(constant_target=flat)
    return None


def _movement(d: FindingData, name: str, direction: int, h: float) -> dict[str, Any] | None:
    """The movement of ``name`` in ``direction`` while its CUSUM is at ``h`` or above: where it
    began, the reference level and the stretch's mean, and the change in units of the
    behaviour's within-step standard deviation (``size``)."""
    w = d.watch
    s = w.series[name].side(direction) if name in w.series else None
    if s is None or s.c < h:
        return None
    ref, to = s.reference, s.level
    if ref is None or to is None:
        return None
    spread = s.spread
    return {"feature": name, "unit": w.basis.units.get(name, ""), "onset": s.since, "from": ref, "to": to,
            "change": to - ref, "size": (to - ref) / spread if spread else None, "cusum": s.c}


def _big(row: dict[str, Any], min_size: float) -> bool:
    return row["size"] is not None and abs(row["size"]) >= min_size


def _relative(row: dict[str, Any]) -> float | None:
    """The stretch's change as a fraction of the reference level (None from a level of 0)."""
    return abs(row["change"]) / abs(row["from"]) if row["from"] else None


def _onset(rows: Sequence[dict[str, Any]]) -> int | None:
    known = [r["onset"] for r in rows if r["onset"] is not None]
    return min(known) if known else None


def moving_against_reward(d: FindingData, h: float = 4.0, z_sel: float = 3.0, min_size: float = 0.25,
                          min_steps: int = 2, min_groups: int = 2) -> Outcome:
    """A behaviour the reward selects (its selection differential summed over the steps so far is
    ``z_sel`` SE from zero) has moved the other way: its level's CUSUM against the selection is at
    ``h`` or above, by at least ``min_size`` of its within-step standard deviation."""
    if (short := _watch_short(d, min_steps, min_groups)) is not None:
        return short
    if (unread := _no_selection(d)) is not None:
        return unread
    rows = []
    for name in d.watch.basis.names:
        sel, z = d.watch.selected(name, z_sel)
        if not sel:
            continue
        row = _movement(d, name, -sel, h)
        if row is not None and _big(row, min_size):
            rows.append({**row, "asked": "more" if sel > 0 else "less", "z_selection": z})
    return Outcome(bool(rows), _onset(rows), {"features": rows, "h": h, "z_sel": z_sel, "min_size": min_size})


def _unexplained(d: FindingData, name: str, direction: int, z_explain: float, z_sel: float) -> tuple[bool, float | None]:
    """No selection explains a movement of ``name`` in ``direction``: its summed selection
    differential is under ``z_explain`` SE in that direction, and not ``z_sel`` SE against it
    (that is a movement against the reward, another finding's)."""
    _, z = d.watch.selected(name, z_sel)
    along = direction * z if z is not None else 0.0
    return (along < z_explain and along > -z_sel), z


def collateral(d: FindingData, h: float = 4.0, min_size: float = 0.25, z_explain: float = 2.0,
               z_sel: float = 3.0, min_steps: int = 2, min_groups: int = 2) -> Outcome:
    """A behaviour moved (its CUSUM at ``h`` or above, by ``min_size`` within-step SDs or more)
    that no selection explains: its summed selection differential is under ``z_explain`` SE in the
    direction it moved (the reward-hacking signature in the named basis)."""
    if (short := _watch_short(d, min_steps, min_groups)) is not None:
        return short
    if (unread := _no_selection(d)) is not None:
        return unread
    rows = []
    for name in d.watch.basis.names:
        for direction in (1, -1):
            row = _movement(d, name, direction, h)
            if row is None or not _big(row, min_size):
                continue
            free, z = _unexplained(d, name, direction, z_explain, z_sel)
            if free:
                rows.append({**row, "z_selection": z})
    return Outcome(bool(rows), _onset(rows), {"features": rows, "h": h, "min_size": min_size,
                                               "z_explain": z_explain})


def length_drift(d: FindingData, h: float = 4.0, min_relative: float = 0.1, z_explain: float = 2.0,
                 z_sel: float = 3.0, min_steps: int = 2, min_groups: int = 2) -> Outcome:
    """A length feature moved (its CUSUM at ``h`` or above) by at least ``min_relative`` of its
    reference level, with no selection explaining it (as ``collateral``)."""
    if (short := _watch_short(d, min_steps, min_groups)) is not None:
        return short
    if (unread := _no_selection(d)) is not None:
        return unread
    rows = []
    for name in d.watch.basis.names:
        if d.watch.basis.kinds.get(name) != "length":
            continue
        for direction in (1, -1):
            row = _movement(d, name, direction, h)
            rel = _relative(row) if row is not None else None
            if row is None or rel is None or rel < min_relative:
                continue
            free, z = _unexplained(d, name, direction, z_explain, z_sel)
            if free:
                rows.append({**row, "relative": rel, "z_selection": z})
    return Outcome(bool(rows), _onset(rows), {"features": rows, "min_relative": min_relative, "h": h})


def _bought(d: FindingData, h: float, min_size: float) -> list[dict[str, Any]]:
    """The declared targets that moved the way the user wants them (sustained, sized)."""
    out = []
    for name, want in d.watch.basis.targets.items():
        row = _movement(d, name, 1 if want == "higher" else -1, h)
        if row is not None and _big(row, min_size):
            out.append(row)
    return out


def proxy_gaming(d: FindingData, h: float = 4.0, min_size: float = 0.25, z_sel: float = 3.0,
                 min_steps: int = 2, min_groups: int = 2) -> Outcome:
    """A declared target moved against what the user wants (its CUSUM at ``h``, by ``min_size``
    within-step SDs or more) while the reward did not fall with it: it rose (its level's CUSUM up
    at ``h``), or stayed flat (its CUSUM for a fall at zero at every step since the target's fall
    began), or selects against the target (the target's selection differential, summed over the
    steps so far, ``z_sel`` SE the wrong way). The proxy holds up while the gold falls (Gao et al.
    2022); a run whose reward falls with its target is collapsing, another finding's. Onset: the
    target's, or where the reward's rise began if it only rose and that is later."""
    if (short := _watch_short(d, min_steps, min_groups)) is not None:
        return short
    if (flat := _constant_targets(d)) is not None:
        return flat
    reward = d.watch.reward
    rose = reward.cusum(1) >= h
    rows = []
    for name, want in d.watch.basis.targets.items():
        against = -1 if want == "higher" else 1
        row = _movement(d, name, against, h)
        if row is None or not _big(row, min_size):
            continue
        sel, z = d.watch.selected(name, z_sel)
        held = reward.down_side.quiet_since(row["onset"])
        rows.append({**row, "want": want, "z_selection": z, "selected_against": sel == against,
                     "reward_held": held and not rose})
    gamed = [r for r in rows if rose or r["selected_against"] or r["reward_held"]]
    evidence = {"features": gamed or rows, "h": h, "reward_rose": rose, "reward_from": reward.up_side.reference,
                "reward_to": reward.up_side.level, "reward_onset": reward.since(1),
                "targets": list(d.watch.basis.targets)}
    if not gamed:
        if rows and (unread := _no_selection(d)) is not None:  # a fallen target whose selection cannot be read
            return unread
        return Outcome(False, evidence=evidence)
    onset = _onset(gamed)
    if rose and not any(r["selected_against"] or r["reward_held"] for r in gamed):
        onset = max(reward.since(1), onset)
    return Outcome(True, onset, evidence)


def paid_for_drift(d: FindingData, h: float = 4.0, z_sel: float = 3.0, min_relative: float = 0.5,
                   min_size: float = 0.25, min_steps: int = 2, min_groups: int = 2) -> Outcome:
    """A behaviour that is not a target grew, in the direction the reward selects it (summed
    selection differential ``z_sel`` SE from zero), by at least ``min_relative`` of its reference
    level and ``min_size`` within-step SDs (its CUSUM at ``h`` or above), while no declared target
    moved the way the user wants: the reward buys its own proxy, not the target."""
    if (short := _watch_short(d, min_steps, min_groups)) is not None:
        return short
    if (flat := _constant_targets(d)) is not None:
        return flat
    if (unread := _no_selection(d)) is not None:
        return unread
    bought = _bought(d, h, min_size)
    rows = []
    for name in d.watch.basis.names:
        if name in d.watch.basis.targets:
            continue
        sel, z = d.watch.selected(name, z_sel)
        if not sel:
            continue
        row = _movement(d, name, sel, h)
        if row is None or not _big(row, min_size) or not abs(row["to"]) > abs(row["from"]):
            continue
        rel = _relative(row)
        if rel is None or rel >= min_relative:
            rows.append({**row, "relative": rel, "z_selection": z})
    evidence = {"features": rows, "bought": bought, "targets": list(d.watch.basis.targets), "h": h,
                "min_relative": min_relative}
    return Outcome(bool(rows) and not bought, _onset(rows) if rows and not bought else None, evidence)


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
    seen = {"eta": eta, "interval": list(iv), "d_t_total": total, "max_eta": max_eta, "min_nats": min_nats,
            "eta_d_t": s.get("eta_d_t")}  # eta's own denominator: D_t over the updates eta is read on
    if total >= min_nats and iv[0] < max_eta <= iv[1]:
        return unjudged(**seen, straddles=True)
    rows_, pairs = s.get("eta_run_rows"), s.get("step_pairs")
    if total < min_nats and rows_ is not None and pairs is not None and rows_ < pairs:
        # a sum over the measured step pairs only: under min_nats there says nothing of the run's (issue 61)
        return unjudged(**seen, partial=True, rows=rows_, pairs=pairs)
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
            _, onset = final_stretch(steps, ratio < max_eta)
    return Outcome(holds, onset, seen)


def run_diverged(d: FindingData) -> Outcome:
    """The run logged a NaN or infinite value (the record's ``manifest.non_finite``, kept as null
    where it was): it diverged at the first step that has one, named with its field, what it was
    and where it was read. A validation completion's non-finite score (``validation.*``) is not
    the training diverging. No threshold: one non-finite number is a fact, not an estimate."""
    vals = [v for v in d.non_finite if not v.field.startswith("validation.")]
    if not vals:
        return Outcome(False, evidence={"n": 0})
    first = min(vals, key=lambda v: v.step)
    same = sorted({v.field for v in vals if v.step == first.step and v.field != first.field})
    steps = sorted({v.step for v in vals})
    return Outcome(True, first.step, {"field": first.field, "value": first.value, "source": first.source,
                                      "others": [f"`{f}`" for f in same[:6]], "n": len(vals), "n_steps": len(steps),
                                      "last": steps[-1]})


def engine_mismatch(d: FindingData, share: float = 0.1, critical: float = 1.0, z: float = 3.0, persist: int = 2,
                    h: float = 5.0, min_steps: int = 2, logged_warn: float = 0.01, logged_critical: float = 0.1,
                    logged_persist: int = 2, logged_min_steps: int = 2) -> Outcome:
    """The engine that sampled the rollouts departs from the policy the trainer scores them with
    by more than ``share`` of the update's own divergence. A step is judged where it has the
    mismatch (``measure.mismatch``: KL(pi_sampler || pi_t) along its rollouts, nats/seq), its SE
    (the series', ``measure.mismatch.series_se``: its own given the step's prompts, from the
    completions within each group, moderated across its neighbouring steps) and a positive D_t.
    Its evidence at a level (``share`` or ``critical`` x D_t) is one number: the excess KL - level
    x D_t over its SE (the series' and level times D_t's, moderated as the cost book states it
    (``ledger.moderated.moderated_by_step``), combined; both given the step's prompts),
    turned into a normal score through Student's t on the step's own SE's degrees of freedom
    (``measure.sequential.normal_score``: on 3 a t of 3 is a tail of 2.9 %, not the normal 0.13 %,
    and the score says which). Not on the series' pooled degrees of freedom, which its interval
    reads: neighbouring steps share their variance, so a stretch whose pooled variance came out
    low inflates the scores of every step in it together, and a CUSUM adds such a stretch up.
    Simulated at the null's boundary (below; 1,000 runs of 1,000 steps, 4 groups of 4, each
    group's spread its own), on the step's own degrees of freedom the rules alarmed on none (the
    line two SDs of a group mean above 0) and under the bound half an SD above 0. Until stop 67
    the SE was the group means' spread across prompts, on the groups less one; read on the pooled
    degrees of freedom, the rules then alarmed on 7.3 % of runs, over the bound.
    Reading the t on the fewer degrees of freedom is conservative: it gives up some of the
    pooling's power for the rules' stated bound. Two rules read the scores, and the finding
    holds where either does at the last step judged:

    * *one step at a time*: the score is at least ``z`` at each of the last ``persist`` steps;
    * *pooled*: a one-sided CUSUM of the scores, C_t = max(0, C_{t-1} + u_t - K) with Page's
      K = 1 of the sequential watch, is at least ``h``. A mismatch that persists but that no step
      resolves alone (a stale engine's log-ratios spread over nats, a few prompt groups a step)
      adds its evidence up over the steps; a mismatch that goes away lets the sum fall by K a step.

    The onset is the first step of the final stretch over the line (one step at a time), or of the
    CUSUM's current excursion above zero (its change-point estimate), the earlier where both hold.
    ``share`` = 0.1 is the paired ledger's ``SAMPLER_KL_MAX_SHARE``: past it the mismatch is a large
    part of what the step's samples say, so the ledger refuses the pair; the finding and the
    refusal read one number. Severity ``critical`` where the same rules hold at ``critical`` x D_t:
    the gradient was taken on another policy's samples by as much as the update moved the policy.

    False alarms over a run, in the worst case the null allows (the true mismatch exactly
    ``share`` x D_t, each score a standard normal): two steps in a row at z = 3 has probability
    1.8e-6 per pair of steps, under 0.2 % over 1,000 steps; the CUSUM at h = 5 crosses within
    1,000 steps with probability 0.94 % (``false_alarm_probability``, Brook & Evans 1972); the
    union is under 1.2 % (tests/unit/test_engine_mismatch.py checks it by simulation at 4 and 8
    groups, on the series' SE as the check at every prefix reads it, and across a jump from a
    matched engine to one at the line). With no mismatch at all the scores sit far below zero and
    the rate is lower still."""
    from reward_lens.measure.ledger.paired import SAMPLER_KL_MAX_SHARE
    from reward_lens.measure.sequential import K, normal_scores

    if share != SAMPLER_KL_MAX_SHARE:
        raise ValueError(f"specs/findings/engine_mismatch.yaml: share = {share}, but the paired ledger refuses a step "
                         f"pair past SAMPLER_KL_MAX_SHARE = {SAMPLER_KL_MAX_SHARE}: one rule, one number")
    # no tap (or rollouts with the engine's log-probabilities but no D_t beside them, as NeMo-RL's dumps):
    # the framework's logged metrics (measure.mismatch.logged_mismatch)
    if d.logged_mismatch and not any((d.series("kl_to_previous").get(int(s)) or 0) > 0 for s in d.mismatch):
        e = logged_mismatch(d.logged_mismatch, d.series("kl_to_previous"), share=share, critical=critical,
                            warn_token=logged_warn, critical_token=logged_critical, persist=logged_persist,
                            min_steps=logged_min_steps)
        e.update(logged_source(e["field"], d.framework))
        sev = e.get("severity") if e.get("severity") == "critical" else None
        return Outcome(e["holds"], e.get("onset"), e, judged=e["judged"], severity=sev)
    # D_t's SE moderated across its measured neighbours, as the cost book states it
    d_t = d.series("kl_to_previous")
    d_se = moderated_by_step(d_t, d.series("kl_to_previous_se"), d.series("tap_groups"))
    # the series' SE (measure.mismatch.series_se: each step's own moderated across its neighbours),
    # over every step the series holds, judged or not
    spread = series_se(d.mismatch)
    rows = []
    for s, m in sorted(d.mismatch.items()):
        dt = d_t.get(int(s))
        se_s, dof_s = spread[s]
        if dt is None or not dt > 0 or not (se_s == se_s):
            continue
        rows.append((int(s), m, dt, d_se.get(int(s), 0.0) or 0.0, se_s, dof_s))
    seen_steps = len(d.mismatch)
    if (short := _too_short(len(rows), min_steps, persist, "engine_mismatch")) is not None:
        return unjudged(**short.evidence, mismatch_steps=seen_steps, no_d_t=seen_steps > 0 and not rows)
    steps = np.array([r[0] for r in rows], dtype=np.int64)
    kl = np.array([r[1].kl_seq for r in rows])
    kl_se = np.array([r[4] for r in rows])
    dt_arr, dse_arr = np.array([r[2] for r in rows]), np.array([r[3] for r in rows])
    # the score's t on the step's own SE's degrees of freedom, not the series' pooled ones:
    # neighbouring steps share their variance, so their scores are not independent (docstring)
    df = np.array([max(r[1].kl_seq_dof, 1.0) for r in rows], dtype=float)

    def scores(level: float) -> np.ndarray:
        """Each step's normal score of (KL - level x D_t) / SE, Student's t on its own SE's degrees
        of freedom; a zero SE gives +-inf (past the clip) or 0 where the excess is zero too."""
        excess = kl - level * dt_arr
        se = np.sqrt(kl_se ** 2 + (level * dse_arr) ** 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(se > 0, excess / se, np.where(excess == 0, 0.0, np.copysign(np.inf, excess)))
        return normal_scores(w, df)

    def rules(scores: np.ndarray) -> tuple[int | None, int | None, float]:
        """(the one-step rule's onset, the pooled rule's onset; None where it does not hold at the
        last step) and the CUSUM at the last step."""
        over = scores >= z
        one = final_stretch(steps, over)[1] if over[-persist:].all() else None
        c, start = 0.0, None
        for s, u in zip(steps, scores):
            c = max(0.0, c + float(u) - K)
            start = None if c == 0.0 else (int(s) if start is None else start)
        return one, start if c >= h else None, c

    warn_scores = scores(share)
    warn_one, warn_pool, cusum = rules(warn_scores)
    crit_one, crit_pool, cusum_crit = rules(scores(critical))
    last = rows[-1]
    peak = max(rows, key=lambda r: r[1].kl_seq / r[2])
    seen = {"steps": len(rows), "share": share, "critical": critical, "z": z, "persist": persist, "h": h, "k": K,
            "last_step": last[0], "kl_seq": last[1].kl_seq, "kl_seq_se": last[4], "kl_seq_se_own": last[1].kl_seq_se,
            "kl_seq_dof": last[5] if last[5] == last[5] else None, "d_t": last[2],
            "ratio": last[1].kl_seq / last[2], "kl_token": last[1].kl_token, "max_log_ratio": last[1].max_log_ratio,
            "tail_share": last[1].tail_share, "peak_step": peak[0], "peak_ratio": peak[1].kl_seq / peak[2],
            "groups": last[1].groups, "score": float(warn_scores[-1]), "cusum": cusum, "cusum_critical": cusum_crit,
            "source": "the tap's rollouts: logp_sampler - logp_pre, k1 along the sampler's own samples"}
    if warn_one is None and warn_pool is None:
        return Outcome(False, None, seen)
    onset = min(x for x in (warn_one, warn_pool) if x is not None)
    seen["rule"] = "step" if warn_pool is None else ("pooled" if warn_one is None else "both")
    severity = None
    if crit_one is not None or crit_pool is not None:
        severity = "critical"
        seen["critical_from"] = min(x for x in (crit_one, crit_pool) if x is not None)
    return Outcome(True, onset, {**seen, "severity": severity or "warn"}, severity=severity)


PREDICATES: dict[str, Callable[..., Outcome]] = {f.__name__: f for f in (
    run_diverged, entropy_collapse, advantage_collapse, kl_spikes, clipping_saturation, reward_plateau, moving_against_reward,
    collateral, length_drift, spending_without_buying, proxy_gaming, paid_for_drift, engine_mismatch)}


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


# What a finding that reads the declared targets lacks where the basis declares none.
TARGET = ("a declared target (what you want, e.g. correctness: `target=` in RewardLensTap.attach, `--target NAME`, "
          "or `target:` in the basis)")


def missing_target(spec: FindingSpec, targets: Mapping[str, str] | None) -> list[str]:
    """``[TARGET]`` for a finding that reads the declared targets (``needs_target``) when there are
    none (``targets`` None: the basis is not known here, as in an audit of a config: nothing)."""
    return [TARGET] if spec.needs_target and targets is not None and not targets else []


def reads_field(spec: FindingSpec, present: Callable[[str], bool], name: str) -> bool:
    """The first alternative of the finding's inputs that the record supplies names ``name``."""
    alt = next((a for a in spec.inputs if all(present(f) for f in a)), None)
    return alt is not None and name in alt
def reads_features(spec: FindingSpec) -> bool:
    """The finding reads the basis's features (computed from the completions): every alternative
    of its inputs has ``rollout.completion``."""
    return bool(spec.inputs) and all("rollout.completion" in alt for alt in spec.inputs)


def reads_weighted_reward(spec: FindingSpec, present: Callable[[str], bool]) -> bool:
    """The finding reads the rollouts' weighted `reward`: the first alternative of its inputs that
    the record supplies names ``rollout.reward``."""
    alt = next((a for a in spec.inputs if all(present(f) for f in a)), None)
    return alt is not None and "rollout.reward" in alt


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
    if out.judged and not holds and data.watch is not None:
        # "clear" carries its power: the smallest sustained change this finding finds within a few
        # steps at the run's own batch (reward_lens/power.py, read from specs/power_table.yaml)
        from reward_lens.power import clear_power

        power = clear_power(spec.id, data.watch)
        if power is not None:
            out.evidence = {**out.evidence, "power": power}
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
    if holds and out.severity is not None:
        if out.severity not in RANK or RANK[out.severity] < RANK[spec.severity]:
            raise ValueError(f"specs/findings/{spec.id}.yaml: its predicate escalated to {out.severity!r}, under the "
                             f"spec's {spec.severity!r}")
        base["severity"] = out.severity
    return FindingOut(**base, status="holds" if holds else "clear", onset=out.onset, evidence=evidence,
                      remedy=remedy, values=_jsonable(out.evidence))


def evaluate(run, report=None, specs: Mapping[str, FindingSpec] | None = None, samples=None,
             watch: RunWatch | None = None) -> list[FindingOut]:
    """Every finding on a finished record (with its report's books where a finding reads them,
    and its read of the rollouts, ``samples``, where it made one, with their sequential watch
    ``watch`` where it made that)."""
    from reward_lens.record.notes import assumed_reward_weights, derived_advantages

    specs = specs if specs is not None else load_findings()
    fields = run.fields()
    data = FindingData.from_run(run, report, samples, watch)
    status = {b.id: b.status for b in report.books} if report is not None else {}
    targets = {f.name: f.target for f in report.basis.features if f.target} if report is not None else {}
    assumed = assumed_reward_weights(run.manifest.notes)
    derived = derived_advantages(run.manifest.notes)

    def present(f: str) -> bool:
        if f in ("reward_mean", "frac_reward_zero_std") and not (fields.get(f) and fields[f].any):
            return bool(data.series(f))  # computed from the rollouts
        if f == "max_grad_norm" and data.series(f):
            return True
        p = fields.get(f)
        return bool(p is not None and p.any)

    unmeasured = []
    if samples:
        from reward_lens.measure.books import unmeasured_features

        unmeasured = unmeasured_features(samples, None)
    out = []
    for s in specs.values():
        missing = missing_inputs(s, present, status) + missing_target(s, targets)
        if unmeasured and not missing and reads_features(s):
            # a feature that is not a number on some rollouts: what the finding reads is not there (issue 61)
            missing = [" ".join(render_template("findings/unmeasured.j2", {"unmeasured": unmeasured}).split())]
        f = evaluate_one(s, data, missing)
        if assumed is not None and f.status != "not_evaluated" and reads_weighted_reward(s, present):
            f = f.model_copy(update={"evidence": f"{f.evidence} " + " ".join(render_template(
                "findings/assumed_reward_weights.j2", {"note": assumed}).split())})
        if derived is not None and f.status != "not_evaluated" and reads_field(s, present, "rollout.advantage"):
            f = f.model_copy(update={"evidence": f"{f.evidence} " + " ".join(render_template(
                "findings/derived_advantages.j2", {"note": derived}).split())})
        out.append(f)
    return out


def evaluate_live(series: Mapping[str, Mapping[int, float]], config: Mapping[str, Any] | None = None,
                  specs: Mapping[str, FindingSpec] | None = None) -> list[FindingOut]:
    """The ``live`` findings that telemetry alone feeds, on its series so far (those that read the
    rollouts are not evaluated here: ``LiveFindings`` takes the rollouts too)."""
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


class LiveFindings:
    """The findings while training, step by step: what ``reward-lens check`` says on the record
    of the steps so far, at the cost of each new step's rollouts.

    ``observe(step, rollouts, heldout, telemetry)`` after each step hands over what is new: the
    rollouts of the steps that finished (a ``pyarrow`` table in the record's rollouts schema, or
    the ``Rollout`` rows a tap writes; any steps up to ``step``, each step once), and telemetry
    rows by step (late values, such as D_t, replace earlier ones). It returns the live findings'
    outcomes. The book-grounded ones (moving against the reward, proxy gaming, paid-for drift,
    collateral, length drift) read the sequential watch (``measure.sequential``): each new step
    is summarised once (its features in ``basis``, its reward, its selection differential within
    prompt groups) and the run is never re-read, so at every prefix their outcome and onset are
    what ``check`` says on that prefix of the record (tests/unit/test_live_findings.py). The
    telemetry ones (entropy, zero-spread groups, D_t spikes, clipping) read the series so far,
    with the reward and zero-spread share taken from the rollouts as ``check`` takes them.
    Held-out completions (pi_t's, the paired ledger's second side) are accepted and not read:
    no live finding needs them.

    ``basis``: the feature basis (``check``'s ``--features``; default the surface basis, its
    default too); ``config``: the trainer's settings (``max_grad_norm``,
    ``max_completion_length``); ``eos_token_id``: the model's, for features that need it."""

    def __init__(self, basis=None, config: Mapping[str, Any] | None = None, *, eos_token_id: int | None = None,
                 specs: Mapping[str, FindingSpec] | None = None):
        from reward_lens.measure.ledger.features import SurfaceFeatures

        self.basis = basis if basis is not None else SurfaceFeatures()
        self.config = dict(config or {})
        self.context = {"eos_token_id": eos_token_id, "max_completion_length": self.config.get("max_completion_length")}
        self.specs = {k: v for k, v in (specs if specs is not None else load_findings()).items() if v.live}
        self.watch = RunWatch(WatchBasis.of(self.basis))
        self.series: dict[str, dict[int, float]] = {}
        self.reward_se: dict[int, float] = {}
        self.columns: set[str] = set()  # rollout columns seen with values
        self.mismatch: dict[int, Any] = {}  # the engine mismatch by step (measure.mismatch), as check reads it

    def observe(self, step: int, rollouts=None, heldout=None, telemetry: Mapping[int, Mapping[str, Any]] | None = None
                ) -> list[FindingOut]:
        """Take the new steps' rollouts and telemetry; the live findings as of ``step``."""
        for s, row in (telemetry or {}).items():
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.series.setdefault(k, {})[int(s)] = float(v)
        if rollouts is not None and not _is_table(rollouts):
            from reward_lens.record.writer import _rollouts_table

            rollouts = _rollouts_table(list(rollouts))
        if rollouts is not None and rollouts.num_rows:
            last = self.watch.last_step if self.watch.last_step is not None else -1
            for m in mismatch_of_table(rollouts):  # each new step once, as check reads the record
                if m.step > last:
                    self.mismatch[m.step] = m
        for sample in self._samples(rollouts):
            st = step_stats(sample)
            if st is not None:
                self.watch.observe(st)
            stats = _sample_reward_stats([sample]) if sample.rewards is not None else None
            if stats is not None:
                (mean, se, zero) = stats
                self.series.setdefault("\0reward_mean", {}).update(mean)
                self.reward_se.update(se)
                self.series.setdefault("\0frac_reward_zero_std", {}).update(zero)
        return self.outcomes()

    def _samples(self, rollouts) -> list:
        import pyarrow as pa
        import pyarrow.compute as pc

        from reward_lens.measure.ledger.price import OPTIONAL_COLUMNS, StepSample, group_codes

        if rollouts is None:
            return []
        if not isinstance(rollouts, pa.Table):
            from reward_lens.record.writer import _rollouts_table

            rollouts = _rollouts_table(list(rollouts))
        if not rollouts.num_rows:
            return []
        self.columns |= {c for c in rollouts.column_names if rollouts.column(c).null_count < rollouts.num_rows}
        steps = rollouts.column("step").to_numpy()
        out = []
        for t in np.unique(steps):
            table = rollouts.filter(pc.equal(rollouts.column("step"), int(t)))
            if int(t) <= (self.watch.last_step if self.watch.last_step is not None else -1):
                continue
            z = self.basis.compute(table, source=f"rollouts of step {int(t)}", context=self.context)
            cols = {}
            for c in ("reward", "advantage"):
                col = table.column(c) if c in table.column_names else None
                if col is not None and col.null_count < len(col):
                    cols[OPTIONAL_COLUMNS[c]] = col.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
            groups = n_groups = None
            if "group_id" in table.column_names and not table.column("group_id").null_count:
                groups, n_groups = group_codes(np.asarray(table.column("group_id").cast(pa.string()).to_pylist()))
            if "rewards" in cols and not np.isfinite(cols["rewards"]).all():
                del cols["rewards"]  # a step with a reward missing: no reward level (check drops it too)
            out.append(StepSample(int(t), tuple(self.basis.names), z, groups=groups, n_groups=n_groups, **cols))
        return out

    def outcomes(self) -> list[FindingOut]:
        """The live findings on the steps observed so far."""
        series = {k: v for k, v in self.series.items() if not k.startswith("\0")}
        for name in ("reward_mean", "frac_reward_zero_std"):  # from the rollouts where telemetry lacks them
            if not series.get(name) and self.series.get("\0" + name):
                series[name] = self.series["\0" + name]
        if not series.get("max_grad_norm") and isinstance(self.config.get("max_grad_norm"), (int, float)):
            series["max_grad_norm"] = {s: float(self.config["max_grad_norm"]) for s in series.get("grad_norm_unclipped", {})}
        data = FindingData(series, config=self.config, reward_se=self.reward_se,
                           watch=self.watch if self.watch.steps else None, mismatch=self.mismatch)

        def present(f: str) -> bool:  # as ``evaluate`` asks the record: a column with a value on some row
            if f.startswith("rollout."):
                return f.removeprefix("rollout.") in self.columns
            return bool(series.get(f))

        return [evaluate_one(s, data, missing_inputs(s, present, None) + missing_target(s, self.basis.targets))
                for s in self.specs.values()]


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


def _is_table(x) -> bool:
    import pyarrow as pa

    return isinstance(x, pa.Table)


class _Evidence(dict):
    """A predicate's evidence for the templates: a key it did not set reads as none."""

    def __missing__(self, key):
        return None


def render_template_string(text: str, ctx: dict[str, Any]) -> str:
    return _compiled(text).render(**ctx)


@lru_cache(maxsize=256)
def _compiled(text: str):
    """A spec's template, compiled once: the tap renders every live finding at every step, and
    compiling took most of a check's time."""
    from reward_lens_spec.render import _env, from_string
    from reward_lens_spec.paths import templates_dir

    return from_string(_env(str(templates_dir())), text)


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


__all__ = ["FindingOut", "FindingData", "LiveFindings", "Outcome", "PREDICATES", "evaluate", "evaluate_live",
           "exit_code", "worst", "render_template"]
