"""The tap's core: everything a reward-lens tap does that is not one trainer's.

A tap measures each optimizer step t (pi_t -> pi_{t+1}) on samples the step never trained on,
and writes the record. An adapter (``taps/trl.py`` for TRL's ``GRPOTrainer``; a plain torch
loop in ``examples/plain_torch_tap.py``; veRL and OpenRLHF the same way, docs/recording.md)
only hooks its trainer and calls, per optimizer step:

1. ``extra_requests(...)`` before the step's generation: the extra prompts (token ids, one per
   completion) to append to the generation batch -- pi_t's completions of the prompt groups the
   budget chose for the pair (t, next), and the current policy's completions of the groups
   chosen at the previous generation -- generated *by the trainer's own generation call*, with
   its settings, on its device or its engine, inside ``with core.capture():``;
2. ``extras_generated(...)``: the extra completions (removed from the batch before anything
   trains on them), with the engine's log-probabilities where it hands them over;
3. ``on_generation(step, batch)``: the step's rollouts as generated (``Generation``); the core
   scores what is due and records D of the step pair (previous generation, t);
4. optionally ``loss_hidden()`` / ``score_from_loss(...)`` around the trainer's loss forward, so
   the rollouts' log pi_t and entropy come from its hidden states rather than a pass of the tap's;
5. ``before_optimizer_step(step, ...)`` and ``after_optimizer_step(step)`` around the optimizer;
6. ``end_step(step)`` (returns True when a live finding asks to stop) and, once, ``end()``.

The measurement (two-sided, the default). For the pair (t, t+1), the tap adds to step t's
own generation ``k`` completions per chosen prompt group (side a: pi_t's samples, never trained
on) and to step t+1's generation ``k`` completions of the *same* prompts (side b: pi_{t+1}'s,
never trained on). Each row is scored under both policies: the drawing policy's
log-probabilities come from the generation itself (the final hidden states captured during it,
mapped by that policy's output layer -- the same numbers it sampled from, no second pass) where
the trainer generates with the model it trains; the other policy's by one forward pass (pi_t's
by a functional call on the kept parameters). D_t is the full-vocabulary token KL(pi_{t+1} ||
pi_t) summed along each row's prefixes, the two sides combined by multiple importance sampling
(balance heuristic, ``measure.ledger.paired.independent_d_t``). Why extra completions in the
trainer's own generation rather than a sampling loop of the tap's own: decoding is
latency-bound, so a handful of extra rows in the generation the trainer runs anyway costs a
small share of it, while a second decode loop costs as much as the trainer's (measured:
bench/tap_forward.py), and under vLLM the extra rows are the engine's samples with the weights
it holds at that moment -- pi_t at step t's generation -- with no ordering to get right.

One-sided (``heldout=0``, or a budget too small for extra completions): the next generation's
rollouts of the measured groups are scored under the kept pi_t instead (side b only), and the
record's estimator says ``independent_next``.

The budget (``taps/budget.py``) sizes the work per step pair from timing alone. The core times
itself: its fixed work (telemetry, the snapshot of pi_t, the record) and its measuring work
(scoring passes; the extra completions' share of the generation).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from reward_lens.measure.ledger.paired import independent_d_t
from reward_lens.measure.whitebox.kl import BlockedLogits, KlEstimate, WholeLogits, score_blocked
from reward_lens.record.schema import NonFiniteValue, OptimizerTelemetry, Rollout
from reward_lens.record.stream import RecordStream
from reward_lens.taps import calls
from reward_lens.taps.budget import Budget, Plan, Shape
from reward_lens.taps.calls import TapCallError
from reward_lens_spec.tap_settings import TapSettings

logger = logging.getLogger("reward_lens")

# What the tap adds to the trainer's own logs: means over the optimizer steps since the previous
# log. eta is not among them: it needs the next step's rollouts and a book-wide noise decision.
LOGGED = {"kl_to_previous": "reward_lens/kl_to_previous", "update_norm": "reward_lens/update_norm",
          "grad_norm": "reward_lens/grad_norm_clipped", "grad_norm_unclipped": "reward_lens/grad_norm_unclipped",
          "entropy": "reward_lens/entropy", "tap_seconds": "reward_lens/tap_seconds"}


class Collective(Protocol):
    """The trainer's process group, as the core needs it (a single process: ``Single``)."""

    world: int
    rank: int

    def gather(self, items: list) -> list: ...


class Single:
    world, rank = 1, 0

    def gather(self, items: list) -> list:
        return list(items)


@dataclass
class Row:
    """A completion waiting for its step to end before it is written: a rollout, or one of the
    tap's extra completions (``drawn_by``: the step whose policy drew it)."""

    step: int
    group: str  # group label within the step (a rollout's group index; an extra's "h<index>")
    prompt: str
    completion: str
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    reward: float
    rewards: dict[str, float]
    advantage: float | None
    order: tuple = ()  # the global order rows are written in (over every rank)
    logp_pre: float | None = None
    logp_prev: float | None = None
    logp_prev_step: int | None = None
    kl_prev: float | None = None
    logp_sampler: float | None = None  # under the engine that sampled it (vLLM), where handed over
    drawn_by: int | None = None  # extras only: the step whose policy drew it
    example: dict | None = None  # the dataset row its prompt came from (the reward functions' keyword arguments)
    hidden: torch.Tensor | None = None  # (len, d): the drawing policy's final hidden states, from its generation
    targets: dict[str, float] = field(default_factory=dict)  # the declared checks' scores (rollouts only)

    def rollout(self) -> tuple[Rollout, list[NonFiniteValue]]:
        """The row as the record stores it, and the values it held that were not finite numbers
        (stored as null: ``calls`` module docstring). A reward of NaN is a reward nobody computed
        (an extra row before its reward function ran; TRL's NaN for a function that returned
        None) and is null without an entry."""
        sources = calls.EXTRA_SOURCE if self.drawn_by is not None else {}
        bad: list[NonFiniteValue] = []

        def kept(name: str, v: float | None) -> float | None:
            if v is None or math.isfinite(v):
                return v
            if not (name == "reward" and math.isnan(v) and self.drawn_by is not None):
                bad.append(calls.non_finite(self.step, name, v, sources.get(name, calls.ROLLOUT_SOURCE[name])))
            return None

        rewards = {}
        for k, v in (self.rewards or {}).items():
            if math.isfinite(v):
                rewards[k] = v
            elif not math.isnan(v):
                bad.append(calls.non_finite(self.step, "rewards", v, f"{sources.get('rewards', calls.ROLLOUT_SOURCE['rewards'])}"
                                                                     f" [{k}]"))
        kl_prev = kept("kl_prev", self.kl_prev)
        row = Rollout(step=self.step, group_id=f"{self.step}:{self.group}", prompt=self.prompt,
                      completion=self.completion, completion_ids=self.completion_ids.tolist(),
                      num_tokens=int(len(self.completion_ids)),
                      reward=kept("reward", self.reward), rewards=rewards or None,
                      advantage=kept("advantage", self.advantage), logp_pre=kept("logp_pre", self.logp_pre),
                      logp_prev=kept("logp_prev", self.logp_prev), logp_prev_step=self.logp_prev_step,
                      # a sum of KLs is >= 0; max() only removes float64 rounding below 0
                      kl_prev=None if kl_prev is None else max(kl_prev, 0.0),
                      logp_sampler=kept("logp_sampler", self.logp_sampler), drawn_by_step=self.drawn_by,
                      targets=self.targets or None)
        return row, bad


@dataclass
class Generation:
    """One generation batch as this process produced it (the adapter's view of the trainer's).

    ``offset``: this process's first row in the global batch; ``total``: the global batch's rows;
    ``group_size``: completions per prompt (rows ``g*group_size .. (g+1)*group_size - 1`` of the
    global batch answer one prompt). ``rewards``: (rows, functions) per reward function (NaN where
    a function gave none), with ``reward_names`` and ``reward_weights``; ``all_rewards``: the
    same over the global batch (for the step's mean reward and zero-spread share)."""

    step: int
    prompts: list[str]
    completions: list[str]
    prompt_ids: list[torch.Tensor]
    completion_ids: list[torch.Tensor]
    rewards: np.ndarray
    all_rewards: np.ndarray
    reward_names: list[str]
    reward_weights: np.ndarray
    advantages: Sequence[float | None]
    group_size: int
    offset: int = 0
    total: int | None = None
    examples: Sequence[dict] | None = None
    logp_sampler: Sequence[float | None] | None = None


@dataclass
class _Pair:
    """A step pair in flight: planned at generation ``step`` (its side a drawn there, its
    hidden states kept), completed at the next generation."""

    step: int
    plan: Plan
    groups: list[int]  # global group indices measured (this process's: those starting on it)
    prompts: dict[int, tuple[str, torch.Tensor, dict]]  # group -> prompt text, ids, example
    side_a: list[Row] = field(default_factory=list)


@dataclass
class _Awaiting:
    """A generation whose rollouts get their log pi_t (and pi_t's side of the token KL, one-sided)
    from the trainer's loss forward: the kept previous policy (one-sided) and the entropy summed
    as the micro-batches come."""

    step: int
    prev_step: int | None
    params: dict[str, torch.Tensor] | None
    rows: list[Row]
    scored: set[int]  # ids of the rows to score under params
    entropy: float = 0.0
    tokens: float = 0.0


def _keep_scores(rows: list[Row], s, prev_step: int | None) -> None:
    for j, p in enumerate(rows):
        p.logp_pre = float(s.logp_new[j])
        if prev_step is not None:
            p.logp_prev, p.kl_prev, p.logp_prev_step = float(s.logp_old[j]), float(s.kl[j]), prev_step


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter or gradient: a DTensor's local shard (FSDP2), else the
    tensor itself; no copy."""
    return t.to_local() if hasattr(t, "to_local") else t


class _Clock:
    """Seconds the tap spends, by kind: ``fixed`` (paid every step, whatever is measured) and
    ``measure`` (what the budget sizes). Nested, the time goes to the innermost kind."""

    def __init__(self):
        self.spent = {"fixed": 0.0, "measure": 0.0}
        self._stack: list[list] = []  # [kind, started]

    @contextmanager
    def __call__(self, kind: str):
        now = time.perf_counter()
        if self._stack:  # the outer kind stops counting while this one runs
            outer = self._stack[-1]
            self.spent[outer[0]] += now - outer[1]
        self._stack.append([kind, now])
        try:
            yield
        finally:
            kind_, started = self._stack.pop()
            now = time.perf_counter()
            self.spent[kind_] += now - started
            if self._stack:
                self._stack[-1][1] = now

    def add(self, kind: str, seconds: float) -> None:
        self.spent[kind] += seconds

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, {"fixed": 0.0, "measure": 0.0}
        return out


def declared_targets(targets, basis, reward_names: Sequence[str] | None) -> list:
    """The tap's targets (``TapSettings.target``) as the record declares them (``TargetDecl``): a
    function is a check (``of: check``); a name is a reward function of the trainer's, else a
    feature of the live basis or of the surface basis; else, where the reward functions are known,
    a ValueError naming them and the basis (at attach, before training)."""
    from reward_lens.measure.ledger.basis import surface_definitions
    from reward_lens.record.schema import TargetDecl

    out = []
    for t in targets or ():
        if t.fn is not None:
            if reward_names is not None and t.name in reward_names:
                raise ValueError(f"RewardLensTap: target `{t.name}` is a function named like the reward function "
                                 f"`{t.name}`: name the check apart ({{'{t.name}_check': fn}}), or pass the name alone to "
                                 "target the reward function")
            out.append(TargetDecl(name=t.name, want=t.want, of="check"))
        elif reward_names is not None and t.name in reward_names:
            out.append(TargetDecl(name=t.name, want=t.want, of="reward"))
        elif t.name in basis.names or t.name in surface_definitions()[0]:
            out.append(TargetDecl(name=t.name, want=t.want, of="feature"))
        elif reward_names is not None:
            raise ValueError(f"RewardLensTap: target `{t.name}` is neither a reward function of the trainer "
                             f"({list(reward_names)}) nor a feature of the basis ({', '.join(basis.names)}); pass a "
                             "function to target a check the reward does not pay for")
        else:  # a trainer that names its reward functions only with each generation: checked there
            out.append(TargetDecl(name=t.name, want=t.want, of="reward"))
    return out


class TapCore:
    """The trainer-neutral tap (module docstring). ``reward``: called with extra rows (``Row``s
    whose ``example`` is their dataset row) to fill in their ``rewards`` and ``reward``."""

    def __init__(self, record_dir: str | Path | None, model: torch.nn.Module, settings: TapSettings, *,
                 pad_id: int, eos_id: int | None, decode: Callable[[list[list[int]]], list[str]],
                 temperature: float = 1.0, collective: Collective | None = None,
                 framework: dict | None = None, optimizer: str | None = None, trainer_config: dict | None = None,
                 notes: Sequence[str] = (), model_description: str | None = None, sharded: str | None = None,
                 reward: Callable[[list[Row]], None] | None = None, reuse: int = 1,
                 captured: bool = True, max_grad_norm: float | None = None,
                 reward_names: Sequence[str] | None = None):
        s = settings
        self.settings = s
        self.model = model
        self.collective = collective or Single()
        self.world, self.rank = self.collective.world, self.collective.rank
        self.sharded = sharded
        self.estimator = s.estimator
        self.paired = bool(s.paired) and s.estimator is not None
        self.heldout = int(s.heldout) if self.paired else 0
        self.n_exact, self.chunk, self.seed = s.n_exact, s.chunk, s.seed
        self.flush_every = int(s.flush_every)
        self.check_every, self.stop_on = s.check_every, s.stop_on
        self.pad_id, self.eos_id, self.decode = pad_id, eos_id, decode
        self.temperature = float(temperature)
        self.reward = reward
        self.reuse = max(1, int(reuse))
        self.max_grad_norm = max_grad_norm
        self._host = s.snapshot == "cpu"
        self._copy = self._host or bool(sharded)  # pi_t copied into the live parameters (not swapped)
        # the drawing policy's side of an extra row from the hidden states of the generation: only
        # where the trainer generates with the model itself (not an engine) and pi_t is a reference
        # away (a snapshot beside whole parameters) with a plain linear output layer
        self.captured = bool(captured) and not self._copy and self._head_is_linear
        self.budget = Budget(s.budget, self.heldout, seed=s.seed, passes=1 if self.captured else 2)
        self.findings_warned: set[str] = set()
        self.findings_log: dict[int, list[str]] = {}
        self.estimates: dict[int, dict[str, KlEstimate]] = {}
        self.plans: dict[int, Plan] = {}
        self._groups_total: dict[int, int] = {}  # step -> the prompt groups its generation held
        self._pending: dict[int, Row] = {}  # rollouts by their global index
        self._pending_extra: list[Row] = []
        self._next_index = 0
        self._used: list[int] = []
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._prev: tuple[int, dict[str, torch.Tensor]] | None = None  # (t, pi_t) kept for the next generation
        self._planned: _Pair | None = None  # the pair (t, next) planned at generation t, its side a drawn there
        self._completing: _Pair | None = None  # the pair (previous generation, t) completed at generation t
        self._side_b: list[Row] = []  # the completing pair's side b, drawn at this generation
        self._generation: int | None = None  # the step whose generation is under way
        self._asked: list[tuple[str, Row]] = []  # the extras asked for at this generation, in order
        self._captured: list[torch.Tensor] = []
        self._generation_timed: tuple[float, int | None, int] | None = None
        self._row_tokens = 1.0  # tokens of a row of the last generation, on average
        self._awaiting: _Awaiting | None = None
        self._row: dict[str, Any] = {}
        self._late: dict[int, dict[str, Any]] = {}
        self._log_acc: dict[str, list[float]] = {}
        self._clock = _Clock()
        self._step_started = time.perf_counter()
        self._unit_samples: list[tuple] = []  # this step's ("forward", s, token passes) / ("generate", s, rows, steps, extra)
        self._generator = torch.Generator().manual_seed(int(s.seed) * 1_000_003 + 7 + self.rank)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(emb, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
        self.vocab: int | None = int(vocab) if isinstance(vocab, int) and vocab > 0 else None
        self._high = -1  # the highest step any call has handed over: steps never go back
        self._generated = -1  # the last generation's step
        self._optimized = -1  # the last optimizer step's
        self._before: int | None = None  # the step before_optimizer_step was called for, until after_optimizer_step
        from reward_lens.findings import LiveFindings
        from reward_lens.measure.ledger.basis import load_basis
        from reward_lens.measure.ledger.features import SurfaceFeatures
        from reward_lens.measure.ledger.targets import with_targets

        # the basis before the record folder (a basis that cannot be read leaves no folder behind),
        # and the live findings in it, as `check --features` would read (its default when none)
        basis = load_basis(s.features) if s.features else SurfaceFeatures()
        self.reward_names = list(reward_names) if reward_names is not None else None
        self.targets = declared_targets(s.target, basis, self.reward_names)
        self.checks = {t.name: t.fn for t in (s.target or ()) if t.fn is not None}
        self.stream = None if self.rank or record_dir is None else RecordStream(
            record_dir, framework=framework or {"name": "unknown"},
            model={"description": model_description or str(getattr(getattr(model, "config", None), "_name_or_path",
                                                                       "") or type(model).__name__),
                   "architecture": type(model).__name__,
                   "n_parameters": sum(p.numel() for p in model.parameters()),
                   "vocab_size": getattr(getattr(model, "config", None), "vocab_size", None),
                   "eos_token_id": eos_id},
            optimizer=optimizer, trainer_config=trainer_config, notes=list(notes), overwrite=s.overwrite,
            targets=self.targets)
        self.live = LiveFindings(with_targets(basis, self.targets), trainer_config, eos_token_id=eos_id)
        self._unchecked: list = []  # rollouts written since the last check of the live findings
        self._unchecked_tel: dict[int, dict[str, float]] = {}  # telemetry committed since then, by step

    # ------------------------------------------------------------------ helpers
    def note(self, text: str) -> None:
        if self.stream is not None:
            self.stream.add_note(text)

    def gather(self, items: list) -> list:
        return self.collective.gather(list(items)) if self.world > 1 else list(items)

    def _step_in_order(self, call: str, step: Any) -> int:
        """``step`` a valid step, not before one a call has already handed over."""
        step = calls.check_step(call, step)
        if step < self._high:
            raise TapCallError(call, "step", step, f"comes after step {self._high}: steps are handed over in "
                                                   "increasing order")
        return step

    def _non_finite(self, entries: Sequence[NonFiniteValue]) -> None:
        if self.stream is not None:
            for e in entries:
                self.stream.add_non_finite(e)

    @cached_property
    def _head_is_linear(self) -> bool:
        """The output layer is a plain linear map of the last hidden states (no soft-capping or
        logit scale): logits can then be computed from the hidden states a block at a time."""
        model = self.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return isinstance(head, torch.nn.Linear) and not any(
            getattr(getattr(model, "config", None), k, None)
            for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))

    @cached_property
    def _head_key(self) -> str | None:
        head = self.model.get_output_embeddings()
        return next((n for n, p in self.model.named_parameters() if p is head.weight), None)

    @cached_property
    def _filler(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([0], dtype=torch.long), torch.tensor([0], dtype=torch.long)

    def _set_late(self, step: int, values: dict[str, Any]) -> None:
        if self._row and self._row.get("step") == step:
            self._row.update(values)
        else:
            self._late.setdefault(step, {}).update(values)

    # ------------------------------------------------------------------ 1-2: extra completions
    def extra_requests(self, step: int, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[str], *,
                       group_size: int, offset: int = 0, total: int | None = None,
                       examples: Sequence[dict] | None = None, per_group: int | None = None,
                       can_draw: bool = True) -> list[list[int]]:
        """The extra prompts (token ids, one entry per completion) to append to the generation of
        ``step``, whose rows on this process are ``prompt_ids`` (the global batch's rows
        ``offset .. offset + len - 1`` of ``total``, ``group_size`` per prompt). ``per_group``:
        completions per group the adapter's engine requires (vLLM's server mode generates a whole
        group per prompt), else the plan's. ``can_draw`` False: the generation cannot take extra
        rows (e.g. images): the pair (step, next) is measured one-sided."""
        call = "extra_requests"
        step = self._step_in_order(call, step)
        if step < self._generated:
            raise TapCallError(call, "step", step, f"comes after the generation of step {self._generated}")
        group_size = calls.check_count(call, step, "group_size", group_size, low=1)
        offset = calls.check_count(call, step, "offset", offset)
        if total is not None:
            total = calls.check_count(call, step, "total", total)
        calls.check_rows(call, step, "prompts", prompts, len(prompt_ids))
        prompt_ids = [calls.check_ids(call, step, "prompt_ids", p, self.vocab, i) for i, p in enumerate(prompt_ids)]
        if per_group is not None:
            per_group = calls.check_count(call, step, "per_group", per_group)
        self._high = step
        with self._clock("measure"):
            total = len(prompt_ids) * self.world if total is None else total
            self._begin_generation(step, total, group_size, two_sided=can_draw)
            out: list[list[int]] = []
            done = self._completing
            # side b of the pair planned at the previous generation (its pi kept), for its groups
            if (can_draw and done is not None and done.plan.shape.per_group and self._prev is not None
                    and self._prev[0] == done.step):
                for g in done.groups:
                    text, ids, example = done.prompts[g]
                    for j in range(done.plan.shape.per_group):
                        self._asked.append(("b", self._extra(step, g, j, text, ids, example, 1)))
                        out.append(ids.tolist())
            plan = self._planned.plan if self._planned is not None else None
            if plan is not None and plan.measured and plan.shape.per_group:
                if per_group is not None:
                    plan = Plan(Shape(plan.shape.groups, per_group), plan.groups, plan.probability, plan.reason)
                    self._planned.plan = self.plans[step] = plan
                mine = {}
                for i in range(len(prompt_ids)):
                    g = (offset + i) // group_size
                    if (offset + i) % group_size == 0 and g in plan.groups:
                        ex = dict(examples[i]) if examples is not None and i < len(examples) else {}
                        mine[g] = (str(prompts[i]), prompt_ids[i], ex)
                self._planned.groups, self._planned.prompts = sorted(mine), mine
                for g in sorted(mine):
                    text, ids, example = mine[g]
                    for j in range(plan.shape.per_group):
                        self._asked.append(("a", self._extra(step, g, j, text, ids, example, 0)))
                        out.append(ids.tolist())
            return out

    def _begin_generation(self, step: int, total: int, group_size: int, two_sided: bool) -> None:
        """Generation ``step`` begins: the pair planned at the previous generation is the one this
        generation completes; the pair (step, next) is planned (once per generation)."""
        if self._generation == step:
            return
        self._generation = step
        self._asked, self._side_b, self._captured = [], [], []
        self._completing, self._planned = self._planned, None
        if not self.paired:
            return
        n_groups = max(1, total // max(1, group_size))
        self._groups_total[step] = n_groups  # the share a pair's measured groups are of the step's
        heldout = self.heldout if two_sided else 0
        plan = self.budget.plan(n_groups, group_size, self._tokens_per_row(), heldout=heldout)
        self.plans[step] = plan
        if plan.measured:
            self._planned = _Pair(step, plan, [], {})

    @staticmethod
    def _extra(step: int, g: int, j: int, text: str, ids: torch.Tensor, example: dict, side: int) -> Row:
        return Row(step=step, group=f"h{g}", prompt=text, completion="", prompt_ids=ids,
                   completion_ids=torch.zeros(0, dtype=torch.long), reward=float("nan"), rewards={},
                   advantage=None, order=(step, side, g, j), drawn_by=step, example=example)

    def _tokens_per_row(self) -> float:
        """About how many tokens a scored row has: the last generation's prompts and completions
        (before the first generation, one: the first pair is measured whole anyway)."""
        return self._row_tokens

    @contextmanager
    def capture(self, n_rows: int | None = None, batch: int | None = None):
        """Around the adapter's generation call: the final hidden states of the last ``n_rows``
        rows of its batch of ``batch`` rows (the extras; default: as many as asked for) at every
        decoding step, taken from the input of the output layer as the generation runs (a forward
        pass of another batch size inside the call is not the generation's, and is passed over).
        The states are handed on to ``extras_generated``."""
        n = len(self._asked) if n_rows is None else n_rows
        self._captured = []
        self._generation_timed = None
        if not (self.captured and n):
            yield
            return
        head = self.model.get_output_embeddings()

        def keep(module, inputs):
            h = inputs[0]
            if h.dim() == 3 and (batch is None or h.shape[0] == batch):
                self._captured.append(h[-n:, -1:, :].detach())

        handle = head.register_forward_pre_hook(keep)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            handle.remove()
            # the generation's time, rows and decoding steps, for the budget (an adapter that
            # generates inside capture() need not time it)
            self._generation_timed = (time.perf_counter() - t0, batch, len(self._captured))

    def extras_generated(self, completions: Sequence[Sequence[int]], logp_sampler: Sequence[float | None] | None = None,
                         *, seconds: float | None = None, rows: int | None = None, decode_steps: int | None = None
                         ) -> None:
        """The extra completions, in the order asked for (token ids, EOS kept where generated),
        with the engine's summed log-probabilities where it hands them over. ``seconds``, ``rows``
        and ``decode_steps``: the whole generation call's time, rows and longest completion, from
        which the extras' marginal cost is learned and charged to the tap (``Budget.row_step_cost``)."""
        call, step = "extras_generated", self._generation
        if len(completions) != len(self._asked):
            raise TapCallError(call, "completions", step, f"has {len(completions)} completions for the "
                                                          f"{len(self._asked)} extra prompts asked for")
        completions = [calls.check_ids(call, step, "completions", c, self.vocab, i) for i, c in enumerate(completions)]
        if logp_sampler is not None:
            calls.check_rows(call, step, "logp_sampler", logp_sampler, len(completions))
            logp_sampler = [calls.check_real(call, step, f"logp_sampler[{i}]", v) for i, v in enumerate(logp_sampler)]
        with self._clock("measure"):
            asked, self._asked = self._asked, []
            captured, self._captured = self._captured, []
            hidden = torch.cat(captured, dim=1) if captured and len(captured[0]) == len(asked) else None
            timed, self._generation_timed = self._generation_timed, None
            if seconds is None and timed is not None and timed[1] and timed[2]:
                seconds, rows, decode_steps = timed
            texts = self.decode([c.tolist() for c in completions]) if completions else []
            for i, ((side, row), ids) in enumerate(zip(asked, completions)):
                row.completion_ids = ids
                row.completion = texts[i]
                if logp_sampler is not None and i < len(logp_sampler):
                    row.logp_sampler = logp_sampler[i]
                if hidden is not None:
                    row.hidden = hidden[i, :len(ids)]
                (self._planned.side_a if side == "a" else self._side_b).append(row)
            if seconds is not None and rows and decode_steps:
                self._unit_samples.append(("generate", seconds, rows, decode_steps, len(asked)))
                per_row_step = self.budget.row_step_cost()
                share = len(asked) / rows * seconds if per_row_step is None else min(
                    per_row_step * decode_steps * len(asked), seconds)
                self._clock.add("measure", share)
            if self.reward is not None and asked:
                self.reward([r for _, r in asked])
            if asked:  # the held-out rows are read in the same basis as the rollouts: the checks too
                self._checks_on([r for _, r in asked], [r.example or {} for _, r in asked])

    # ------------------------------------------------------------------ 3: the generation
    def on_generation(self, batch: Generation, training: bool = True) -> None:
        """Step ``batch.step``'s rollouts as generated: recorded; the pair (previous generation,
        step) scored and its D recorded."""
        batch = self._checked_generation(batch)
        with self._clock("fixed"):
            t, n = batch.step, len(batch.completion_ids)
            total = n * self.world if batch.total is None else batch.total
            offset = batch.offset
            group = max(1, int(batch.group_size))
            self._begin_generation(t, total, group, two_sided=False)  # where no extras were asked for
            weights = np.asarray(batch.reward_weights, dtype=float)
            self._batch_rewards(t, np.nansum(np.asarray(batch.all_rewards, float) * weights, axis=1), group)
            base = self._next_index
            self._next_index += total
            fresh = []
            for i in range(n):
                r = np.asarray(batch.rewards[i], float)
                adv = batch.advantages[i]
                self._pending[base + offset + i] = p = Row(
                    step=t, group=str((offset + i) // group), prompt=str(batch.prompts[i]),
                    completion=str(batch.completions[i]), prompt_ids=batch.prompt_ids[i],
                    completion_ids=batch.completion_ids[i], reward=float(np.nansum(r * weights)),
                    rewards={nm: float(v) for nm, v in zip(batch.reward_names, r) if not math.isnan(v)},
                    advantage=None if adv is None else float(adv), order=(t, 0, base + offset + i))
                if batch.logp_sampler is not None:
                    p.logp_sampler = batch.logp_sampler[i]
                fresh.append(p)
            self._name_prompts(fresh, offset, group)
            self._score_checks(fresh, batch, offset)
            if fresh:
                self._row_tokens = float(np.mean([len(p.prompt_ids) + len(p.completion_ids) for p in fresh]))
        if self.paired and training:
            was = self.model.training
            self.model.eval()
            try:
                with self._clock("measure"):
                    self._score_generation(t, fresh, group, offset, total)
            finally:
                self.model.train(was)

    def _score_checks(self, fresh: list[Row], batch: Generation, offset: int) -> None:
        """The declared targets on the generation's rollouts: a reward function named as a target
        must be one of the batch's; a check (a target the reward does not pay for) is called like a
        reward function -- ``prompts``, ``completions`` (the texts), ``completion_ids`` and the
        dataset row's columns as keyword arguments -- and its values kept on each rollout."""
        missing = [t.name for t in self.targets if t.of == "reward" and t.name not in batch.reward_names]
        if missing:
            raise ValueError(f"RewardLensTap: target {missing} names no reward function of the trainer "
                             f"({list(batch.reward_names)}) and no feature of the basis")
        examples = [(batch.examples[i] if batch.examples is not None and i < len(batch.examples) else None) or {}
                    for i in range(len(fresh))]  # this process's dataset rows, as its rollouts
        self._checks_on(fresh, examples)

    def _checks_on(self, fresh: list[Row], examples: list[dict]) -> None:
        """Each declared check's score on ``fresh`` (their dataset rows ``examples``)."""
        if not self.checks or not fresh:
            return
        keys = [k for k in examples[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [ex.get(k) for ex in examples] for k in keys}
        for name, fn in self.checks.items():
            try:
                values = fn(prompts=[r.prompt for r in fresh], completions=[r.completion for r in fresh],
                            completion_ids=[r.completion_ids.tolist() for r in fresh], **kwargs)
                values = [None if v is None else float(v) for v in values]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"RewardLensTap: target `{name}` ({getattr(fn, '__name__', fn)!s}) did not return one "
                                 f"number per completion ({' '.join(str(exc).split())[:160]})") from None
            if len(values) != len(fresh):
                raise ValueError(f"RewardLensTap: target `{name}` returned {len(values)} values for {len(fresh)} "
                                 "completions (it must return one per completion)")
            for r, v in zip(fresh, values):
                if v is not None and math.isfinite(v):
                    r.targets[name] = v

    def _checked_generation(self, batch: Generation) -> Generation:
        """``batch`` as handed to ``on_generation``, checked before anything of it is kept
        (``calls``): a TapCallError naming the argument and the step, or the batch with its
        token ids as long tensors and its advantages and engine log-probabilities as floats or None."""
        call = "on_generation"
        t = self._step_in_order(call, batch.step)
        # a step's generation may come in several batches (TRL with steps_per_generation under
        # gradient_accumulation_steps generates at every micro-batch, all at one global step)
        if t < self._generated:
            raise TapCallError(call, "step", t, f"comes after the generation of step {self._generated}")
        n = len(batch.completion_ids)
        for name in ("prompts", "completions", "prompt_ids", "advantages"):
            calls.check_rows(call, t, name, getattr(batch, name), n)
        group = calls.check_count(call, t, "group_size", batch.group_size, low=1)
        offset = calls.check_count(call, t, "offset", batch.offset)
        total = None if batch.total is None else calls.check_count(call, t, "total", batch.total)
        if total is not None and offset + n > total:
            raise TapCallError(call, "offset", t, f"{offset} + {n} rows run past the global batch's {total}")
        names = [str(x) for x in batch.reward_names]
        weights = calls.check_weights(call, t, batch.reward_weights, names)
        rewards = calls.check_matrix(call, t, "rewards", batch.rewards, n, len(names))
        all_rewards = calls.check_matrix(call, t, "all_rewards", batch.all_rewards, None, len(names))
        if total is not None and all_rewards.shape[0] != total:
            raise TapCallError(call, "all_rewards", t, f"has {all_rewards.shape[0]} rows for a global batch of {total}")
        pids = [calls.check_ids(call, t, "prompt_ids", x, self.vocab, i) for i, x in enumerate(batch.prompt_ids)]
        cids = [calls.check_ids(call, t, "completion_ids", x, self.vocab, i) for i, x in enumerate(batch.completion_ids)]
        adv = [calls.check_real(call, t, f"advantages[{i}]", a) for i, a in enumerate(batch.advantages)]
        sampler = None
        if batch.logp_sampler is not None:
            calls.check_rows(call, t, "logp_sampler", batch.logp_sampler, n)
            sampler = [calls.check_real(call, t, f"logp_sampler[{i}]", v) for i, v in enumerate(batch.logp_sampler)]
        self._high = self._generated = t
        return Generation(step=t, prompts=list(batch.prompts), completions=list(batch.completions), prompt_ids=pids,
                          completion_ids=cids, rewards=rewards, all_rewards=all_rewards, reward_names=names,
                          reward_weights=weights, advantages=adv, group_size=group, offset=offset, total=total,
                          examples=batch.examples, logp_sampler=sampler)

    def _name_prompts(self, fresh: list[Row], offset: int, group: int) -> None:
        """The planned pair's prompt texts as the trainer recorded them for its rollouts (an
        adapter that asked for extras before it had the texts passed empty ones)."""
        pair = self._planned
        if pair is None:
            return
        for g, (text, ids, example) in list(pair.prompts.items()):
            i = g * group - offset
            if not text and 0 <= i < len(fresh):
                pair.prompts[g] = (fresh[i].prompt, ids, example)
                for r in pair.side_a:
                    if r.group == f"h{g}":
                        r.prompt = fresh[i].prompt

    def _score_generation(self, t: int, fresh: list[Row], group: int, offset: int, total: int) -> None:
        kept = self._prev if self._prev is not None and self._prev[0] == t - self.reuse else None
        done, self._completing = self._completing, None
        side_b, self._side_b = self._side_b, []
        fuse = self.settings.loss_forward and self.reuse == 1 and self._head_is_linear and not self._copy
        if kept is None or done is None or done.step != kept[0]:
            self._await_or_score(t, fresh, None, None, set(), fuse)
            return
        prev_step, params = kept
        if done.plan.shape.per_group:  # two-sided, on the extra completions of both generations
            self._await_or_score(t, fresh, None, None, set(), fuse)
            if not sum(self.gather([len(side_b)])):  # this generation could not take side b: no pair
                self.plans[prev_step] = Plan(None, (), done.plan.probability, "no_side_b")
                self._set_late(prev_step, {"tap_groups": 0})
                return
            side_a = done.side_a
            self._score_extras(side_b, params, prev_step, drawn_by_new=True)
            self._score_extras(side_a, params, prev_step, drawn_by_new=False)
            for r in side_a + side_b:
                r.step, r.logp_prev_step = t, prev_step
            self._pending_extra.extend(side_a + side_b)
            self._record_d_t(prev_step, [(r.group, True, r) for r in side_a] + [(r.group, False, r) for r in side_b])
            return
        # one-sided: the measured groups among this generation's rollouts, chosen now
        n_groups = max(1, total // group)
        chosen = set(self.budget.choose(n_groups, done.plan.shape.groups))
        scored = {id(p) for i, p in enumerate(fresh) if (offset + i) // group in chosen}
        self._await_or_score(t, fresh, prev_step, params, scored, fuse)

    def _await_or_score(self, t: int, fresh: list[Row], prev_step: int | None, params, scored: set[int],
                        fuse: bool) -> None:
        """The rollouts' own log pi_t and entropy -- and, one-sided, the scored rows under the kept
        policy -- from the trainer's loss forward (``fuse``) or passes of the tap's own."""
        if fuse:
            self._awaiting = _Awaiting(t, prev_step, params, fresh, scored)
            return
        rows = [p for p in fresh if id(p) in scored] if params is not None else []
        with self._clock("fixed"):  # every rollout's own numbers: paid whatever the budget measures
            own = self._score(fresh, None, t)
        if rows:  # one-sided: the measured rows under the kept policy as well (their own side again)
            self._score(rows, params, prev_step)
        total_ent, tokens = (sum(x) for x in zip(*self.gather([own])))
        if tokens > 0:
            self._set_late(t, {"entropy": total_ent / tokens})
        if params is not None:
            self._record_d_t(prev_step, [(p.group, False, p) for p in rows])

    def _score_extras(self, rows: list[Row], params: dict[str, torch.Tensor], prev_step: int,
                      drawn_by_new: bool) -> None:
        """Both policies' numbers for extra rows: the drawing policy's from the hidden states of its
        generation where captured (``row.hidden``), the other's by a forward pass."""
        if not rows and self.world == 1:
            return
        with torch.no_grad():
            chunks = [rows[a:a + self.chunk] for a in range(0, len(rows), self.chunk)]
            if self.sharded:
                most = max(self.gather([len(chunks)]))
                chunks += [[]] * (most - len(chunks))
            for chunk in chunks:
                items = [(p.prompt_ids, p.completion_ids) for p in chunk] or [self._filler]
                ids, att, comp, pw = self._batch(items)
                have = bool(chunk) and all(p.hidden is not None for p in chunk)
                t0 = time.perf_counter()
                if drawn_by_new:  # side b: pi_t's own numbers from its generation, pi_prev's by a pass
                    new = self._from_hidden(chunk, comp, None) if have else self._forward(None, ids, att).positions(pw - 1, -1)
                    old = self._forwards_under(params, [(ids, att)])[0].positions(pw - 1, -1)
                else:  # side a: pi_prev's numbers from its generation, pi_t's by a pass
                    new = self._forward(None, ids, att).positions(pw - 1, -1)
                    old = (self._from_hidden(chunk, comp, params) if have
                           else self._forwards_under(params, [(ids, att)])[0].positions(pw - 1, -1))
                passes = int(att.sum()) * (1 if have else 2)
                if not chunk:
                    continue
                s = score_blocked(new, old, ids[:, pw:], comp)
                _keep_scores(chunk, s, prev_step)
                self._unit_samples.append(("forward", time.perf_counter() - t0, passes))
        for p in rows:
            p.hidden = None

    def _from_hidden(self, rows: list[Row], comp: torch.Tensor, params: dict[str, torch.Tensor] | None):
        """The drawing policy's logits over the rows' completion positions from the hidden states
        its generation produced, mapped by its output layer (the live one, or the kept ``params``')."""
        head = self.model.get_output_embeddings()
        weight = head.weight if params is None or self._head_key not in params else params[self._head_key]
        width = comp.shape[1]
        h0 = rows[0].hidden
        hidden = h0.new_zeros((len(rows), width, h0.shape[-1]))
        for i, p in enumerate(rows):
            hidden[i, :len(p.hidden)] = p.hidden
        return BlockedLogits(hidden, weight.detach(), None if head.bias is None else head.bias.detach(),
                             self.temperature)

    def _record_d_t(self, prev_step: int, rows: list[tuple[str, bool, Row]]) -> None:
        """D of the pair (prev_step, the generation's step) from the scored rows of every process
        (gathered: every process calls it); a row's bool: drawn by the earlier policy (side a)."""
        got = self.gather([(g, a, r.logp_pre - r.logp_prev, r.kl_prev) for g, a, r in rows
                           if r.logp_pre is not None and r.logp_prev is not None])
        if self.reuse != 1 or not got:
            return
        groups = np.array([x[0] for x in got])
        labels, codes = np.unique(groups, return_inverse=True)
        side = np.array([x[1] for x in got], dtype=bool)
        # the measured groups are a sample of the step's where the budget measured a subset: the SE
        # is then two-stage, the books' (``paired.group_sampling``), of D over all the step's groups
        share = min(1.0, len(labels) / max(self._groups_total.get(prev_step, len(labels)), 1))
        mean, se = independent_d_t(np.array([x[2] for x in got]), side if side.any() else None,
                                   np.array([x[3] for x in got]), codes, len(labels), share=share)
        name = "independent_two_sided" if side.any() else "independent_next"
        self.estimates.setdefault(prev_step, {})[name] = KlEstimate(mean, se, len(got), (), name)
        if self.estimator == "independent":
            self._set_late(prev_step, {"kl_to_previous": mean, "kl_to_previous_se": se if se == se else None,
                                       "kl_to_previous_estimator": name})

    def _score(self, items: list[Row], params: dict[str, torch.Tensor] | None, prev_step: int | None
               ) -> tuple[float, float]:
        """logp_pre under the live policy and, with ``params``, logp_prev and kl_prev under it, for
        every item (``chunk`` sequences at a time). Returns the live policy's summed token entropy
        along the items and their token count (every process makes as many passes under FSDP2)."""
        ent = tokens = 0.0
        if not items and not self.sharded:
            return ent, tokens
        with torch.no_grad():
            chunks = [items[a:a + self.chunk] for a in range(0, len(items), self.chunk)]
            if self.sharded:
                most = max(self.gather([len(chunks)]))
                chunks += [[]] * (most - len(chunks))
            batches = [self._batch([(p.prompt_ids, p.completion_ids) for p in chunk] or [self._filler])
                       for chunk in chunks]
            t0 = time.perf_counter()
            olds = iter(self._forwards_under(params, [(b[0], b[1]) for b in batches])) if params is not None else None
            passes = 0
            for chunk, (ids, att, comp, pw) in zip(chunks, batches):
                new = self._forward(None, ids, att).positions(pw - 1, -1)
                old = next(olds).positions(pw - 1, -1) if olds is not None else None
                passes += int(att.sum()) * (2 if olds is not None else 1)
                if not chunk:
                    continue
                s = score_blocked(new, old, ids[:, pw:], comp)
                _keep_scores(chunk, s, prev_step if params is not None else None)
                ent += float(s.entropy_new.sum())
                tokens += float(comp.sum())
            if params is not None and passes:
                self._unit_samples.append(("forward", time.perf_counter() - t0, passes))
        return ent, tokens

    # ------------------------------------------------------------------ 4: the loss forward
    def awaiting(self, ids: Sequence[int]) -> bool:
        """True when rows of this generation (global indices ``ids``) wait for the loss forward."""
        aw = self._awaiting
        return aw is not None and bool(ids) and all(
            (p := self._pending.get(i)) is not None and p.step == aw.step for i in ids)

    @contextmanager
    def loss_hidden(self):
        """The decoder's last hidden states during the trainer's loss forward, one tensor per call,
        detached (the output layer may be fused into the loss and never called: the decoder is hooked)."""
        model = self.model
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        seen: list[torch.Tensor] = []
        if decoder is None or decoder is model:
            yield seen
            return

        def keep(m, args, out):
            h = getattr(out, "last_hidden_state", None)
            if h is None and isinstance(out, tuple) and out:
                h = out[0]
            if isinstance(h, torch.Tensor):
                seen.append(h.detach())

        handle = decoder.register_forward_hook(keep)
        try:
            yield seen
        finally:
            handle.remove()

    @torch.no_grad()
    def score_from_loss(self, ids: Sequence[int], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                        hidden: list[torch.Tensor]) -> None:
        """A micro-batch of the awaiting generation (rows ``ids``, TRL's padded layout: prompts
        left-padded, completions right-padded): log pi_t and entropy from the loss forward's hidden
        states; one-sided, the scored rows under the kept policy by a functional call."""
        with self._clock("fixed"):  # the rollouts' own numbers: paid whatever the budget measures
            aw = self._awaiting
            rows = [self._pending[i] for i in ids]
            full_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            att = torch.cat([prompt_mask, completion_mask], dim=1)
            pw, cw = prompt_ids.shape[1], completion_ids.shape[1]
            comp = completion_mask.bool().cpu()
            targets = completion_ids.cpu()
            h = torch.cat(hidden, dim=0) if hidden else None
            head = self.model.get_output_embeddings()
            if h is not None and h.shape[0] == len(rows) and h.shape[1] == pw + cw:
                new = BlockedLogits(h, head.weight.detach(), None if head.bias is None else head.bias.detach(),
                                    self.temperature).positions(pw - 1, -1)
            else:
                new = self._forward(None, full_ids, att).positions(pw - 1, -1)
            s = score_blocked(new, None, targets, comp)
            _keep_scores(rows, s, None)
            aw.entropy += float(s.entropy_new.sum())
            aw.tokens += float(comp.sum())
            if aw.params is not None:
                sel = [j for j, r in enumerate(rows) if id(r) in aw.scored]
                if sel:
                    with self._clock("measure"):  # one-sided: the measured rows under the kept policy
                        idx = torch.tensor(sel)
                        t0 = time.perf_counter()
                        old = self._forward(aw.params, full_ids[idx], att[idx]).positions(pw - 1, -1)
                        s2 = score_blocked(new.rows(idx), old, targets[idx], comp[idx])
                        _keep_scores([rows[j] for j in sel], s2, aw.prev_step)
                        self._unit_samples.append(("forward", time.perf_counter() - t0, int(att[idx].sum())))

    def _finish_awaiting(self) -> None:
        """After the step's micro-batches (every process): what no micro-batch scored, the step's
        entropy along its rollouts and, one-sided, D of the pair."""
        aw, self._awaiting = self._awaiting, None
        self._score([p for p in aw.rows if p.logp_pre is None], None, aw.step)  # not expected in GRPO
        if aw.params is not None:
            self._score([p for p in aw.rows if id(p) in aw.scored and p.logp_prev is None], aw.params, aw.prev_step)
        ent, tokens = (sum(x) for x in zip(*self.gather([(aw.entropy, aw.tokens)])))
        if tokens > 0:
            self._set_late(aw.step, {"entropy": ent / tokens})
        if aw.params is not None:
            self._record_d_t(aw.prev_step, [(p.group, False, p) for p in aw.rows if id(p) in aw.scored])

    # ------------------------------------------------------------------ policies
    @contextmanager
    def policy(self, params: dict[str, torch.Tensor]):
        """The model with ``params`` (a kept snapshot) in place of its own parameters and back,
        without gradients: swapped by reference beside whole parameters; copied in (the live
        values parked in host memory meanwhile) when kept on the host or as FSDP2 shards."""
        self._reshard()
        named = dict(self.model.named_parameters())
        saved = {}
        try:
            with torch.no_grad():
                for name, value in params.items():
                    live = named[name]
                    if self._copy:
                        saved[name] = _local(live.detach()).to("cpu", copy=True)
                        _local(live.data).copy_(value)
                    else:
                        saved[name] = live.data
                        live.data = value
            yield self.model
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    if self._copy:
                        _local(named[name].data).copy_(value)
                    else:
                        named[name].data = value
            self._reshard()

    def _reshard(self) -> None:
        """Under FSDP2, drop every gathered parameter so the next forward gathers the shards as
        they are now (a module kept unsharded after an eval forward would use stale parameters)."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _forwards_under(self, params: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]):
        if not self._copy:
            return [self._forward(params, ids, att) for ids, att in batches]
        with self.policy(params):
            return [self._forward(None, ids, att, own_head=True) for ids, att in batches]

    def _forward(self, params: dict[str, torch.Tensor] | None, ids: torch.Tensor, mask: torch.Tensor,
                 own_head: bool = False):
        """The policy's logits over ``ids`` (at the sampling temperature), under the live
        parameters or ``params``: ``BlockedLogits`` where the output layer is a plain linear map,
        else ``WholeLogits``. ``own_head``: the output layer is cloned (it is swapped back after)."""
        model = self.model
        dev = next(model.parameters()).device
        kwargs = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        blocked = not self.sharded and self._head_is_linear
        hidden: list[torch.Tensor] = []
        if blocked:
            def keep(m, inputs):
                hidden.append(inputs[0])
                return (inputs[0][..., :0, :],)
            handle = head.register_forward_pre_hook(keep)
        try:
            if params is None:
                logits = model(**kwargs).logits
            else:
                logits = torch.func.functional_call(model, params, args=(), kwargs=kwargs).logits
        finally:
            if blocked:
                handle.remove()
        if not blocked:
            return WholeLogits((logits.float() / self.temperature).cpu())
        key = self._head_key
        weight = head.weight if params is None or key not in params else params[key]
        bias = head.bias
        if own_head:
            weight = weight.detach().clone()
            bias = None if bias is None else bias.detach().clone()
        return BlockedLogits(hidden[0], weight, bias, self.temperature)

    def _batch(self, items: list[tuple[torch.Tensor, torch.Tensor]]):
        """Left-pad prompts, right-pad completions (TRL's layout): ids, attention mask, the
        completion-token mask, and the prompt width."""
        pad = self.pad_id
        pw = max(len(p) for p, _ in items)
        cw = max(max(len(c) for _, c in items), 1)
        ids = torch.full((len(items), pw + cw), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        comp = torch.zeros((len(items), cw), dtype=torch.bool)
        for i, (p, c) in enumerate(items):
            ids[i, pw - len(p):pw] = p
            ids[i, pw:pw + len(c)] = c
            att[i, pw - len(p):pw + len(c)] = 1
            comp[i, :len(c)] = True
        return ids, att, comp, pw

    # ------------------------------------------------------------------ 5: the optimizer step
    def used(self, ids: Sequence[int]) -> None:
        """Rows (global indices) a micro-batch trained on (for ``estimator='exact'``)."""
        self._used.extend(int(i) for i in ids)

    def before_optimizer_step(self, step: int, *, learning_rate: float, grad_norm_unclipped: float | None,
                              max_grad_norm: float | None, beta: float | None = None) -> None:
        """After the gradients of step t, before ``optimizer.step()``: the applied gradient's norm,
        and pi_t's snapshot (kept to the next generation where a pair is measured)."""
        call = "before_optimizer_step"
        step = self._step_in_order(call, step)
        if step <= self._optimized:
            raise TapCallError(call, "step", step, f"optimizer step {self._optimized} was handed over already: each "
                                                   "optimizer step comes once, after the last one")
        if self._before is not None:
            raise TapCallError(call, "step", step, f"before_optimizer_step of step {self._before} had no "
                                                   "after_optimizer_step")
        learning_rate = calls.check_real(call, step, "learning_rate", learning_rate, optional=False)
        grad_norm_unclipped = calls.check_real(call, step, "grad_norm_unclipped", grad_norm_unclipped)
        max_grad_norm = calls.check_real(call, step, "max_grad_norm", max_grad_norm)
        beta = calls.check_real(call, step, "beta", beta)
        self._high = self._optimized = self._before = step
        if self._awaiting is not None:
            was = self.model.training
            self.model.eval()
            try:
                with self._clock("measure"):
                    self._finish_awaiting()
            finally:
                self.model.train(was)
        with self._clock("fixed"):
            params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
            grads = [_local(p.grad.detach()) for p in params.values() if p.grad is not None]
            sq = float(sum((g.double() ** 2).sum() for g in grads)) if grads else 0.0
            if self.sharded:
                sq = sum(self.gather([sq]))
            row = {"step": step, "learning_rate": float(learning_rate), "grad_norm": math.sqrt(sq),
                   "grad_norm_unclipped": grad_norm_unclipped,
                   "max_grad_norm": float(max_grad_norm) if max_grad_norm else None,
                   "beta": None if beta is None else float(beta)}
            self._row = {**self._late.pop(step, {}), **row}
            if self._host:
                pin = next(iter(params.values())).is_cuda if params else False
                self._snapshot = {n: torch.empty(_local(p).shape, dtype=p.dtype, pin_memory=pin).copy_(_local(p.detach()))
                                  for n, p in params.items()}
            else:
                self._snapshot = {n: _local(p.detach()).clone() for n, p in params.items()}

    def after_optimizer_step(self, step: int) -> None:
        """After ``optimizer.step()``: the update's norm; pi_t kept for the next generation."""
        call = "after_optimizer_step"
        step = calls.check_step(call, step)
        if self._before is None or self._snapshot is None:
            raise TapCallError(call, "step", step, "came without before_optimizer_step: call it after the "
                                                   "gradients, before optimizer.step()")
        if step != self._before:
            raise TapCallError(call, "step", step, f"follows before_optimizer_step of step {self._before}")
        self._before = None
        with self._clock("fixed"):
            snap = self._snapshot
            with torch.no_grad():
                sq = float(sum(((_local(p.detach()) - snap[n].to(p.device)) ** 2).sum().double()
                               for n, p in self.model.named_parameters() if n in snap))
            if self.sharded:
                sq = sum(self.gather([sq]))
            self._row["update_norm"] = math.sqrt(sq)
        used = [i for i in dict.fromkeys(self._used) if i in self._pending]
        self._used = []
        if self.estimator == "exact" and (used or self.world > 1):
            was = self.model.training
            self.model.eval()
            try:
                with self._clock("measure"):
                    est = self._exact(used, step, snap)
            finally:
                self.model.train(was)
            if est is not None:
                self.estimates.setdefault(step, {})["exact"] = est
                self._row.update(kl_to_previous=est.mean, kl_to_previous_se=est.se,
                                 kl_to_previous_estimator=est.estimator)
        plan = self.plans.get(step)
        if step % self.reuse == 0:  # a generation step: its policy kept where a pair starting here is measured
            self._prev = (step, snap) if self.paired and (plan is None or plan.measured) else None
        if plan is not None:
            self._row.update(tap_budget=self.settings.budget, tap_probability=plan.probability,
                             tap_groups=len(plan.groups) if plan.measured else 0,
                             tap_per_group=plan.shape.per_group if plan.shape else None)
        self._snapshot = None

    @torch.no_grad()
    def _exact(self, used: list[int], t: int, snap: dict[str, torch.Tensor]) -> KlEstimate | None:
        """D_t from ``n_exact`` fresh samples of pi_{t+1} for step t's prompts (its own sampler:
        a validation estimator, not the default)."""
        from reward_lens.measure.whitebox.policy import sample

        prompts = list(dict.fromkeys(tuple(self._pending[i].prompt_ids.tolist()) for i in used))
        share = self.n_exact // self.world + (1 if self.rank < self.n_exact % self.world else 0)
        per = []
        cap = self._cap
        for k, prompt in enumerate(prompts):
            m = share // len(prompts) + (1 if k < share % len(prompts) else 0)
            if m == 0:
                continue
            seqs = sample(self.model, list(prompt), m, cap, self.eos_id, self.pad_id,
                          self.seed + 7919 * t + k + 104729 * self.rank, temperature=self.temperature)
            ids, comp_full = seqs.ids, seqs.completion_mask
            att = torch.ones_like(ids)
            new = self._forward(None, ids, att).positions(0, -1)
            (old,) = self._forwards_under(snap, [(ids, att)])
            old = old.positions(0, -1)
            per.extend(score_blocked(new, old, ids[:, 1:], comp_full[:, 1:]).kl.tolist())
        per = self.gather(per)
        return KlEstimate.of(per) if len(per) > 1 else None

    _cap = 256  # the exact estimator's length cap (the adapter sets the trainer's)

    # ------------------------------------------------------------------ 6: the end of a step
    def begin(self) -> None:
        """Training starts: the first step's time is counted from here."""
        self._step_started = time.perf_counter()
        self._clock.take()

    def end_step(self, step: int) -> bool:
        """After optimizer step ``step``: telemetry committed, finished rows written, the record
        flushed every ``flush_every`` steps, the budget fed, the live findings evaluated every
        ``check_every`` steps. Returns True when a live finding at ``stop_on`` or above holds
        (on every process alike)."""
        step = self._step_in_order("end_step", step)
        if self._before is not None:
            raise TapCallError("end_step", "step", step, f"before_optimizer_step of step {self._before} had no "
                                                         "after_optimizer_step")
        self._high = step
        with self._clock("fixed"):
            t = step
            if self._row:
                self._commit_row(self._row)
                self._row = {}
            for s in sorted(x for x in self._late if x <= t):
                self._commit_row({"step": s, **self._late.pop(s)})
            ready = sorted(i for i, p in self._pending.items() if p.step + self.reuse - 1 <= t)
            self._write(ready)
            if (t + 1) % self.flush_every == 0 and self.stream is not None:
                self.stream.flush()
            stop = self._check(t) if self.check_every and (t + 1) % self.check_every == 0 else False
        now = time.perf_counter()
        spent = self._clock.take()
        wall = now - self._step_started
        self._step_started = now
        tap = spent["fixed"] + spent["measure"]
        units = self.gather([(wall, tap, spent["fixed"], list(self._unit_samples))])
        self._unit_samples = []
        self.budget.observe_step(max(u[0] for u in units), max(u[1] for u in units), max(u[2] for u in units))
        for _, _, _, samples in units:
            for kind, seconds, *counts in samples:
                if kind == "forward":
                    self.budget.observe_forward(seconds, counts[0])
                else:
                    rows, steps, extra = counts
                    self.budget.observe_generation(seconds, rows, extra, steps)
        self.set_telemetry(step, tap_seconds=tap, step_seconds=wall)
        self._log_acc.setdefault(LOGGED["tap_seconds"], []).append(tap)
        return stop

    def _check(self, t: int) -> bool:
        """The live findings on the steps so far (rank 0 holds the telemetry): each logged as
        ``reward_lens/finding/<id>`` (1 while it holds), a warning the first time one holds; True
        on every process when one at ``stop_on`` or above holds."""
        from reward_lens.findings import RANK

        stop = False
        if self.stream is not None:
            rows, self._unchecked = self._unchecked, []
            tel, self._unchecked_tel = self._unchecked_tel, {}
            held = []
            for f in self.live.observe(t, rows, None, tel):  # the steps so far, as `check` would read them
                if f.status == "not_evaluated":
                    continue
                self._log_acc.setdefault(f"reward_lens/finding/{f.id}", []).append(1.0 if f.status == "holds" else 0.0)
                if f.status == "holds":
                    held.append(f.id)
                    if f.id not in self.findings_warned:
                        self.findings_warned.add(f.id)
                        logger.warning("reward-lens: %s (%s) from step %s: %s", f.title, f.severity, f.onset, f.evidence)
                    if self.stop_on is not None and RANK[f.severity] >= RANK[self.stop_on]:
                        stop = True
            if held:
                self.findings_log[t] = held
        if self.stop_on is not None:
            stop = any(self.gather([stop]))
        return stop

    def _batch_rewards(self, t: int, total: np.ndarray, group: int) -> None:
        if not len(total):
            return
        groups = [total[i:i + group] for i in range(0, len(total), group)]
        sized = [g for g in groups if len(g) > 1]
        values = {"reward_mean": float(np.mean(total))}
        if sized:
            values["frac_reward_zero_std"] = float(np.mean([np.ptp(g) == 0 for g in sized]))
        plan = self.plans.get(t)
        if plan is not None:
            values["tap_groups_total"] = max(1, len(total) // group)
        self._late.setdefault(t, {}).update(values)

    def set_telemetry(self, step: int, **values: Any) -> None:
        """Telemetry of a committed step, measured after it (e.g. a trainer's logged KL to the
        reference): into the record and the live findings' series. A value that is not a finite
        number is stored as null and kept in the manifest's ``non_finite`` list."""
        step = calls.check_step("set_telemetry", step)
        bad = {k: v for k, v in values.items() if calls.is_bad_float(v)}
        self._non_finite([calls.non_finite(step, k, v, calls.TELEMETRY_SOURCE.get(k, f"set_telemetry({k})"))
                          for k, v in bad.items()])
        values = {k: v for k, v in values.items() if k not in bad}
        if self.stream is not None:
            self.stream.set_telemetry(OptimizerTelemetry(step=step, **values))
        if self.check_every and self.stream is not None:  # only rank 0 checks
            for k, v in values.items():
                if isinstance(v, float):
                    self._unchecked_tel.setdefault(step, {})[k] = v

    def _commit_row(self, row: dict[str, Any]) -> None:
        # a value that is not a finite number is data about the run: null, and an entry of the
        # manifest's non_finite list naming the call that handed it over
        bad = {k: v for k, v in row.items() if calls.is_bad_float(v)}
        self._non_finite([calls.non_finite(row["step"], k, v, calls.TELEMETRY_SOURCE.get(k, k)) for k, v in bad.items()])
        row = {k: v for k, v in row.items() if v is not None and k not in bad}
        if self.stream is not None:
            self.stream.set_telemetry(OptimizerTelemetry(**row))
        if self.check_every and self.stream is not None:  # the live findings read what was committed since
            for k, v in row.items():                      # their last check (only rank 0 checks)
                if k != "step" and isinstance(v, float):
                    self._unchecked_tel.setdefault(row["step"], {})[k] = v
        for key, name in LOGGED.items():
            if key in row and key != "tap_seconds":
                self._log_acc.setdefault(name, []).append(float(row[key]))

    def _write(self, ready: list[int]) -> None:
        """Rank 0 writes every process's finished rollouts and the scored extra rows, in global order."""
        rows = [self._pending.pop(i) for i in ready]
        extra, self._pending_extra = self._pending_extra, []
        rows = [(r.order, *r.rollout()) for r in rows]
        extra = [(r.order, *r.rollout()) for r in extra]
        if self.world > 1:
            rows = self.gather(rows)
            extra = self.gather(extra)
        if self.stream is not None:
            self._non_finite([e for _, _, bad in sorted(rows + extra, key=lambda x: x[0]) for e in bad])
            rows = [(o, r) for o, r, _ in rows]
            extra = [(o, r) for o, r, _ in extra]
            if rows:
                rows = [r for _, r in sorted(rows, key=lambda x: x[0])]
                self.stream.add_rollouts(rows)
                if self.check_every:
                    self._unchecked.extend(rows)
            if extra:
                self.stream.add_heldout([r for _, r in sorted(extra, key=lambda x: x[0])])

    def drain_log(self) -> dict[str, float]:
        """The tap's numbers since the last call, for the trainer's own logs (means per key)."""
        out = {name: sum(v) / len(v) for name, v in self._log_acc.items() if v}
        self._log_acc = {}
        return out

    def end(self, last_step: int) -> None:
        """At the end of training: the rows left written, the telemetry of the steps before
        ``last_step`` committed, the record flushed. Extra completions of a pair whose next
        generation never came are dropped (they have no second side)."""
        self._write(sorted(self._pending))
        for s in sorted(x for x in self._late if x < last_step):
            self._commit_row({"step": s, **self._late.pop(s)})
        if self.stream is not None:
            self.stream.flush()
