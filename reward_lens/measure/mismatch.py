"""The engine-trainer mismatch: KL(pi_sampler || pi_t) along the rollouts the sampler drew, per step.

Where an inference engine (vLLM, SGLang, a stand-in) samples the rollouts and hands over its own
log-probabilities of them (the record's ``logp_sampler``, summed over each completion), the gap
g_i = log pi_sampler(y_i) - log pi_t(y_i) (``logp_sampler - logp_pre``) along the sampler's own
samples has expectation KL(pi_sampler || pi_t) summed over the sequence (the k1 estimator,
unbiased because the rollouts are the sampler's draws). Per step:

* per sequence (nats/seq): the mean over prompt groups of each group's mean gap, with its SE given
  the step's prompts (``group_kl``: the stratified SE, each group's completions its own sample);
* per token (nats/token, the token-weighted mean ``fields.yaml`` gives that unit): sum g / sum
  tokens, a ratio of totals, its SE by linearisation within the groups the same way (the delta
  method for a ratio estimator, Cochran 1977 ch. 6);
* its tail: the largest per-sequence |g| and the share of sequences whose probability ratio
  pi_sampler / pi_t is beyond ``TAIL_RATIO`` either way;
* its size against the update: per sequence over D_t = KL(pi_{t+1} || pi_t) (``kl_to_previous``,
  nats/seq), the divergence the step spent. A mismatch comparable to D_t means the gradient was
  taken on another policy's samples by as much as the update moved the policy.

Why k1 along the rollouts and not the full-vocabulary token KL: the engine hands over the
log-probability of the sampled token only, never its distribution, so the sampled-token gap is
all a record has. It is unbiased; its noise is what the SE states. Why not TRL's
``sampling/sampling_logp_difference/mean`` or veRL's ``rollout_corr/k3_kl``: the first is a mean
|gap| per token (not a KL: it is positive with no mismatch at all where the engine's numbers are
noisy, and its scale depends on the length), the second an estimate of the same KL per token
with another estimator's bias and variance; where only they are logged, the finding reads them
labelled as what they are (``engine_mismatch``'s sources), never as this series.

One computation, read by both: the paired ledger's premise check (``PREMISE_FAILED
sampler_mismatch``, a step pair whose sampler departs from pi_{t+1} by more than
``SAMPLER_KL_MAX_SHARE`` of D_t) calls ``group_kl`` on its rows, so its number for the pair
(t-1, t) is this series' per-sequence value at step t wherever the ledger kept every rollout, and
its SE is moderated across the run's pairs by the series' own ``moderated_kl_se``.

Why given the prompts (stop 67; before it the SE was the spread of the group means across
prompts, on G - 1 degrees of freedom). The finding asks whether the engine departed from the
policy on the prompts this update trained on, by a share of the D_t it spent on them, and D_t's
SE is given the prompts too. Across prompts the SE also held how much the engine's departure
differs from prompt to prompt, which is not noise about that number: on the benchmark's stale
engine (``tools/mismatch_runs.py``, seeds 21-23) that spread was about three times the
within-group one (group means from 0.8 to 110 D_t at one step), so no step's score could pass
about 1 / (its relative SE) however far past D_t the mismatch was, and `check` said critical on 1
of the 5 runs whose mismatch reached D_t. Given the prompts the same steps resolve it at once.

The series' SE, moderated across neighbouring steps (``series_se``; the one SE the finding, its
evidence and the paired ledger's refusal read). A step's own SE (``StepMismatch.kl_seq_se``) has
the fault D_t's had (``ledger.moderated``'s docstring): where
the per-sequence gap is nearly constant with a rare tail, the sample's spread is small exactly on
the draws that missed the tail, which sit off the truth. The tail's shape is the engine's (its
precision, its top-p, its lag), which moves little from one step to the next; whether a step's
sample caught it is chance. So, as D_t's, each step's relative variance per rollout,
u_s = N_s (SE_s / kl_s)^2, is pooled with its neighbours' by ``ledger.moderated.pooled_variances``
(the one pooling D_t's and eta's SEs use, with their window of 3 measured steps either side and own
weight 1/2): SE_t = kl_t sqrt(v_t / N_t), on the Welch-Satterthwaite degrees of freedom it returns
(a step's own: its SE's). Only steps whose mismatch is resolved take part: those whose own 95 %
interval lies above 0 (kl_s > t_{.975} SE_s). A step not resolved keeps its own SE and lends
nothing.

Why relative, and why only where resolved. The spread of a k1 estimate grows with the mismatch:
on the benchmark's stale engine the estimate fell from 22 to 4 nats a sequence within three steps
of its onset while its relative SE stayed between 0.23 and 0.37 (``tools/mismatch_runs.py``, seed
22). Pooled as variance, the later steps borrowed the early steps' variance, several times theirs,
and the finding lost that run (named at the last step with each step's own SE; clear with the
variance pooled: the first version of this moderation, measured and dropped). But a relative
variance is unbounded where the estimate is near 0 -- a matched engine, whose k1 estimate sits at
0, or a bfloat16 engine's 0.0015 nats under a spread of 0.007 -- so those steps cannot lend one. At
the jump a real run shows (the engine departs at an onset step: stale weights, a changed sampling
setting) the matched steps before it are not resolved and lend nothing: the onset step pools only
with the resolved steps after it, and at the live edge, where it is the last, with none -- its own
SE, as without the moderation: the finding is neither delayed nor advanced by the matched steps,
and the onset it names is where the scores say. An engine whose mismatch is resolved at no step
(bfloat16 here) keeps each step's own SE, which covers it (the coverage line below). A matched
step resolved by chance (one in forty) lends a relative variance of at most G / t^2, the widest a
resolved step can have.
tests/unit/test_mismatch.py checks the jump, a mismatch that changes size and a case worked by hand;
tests/unit/test_engine_mismatch.py the rules' false alarms with this SE, at the null's boundary
and across such a jump. The finding reads this SE with its t on the step's own degrees of freedom,
not on the pooled degrees of freedom its interval reads (``findings.engine_mismatch`` says why:
neighbouring steps share their variance, and a CUSUM adds up a stretch whose pooled variance came
out low). A step with no SE of its own (one prompt group of one completion) has none and is no
one's neighbour.

Checked against the truth (tests/unit/test_mismatch.py): a tabular autoregressive policy (next
token from the previous one, per prompt), so KL(pi_sampler || pi_t) is exact by dynamic
programming; sampled by its bfloat16 cast, a temperature of 1.3 and top-p 0.9 the scorer does not
apply, 8 prompt groups x 8 completions redrawn 400 times, the step's own 95 % interval (t on its
own degrees of freedom) covered the exact per-sequence KL of the step's own prompts 95.3 %,
93.5 %, 95.3 % of the time, the per-token one 95.5 %, 93.0 %, 95.8 %, and the series' 95.0 %,
95.8 %, 95.3 %. On the benchmark's own policy and stand-in engine (``tools/mismatch_runs.py
--coverage``: the truth the full-vocabulary token KL along fresh engine samples, 200 fresh steps
of 8 groups x 8; docs/science.md quotes the line) the series' SE covers bfloat16 95.0 %,
temperature 94.0 %, top-p 97.5 %, the step's own beside it 95.5 %, 97.0 %, 74.5 %: on top-p the
per-sequence KL is nearly the same for every completion that runs to the length cap and lower on
the rare early-ending ones, and a step that draws none of those has too small an SE, which its
neighbours' relative variance widens (bench/results/mismatch_coverage.json; the SE across prompts
before stop 67 read 93.5 %, 96.5 %, 97.0 % and own 74 % on top-p against the mean over all
prompts, and a first version pooling the variance itself 94.5 %, 96.0 %, 97.0 %, dropped for the
stale run it lost, above).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from reward_lens.measure.ledger.moderated import pooled_variances
from reward_lens.measure.sequential import final_stretch

# The tail's probability ratio: a sequence the sampler gives more than 3x, or less than a third,
# of the policy's probability. 3.0 is TRL's default `vllm_importance_sampling_clip_max` (TRL 1.16,
# trl/trainer/grpo_config.py line 338: under its default `sequence_mask` mode a sequence whose ratio
# pi_t / pi_sampler exceeds it is masked out of the loss), so the share beyond it is the share of
# the batch that correction would drop or clip.
TAIL_RATIO = 3.0


@dataclass(frozen=True)
class StepMismatch:
    """KL(pi_sampler || pi_t) along step t's rollouts (module docstring)."""

    step: int
    kl_seq: float  # nats/seq: mean over groups of the mean gap log pi_sampler - log pi_t
    kl_seq_se: float  # its own sample's SE given the step's prompts (group_kl); the series' SE is series_se's
    kl_seq_dof: float  # its degrees of freedom
    kl_seq_size: int  # the units its variance is a mean over (GroupKL.size)
    se_within: bool  # True: the SE is from the completions within each group (group_kl)
    kl_token: float | None  # nats/token: sum of gaps / sum of tokens (None without token counts)
    kl_token_se: float | None  # its own sample's SE (linearised within the groups), not moderated:
    # no finding or curve reads it; the finding reads kl_seq on series_se's SE
    max_log_ratio: float  # the largest |gap| of one sequence, nats
    tail_share: float  # share of sequences with |gap| > log TAIL_RATIO
    n: int  # rollouts with both log-probabilities
    groups: int
    d_t: float | None = None  # D_t of the step (kl_to_previous), nats/seq, where recorded
    d_t_se: float | None = None

    @property
    def ratio(self) -> float | None:
        """kl_seq / D_t, where D_t is a positive number."""
        return self.kl_seq / self.d_t if self.d_t is not None and self.d_t > 0 else None

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "tail_ratio": TAIL_RATIO}


class GroupKL(NamedTuple):
    """The per-sequence estimate of one step's rollouts (``group_kl``)."""

    kl: float  # nats/seq: the mean over prompt groups of each group's mean gap
    se: float  # its SE given the step's prompts (NaN where none can be formed)
    dof: float  # the SE's degrees of freedom (NaN with it)
    size: int  # the units the SE's variance is a mean over: rollouts (within) or groups (across)
    within: bool  # True: the SE is from the completions within each group; False: across groups


def group_kl(gap: np.ndarray, codes: np.ndarray, n_groups: int) -> GroupKL | None:
    """The per-sequence estimate: the mean over prompt groups of each group's mean gap, and its SE
    given the step's prompts; None where no gap is finite. Non-finite gaps are left out (a row the
    engine could not score).

    The SE is the stratified one (Cochran 1977, 5.9): the step's prompts are fixed, its
    completions drawn by the engine, so the estimate's variance is the sum over groups of each
    group mean's, sum_g s_g^2 / n_g / G^2, with Welch-Satterthwaite's degrees of freedom over the
    groups (each s_g^2 on n_g - 1). That is the question the finding asks of a step: did the
    engine depart from the policy on the prompts this update trained on, by a share of the D_t it
    spent on them -- and D_t's SE is conditional on the prompts too (``ledger.paired.independent_d_t``,
    a stratified jackknife). The spread of the group means across prompts is not noise about
    that number: a stale engine departs more on the prompts whose policy moved more, and on the
    benchmark's stale runs that spread was three times the within-group one (module docstring).
    Where a group holds fewer than two finite gaps (one completion a prompt, as PPO samples) no
    within-group variance can be formed, and the SE is the spread of the group means across groups
    on G - 1 degrees of freedom: its expectation is the within-group variance plus the prompts'
    spread, so it is the conditional SE's, widened (NaN with one group)."""
    gap = np.asarray(gap, dtype=np.float64)
    codes = np.asarray(codes, dtype=np.int64)
    ok = np.isfinite(gap)
    if not ok.any():
        return None
    g, c = gap[ok], codes[ok]
    count = np.bincount(c, minlength=n_groups)
    present = count > 0
    n = count[present].astype(np.float64)
    all_means = np.bincount(c, weights=g, minlength=n_groups) / np.maximum(count, 1)
    means = all_means[present]
    m = len(means)
    kl = float(means.mean())
    if (n >= 2).all():
        dev = g - all_means[c]
        var_g = np.bincount(c, weights=dev * dev, minlength=n_groups)[present] / (n - 1)  # each group's s_g^2
        w = var_g / n
        total = float(w.sum())
        se = math.sqrt(total) / m
        denom = float((w * w / (n - 1)).sum())
        dof = total * total / denom if denom > 0 else float(n.sum() - m)
        return GroupKL(kl, se, dof, int(n.sum()), True)
    if m > 1:
        return GroupKL(kl, float(means.std(ddof=1) / math.sqrt(m)), float(m - 1), m, False)
    return GroupKL(kl, float("nan"), float("nan"), m, False)


def moderated_kl_se(kl, se, dof, size, within=None) -> tuple[np.ndarray, np.ndarray]:
    """The series' SEs of the per-sequence mismatch and their degrees of freedom, for a run's steps
    in step order: ``kl`` each step's estimate, ``se`` its own SE and ``dof`` its degrees of freedom
    (``group_kl``'s), ``size`` the units its variance is a mean over (``GroupKL.size``: rollouts for
    the within-group SE, groups for the across-group one). A step whose own 95 % interval lies
    above 0 (kl > t_{.975, dof} SE: the mismatch resolved) has its relative variance per unit,
    n_s (SE_s / kl_s)^2, pooled with its resolved neighbours' (``pooled_variances``, on its own
    degrees of freedom): SE_t = kl_t sqrt(v_t / n_t), on the Welch-Satterthwaite degrees of
    freedom. A step not resolved keeps its own SE and degrees of freedom and lends nothing (module
    docstring: why). A step without a finite SE (or under one degree of freedom) has none (NaN out)
    and is no one's neighbour. ``within`` (``GroupKL.within`` per step; None: all of one kind) keeps
    the two kinds of SE apart: a relative variance per rollout within the groups and one per group
    across them (which also holds the prompts' spread) are on two scales, so each is pooled only
    with neighbours of its own kind."""
    from scipy import special

    k, s, f, n = (np.asarray(x, dtype=np.float64) for x in (kl, se, dof, size))
    w = np.ones(k.shape, dtype=bool) if within is None else np.asarray(within, dtype=bool)
    if not (k.shape == s.shape == f.shape == n.shape == w.shape) or k.ndim != 1:
        raise ValueError(f"kl, se, dof, size and within must be 1-d of one length, not {k.shape}, {s.shape}, "
                         f"{f.shape}, {n.shape}, {w.shape}")
    has = np.isfinite(s) & (s >= 0) & np.isfinite(f) & (f >= 1) & (n >= 2) & np.isfinite(k)
    out_se = np.where(has, s, np.nan)
    out_dof = np.where(has, f, np.nan)
    # each step's own t quantile, at once (the live tap re-reads the whole series at every step)
    q = np.where(has, special.stdtrit(np.where(has, f, 1.0), 0.975), np.inf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        u = n * (s / k) ** 2  # beyond the float range it takes no part
    resolved = has & (k > q * s) & np.isfinite(u)
    for kind in (True, False):
        ok = np.flatnonzero(resolved & (w == kind))
        if len(ok):
            var, out_dof[ok] = pooled_variances(u[ok], f[ok])
            out_se[ok] = k[ok] * np.sqrt(var / n[ok])
    return out_se, out_dof


def series_se(series: Mapping[int, StepMismatch]) -> dict[int, tuple[float, float]]:
    """Step -> (SE, degrees of freedom) of ``kl_seq``: the series' SE, ``moderated_kl_se`` over the
    steps of ``series`` in step order (the one SE the finding and its evidence read). It depends on
    which steps the series holds: at a prefix of a run (the live tap's view) the last steps have
    neighbours on one side only."""
    steps = sorted(series)
    se, dof = moderated_kl_se([series[s].kl_seq for s in steps], [series[s].kl_seq_se for s in steps],
                              [series[s].kl_seq_dof for s in steps], [series[s].kl_seq_size for s in steps],
                              [series[s].se_within for s in steps])
    return {s: (a, b) for s, a, b in zip(steps, se.tolist(), dof.tolist())}


def step_mismatch(step: int, gap: np.ndarray, codes: np.ndarray, n_groups: int,
                  tokens: np.ndarray | None = None) -> StepMismatch | None:
    """One step's mismatch from its rollouts' gaps (log pi_sampler - log pi_t, nats/seq), prompt
    group codes 0..n_groups-1 and token counts (None: no per-token value). None where no row has
    both log-probabilities."""
    gap = np.asarray(gap, dtype=np.float64)
    codes = np.asarray(codes, dtype=np.int64)
    seq = group_kl(gap, codes, n_groups)
    if seq is None:
        return None
    ok = np.isfinite(gap)
    g, c = gap[ok], codes[ok]
    kl_tok = kl_tok_se = None
    if tokens is not None:
        tk = np.asarray(tokens, dtype=np.float64)[ok]
        if np.isfinite(tk).all() and tk.sum() > 0:
            a = np.bincount(c, weights=g, minlength=n_groups)
            b = np.bincount(c, weights=tk, minlength=n_groups)
            count = np.bincount(c, minlength=n_groups)
            keep = count > 0
            kl_tok = float(a[keep].sum() / b[keep].sum())
            # the ratio's SE by linearisation (Cochran 1977, 6.3): its residuals e = gap - kl_tok x tokens,
            # given the prompts as the per-sequence SE is (group_kl): sum over groups of n_g s_g^2(e)
            # over the squared token total; across groups where a group has one completion
            e = g - kl_tok * tk
            if seq.within:
                em = np.bincount(c, weights=e, minlength=n_groups) / np.maximum(count, 1)
                ss = np.bincount(c, weights=(e - em[c]) ** 2, minlength=n_groups)[keep]
                n_g = count[keep].astype(np.float64)
                kl_tok_se = float(math.sqrt((n_g * ss / (n_g - 1)).sum()) / b[keep].sum())
            else:
                ag, bg = a[keep], b[keep]
                m = len(ag)
                kl_tok_se = (float(math.sqrt(((ag - kl_tok * bg) ** 2).sum() * m / (m - 1)) / bg.sum())
                             if m > 1 else float("nan"))
    return StepMismatch(step=int(step), kl_seq=seq.kl, kl_seq_se=seq.se, kl_seq_dof=seq.dof, kl_seq_size=seq.size,
                        se_within=seq.within, kl_token=kl_tok, kl_token_se=kl_tok_se,
                        max_log_ratio=float(np.abs(g).max()),
                        tail_share=float((np.abs(g) > math.log(TAIL_RATIO)).mean()),
                        n=int(ok.sum()), groups=int((np.bincount(c, minlength=n_groups) > 0).sum()))


def mismatch_of_table(table) -> list[StepMismatch]:
    """Each step's mismatch from rollouts in the record's schema (a ``pyarrow`` table with
    ``step``, ``group_id``, ``logp_sampler``, ``logp_pre`` and, where present, ``num_tokens``);
    steps without a row holding both log-probabilities are left out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = set(table.column_names)
    if not {"step", "group_id", "logp_sampler", "logp_pre"} <= cols or not table.num_rows:
        return []

    def floats(name: str) -> np.ndarray:
        return pc.fill_null(table.column(name).cast(pa.float64()), float("nan")).to_numpy(zero_copy_only=False)

    steps = table.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
    gap = floats("logp_sampler") - floats("logp_pre")
    tokens = floats("num_tokens") if "num_tokens" in cols else None
    groups = np.asarray(table.column("group_id").cast(pa.string()).to_pylist(), dtype=object)
    out = []
    for s in np.unique(steps):
        at = steps == s
        if not np.isfinite(gap[at]).any():
            continue
        labels, codes = np.unique(groups[at].astype(str), return_inverse=True)
        m = step_mismatch(int(s), gap[at], codes, len(labels), None if tokens is None else tokens[at])
        if m is not None:
            out.append(m)
    return out


def mismatch_series(tables: Iterable, d_t: Mapping[int, float] | None = None,
                    d_t_se: Mapping[int, float] | None = None) -> dict[int, StepMismatch]:
    """The run's mismatch by step, from its rollouts' tables (``Run.iter_rollouts``), each step
    given its D_t where ``d_t`` (``kl_to_previous`` by step) has it."""
    import pyarrow as pa

    parts = [t for t in tables if t.num_rows]
    # a step's rows may span two of the reader's chunks: read as one table
    out = {m.step: m for m in mismatch_of_table(pa.concat_tables(parts))} if parts else {}
    if d_t:
        from dataclasses import replace

        out = {s: replace(m, d_t=d_t.get(s), d_t_se=(d_t_se or {}).get(s)) for s, m in out.items()}
    return dict(sorted(out.items()))


ROLLOUT_COLUMNS = ("group_id", "logp_sampler", "logp_pre", "num_tokens")


def run_mismatch(run) -> dict[int, StepMismatch]:
    """``mismatch_series`` of a record (``open_run``): empty where its rollouts hold no
    ``logp_sampler``."""
    have = set(run.rollout_columns()) if run.n_rollouts else set()
    if not {"group_id", "logp_sampler", "logp_pre"} <= have:
        return {}
    cols = [c for c in ROLLOUT_COLUMNS if c in have]
    return mismatch_series(run.iter_rollouts(cols), run.telemetry_column("kl_to_previous"),
                           run.telemetry_column("kl_to_previous_se"))


# ------------------------------------------------------------------ from a framework's logged metrics
# Where no tap ran, a run has no per-rollout logp_sampler, only the batch summaries its framework
# logged (specs/fields.yaml's sampler_* fields). Each is read as what it is, and turned into an
# estimate of, or a bound on, the same quantity: KL(pi_sampler || pi_t) per token, along the
# engine's own tokens. Write g = log pi_t(token) - log pi_sampler(token) for a token the engine drew.
#
# * ``sampler_kl_token`` (veRL `rollout_corr/k3_kl`, NeMo-RL `gen_kl_error`: k3; OpenRLHF `vllm_kl`:
#   k1) and ``sampler_kl_token_k1`` (veRL `rollout_corr/kl`): estimates of it, read as they are
#   (k3 preferred where both are logged: each term is >= 0, so its batch mean is not a difference
#   of large cancelling terms). No framework logs their SE.
# * ``sampler_logp_diff_mean`` (TRL `sampling/sampling_logp_difference/mean`), m = mean |g|: not a
#   KL, but it brackets one. Above: KL = E[-g] <= E|g| = m. Below: KL >= E[exp(g) - 1 - g] (equal
#   where the engine's support is the policy's; smaller where the engine truncates, as top-p does),
#   and exp(g) - 1 - g >= exp(-|g|) - 1 + |g| =: h(|g|), convex and increasing in |g|, so by
#   Jensen KL >= h(m) = exp(-m) - 1 + m (about m^2 / 2).
# * ``sampler_prob_diff_mean`` (veRL `training/rollout_probs_diff_mean`), q = mean |p_t - p_sampler|
#   of the sampled token: at one position E_sampler|p_s(a) - p_t(a)| <= sum_a |p_s(a) - p_t(a)| =
#   2 TV <= sqrt(2 KL) (Pinsker), and by Jensen over positions KL >= q^2 / 2. No upper bound.
# * ``sampler_token_prob_error`` (NeMo-RL `token_mult_prob_error`), r = mean exp|g|: by Jensen
#   E|g| <= log E exp|g|, so KL <= log r. No lower bound.
#
# Each bound holds for the expectations; the logged numbers are batch means over thousands of
# tokens, read without an SE (none is logged), which is why the rule asks for steps in a row.
# A per-token quantity is never made per-sequence without the length: only where the record holds
# each step's mean completion length in tokens (the rollouts' ``num_tokens``) is it multiplied out
# to compare with D_t (nats/seq), and the multiplication is exact for a token-weighted mean.

LOGGED_FIELDS = ("sampler_kl_token", "sampler_kl_token_estimator", "sampler_kl_token_k1", "sampler_logp_diff_mean",
                 "sampler_prob_diff_mean", "sampler_token_prob_error")


@dataclass(frozen=True)
class LoggedMismatch:
    """KL(pi_sampler || pi_t) per token at one step, from a framework's logged metrics: an estimate
    (``low == high``) or the bounds its metrics give (``high`` None: no upper bound)."""

    step: int
    low: float  # nats/token
    high: float | None  # nats/token
    field: str  # the record field it was read from (the first, where bounds of two are combined)
    logged: float  # that field's value
    estimator: str | None = None  # k1 / k3 where it is an estimate
    tokens: float | None = None  # the step's mean completion length in tokens, where the record has it

    @property
    def estimate(self) -> bool:
        return self.high is not None and self.low == self.high


def _h(m: float) -> float:
    return math.expm1(-m) + m


def logged_step(step: int, values: Mapping[str, object], tokens: float | None = None) -> LoggedMismatch | None:
    """One step's per-token mismatch from the ``LOGGED_FIELDS`` it has (module comment above);
    None where it has none."""
    def num(name: str) -> float | None:
        v = values.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    kl = num("sampler_kl_token")
    if kl is not None:
        est = values.get("sampler_kl_token_estimator")
        return LoggedMismatch(step, kl, kl, "sampler_kl_token", kl, est if isinstance(est, str) else None, tokens)
    k1 = num("sampler_kl_token_k1")
    if k1 is not None:
        return LoggedMismatch(step, k1, k1, "sampler_kl_token_k1", k1, "k1", tokens)
    bounds = []  # (field, value, low, high)
    if (m := num("sampler_logp_diff_mean")) is not None:
        bounds.append(("sampler_logp_diff_mean", m, _h(m), m))
    if (q := num("sampler_prob_diff_mean")) is not None:
        bounds.append(("sampler_prob_diff_mean", q, q * q / 2, None))
    if (r := num("sampler_token_prob_error")) is not None and r >= 1:
        bounds.append(("sampler_token_prob_error", r, 0.0, math.log(r)))
    if not bounds:
        return None
    highs = [b[3] for b in bounds if b[3] is not None]
    return LoggedMismatch(step, max(b[2] for b in bounds), min(highs) if highs else None, bounds[0][0], bounds[0][1],
                          None, tokens)


def logged_series(telemetry: Mapping[str, Mapping[int, object]],
                  tokens: Mapping[int, float] | None = None) -> dict[int, LoggedMismatch]:
    """``logged_step`` at every step of ``telemetry`` ({field: {step: value}}, the record's
    columns) that has one of the ``LOGGED_FIELDS``; ``tokens``: each step's mean completion length."""
    steps = sorted({int(s) for f in LOGGED_FIELDS for s in telemetry.get(f, {})})
    out = {}
    for s in steps:
        m = logged_step(s, {f: telemetry.get(f, {}).get(s) for f in LOGGED_FIELDS}, (tokens or {}).get(s))
        if m is not None:
            out[s] = m
    return out


def run_logged_mismatch(run) -> tuple[dict[int, LoggedMismatch], str | None]:
    """``logged_series`` of a record, and the framework that logged it (the manifest's name);
    each step's mean completion length from the rollouts' ``num_tokens`` where they hold it."""
    telemetry = {f: run.telemetry_column(f) for f in LOGGED_FIELDS}
    if not any(telemetry.values()):
        return {}, None
    total: dict[int, list[float]] = {}  # step -> [tokens, rollouts], over the reader's chunks
    if run.n_rollouts and "num_tokens" in set(run.rollout_columns()):
        import pyarrow as pa
        import pyarrow.compute as pc

        for t in run.iter_rollouts(["num_tokens"]):
            st = t.column("step").to_numpy(zero_copy_only=False)
            nt = pc.fill_null(t.column("num_tokens").cast(pa.float64()), float("nan")).to_numpy(zero_copy_only=False)
            for s in np.unique(st):
                acc = total.setdefault(int(s), [0.0, 0.0])
                acc[0] += float(nt[st == s].sum())  # a missing count makes the step's total NaN: no length
                acc[1] += float((st == s).sum())
    tokens = {s: a / n for s, (a, n) in total.items() if n and math.isfinite(a)}
    return logged_series(telemetry, tokens), run.manifest.framework.name


def logged_source(field: str, framework: str | None) -> dict:
    """Where a logged mismatch came from, for the evidence: the framework's name (its spec's, as
    users know it) and the key it logs ``field`` under (specs/fields.yaml); None where unknown."""
    from reward_lens_spec import load_fields, load_frameworks, load_importers

    fw = (framework or "").replace("-", "_")
    entry = load_fields().fields[field].frameworks.get(fw)
    spec = load_frameworks().get(fw)
    imp = load_importers().importers.get(framework or "")
    name = spec.name if spec is not None else imp.name if imp is not None and imp.name else framework
    return {"framework": name, "key": entry.key if entry is not None else None}


def logged_mismatch(series: Mapping[int, LoggedMismatch], d_t: Mapping[int, float] | None = None, *,
                    share: float, critical: float, warn_token: float, critical_token: float, persist: int,
                    min_steps: int) -> dict:
    """The engine_mismatch rule on a framework's logged metrics (specs/findings/engine_mismatch.yaml,
    its ``logged_`` params; docs/findings.md says where each threshold comes from).

    A step is judged over a line where the lower end of what its metrics say of KL(pi_sampler ||
    pi_t) per token (an estimate is its own lower and upper end) is at or above the line, under it
    where the upper end is below; a step whose bounds straddle the line is not judged. The line is
    ``share`` x D_t (and ``critical`` x D_t for critical), the tap path's own, where the step has D_t
    (``kl_to_previous``, nats/seq) and the record its mean completion length (the per-token value
    times it is nats/seq, exactly, for a token-weighted mean); elsewhere the absolute
    ``warn_token`` (and ``critical_token``) nats per token. It holds where the last ``persist``
    judged steps are over the warn line (the logged numbers carry no SE: a single batch mean over
    the line is not enough), critical where they are over the critical line too; onset: the first
    step of the final stretch over the line. Fewer than ``min_steps`` judged steps: not judged.

    Returns the evidence the finding cites: ``judged``, ``holds``, ``severity`` (warn/critical, where
    it holds), ``onset``, and the numbers."""
    if min_steps < persist:
        raise ValueError(f"specs/findings/engine_mismatch.yaml: logged_min_steps = {min_steps} is under the "
                         f"logged_persist = {persist} steps the rule reads")
    rows = []
    d_t = d_t or {}
    no_length = 0
    for s, m in sorted(series.items()):
        dt = d_t.get(s)
        if dt is not None and dt > 0 and m.tokens is not None and m.tokens > 0:
            lo, hi = m.low * m.tokens, None if m.high is None else m.high * m.tokens
            warn_at, crit_at, basis = share * dt, critical * dt, "d_t"
        else:
            no_length += dt is not None and dt > 0
            lo, hi, warn_at, crit_at, basis = m.low, m.high, warn_token, critical_token, "absolute"
        over, under = lo >= warn_at, hi is not None and hi < warn_at
        if over or under:
            rows.append((s, m, over, lo >= crit_at, basis, dt))
    seen = {"logged": True, "logged_steps": len(series), "steps": len(rows), "warn_token": warn_token,
            "critical_token": critical_token, "share": share, "critical": critical, "persist": persist,
            "min_steps": min_steps, "d_t_no_length": no_length, "n_d_t": sum(r[4] == "d_t" for r in rows)}
    first = next(iter(series.values()), None)
    if first is not None:
        seen.update(field=first.field, estimator=first.estimator)
    if len(rows) < min_steps:
        return {**seen, "judged": False, "holds": False, "too_short": True,
                "straddle": len(series) - len(rows)}
    steps = [r[0] for r in rows]
    last = rows[-1][1]
    peak = max(rows, key=lambda r: r[1].low)
    seen.update(last_step=steps[-1], low=last.low, high=last.high, estimate=last.estimate, field=last.field,
                logged_value=last.logged, estimator=last.estimator, peak_step=peak[0], peak_low=peak[1].low,
                basis=rows[-1][4], d_t=rows[-1][5] if rows[-1][4] == "d_t" else None,
                tokens=last.tokens if rows[-1][4] == "d_t" else None, judged=True)
    warn = [r[2] for r in rows]
    crit = [r[3] for r in rows]
    if not all(warn[-persist:]):
        return {**seen, "holds": False, "onset": None}
    severity = "critical" if all(crit[-persist:]) else "warn"
    out = {**seen, "holds": True, "onset": final_stretch(steps, warn)[1], "severity": severity}
    if severity == "critical":
        out["critical_from"] = final_stretch(steps, crit)[1]
    return out


__all__ = ["GroupKL", "LOGGED_FIELDS", "LoggedMismatch", "TAIL_RATIO", "StepMismatch", "group_kl", "logged_mismatch", "logged_series", "logged_source", "logged_step",
           "mismatch_of_table", "mismatch_series", "moderated_kl_se", "run_logged_mismatch", "run_mismatch", "series_se",
           "step_mismatch"]
