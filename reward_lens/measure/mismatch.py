"""The engine-trainer mismatch: KL(pi_sampler || pi_t) along the rollouts the sampler drew, per step.

Where an inference engine (vLLM, SGLang, a stand-in) samples the rollouts and hands over its own
log-probabilities of them (the record's ``logp_sampler``, summed over each completion), the gap
g_i = log pi_sampler(y_i) - log pi_t(y_i) (``logp_sampler - logp_pre``) along the sampler's own
samples has expectation KL(pi_sampler || pi_t) summed over the sequence (the k1 estimator,
unbiased because the rollouts are the sampler's draws). Per step:

* per sequence (nats/seq): the mean over prompt groups of each group's mean gap, with the SE of
  that mean across groups (groups are the independent units: a prompt's completions share it);
* per token (nats/token, the token-weighted mean ``fields.yaml`` gives that unit): sum g / sum
  tokens, a ratio of group totals, its SE by linearisation over groups (the delta method for a
  ratio estimator, Cochran 1977 ch. 6);
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
(t-1, t) is this series' per-sequence value at step t wherever the ledger kept every rollout.

Checked against the truth (tests/unit/test_mismatch.py): a tabular autoregressive policy (next
token from the previous one, per prompt), so KL(pi_sampler || pi_t) is exact by dynamic
programming; sampled by its bfloat16 cast (exact KL 8.7e-6 nats/seq), a temperature of 1.3
(0.091) and top-p 0.9 the scorer does not apply (0.197), 8 prompt groups x 8 completions redrawn
400 times, the 95 % interval (t quantile, 7 dof) covered the exact per-sequence KL 94.8 %, 93.5 %,
96.5 % of the time, and the per-token one 94.8 %, 92.8 %, 94.8 %. On the benchmark's own policy and
stand-in engine (``tools/mismatch_runs.py --coverage``: the truth the full-vocabulary token KL along
fresh engine samples, 200 fresh steps of 8 groups x 8; docs/science.md quotes the line) bfloat16 and
temperature cover at their rate and top-p 0.9 at 74 %: there the per-sequence KL is nearly the same
for every completion that runs to the length cap and lower on the rare early-ending ones, and a
step that draws none of those has too small an SE.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np

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
    kl_seq_se: float  # its SE across groups (NaN with one group)
    kl_token: float | None  # nats/token: sum of gaps / sum of tokens (None without token counts)
    kl_token_se: float | None
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


def group_kl(gap: np.ndarray, codes: np.ndarray, n_groups: int) -> tuple[float, float] | None:
    """The per-sequence estimate: the mean over prompt groups of each group's mean gap, and its SE
    across groups (NaN with one group); None where no gap is finite. Non-finite gaps are left out
    (a row the engine could not score)."""
    gap = np.asarray(gap, dtype=np.float64)
    codes = np.asarray(codes, dtype=np.int64)
    ok = np.isfinite(gap)
    if not ok.any():
        return None
    count = np.bincount(codes[ok], minlength=n_groups)
    present = count > 0
    means = np.bincount(codes[ok], weights=gap[ok], minlength=n_groups)[present] / count[present]
    se = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else float("nan")
    return float(means.mean()), se


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
            keep = np.bincount(c, minlength=n_groups) > 0
            a, b = a[keep], b[keep]
            kl_tok = float(a.sum() / b.sum())
            m = len(a)
            kl_tok_se = (float(math.sqrt(((a - kl_tok * b) ** 2).sum() * m / (m - 1)) / b.sum())
                         if m > 1 else float("nan"))
    return StepMismatch(step=int(step), kl_seq=seq[0], kl_seq_se=seq[1], kl_token=kl_tok, kl_token_se=kl_tok_se,
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


__all__ = ["TAIL_RATIO", "StepMismatch", "group_kl", "mismatch_of_table", "mismatch_series", "run_mismatch",
           "step_mismatch"]
