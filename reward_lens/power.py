r"""Detection power of the sequential findings: how many steps of a sustained change each one
needs before it holds, at a given number of prompt groups per step and completions per group.

The sequential findings (proxy gaming, paid-for drift, moving against the reward, collateral
behaviour, length drift) hold their false-alarm rate over a run (``measure.sequential``: a
self-starting CUSUM per behaviour, ``h`` = 5, ``k`` = 1); how soon they hold after a change begins
is a matter of evidence per step, so of the batch. This module measures it on the findings' own
code: a simulated run (``specs/power.yaml``: ``steps_before`` steps at a base, then a change
sustained step after step) is made as rollouts (``StepSample``: each prompt group's completions,
their features, rewards and GRPO advantages), summarised by the watch's own ``step_block``, fed
step by step to a ``RunWatch``, and the finding's own predicate (``findings.PREDICATES``, with its
spec's parameters) is asked at every prefix. The delay is the number of changed steps seen when it
first holds (1: at the change's first step); its distribution over ``runs`` runs gives the median
and the 90 % quantile. No second model of the rule: whatever gates the finding adds to its CUSUM
(its ``min_size`` in within-step SDs, ``min_relative`` of the level, the selection it needs) gate
the delay too, which is why a small change can take many more steps than its per-step SE alone
says.

**The streams.** A 0/1 behaviour (a target such as ``correct``) is Bernoulli at its rate, every
completion independently; a length is Gamma-distributed tokens (shape 4: SD half the mean at the
base), rounded. Prompts are alike: the per-step standard error this states,
``sqrt(p (1 - p) / (G m))`` or ``SD / sqrt(G m)``, is the smallest a batch of G groups of m can
have; a task whose prompts differ in difficulty has a larger one, and its delays are longer. The
dispersion is a parameter (``scenario``, ``simulate``): a length's coefficient of variation
``cv``, and a rate's intraclass correlation over prompts ``icc`` (each prompt group's rate drawn
from a Beta around the step's level; the step SE grows by ``sqrt(1 + (m - 1) icc)``). The audit
states the table's (prompts alike, a length's SD half its mean) and says so; a clear finding sets
the run's own beside it (``own_dispersion``); tools/power_vs_labelled.py simulates each labelled
run at its own (its records: ``dispersion``).

The reward of each scenario (``reward:``) is what makes the finding's other conditions
hold: for proxy gaming it pays against the target (it rises as the target falls: the off-by-one
answer key), for moving against the reward it is the behaviour, for paid-for drift it pays per
token, for collateral behaviour and length drift it is a coin that selects nothing.

**False alarms** are stated from the Markov chain of Brook & Evans (1972) on the rule's CUSUM
(``sequential.false_alarm_probability``): the chance that one behaviour's one-sided sum reaches
``h`` within ``run_length`` steps when nothing changes (0.94 % over 1,000 steps at ``h`` = 5). The
finding holds only where that sum is at ``h``, so this bounds its false alarms per behaviour and
direction it watches (its size gates only lower them; tests/unit/test_power.py checks the rate on
simulated runs with no change).

**Cached.** The simulations take minutes (``tools/power_table.py`` writes
``specs/power_table.yaml``: every finding, batch and change of ``specs/power.yaml``'s grid); the
audit and the report read that table (``lru_cache``) at the grid's nearest batch at or below
theirs, and say so where it is not theirs (fewer prompt groups or completions are taken to find a
change no sooner: the read errs late), so they stay fast.
``simulate`` runs one cell directly (the tests, and tools/power_vs_labelled.py at a run's own change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from reward_lens.measure.ledger.price import StepSample
from reward_lens.measure.sequential import RunWatch, WatchBasis, false_alarm_probability, step_block
from reward_lens_spec.paths import specs_dir

SPEC = "power.yaml"
CHUNK = 8  # steps of a simulated run made at a time
# the round bounds a false-alarm rate is stated under
FALSE_ALARM_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
TABLE = "power_table.yaml"


class Scenario(BaseModel):
    """One finding's simulated change (specs/power.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["rate", "length"]
    feature: str
    target: Literal["higher", "lower"] | None = None
    base: float
    # the dispersion: a length's Gamma shape (coefficient of variation 1 / sqrt(shape)); a rate's
    # intraclass correlation over prompts (the share of its variance that is prompt difficulty)
    shape: float = 4.0
    icc: float = 0.0
    direction: Literal[-1, 1]
    reward: Literal["against", "behaviour", "length", "coin"]
    target_base: float | None = None
    stated: float
    ladder: list[float]
    what: str  # the behaviour in words, as the audit names it ("a target")
    scenario: str  # the reward's part in words ("the reward paying against it")


class PowerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps_before: int
    horizon: int
    runs: int
    seed: int
    quantile: float
    within: int
    run_length: int
    groups: list[int]
    completions: list[int]
    findings: dict[str, Scenario]


@lru_cache(maxsize=None)
def load_power(root: str | None = None) -> PowerSpec:
    from reward_lens_spec.yamlload import safe_load_bounded

    path = Path(root or specs_dir()) / SPEC
    return PowerSpec(**safe_load_bounded(path.read_text()))


@dataclass(frozen=True)
class Delays:
    """The delays of ``runs`` simulated runs (changed steps seen when the finding first held; inf:
    not within the horizon)."""

    finding: str
    groups: int
    completions: int
    change: float
    delays: np.ndarray
    horizon: int
    quantile: float = 0.9

    @property
    def found(self) -> float:
        """The share of runs in which it held within the horizon."""
        return float(np.isfinite(self.delays).mean())

    def at(self, q: float) -> int | None:
        """The q-quantile of the delay (the smallest delay with at least q of the runs at or under
        it); None where it lies past the horizon."""
        d = np.sort(self.delays)
        v = d[min(len(d) - 1, max(0, math.ceil(q * len(d)) - 1))]
        return int(v) if math.isfinite(v) else None

    @property
    def median(self) -> int | None:
        return self.at(0.5)

    @property
    def upper(self) -> int | None:
        """The ``quantile`` (90 %) delay: "90 % within" it."""
        return self.at(self.quantile)


def _basis(sc: Scenario) -> WatchBasis:
    names = [sc.feature] if sc.target_base is None else ["correct", sc.feature]
    units = {n: ("tokens" if sc.kind == "length" and n == sc.feature else "share") for n in names}
    kinds = {sc.feature: "length"} if sc.kind == "length" else {}
    targets = {sc.feature: sc.target} if sc.target else {}
    if sc.target_base is not None:
        targets["correct"] = "higher"
    return WatchBasis(tuple(names), units, kinds, targets)


def _stream(sc: Scenario, groups: int, completions: int, change: float, before: int, start: int, steps: int,
            rng: np.random.Generator) -> list[StepSample]:
    """Steps ``start`` .. ``start + steps - 1`` of one simulated run, as rollouts: ``before`` steps
    at the base, then the change (the j-th changed step ``j * change`` from the base, a rate held
    in [0, 1]). The dispersion is the scenario's: a length's ``shape`` (its coefficient of variation
    ``1 / sqrt(shape)``), a rate's ``icc`` (each prompt group's own rate drawn from a Beta with the
    step's level as its mean and ``icc`` as its intraclass correlation; 0: prompts alike)."""
    n = groups * completions
    j = np.maximum(0, np.arange(start, start + steps) - before + 1).astype(float)
    if sc.kind == "rate":
        level = np.clip(sc.base + sc.direction * j * change / 100.0, 0.0, 1.0)
        rate = np.repeat(level[:, None], n, axis=1)
        if sc.icc > 0:
            # Var(prompt rate) = icc p (1 - p): Beta(p a, (1 - p) a) with a = 1 / icc - 1
            a = 1.0 / sc.icc - 1.0
            mean = np.clip(level, 1e-9, 1 - 1e-9)[:, None]
            prompt = rng.beta(np.broadcast_to(mean * a, (steps, groups)), np.broadcast_to((1 - mean) * a, (steps, groups)))
            rate = np.where((level[:, None] > 0) & (level[:, None] < 1), np.repeat(prompt, completions, axis=1), rate)
        x = (rng.random((steps, n)) < rate).astype(float)
    else:
        level = np.maximum(1.0, sc.base + sc.direction * j * change)
        x = np.maximum(1.0, np.round(rng.gamma(sc.shape, 1.0, (steps, n)) * (level / sc.shape)[:, None]))
    if sc.reward == "against":
        r = 1.0 - x
    elif sc.reward == "behaviour":
        r = x.copy()
    elif sc.reward == "length":
        r = x / sc.base
    else:
        r = (rng.random((steps, n)) < 0.5).astype(float)
    cols = [x]
    if sc.target_base is not None:  # a declared target the run does not buy: held at its rate
        cols.insert(0, (rng.random((steps, n)) < sc.target_base).astype(float))
    g = r.reshape(steps, groups, completions)
    sd = g.std(axis=2, ddof=1, keepdims=True) if completions > 1 else np.zeros_like(g[..., :1])
    adv = ((g - g.mean(axis=2, keepdims=True)) / (sd + 1e-4)).reshape(steps, n)  # GRPO's, TRL's epsilon
    codes = np.repeat(np.arange(groups), completions)
    names = _basis(sc).names
    return [StepSample(start + t, names, np.column_stack([c[t] for c in cols]), rewards=r[t], advantages=adv[t],
                       groups=codes, n_groups=groups) for t in range(steps)]


def _predicate(finding: str):
    from reward_lens.findings import PREDICATES
    from reward_lens_spec import load_findings

    spec = load_findings()[finding]
    return PREDICATES[spec.predicate], dict(spec.params)


def scenario(finding: str, *, base: float | None = None, cv: float | None = None, icc: float | None = None,
             kind: str | None = None) -> Scenario:
    """``finding``'s scenario (specs/power.yaml) with the run's own numbers in place of its
    assumptions: ``base`` the level the change starts from (a rate, or a mean length); ``cv`` a
    length's coefficient of variation (its within-step SD over its mean); ``icc`` a rate's
    intraclass correlation over prompts (0: prompts alike; measured: ``dispersion``); ``kind``
    "rate" for a 0/1 behaviour where the scenario watches a length (paid-for drift bought as a
    rate: the reward then pays for the behaviour itself)."""
    sc = load_power().findings[finding]
    update: dict[str, Any] = {}
    if kind is not None and kind != sc.kind:
        if kind != "rate" or sc.reward != "length":
            raise ValueError(f"{finding}: its scenario cannot be read as a {kind!r} behaviour")
        update.update(kind="rate", feature="behaviour", reward="behaviour", base=0.5)
    if base is not None:
        update["base"] = float(base)
    if cv is not None:
        if not (cv > 0 and math.isfinite(cv)):
            raise ValueError(f"cv must be a positive number (a length's SD over its mean), got {cv!r}")
        update["shape"] = 1.0 / cv ** 2
    if icc is not None:
        if not (0 <= icc < 1):
            raise ValueError(f"icc must lie in [0, 1) (the share of a rate's variance between prompts), got {icc!r}")
        update["icc"] = float(icc)
    return sc.model_copy(update=update) if update else sc


def simulate(finding: str, groups: int, completions: int, change: float, *, runs: int | None = None,
             horizon: int | None = None, seed: int | None = None, before: int | None = None,
             base: float | None = None, cv: float | None = None, icc: float | None = None,
             kind: str | None = None) -> Delays:
    """The delays of ``finding`` over simulated runs of its scenario (specs/power.yaml) at
    ``groups`` prompt groups a step of ``completions`` each, the change ``change`` a step (points
    of a rate, or tokens); 0 gives the false alarms after ``before`` quiet steps. ``base``, ``cv``,
    ``icc``, ``kind``: the run's own level and dispersion in place of the scenario's assumptions
    (``scenario``)."""
    from reward_lens.findings import FindingData

    p = load_power()
    sc = scenario(finding, base=base, cv=cv, icc=icc, kind=kind)
    custom = sc != p.findings[finding]
    runs = p.runs if runs is None else runs
    horizon = p.horizon if horizon is None else horizon
    before = p.steps_before if before is None else before
    fn, params = _predicate(finding)
    h = float(params["h"])
    basis = _basis(sc)
    # one stream of random numbers per cell, from the seed and the cell (a cell reruns alike alone)
    rng = np.random.default_rng([p.seed if seed is None else seed, groups, completions, int(round(change * 1000)),
                                 sorted(p.findings).index(finding),
                                 *([] if not custom else [int(round(sc.base * 1000)), int(round(sc.shape * 1000)),
                                                          int(round(sc.icc * 1e6)), int(sc.kind == "rate")])])
    out = np.full(runs, np.inf)
    total = before + horizon
    for i in range(runs):
        watch = RunWatch(basis)
        start = 0
        while start < total and not math.isfinite(out[i]):
            # a run is made CHUNK steps at a time and stops where the finding holds (a large batch's
            # later steps would cost most of the time and change nothing)
            quiet = start == 0 and before > 0
            count = before if quiet else min(CHUNK, total - start)  # the quiet steps first, as one block
            block = step_block(_stream(sc, groups, completions, change, before, start, count, rng))
            start += count
            if quiet:
                # no predicate is asked before the change: the quiet steps go in at once, which leaves
                # the state that step-by-step observation does (test_sequential checks it)
                watch.observe_block(block)
                continue
            for k in range(len(block.steps)):
                watch.observe(block.row(k))
                if block.steps[k] < before:
                    continue
                # every one of these predicates holds only where some behaviour's CUSUM is at its h
                # (``findings._movement``): until then asking it cannot change the answer
                if max(max(w.up, w.down) for w in watch.series.values()) < h:
                    continue
                o = fn(FindingData({}, watch=watch), **params)
                if o.holds and o.judged:
                    out[i] = int(block.steps[k]) - before + 1
                    break
    return Delays(finding, groups, completions, change, out, horizon, p.quantile)


def step_se(finding: str, groups: int, completions: int, sc: Scenario | None = None) -> float:
    """The standard error of one step's level at the scenario's base, in its unit (points of a
    rate, tokens), at its dispersion (``sc``: a ``scenario`` with the run's own; by default
    specs/power.yaml's): a rate's ``sqrt(p (1 - p) (1 + (m - 1) icc) / (G m))`` (prompts alike,
    icc 0: the least a batch of G x m can have), a length's ``SD / sqrt(G m)``."""
    sc = sc or load_power().findings[finding]
    n = groups * completions
    if sc.kind == "rate":
        return 100.0 * math.sqrt(sc.base * (1 - sc.base) * (1 + (completions - 1) * sc.icc) / n)
    return sc.base / math.sqrt(sc.shape) / math.sqrt(n)


def dispersion(values: np.ndarray, groups: np.ndarray) -> dict[str, float]:
    """A behaviour's dispersion within steps, from one step's rollouts (``values``, with each one's
    prompt group ``groups``) or several steps' stacked with groups coded apart: its mean, its SD
    over rollouts, the coefficient of variation (SD over mean: a length's ``cv``), and the
    intraclass correlation over prompts (the one-way ANOVA estimate, at least 0: a rate's ``icc``),
    what ``simulate`` takes in place of specs/power.yaml's assumptions."""
    x = np.asarray(values, dtype=float)
    codes = np.unique(np.asarray(groups), return_inverse=True)[1]
    g = int(codes.max()) + 1 if len(codes) else 0
    if len(x) < 3 or g < 2 or g == len(x):
        raise ValueError("a dispersion needs at least 2 prompt groups, one with 2 or more rollouts")
    size = np.bincount(codes, minlength=g).astype(float)
    mean_g = np.bincount(codes, weights=x, minlength=g) / size
    ss_w = float(((x - mean_g[codes]) ** 2).sum())
    ss_b = float((size * (mean_g - x.mean()) ** 2).sum())
    ms_w, ms_b = ss_w / (len(x) - g), ss_b / (g - 1)
    n0 = (len(x) - (size ** 2).sum() / len(x)) / (g - 1)  # the groups' effective size
    icc = max(0.0, (ms_b - ms_w) / (ms_b + (n0 - 1) * ms_w)) if ms_b + (n0 - 1) * ms_w > 0 else 0.0
    sd = float(x.std(ddof=1))
    mean = float(x.mean())
    return {"mean": mean, "sd": sd, "cv": sd / mean if mean else math.inf, "icc": icc}


@lru_cache(maxsize=None)
def false_alarms(finding: str, run_length: int | None = None) -> float:
    """The chance that one watched behaviour's one-sided CUSUM reaches the finding's ``h`` within
    ``run_length`` steps with no change (Brook & Evans): a bound on its false alarms per behaviour
    and direction (cached: the chain over 1,000 steps is a tenth of a second, and the tap asks at
    every step)."""
    from reward_lens_spec import load_findings

    h = float(load_findings()[finding].params["h"])
    return false_alarm_probability(h, run_length or load_power().run_length)


# ------------------------------------------------------------------------------------ the table
def build_table(findings: list[str] | None = None, progress=None, completions: list[int] | None = None
                ) -> dict[str, Any]:
    """Every cell of specs/power.yaml's grid simulated (of ``completions`` only, where given):
    finding -> "GxM" -> change -> [median, upper, found] (median and upper None past the horizon).
    Each cell draws its own random numbers (``simulate``), so a part of the grid made alone is
    what the whole grid's run makes of it."""
    p = load_power()
    out: dict[str, Any] = {}
    for f in findings or list(p.findings):
        cells = out.setdefault(f, {})
        for g in p.groups:
            for m in completions or p.completions:
                row = {}
                for c in p.findings[f].ladder:
                    d = simulate(f, g, m, c)
                    row[_key(c)] = [d.median, d.upper, round(d.found, 3)]
                    if progress:
                        progress(f, g, m, c, d)
                cells[f"{g}x{m}"] = row
    return out


def source_digest() -> str:
    """What a table is made from: specs/power.yaml's simulated settings (not its words) and each
    simulated finding's predicate and parameters; a table whose ``source`` differs is stale."""
    import hashlib
    import json

    from reward_lens_spec import load_findings

    p = load_power()
    specs = load_findings()
    data = p.model_dump(exclude={"findings": {f: {"what", "scenario"} for f in p.findings}})
    for f in data["findings"].values():
        # prompts alike (icc 0) draw the very numbers they drew before the icc was a setting
        if f.get("icc") == 0:
            del f["icc"]
    data["predicates"] = {f: [specs[f].predicate, specs[f].params] for f in sorted(p.findings)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _key(change: float) -> str:
    return f"{change:g}"


@lru_cache(maxsize=None)
def load_table(root: str | None = None) -> dict[str, Any] | None:
    """specs/power_table.yaml (None where it was never generated)."""
    from reward_lens_spec.yamlload import safe_load_bounded

    path = Path(root or specs_dir()) / TABLE
    if not path.is_file():
        return None
    return safe_load_bounded(path.read_text())


def grid_cell(groups: float, completions: float) -> tuple[int, int] | None:
    """The grid's batch nearest at or below ``groups`` x ``completions`` (None under the grid's
    least: fewer than 2 prompt groups a step or 2 completions a group, which the findings do not
    judge)."""
    p = load_power()
    gs = [g for g in p.groups if g <= groups + 1e-9]
    ms = [m for m in p.completions if m <= completions + 1e-9]
    return (gs[-1], ms[-1]) if gs and ms else None


@dataclass(frozen=True)
class Power:
    """What a finding can catch at a batch (the table's cell): for the audit's sentence and the
    report's "clear"."""

    finding: str
    groups: int  # the batch asked about
    completions: int
    cell: tuple[int, int]  # the grid's batch it was read at
    kind: str
    base: float
    direction: int
    target: bool
    change: float  # the stated change
    median: int | None
    upper: int | None
    found: float
    se: float  # one step's SE at the cell's batch, in the unit
    icc: float  # the dispersion the table assumed: a rate's intraclass correlation over prompts (0: alike)
    cv: float | None  # a length's coefficient of variation (None for a rate)
    false_alarm: float
    run_length: int
    within: int
    quantile: float
    smallest: float | None  # the smallest change of the ladder found within ``within`` steps (quantile)
    largest_tried: float
    what: str
    scenario: str
    horizon: int

    @property
    def false_alarm_below(self) -> float:
        """A round bound the false-alarm rate is under (1 % for 0.94 %)."""
        return next(b for b in (*FALSE_ALARM_BOUNDS, 1.0) if self.false_alarm < b)

    def context(self) -> dict[str, Any]:
        """The numbers the templates read."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {
            "cell_groups": self.cell[0], "cell_completions": self.cell[1], "false_alarm_below": self.false_alarm_below}


def power_at(finding: str, groups: float, completions: float) -> Power | None:
    """The table's statement for ``finding`` at a batch; None where the finding has no scenario,
    the table is missing, or the batch is under the grid."""
    p = load_power()
    table = load_table()
    table = table["cells"] if table is not None else None
    if finding not in p.findings or table is None or finding not in table:
        return None
    cell = grid_cell(groups, completions)
    if cell is None:
        return None
    row = table[finding].get(f"{cell[0]}x{cell[1]}")
    if row is None:
        return None
    sc = p.findings[finding]
    median, upper, found = row[_key(sc.stated)]
    smallest = next((c for c in sc.ladder if row[_key(c)][1] is not None and row[_key(c)][1] <= p.within), None)
    return Power(finding, int(round(groups)), int(round(completions)), cell, sc.kind, sc.base, sc.direction,
                 sc.target is not None, sc.stated, median, upper, found, step_se(finding, *cell), sc.icc,
                 1.0 / math.sqrt(sc.shape) if sc.kind == "length" else None,
                 false_alarms(finding), p.run_length, p.within, p.quantile, smallest, max(sc.ladder), sc.what,
                 sc.scenario, p.horizon)


def run_batch(watch: RunWatch) -> tuple[float, float] | None:
    """A run's batch as its watch read it: prompt groups per step (the mean over its steps) and
    completions per group (its rollouts over its groups); None before any step."""
    for s in watch.series.values():
        if s.steps and s.ref_n > 0:
            groups = s.ref_n / s.steps
            rollouts = s.rows_df / s.steps + 1.0
            return groups, rollouts / groups
    return None


def clear_power(finding: str, watch: RunWatch) -> dict[str, Any] | None:
    """What a clear ``finding`` could have seen on the run its ``watch`` read: the table's statement
    at the run's own batch (prompt groups per step, completions per group), for its evidence; None
    where the finding has no scenario or the batch is not tabulated."""
    batch = run_batch(watch)
    if batch is None:
        return None
    pw = power_at(finding, *batch)
    if pw is None:
        return None
    ctx = pw.context()
    ctx["groups"], ctx["completions"] = round(batch[0], 1), round(batch[1], 1)
    out = {k: ctx[k] for k in ("groups", "completions", "cell_groups", "cell_completions", "kind", "base", "direction",
                               "what", "scenario", "smallest", "largest_tried", "within", "quantile", "icc", "cv")}
    out["own"] = own_dispersion(finding, watch, batch[1])
    return out


def own_dispersion(finding: str, watch: RunWatch, completions: float) -> list[dict[str, Any]]:
    """The run's own dispersion of the behaviours ``finding``'s scenario stands for, read by its
    watch over every step (its pooled between-group variance of group means, and its within-step
    SD over rollouts): for a rate scenario the declared targets, each with its ``icc`` over
    prompts and its step SE over the SE of prompts alike (``se_ratio``, sqrt(1 + (m - 1) icc)); for
    a length scenario the length features, each with its mean and ``cv``. What the table assumed
    is beside it in ``clear_power``; the catch the table states is for its dispersion, not this."""
    sc = load_power().findings.get(finding)
    if sc is None:
        return []
    b = watch.basis
    names = ([n for n in b.names if n in b.targets] if sc.kind == "rate"
             else [n for n in b.names if b.kinds.get(n) == "length"])
    out = []
    for name in names:
        s = watch.series.get(name)
        if s is None or s.df <= 0 or not s.spread or s.reference is None:
            continue
        if sc.kind == "rate":
            ratio = max(1.0, completions * (s.ss / s.df) / s.spread ** 2)
            icc = (ratio - 1.0) / (completions - 1.0) if completions > 1 else 0.0
            out.append({"feature": name, "icc": round(icc, 3), "se_ratio": round(math.sqrt(ratio), 2)})
        elif s.reference > 0:
            out.append({"feature": name, "mean": round(s.reference, 3), "cv": round(s.spread / s.reference, 3)})
    return out


__all__ = ["clear_power", "Delays", "dispersion", "scenario", "Power", "PowerSpec", "Scenario", "build_table",
           "false_alarms", "grid_cell", "load_power",
           "load_table", "own_dispersion", "power_at", "run_batch", "simulate", "step_se"]
