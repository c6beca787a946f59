"""What an adapter hands the tap core, checked where it enters (issue 61).

A value the record's reader would refuse later -- a step handed over out of order, a token id
past the vocabulary, a 2-D completion, rows that do not line up -- is refused *at the call*
with a ``TapCallError`` naming the call, the argument and the step: the run stops at the first
wrong call instead of training for hours into a record that cannot be read.

A value that is not a finite number (a NaN advantage, an infinite reward, a NaN engine
log-probability, a diverged gradient norm) is not a wrong call: it is data about the run. It is
stored as null in its field and kept in the manifest's ``non_finite`` list with what it was and
which call handed it over (``RunManifest.non_finite``; ARCHITECTURE.md, "the record layer is the
ground floor"), so the record stays readable and says where the run diverged.

Torch is imported lazily: the helpers take what the core hands them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from reward_lens.record.schema import NonFiniteValue

# Steps are stored as int64 (schema: optimizer_step, >= 0).
STEP_LIMIT = 2**63

# Which call handed over each telemetry field the tap commits (the ``source`` of a NonFiniteValue).
TELEMETRY_SOURCE = {
    "learning_rate": "before_optimizer_step(learning_rate)",
    "grad_norm_unclipped": "before_optimizer_step(grad_norm_unclipped)",
    "max_grad_norm": "before_optimizer_step(max_grad_norm)",
    "beta": "before_optimizer_step(beta)",
    "grad_norm": "before_optimizer_step (the norm of the gradients the tap read)",
    "update_norm": "after_optimizer_step (the norm of the update the tap read)",
    "reward_mean": "on_generation(all_rewards)",
    "frac_reward_zero_std": "on_generation(all_rewards)",
    "entropy": "the tap's scoring of the rollouts under pi_t",
    "kl_to_previous": "the tap's scoring of the step pair",
    "kl_to_previous_se": "the tap's scoring of the step pair",
}

# Which call handed over each rollout field (extras: the tap's own completions).
ROLLOUT_SOURCE = {
    "reward": "on_generation(rewards)",
    "rewards": "on_generation(rewards)",
    "advantage": "on_generation(advantages)",
    "logp_sampler": "on_generation(logp_sampler)",
    "logp_pre": "the tap's scoring under pi_t",
    "logp_prev": "the tap's scoring under the previous policy",
    "kl_prev": "the tap's scoring under the previous policy",
}
EXTRA_SOURCE = {
    "reward": "the reward function on the tap's extra completions",
    "rewards": "the reward function on the tap's extra completions",
    "logp_sampler": "extras_generated(logp_sampler)",
}


class TapCallError(ValueError):
    """An adapter's call the tap cannot record: ``call`` (the core's method), ``argument``,
    ``step`` (None where the call has none) and what is wrong. Raised at the call, before anything
    of it is kept."""

    def __init__(self, call: str, argument: str, step: int | None, problem: str):
        self.call, self.argument, self.step, self.problem = call, argument, step, problem
        at = f"{call}(step={step})" if step is not None else f"{call}()"
        super().__init__(f"reward-lens tap: {at}: `{argument}` {problem}")


def tag(value: float) -> str:
    """A non-finite float as ``NonFiniteValue.value`` spells it."""
    return "nan" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def non_finite(step: int, field: str, value: float, source: str) -> NonFiniteValue:
    return NonFiniteValue(step=int(step), field=field, value=tag(value), source=source)


def is_bad_float(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def check_step(call: str, step: Any, argument: str = "step") -> int:
    """A step: an integer (not a bool) in [0, 2**63)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TapCallError(call, argument, None, f"must be an integer optimizer step (got {type(step).__name__} "
                                                 f"{step!r})")
    step = int(step)
    if not 0 <= step < STEP_LIMIT:
        raise TapCallError(call, argument, step, "must lie in [0, 2**63)")
    return step


def check_count(call: str, step: int | None, argument: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TapCallError(call, argument, step, f"must be an integer (got {type(value).__name__} {value!r})")
    value = int(value)
    if not low <= value < STEP_LIMIT:
        raise TapCallError(call, argument, step, f"must be at least {low} (got {value})")
    return value


def check_real(call: str, step: int | None, argument: str, value: Any, *, optional: bool = True) -> float | None:
    """A real number handed over (non-finite allowed: the caller records it as data)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        if hasattr(value, "item") and getattr(value, "ndim", getattr(value, "dim", lambda: 1)()) == 0:
            return check_real(call, step, argument, value.item(), optional=optional)
        raise TapCallError(call, argument, step, f"must be a real number{' or None' if optional else ''} "
                                                 f"(got {type(value).__name__})")
    return float(value)


def check_rows(call: str, step: int, argument: str, value: Any, n: int) -> None:
    try:
        got = len(value)
    except TypeError:
        raise TapCallError(call, argument, step, f"must hold one entry per row (got {type(value).__name__})") from None
    if got != n:
        raise TapCallError(call, argument, step, f"has {got} entries for {n} rows")


def check_ids(call: str, step: int, argument: str, ids: Any, vocab: int | None, row: int):
    """One sequence of token ids: a 1-D integer tensor (or a list of ints) within the vocabulary.
    Returns it as a long tensor."""
    import torch

    where = f"{argument}[{row}]"
    if isinstance(ids, torch.Tensor):
        t = ids
    else:
        try:
            arr = np.asarray(list(ids))
        except TypeError:
            raise TapCallError(call, where, step, f"must be a sequence of token ids (got {type(ids).__name__})") from None
        if arr.size and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer)):
            raise TapCallError(call, where, step, f"must hold integer token ids (got {arr.dtype})")
        t = torch.as_tensor(arr.astype(np.int64) if arr.size else np.zeros(0, np.int64))
    if t.dim() != 1:
        raise TapCallError(call, where, step, f"must be one row of token ids, 1-D (got shape {tuple(t.shape)})")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TapCallError(call, where, step, f"must hold integer token ids (got {t.dtype})")
    if len(t):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0:
            raise TapCallError(call, where, step, f"holds token id {lo} (ids are >= 0)")
        if vocab is not None and hi >= vocab:
            raise TapCallError(call, where, step, f"holds token id {hi}, past the vocabulary ({vocab} tokens)")
    return t.to(torch.long)


def check_matrix(call: str, step: int, argument: str, value: Any, rows: int | None, cols: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise TapCallError(call, argument, step, "must be an array of real numbers") from None
    if arr.ndim != 2 or (rows is not None and arr.shape[0] != rows) or arr.shape[1] != cols:
        want = f"({rows if rows is not None else 'rows'}, {cols})"
        raise TapCallError(call, argument, step, f"must have shape {want}: one row per completion, one column per "
                                                 f"reward function (got shape {arr.shape})")
    return arr


def check_weights(call: str, step: int, weights: Any, names: Sequence[str]) -> np.ndarray:
    try:
        w = np.asarray(weights, dtype=float)
    except (TypeError, ValueError):
        raise TapCallError(call, "reward_weights", step, "must be real numbers") from None
    if w.ndim != 1 or len(w) != len(names):
        raise TapCallError(call, "reward_weights", step, f"must hold one weight per reward function "
                                                         f"({len(names)}; got shape {w.shape})")
    if not np.isfinite(w).all():
        raise TapCallError(call, "reward_weights", step, "must be finite (a weight is the trainer's setting, "
                                                         "not a value the run produced)")
    return w
