r"""Sequential watch: which behaviours moved from which step, judged at every step with a
false-alarm rate held over the run.

A finding checked at every step (the tap, while training; ``reward-lens check`` on every prefix
of a record) looks at the data many times. A per-look test at 5 % raises a false alarm on most
long runs, and its first crossing is not where the change began. This module is the one
sequential rule the book-grounded findings share, built from the books' per-update statistics
and updated at the cost of one step's rollouts.

**Per step**, from that step's rollouts alone, with prompt groups as the independent units (as the
effect and cause books count them): every feature's level (the mean of its group means), the
reward's level, their between-group sums of squares, and the selection differential
``s_t = Cov_t(z, A)`` within groups with its standard error (``cause.selection_differentials``:
the cause book's own per-step numbers). Nothing else is kept: the watch never re-reads a step.

**Levels: a self-starting CUSUM per series** (Page 1954, "Continuous inspection schemes",
Biometrika 41; Hawkins 1987, "Self-starting CUSUM charts for location and scale", The
Statistician 36). Each series keeps a *reference*: the precision-weighted mean of its level over
every step so far, and the pooled between-group variance. A new step's level is read against the
steps before it as a recursive residual (Brown, Durbin & Evans 1975), standardised by the
variance of the difference, ``sigma^2 (1/G_t + 1/G_ref)``, and turned into a normal score through
Student's t on the pooled degrees of freedom (Hawkins's normal scores). Under no change these
scores are independent standard normals whatever the reference's own noise (a first step that
happens to be easy drags nothing), which is why every step joins the reference: freezing it once
a change is suspected makes later scores share its error, and measured on runs with no change it
raised the false alarms twentyfold. Two one-sided sums run on the scores,

    C+_t = max(0, C+_{t-1} + u_t - k),    C-_t = max(0, C-_{t-1} - u_t - k),

and a series *has moved* up (down) while C+ (C-) is at least ``h``. ``k`` = ``K`` = 1 (Page's
optimum for a shift of 2 standard errors per step); ``h`` is each finding's parameter. The
**onset** is the first step of the stretch over which the sum has stayed above zero up to now (the
CUSUM's change-point estimate), not the step at which it crossed ``h``; a movement is described
against the reference and spread of the step before its stretch began, and the level it reached
(the mean of its last ``RECENT`` steps). A movement that comes back lets the sum fall by at least
``k`` per step until the finding clears.

False alarms: for independent standard-normal scores, the probability that one one-sided sum
crosses ``h`` within N steps follows from the Markov chain of Brook & Evans (1972, Biometrika 59):
``false_alarm_probability`` computes it (``h`` = 5, ``k`` = 1: 0.025 % in 30 steps, 0.09 % in 100,
per series and direction). The scores are only approximately normal when a step has a handful of
prompt groups (prompt difficulty is not Gaussian): tools/labelled_runs.py --rates measures the rate
on simulated runs with no change, and its benchmark on healthy runs; docs/findings.md quotes both.

**Selection: summed over the steps so far.** ``S = sum_t s_t`` with ``SE = sqrt(sum_t se_t^2)`` (the
cause book's run-level differential on the steps so far); a feature is *selected* in the direction
of ``S`` when ``|S| >= z_sel SE``. The differential is the *total* selection (direct, or through a
behaviour it correlates with; Price's equation moves a feature mean along it to first order), so a
feature that moves against it moves against what the reward selects, whichever way the reward
reached it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special

# Page's reference value, in standard errors of one step's level: optimal for a shift of 2 SE per
# step (k = delta / 2); shifts of 2 SE and more are what a collapsing or hacked run shows within a
# few steps on 8 prompt groups per step (tools/labelled_runs.py).
K = 1.0
# The level a movement has reached: the mean over the stretch's last RECENT steps.
RECENT = 3
# A normal score is clipped here: a step whose level is more than 8 SE from the reference adds 8 to
# the sum (no single step should carry a finding on its own beyond what 8 SE says).
U_MAX = 8.0


@dataclass(frozen=True)
class WatchBasis:
    """What the watch needs of a feature basis: names in order, units, kinds, declared targets."""

    names: tuple[str, ...]
    units: Mapping[str, str] = field(default_factory=dict)
    kinds: Mapping[str, str] = field(default_factory=dict)
    targets: Mapping[str, str] = field(default_factory=dict)  # name -> "higher" | "lower"

    @classmethod
    def of(cls, basis) -> WatchBasis:
        """From a ``FeatureBasis`` or a report's ``BasisOut``."""
        if hasattr(basis, "describe"):
            rows = basis.describe()
        else:
            rows = [f.model_dump() for f in basis.features]
        return cls(tuple(r["name"] for r in rows), {r["name"]: r["unit"] for r in rows},
                   {r["name"]: r["kind"] for r in rows},
                   {r["name"]: r["target"] for r in rows if r.get("target")})


@dataclass(frozen=True)
class StepStats:
    """One step's summary, from its rollouts alone (prompt groups as units). Series are the
    features in basis order, then the reward; a series not observed at the step is NaN."""

    step: int
    level: np.ndarray  # (m,) mean of the group means
    groups: int  # prompt groups G
    ss_between: np.ndarray  # (m,) sum over groups of (group mean - level)^2
    n: int  # rollouts
    ss_rows: np.ndarray  # (m,) sum over rollouts of (value - the step's rollout mean)^2
    selection: np.ndarray | None  # (k,) s_t = Cov_t(z, A) within groups; None without advantages
    selection_se: np.ndarray | None  # (k,)


# The fewest prompt groups a step is read from: its level is the mean of the group means and its
# spread is read between them (the sequential findings' specs state it as ``min_groups``).
MIN_GROUPS = 2


def step_stats(sample) -> StepStats | None:
    """``StepStats`` of one ``StepSample`` (features, rewards, advantages, groups); None for a
    step without prompt groups (the units) or with fewer than two of them."""
    block = step_block([sample])
    return block.row(0) if len(block.steps) else None


@dataclass(frozen=True)
class StepBlock:
    """``StepStats`` of many steps as arrays, row i for the i-th step read (steps in the order
    given): what ``RunWatch.observe_block`` takes at once. ``has_selection`` marks the steps with
    advantages (the others' selection rows are NaN)."""

    steps: np.ndarray  # (S,) int
    level: np.ndarray  # (S, m)
    groups: np.ndarray  # (S,) int
    ss_between: np.ndarray  # (S, m)
    n: np.ndarray  # (S,) int
    ss_rows: np.ndarray  # (S, m)
    selection: np.ndarray  # (S, k)
    selection_se: np.ndarray  # (S, k)
    has_selection: np.ndarray  # (S,) bool

    def row(self, i: int) -> StepStats:
        sel = self.has_selection[i]
        return StepStats(int(self.steps[i]), self.level[i], int(self.groups[i]), self.ss_between[i], int(self.n[i]),
                         self.ss_rows[i], self.selection[i] if sel else None, self.selection_se[i] if sel else None)


# Steps of one layout summed at a time: a block's temporaries (steps x n x series floats, 5 MB at
# 64 rollouts x 10 series) stay small, where a whole run's would add hundreds of MB to the peak.
STEP_BLOCK = 1024


def step_block(samples: Sequence) -> StepBlock:
    """``step_stats`` of every sample that has at least ``MIN_GROUPS`` prompt groups. Steps that
    share a layout (n rollouts in G consecutive groups of n / G, TRL's) are summed as one
    (steps, G, n / G, m) array, without Python per step; any other step on its own."""
    from reward_lens.measure.cause import step_selection
    from reward_lens.measure.ledger.price import blocks, sample_codes

    ok, codes_of = [], []
    for s in samples:
        if s.groups is None or s.n == 0:
            continue
        codes, g = sample_codes(s)
        if g >= MIN_GROUPS:
            ok.append(s)
            codes_of.append((codes, g))
    k = samples[0].z.shape[1] if samples else 0
    m = k + 1
    size = len(ok)
    level, ss_between, ss_rows = (np.empty((size, m)) for _ in range(3))
    gs = np.fromiter((g for _, g in codes_of), np.int64, size)
    ns = np.fromiter((s.n for s in ok), np.int64, size)
    layouts: dict[tuple[int, int], list[int]] = {}
    equal = _in_blocks(ok, gs, ns)
    for i, ((codes, g), on) in enumerate(zip(codes_of, equal.tolist() if equal is not None else [None] * size)):
        if on is None:
            on = bool(blocks(codes, g))
        layouts.setdefault((int(ns[i]), g) if on else (-1 - i, g), []).append(i)
    chunks = [((n, g), rows[lo:lo + STEP_BLOCK]) for (n, g), rows in layouts.items()
              for lo in range(0, len(rows), STEP_BLOCK)]
    for (n, g), rows in chunks:
        if n < 0:  # groups not in equal consecutive blocks: this step alone
            codes = codes_of[rows[0]][0]
            x = _series(ok[rows[0]])[None]
            size_g = np.bincount(codes, minlength=g).astype(float)
            gm = np.stack([np.bincount(codes, weights=x[0, :, j], minlength=g) for j in range(m)], 1)[None] / size_g[:, None]
        else:
            chunk = [ok[i] for i in rows]
            x = _stacked_series(chunk, n)  # (S', n, m)
            if x is None:
                x = np.stack([_series(s) for s in chunk])
            gm = x.reshape(len(rows), g, n // g, m).sum(axis=2) / float(n // g)  # each group's sums in row order
        # the reductions over one axis of a stack give each step the numbers it gets alone
        lv = gm.mean(axis=1)
        level[rows] = lv
        ss_between[rows] = ((gm - lv[:, None, :]) ** 2).sum(axis=1)
        ss_rows[rows] = ((x - x.mean(axis=1)[:, None, :]) ** 2).sum(axis=1)
    has_sel = _finite_advantages(ok, ns)
    sel = np.full((size, k), np.nan)
    se = np.full((size, k), np.nan)
    if has_sel.any():  # the cause book's per-step differentials (worked out once per read, memoised)
        every = [s for s in samples if s.advantages is not None and s.groups is not None]
        sel[has_sel], se[has_sel] = step_selection(every, [s for s, h in zip(ok, has_sel.tolist()) if h])
    steps = np.fromiter((int(s.step) for s in ok), np.int64, size)
    return StepBlock(steps, level, gs, ss_between, ns, ss_rows, sel, se, has_sel)


def _in_blocks(samples: Sequence, gs: np.ndarray, ns: np.ndarray) -> np.ndarray | None:
    """``blocks(codes, g)`` of each sample (its g groups of n / g rows, one after another), for
    samples whose group codes lie one after another in one read (coded there: ``n_groups`` set),
    in one pass over the column: each row's code against (row - first row) // (n / g). None for
    any other samples."""
    from reward_lens.measure.ledger.price import stack_range, stacked

    if not len(samples) or any(s.n_groups is None for s in samples) or stack_range(samples, "groups") is None:
        return None
    codes = np.asarray(stacked(samples, "groups"))
    if len(codes) != int(ns.sum()) or not (ns > 0).all():
        return None
    m = np.where(gs > 0, ns // np.maximum(gs, 1), 0)
    starts = np.r_[0, np.cumsum(ns)[:-1]]
    row_m = np.repeat(np.maximum(m, 1), ns)
    want = (np.arange(len(codes)) - np.repeat(starts, ns)) // row_m
    return (m > 0) & (m * gs == ns) & np.logical_and.reduceat(codes == want, starts)


def _stacked_series(chunk: Sequence, n: int) -> np.ndarray | None:
    """``np.stack([_series(s) for s in chunk])`` for samples of n rows each that lie one after
    another in one read (``stack_range``): their features and rewards taken as they lie there and
    joined in one pass, the same array; None for any other samples."""
    from reward_lens.measure.ledger.price import stack_range, stacked

    if stack_range(chunk, "z") is None:
        return None
    z = np.asarray(stacked(chunk, "z"), dtype=float)
    if all(s.rewards is None for s in chunk):
        r = np.full(len(z), np.nan)
    elif stack_range(chunk, "rewards") is not None:
        r = np.asarray(stacked(chunk, "rewards"), dtype=float)
    else:
        return None
    if len(z) != len(chunk) * n or len(r) != len(z):
        return None
    return np.concatenate([z.reshape(len(chunk), n, -1), r.reshape(len(chunk), n, 1)], axis=2)


def _finite_advantages(samples: Sequence, ns: np.ndarray) -> np.ndarray:
    """Whether each sample (of ``ns`` rows, each at least one) has advantages, every one finite:
    for samples that lie one after another in one read, one pass over the column."""
    from reward_lens.measure.ledger.price import stack_range, stacked

    if len(samples) and stack_range(samples, "advantages") is not None:
        a = np.asarray(stacked(samples, "advantages"), dtype=float)
        if len(a) == int(ns.sum()) and (ns > 0).all():
            return np.logical_and.reduceat(np.isfinite(a), np.r_[0, np.cumsum(ns)[:-1]])
    return np.array([s.advantages is not None and bool(np.isfinite(np.asarray(s.advantages, dtype=float)).all())
                     for s in samples], dtype=bool)


def _series(sample) -> np.ndarray:
    """A step's rows of every series: its features, then its reward (NaN without rewards)."""
    z = np.asarray(sample.z, dtype=float)
    r = np.asarray(sample.rewards, dtype=float) if sample.rewards is not None else np.full(sample.n, np.nan)
    return np.column_stack([z, r])


def final_stretch(steps, holds) -> tuple[bool, int | None]:
    """Whether the condition holds at the last step, and the first step of the stretch of
    consecutive holding steps that ends there (the onset). The findings' and the logged
    mismatch's one reading of "from which step"."""
    if not len(holds) or not holds[-1]:
        return False, None
    i = len(holds) - 1
    while i > 0 and holds[i - 1]:
        i -= 1
    return True, int(steps[i])


def normal_score(w: float, df: float) -> float:
    """Student's t on ``df`` degrees of freedom mapped to the standard normal with the same
    tail probability (Hawkins's normal scores), clipped at ``U_MAX``."""
    return float(normal_scores(np.array([w], dtype=float), np.array([df], dtype=float))[0])


def normal_scores(w: np.ndarray, df: np.ndarray) -> np.ndarray:
    """``normal_score`` of arrays (elementwise, the same ufuncs and so the same numbers)."""
    w, df = np.asarray(w, dtype=float), np.asarray(df, dtype=float)
    finite = np.isfinite(w)
    aw = np.where(finite, -np.abs(w), 0.0)
    with np.errstate(invalid="ignore"):
        tail = np.where(df > 0, special.stdtr(np.where(df > 0, df, 1.0), aw), special.ndtr(aw))
        u = np.where(tail > 0, -special.ndtri(np.where(tail > 0, tail, 0.5)), U_MAX)  # a tail beyond float64: past the clip
    u = np.minimum(U_MAX, np.copysign(np.abs(u), w))
    u = np.maximum(-U_MAX, u)
    # not finite: +-inf is past the clip, NaN scores nothing
    return np.where(finite, u, np.where(np.isnan(w), 0.0, np.copysign(U_MAX, w)))


@dataclass
class OneSided:
    """One direction's CUSUM over a series' normal scores, and the stretch over which it has been
    above zero: where it began, the level before it (the reference and the behaviour's spread at
    that step), and the level over its last ``RECENT`` steps."""

    direction: int  # +1: watches for a rise; -1: for a fall
    c: float = 0.0  # the sum
    since: int | None = None  # first step of the stretch with c > 0
    reference: float | None = None  # the series' reference when the stretch began
    spread: float | None = None  # the behaviour's within-step SD over rollouts then
    recent: list = field(default_factory=list)  # (G_t, level_t) of the stretch's last RECENT steps
    last_active: int | None = None  # the last step at which the sum was above zero

    def quiet_since(self, step: int) -> bool:
        """The sum has been zero at every step from ``step`` on: no sign of a movement this way."""
        return self.last_active is None or self.last_active < step

    @property
    def level(self) -> float | None:
        """The level over the last ``RECENT`` steps of the stretch (fewer if it is shorter)."""
        n = sum(g for g, _ in self.recent)
        return sum(g * x for g, x in self.recent) / n if n else None

    def add(self, step: int, u: float, groups: int, level: float, reference: float, spread: float | None) -> None:
        c = max(0.0, self.c + self.direction * u - K)
        if c <= 0:
            self.since, self.reference, self.spread, self.recent = None, None, None, []
        else:
            if self.c <= 0:  # a stretch begins: keep the level from before it
                self.since, self.reference, self.spread, self.recent = step, reference, spread, []
            self.recent = [*self.recent, (groups, level)][-RECENT:]
            self.last_active = step
        self.c = c

    def add_many(self, steps: np.ndarray, u: np.ndarray, groups: np.ndarray, level: np.ndarray,
                 reference: np.ndarray, spread: np.ndarray) -> None:
        """``add`` of every step in order (arrays; ``spread`` NaN where there was none): the sum's
        recursion step by step in floats, the stretch's bookkeeping from where it ends."""
        c0 = c = self.c
        sums = []
        keep = sums.append
        for du in (self.direction * u).tolist():
            # ``add``'s max(0.0, c + du - K), the same sum in the same order and the same pick
            # (NaN and -0.0 give 0.0 as max does), without a call per step (20 series x 10,000
            # steps: a third of the time)
            c = c + du - K
            if not c > 0.0:
                c = 0.0
            keep(c)
        sums = np.array(sums)
        positive = sums > 0
        self.c = c
        if positive.any():
            self.last_active = int(steps[np.flatnonzero(positive)[-1]])
        if not c > 0:
            self.since, self.reference, self.spread, self.recent = None, None, None, []
            return
        zeros = np.flatnonzero(~positive)
        start = int(zeros[-1]) + 1 if len(zeros) else 0  # the stretch's first step among these
        if start > 0 or c0 <= 0:  # a stretch began among these steps: the level from before it
            sp = float(spread[start])
            self.since, self.reference = int(steps[start]), float(reference[start])
            self.spread, self.recent = (sp if sp == sp else None), []
        tail = range(max(start, len(sums) - RECENT), len(sums))
        self.recent = [*self.recent, *((int(groups[i]), float(level[i])) for i in tail)][-RECENT:]


@dataclass
class SeriesWatch:
    """A series (a feature's level, or the reward's): its reference (every step so far, the
    self-starting chart's running mean and pooled variance) and one CUSUM per direction."""

    ref_sum: float = 0.0  # sum of G_t * level_t over the steps so far
    ref_n: float = 0.0  # sum of G_t
    ss: float = 0.0  # pooled between-group sum of squares
    df: float = 0.0  # its degrees of freedom, sum of (G_t - 1)
    rows_ss: float = 0.0  # within-step sum of squares over rollouts (the behaviour's own spread)
    rows_df: float = 0.0
    up_side: OneSided = field(default_factory=lambda: OneSided(1))
    down_side: OneSided = field(default_factory=lambda: OneSided(-1))
    last_score: float | None = None
    steps: int = 0  # steps observed

    @property
    def reference(self) -> float | None:
        return self.ref_sum / self.ref_n if self.ref_n > 0 else None

    @property
    def spread(self) -> float | None:
        """The behaviour's within-step standard deviation over rollouts, pooled, or None."""
        return math.sqrt(self.rows_ss / self.rows_df) if self.rows_df > 0 else None

    def side(self, direction: int) -> OneSided:
        return self.up_side if direction > 0 else self.down_side

    @property
    def up(self) -> float:
        return self.up_side.c

    @property
    def down(self) -> float:
        return self.down_side.c

    def cusum(self, direction: int) -> float:
        return self.side(direction).c

    def since(self, direction: int) -> int | None:
        return self.side(direction).since

    def observe(self, step: int, level: float, groups: int, ss_between: float, n: int, ss_rows: float) -> None:
        if not math.isfinite(level):
            return
        self.steps += 1
        if self.ref_n > 0:
            df = self.df + groups - 1
            var = (self.ss + ss_between) / df if df > 0 else 0.0
            u = 0.0
            if var > 0:
                w = (level - self.reference) / math.sqrt(var * (1.0 / groups + 1.0 / self.ref_n))
                u = normal_score(w, df)
            self.last_score = u
            ref, spread = self.reference, self.spread
            self.up_side.add(step, u, groups, level, ref, spread)
            self.down_side.add(step, u, groups, level, ref, spread)
        self.ref_sum += groups * level  # every step joins the reference: the recursive residuals stay independent
        self.ref_n += groups
        self.ss += ss_between
        self.df += groups - 1
        self.rows_ss += ss_rows
        self.rows_df += n - 1

    def observe_many(self, steps: np.ndarray, level: np.ndarray, groups: np.ndarray, ss_between: np.ndarray,
                     n: np.ndarray, ss_rows: np.ndarray) -> None:
        """``observe`` of every step in order (arrays over steps), leaving the state that many
        calls leave: the reference's running sums as cumulative sums (the same additions in the
        same order), the scores in one vectorised pass, only the CUSUM's recursion step by step."""
        ok = np.isfinite(level)
        if not ok.all():
            steps, level, groups, ss_between, n, ss_rows = (x[ok] for x in (steps, level, groups, ss_between, n,
                                                                          ss_rows))
        if not len(level):
            return
        g = groups.astype(float)
        # the running sums after each step (cumsum adds in order, as the calls do), and before it
        ref_sum = np.cumsum(np.r_[self.ref_sum, g * level])
        ref_n = np.cumsum(np.r_[self.ref_n, g])
        ss = np.cumsum(np.r_[self.ss, ss_between])
        df = np.cumsum(np.r_[self.df, g - 1.0])  # integers in float64: exact whichever the order
        rows_ss = np.cumsum(np.r_[self.rows_ss, ss_rows])
        rows_df = np.cumsum(np.r_[self.rows_df, n.astype(float) - 1.0])
        scored = ref_n[:-1] > 0  # a step with a reference before it
        with np.errstate(divide="ignore", invalid="ignore"):
            var = np.where(df[1:] > 0, ss[1:] / df[1:], 0.0)
            reference = ref_sum[:-1] / ref_n[:-1]
            w = (level - reference) / np.sqrt(var * (1.0 / g + 1.0 / ref_n[:-1]))
            spread = np.sqrt(rows_ss[:-1] / rows_df[:-1])
        u = np.where(var > 0, normal_scores(np.where(var > 0, w, 0.0), df[1:]), 0.0)
        has_spread = rows_df[:-1] > 0
        idx = np.flatnonzero(scored)
        if len(idx):
            self.last_score = float(u[idx[-1]])
            for side in (self.up_side, self.down_side):
                side.add_many(steps[idx], u[idx], groups[idx], level[idx], reference[idx],
                              np.where(has_spread[idx], spread[idx], np.nan))
        self.steps += len(level)
        self.ref_sum, self.ref_n, self.ss, self.df = float(ref_sum[-1]), float(ref_n[-1]), float(ss[-1]), float(df[-1])
        self.rows_ss, self.rows_df = float(rows_ss[-1]), float(rows_df[-1])


@dataclass
class RunWatch:
    """Every series of a run, and the selection summed over the steps so far. ``observe`` takes
    one step's ``StepStats`` (steps in order; a step seen again is ignored)."""

    basis: WatchBasis
    series: dict[str, SeriesWatch] = field(default_factory=dict)
    selection: np.ndarray | None = None  # (k,) sum of s_t
    selection_var: np.ndarray | None = None  # (k,) sum of se_t^2
    last_step: int | None = None
    steps: int = 0

    REWARD = "reward"  # the reward's series (a feature of this name would shadow it: see key())

    def __post_init__(self):
        for name in (*self.basis.names, self._reward_key()):
            self.series.setdefault(name, SeriesWatch())

    def _reward_key(self) -> str:
        return self.REWARD if self.REWARD not in self.basis.names else "\0reward"

    @property
    def reward(self) -> SeriesWatch:
        return self.series[self._reward_key()]

    def observe(self, st: StepStats) -> None:
        if self.last_step is not None and st.step <= self.last_step:
            return
        self.last_step = st.step
        self.steps += 1
        keys = (*self.basis.names, self._reward_key())
        for j, name in enumerate(keys):
            self.series[name].observe(st.step, float(st.level[j]), st.groups, float(st.ss_between[j]), st.n,
                                      float(st.ss_rows[j]))
        if st.selection is not None:
            se2 = np.where(np.isfinite(st.selection_se), st.selection_se ** 2, 0.0)
            sel = np.where(np.isfinite(st.selection), st.selection, 0.0)
            self.selection = sel if self.selection is None else self.selection + sel
            self.selection_var = se2 if self.selection_var is None else self.selection_var + se2

    def observe_block(self, block: StepBlock) -> None:
        """``observe`` of every row of ``block`` in order, leaving the same state (a test checks it
        number for number against the calls): what ``reward-lens check`` does with a whole run."""
        steps = block.steps
        if not len(steps):
            return
        # the steps ``observe`` would take: each later than every step before it
        prior = np.maximum.accumulate(np.r_[self.last_step if self.last_step is not None else np.iinfo(np.int64).min,
                                            steps[:-1]])
        take = steps > prior
        if not take.all():
            block = StepBlock(**{f.name: getattr(block, f.name)[take] for f in dataclasses.fields(block)})
            steps = block.steps
            if not len(steps):
                return
        self.last_step = int(steps[-1])
        self.steps += len(steps)
        keys = (*self.basis.names, self._reward_key())
        for j, name in enumerate(keys):
            self.series[name].observe_many(steps, block.level[:, j], block.groups, block.ss_between[:, j], block.n,
                                           block.ss_rows[:, j])
        if block.has_selection.any():
            sel = block.selection[block.has_selection]
            se = block.selection_se[block.has_selection]
            se2 = np.where(np.isfinite(se), se ** 2, 0.0)
            sel = np.where(np.isfinite(sel), sel, 0.0)
            if self.selection is not None:  # the running sums carry on from them, in the same order
                sel, se2 = np.vstack([self.selection, sel]), np.vstack([self.selection_var, se2])
            self.selection = np.cumsum(sel, axis=0)[-1]
            self.selection_var = np.cumsum(se2, axis=0)[-1]

    def selected(self, name: str, z_sel: float) -> tuple[int, float | None]:
        """The direction in which the reward selects ``name`` (+1, -1; 0 when the summed
        differential is not ``z_sel`` SE from zero) and its z."""
        if self.selection is None:
            return 0, None
        j = self.basis.names.index(name)
        v = self.selection_var[j]
        if not v > 0:
            return 0, None
        z = float(self.selection[j] / math.sqrt(v))
        return (1 if z > 0 else -1) if abs(z) >= z_sel else 0, z

    def moved(self, name: str, h: float) -> int:
        """+1 or -1 while the series has moved up or down (its CUSUM at ``h`` or above), else 0
        (both at once cannot hold: a score feeds one sum and drains the other)."""
        s = self.series[name]
        if s.up >= h:
            return 1
        if s.down >= h:
            return -1
        return 0


def watch_samples(samples: Sequence, basis: WatchBasis) -> RunWatch:
    """A ``RunWatch`` fed every step of ``samples`` in order (what ``reward-lens check`` reads)."""
    w = RunWatch(basis)
    w.observe_block(step_block(sorted(samples, key=lambda x: x.step)))
    return w


def false_alarm_probability(h: float, steps: int, k: float = K, shift: float = 0.0, cells: int = 400) -> float:
    """P(a one-sided CUSUM of independent N(shift, 1) scores reaches ``h`` within ``steps``
    steps), by the Markov chain of Brook & Evans (1972) on ``cells`` states of [0, h). With
    ``shift`` = 0: the false-alarm probability; with a shift: the probability of detecting it."""
    w = h / cells
    edges = np.arange(cells + 1) * w
    mids = edges[:-1] + w / 2
    cdf = special.ndtr(edges[None, :] - mids[:, None] + k - shift)
    p = np.diff(cdf, axis=1)
    p[:, 0] += special.ndtr(-mids + k - shift)
    alive = np.diff(special.ndtr(edges + k - shift))
    alive[0] += special.ndtr(k - shift)
    for _ in range(steps - 1):
        alive = alive @ p
    return float(1.0 - alive.sum())
