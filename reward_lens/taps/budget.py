"""The tap's cost budget: how much of each step pair it measures, chosen from timing alone.

``budget=b`` is the tap's time as a fraction of an untapped optimizer step. Each step the tap
times itself and the step around it; the untapped step is the step's wall time less the tap's
own time (a running median over the last ``WINDOW`` steps, so one slow step does not move it).
The allowance of a step is ``b`` times that, less the tap's fixed cost (the telemetry, the
snapshot of pi_t, writing the record: paid every step, measured as such).

What an allowance buys is a **shape** of the step pair's measurement, priced from the unit
costs the tap has measured so far (seconds per scored token of each kind):

* two-sided: ``k`` completions per prompt group from each policy (pi_t's drawn in step t's own
  generation, pi_{t+1}'s in step t+1's, never trained on), for ``m`` groups;
* one-sided: ``m`` groups of the next generation's rollouts scored under pi_t (no extra
  completions);

in this order of preference: the two-sided shape with the most groups at ``k = heldout`` (the
completions per group ``budget=None`` draws: 4 by default), every group or at least
``MIN_SUBSET_GROUPS`` (8) of them; failing that,
**two-sided pairs on a share of the step pairs**, each measured whole (every group, ``k =
heldout``: exactly as ``budget=None`` measures it), each pair measured with probability ``p`` =
what the allowance covers of its cost, and never fewer than the floor (below). Two-sided
comes first, and a share of two-sided pairs before one-sided pairs on all of them (the owner's
ruling on issue 57: the one-sided estimator reads a step that sharpens the policy from its
heavy-tailed side, docs/science.md), and a measured pair is whole so that its estimate is of the
step's change over all the step's prompts. Completions per group come before groups (issue 62):
through stop 65 the budget bought ``k = 2`` on more groups or pairs, and on the truth harness's
collapsing run (tools/truth.py, a sharpened policy) a 2 + 2 sample failed five of the issue's
lines that ``budget=None``'s 4 + 4 met: a sharpened prompt's behaviours are constant in most 2 + 2
groups (no within-group contrast to read), the token KL's heavy tail is seldom in a 2 + 2 sample,
and eta's ratio leans with the small sample. A measured pair is now the pair ``budget=None``
measures, so what the harness checks at ``budget=None`` holds for each measured pair at any
budget; the budget sets how many pairs (and, on a generation large enough, how many groups).
One-sided (the next generation's rollouts scored under pi_t) is what a tap that draws no extra
completions (``heldout=0``, or a generation that cannot take them) measures: the most
groups that fit, else whole on a share of the pairs as above.

The floor. Where the allowance covers less than the floor's share of a whole pair's cost -- a
small or short run, where the tap's fixed work alone is a tenth of a step that takes tens of
milliseconds -- the budget would measure a handful of pairs or none, and the report would resolve
nothing: the run would have paid the tap's fixed cost for no answer. The budget then measures the
floor's share anyway, spends more than ``budget`` on average, and says so (the plan's reason
``floor``, its probability in the telemetry; the report's tap sentence). The floor is a spend, not
a count (``record.schema.tap_floor``): ``MIN_SHARE`` (a quarter) of the pairs at 2 + 2 completions
or one-sided, and as much sampling at more completions, ``MIN_SHARE * 2 / k`` of the pairs at k +
k (an eighth at 4 + 4). Issue 57's small runs needed that much sampling, and a count floor would
have doubled the floor's spend when the measured pair doubled (on bench/tap_forward.py's 31.7M
model, by its stop-65 unit costs, the default would have spent about 0.14 of a step, past its
tenth: an estimate, not a measurement).

Which pairs. A share is taken by systematic sampling with a random start: a running sum of the
pairs' probabilities, started at a uniform draw of the tap's seeded generator, and pair i is
measured when the sum crosses an integer. Each pair is then measured with its probability ``p_i``
exactly (as with a coin), the measured pairs are spread evenly over the run instead of in clumps,
and the count over n pairs is within one of ``sum p_i``: a short run is never left unmeasured by
an unlucky coin. The choice reads the pair's index and the timing only.

Why this keeps the estimators unbiased. The shape depends on the timing of earlier steps only,
never on a value sampled for the pair it measures; the ``m`` groups are drawn uniformly at
random from the generation's groups (the tap's own seeded generator), each with the same
probability ``m / G``; so the mean over the measured groups is an unbiased estimate of the mean
over all of them, and its standard error across the measured groups widens with the smaller
sample as it should (groups are the units of every paired estimate). A pair the share skips
is a pair with no measurement, recorded as such with its probability (``tap_probability``),
never a pair whose number is guessed.

The first step pair, before any unit cost is known, is measured whole: it is what the costs
are learned from.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from statistics import median

import numpy as np

from reward_lens.record.schema import TAP_MIN_PER_GROUP, TAP_MIN_SHARE, tap_floor

# Steps over which the untapped step time and the fixed cost are medians.
WINDOW = 8
# The fewest prompt groups the budget measures where the generation has more (a standard error
# across groups needs two; with one group D_t's is the delta-method one within it).
MIN_GROUPS = 2
# The fewest prompt groups a two-sided pair is measured on where the budget cannot measure every
# group: fewer, and every interval of the pair rests on a t of under 7 degrees of freedom (the
# groups less one; its 97.5 % quantile 2.45 at 6, 4.30 at 2, against the normal's 1.96), so that
# the same spend on whole pairs (every group) on a share of the steps gives narrower intervals:
# on tools/cost_precision.py's moderate run at budget 0.25 the tap bought 3 of 8 groups on 90 % of
# the pairs and the run-level eta interval was 0.313 wide, against 0.329 at 0.10 (whole pairs on
# 18 % of them). A generation of fewer groups is measured whole, on a share of the pairs.
MIN_SUBSET_GROUPS = 8
# The fewest completions per group and side of a two-sided measurement: the paired ledger keeps
# groups of two or more rows per side (one row has no within-group information).
MIN_PER_GROUP = TAP_MIN_PER_GROUP
# The least share of the step pairs a budget measures, whatever the allowance: a quarter. A run of
# 24 updates then has 6 or more pairs measured whole besides the first, which a report can pool
# into windows; below it a small run's report resolved nothing (issue 57: 2 of 24 pairs two-sided,
# "resolved from noise at 0 of 14"). Where it binds, the tap spends more than its budget, and the
# plan says so (reason "floor"). It is a spend: at k + k completions per group the floor measures
# MIN_SHARE * 2 / k of the pairs (``tap_floor``: an eighth at 4 + 4), as much sampling as a quarter
# of the pairs at 2 + 2, which is what issue 57's small runs needed.
MIN_SHARE = TAP_MIN_SHARE


@dataclass(frozen=True)
class Shape:
    """What a step pair's measurement holds: ``groups`` prompt groups, each with ``per_group``
    completions from each policy (0: one-sided, the next generation's rollouts scored)."""

    groups: int
    per_group: int

    @property
    def sides(self) -> str:
        return "two-sided" if self.per_group else "one-sided"


@dataclass(frozen=True)
class Plan:
    """The measurement of one step pair: the shape, which groups (indices into the generation's
    groups, sorted), the probability the pair was measured at all, and why it took this shape."""

    shape: Shape | None  # None: not measured
    groups: tuple[int, ...]
    probability: float
    # "unbounded" (no budget), "first" (whole, the unit costs are learned from it), "fits" (the
    # largest shape the allowance covers), "share" (whole, on the share of the pairs the allowance
    # covers), "floor" (whole, on the floor's share of the pairs, ``tap_floor``: more than the allowance covers),
    # "skipped" (not in the share), "few_groups" (under MIN_GROUPS groups in the generation),
    # "no_side_b" (planned two-sided, but the next generation could not take the extra completions)
    reason: str

    @property
    def measured(self) -> bool:
        return self.shape is not None and bool(self.groups)


@dataclass
class UnitCosts:
    """Seconds per token of each kind of the tap's work, as measured (running medians)."""

    forward: float | None = None  # one policy's forward pass (scoring), per token
    generate: float | None = None  # one more row in a generation, whole (its decoding steps)
    fixed: float | None = None  # the tap's fixed cost per step (s)


class Budget:
    """Sizes the tap's work per step pair to ``fraction`` of an untapped step (None: everything)."""

    def __init__(self, fraction: float | None, heldout: int, seed: int = 0, passes: int = 2):
        self.fraction = fraction
        self.heldout = int(heldout)
        self.passes = int(passes)  # forward passes per extra row (1 where the drawing policy's side is captured)
        self._rng = random.Random(seed * 7_919 + 13)
        # the systematic share's running sum of probabilities, started at a uniform draw on first use
        self._credit: float | None = None
        self._untapped: deque[float] = deque(maxlen=WINDOW)
        self._fixed: deque[float] = deque(maxlen=WINDOW)
        self._forward: deque[float] = deque(maxlen=WINDOW)
        self._generate: deque[float] = deque(maxlen=WINDOW)

    # ------------------------------------------------------------------ what was measured
    def observe_step(self, step_seconds: float, tap_seconds: float, fixed_seconds: float) -> None:
        """One optimizer step's wall time, the tap's time inside it, and the part of that which is
        paid every step whatever is measured."""
        if step_seconds > 0 and tap_seconds >= 0:
            self._untapped.append(max(step_seconds - tap_seconds, 0.0))
        if fixed_seconds >= 0:
            self._fixed.append(fixed_seconds)

    def observe_forward(self, seconds: float, tokens: int) -> None:
        """Scoring forward passes over ``tokens`` tokens in all (a token scored under two policies
        counts twice)."""
        if tokens > 0 and seconds >= 0:
            self._forward.append(seconds / tokens)

    def observe_generation(self, seconds: float, rows: int, extra_rows: int, decode_steps: int) -> None:
        """A generation call of ``rows`` rows, ``extra_rows`` of them the tap's, that decoded for
        ``decode_steps`` steps (its longest completion) in ``seconds``."""
        if rows > 0 and decode_steps > 0 and seconds >= 0:
            self._generate.append((rows, extra_rows, seconds / decode_steps, decode_steps))

    def row_step_cost(self) -> float | None:
        """Seconds one more row adds to one decoding step: the slope of a decoding step's time on
        the rows in the batch over the generations seen (least squares, its upper 2-SE bound),
        where four or more held different numbers of rows; else the time of a step shared out over
        its rows (what the extras would cost if decoding were compute-bound: an upper bound, as
        decoding is mostly latency-bound). Never above that upper bound, never below zero."""
        if not self._generate:
            return None
        rows = np.array([g[0] for g in self._generate], dtype=float)
        per_step = np.array([g[2] for g in self._generate])
        upper = float(np.median(per_step / rows))
        if len(rows) < 4 or len(np.unique(rows)) < 2:
            return upper
        # the slope's upper 2-SE bound: a noisy fit errs on the dear side
        (slope, _), cov = np.polyfit(rows, per_step, 1, cov=True)
        bound = float(slope + 2.0 * math.sqrt(max(cov[0, 0], 0.0)))
        return min(max(bound, 0.0), upper)

    def decode_steps(self) -> float | None:
        return float(median(g[3] for g in self._generate)) if self._generate else None

    @property
    def costs(self) -> UnitCosts:
        step, n = self.row_step_cost(), self.decode_steps()
        return UnitCosts(median(self._forward) if self._forward else None,
                         None if step is None else step * n,
                         median(self._fixed) if self._fixed else None)

    @property
    def untapped_step(self) -> float | None:
        return median(self._untapped) if self._untapped else None

    def allowance(self) -> float | None:
        """Seconds per step the budget leaves for measuring (None: unbounded or not known yet)."""
        if self.fraction is None or self.untapped_step is None:
            return None
        return self.fraction * self.untapped_step - (self.costs.fixed or 0.0)

    # ------------------------------------------------------------------ what to measure
    def cost(self, shape: Shape, rows_per_group: float, tokens_per_row: float) -> float:
        """Seconds a shape takes. Two-sided: ``2 m k`` extra rows, each one more row in a
        generation and ``passes`` forward passes (one where the drawing policy's side comes from
        its generation). One-sided: the measured groups' rollouts in one pass under pi_t (their
        own side comes from the trainer's loss forward or the pass every rollout gets)."""
        c = self.costs
        fwd = c.forward or 0.0
        if shape.per_group:
            rows = 2 * shape.groups * shape.per_group
            return rows * (tokens_per_row * self.passes * fwd + (c.generate or 0.0))
        return shape.groups * rows_per_group * tokens_per_row * fwd

    def plan(self, n_groups: int, rows_per_group: float, tokens_per_row: float, heldout: int | None = None) -> Plan:
        """The measurement of the next step pair over a generation of ``n_groups`` prompt groups
        of ``rows_per_group`` rollouts of about ``tokens_per_row`` tokens. ``heldout``: the most
        extra completions per group this generation can take (0: one-sided only)."""
        heldout = self.heldout if heldout is None else min(int(heldout), self.heldout)
        whole = Shape(n_groups, heldout)
        if n_groups < 1:
            return Plan(None, (), 0.0, "few_groups")
        allowance = self.allowance()
        if self.fraction is None:
            return Plan(whole, tuple(range(n_groups)), 1.0, "unbounded")
        if allowance is None or self.costs.forward is None or (heldout and self.costs.generate is None):
            return Plan(whole, tuple(range(n_groups)), 1.0, "first")
        shape = self._shape(n_groups, rows_per_group, tokens_per_row, allowance, heldout)
        if shape is not None:
            return Plan(shape, self.choose(n_groups, shape.groups), 1.0, "fits")
        # whole, on a share of the pairs: two-sided (as budget=None measures it) where the generation
        # can take extra completions
        share = Shape(n_groups, heldout if heldout >= MIN_PER_GROUP else 0)
        cost = self.cost(share, rows_per_group, tokens_per_row)
        covered = max(0.0, min(1.0, allowance / cost)) if cost > 0 else 1.0
        floor = tap_floor(share.per_group)
        p, reason = (covered, "share") if covered >= floor else (floor, "floor")
        if not self.take(p):
            return Plan(None, (), p, "skipped")
        return Plan(share, tuple(range(n_groups)), p, reason)

    def take(self, p: float) -> bool:
        """Whether the next pair of a share is measured, with probability ``p``: systematic sampling
        with a random start (the running sum crosses an integer). Reads no sampled value."""
        if self._credit is None:
            self._credit = self._rng.random()
        before = self._credit
        self._credit += p
        return math.floor(self._credit) > math.floor(before)

    def _shape(self, n_groups: int, rows_per_group: float, tokens_per_row: float, allowance: float,
               heldout: int) -> Shape | None:
        def fits(s: Shape) -> bool:
            return self.cost(s, rows_per_group, tokens_per_row) <= allowance

        least = min(MIN_GROUPS, n_groups)
        if heldout >= MIN_PER_GROUP:
            # budget=None's completions per group, on as many groups as fit (issue 62: not more
            # groups at 2 + 2, which a sharpened policy's estimates fail on), and never a subset of
            # fewer than MIN_SUBSET_GROUPS: else whole pairs on a share of the steps (``plan``)
            least = min(MIN_SUBSET_GROUPS, n_groups)
            m = next((g for g in range(n_groups, least - 1, -1) if fits(Shape(g, heldout))), None)
            return Shape(m, heldout) if m is not None else None
        m = next((g for g in range(n_groups, least - 1, -1) if fits(Shape(g, 0))), None)
        return Shape(m, 0) if m is not None else None

    def choose(self, n_groups: int, m: int) -> tuple[int, ...]:
        """``m`` of ``n_groups`` group indices, uniformly at random (sorted); all where m >= n."""
        if m >= n_groups:
            return tuple(range(n_groups))
        return tuple(sorted(self._rng.sample(range(n_groups), m)))
