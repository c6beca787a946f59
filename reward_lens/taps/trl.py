"""The TRL tap: a reward-lens record written while ``GRPOTrainer`` trains, with D_t.

One line in a GRPO script::

    from reward_lens.taps.trl import RewardLensTap

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    RewardLensTap.attach(trainer, "runs/my-run")  # <- the tap
    trainer.train()

``attach`` adds a ``TrainerCallback`` and wraps four methods *of this trainer instance* (no
class is patched): ``_generate_and_score_completions`` (to see every rollout as generated:
exact token ids, per-function rewards, advantages, and to score it), ``compute_loss`` (to see
which rollouts each micro-batch used, so the record is right under gradient accumulation and
TRL's shuffling), ``_get_grad_norm`` (what ``clip_grad_norm_`` returned) and ``log``.

Per optimizer step t (pi_t -> pi_{t+1}) it records the learning rate the optimizer used,
``grad_norm_unclipped`` (the clip function's return value), ``grad_norm`` (the norm of the
gradient actually applied, measured after clipping), ``max_grad_norm``, ``update_norm``
(||theta_{t+1} - theta_t||, measured around ``optimizer.step()``), ``beta``, ``kl_to_ref``
when TRL computes it (per-token mean; recorded only with ``logging_steps=1``), the policy's
token ``entropy`` along its own rollouts, and ``kl_to_previous`` = D_t in nats per sequence
with its standard error and the estimator that produced it.

D_t is measured on samples independent of the step, never along the rollouts it trained on
(there the update inflates log pi_{t+1}/pi_t: that estimate read 0.36-11x the truth). The tap
keeps pi_t's parameters from ``on_pre_optimizer_step`` until the next generation, and when
step t+1 generates (before any gradient of it):

* its rollouts y ~ pi_{t+1} are scored under both policies: ``logp_pre`` = log pi_{t+1}(y),
  ``logp_prev`` = log pi_t(y), and ``kl_prev`` = the full-vocabulary token KL(pi_{t+1} || pi_t)
  summed along y's prefixes (chain rule: unbiased for D_t, Rao-Blackwellised);
* with ``heldout=h`` (default 4) it draws h completions per prompt from pi_t itself (pi_t's
  parameters swapped into the model for the draw, at the trainer's temperature; never in the
  loss), scores them the same way, and has the trainer's reward functions score them: the
  second side of the paired ledger (``heldout-*.parquet`` in the record, filed under step t+1).
  A step that sharpens the policy is then estimated from the side that covers it (the
  paired ledger's module says why and what was measured);
* D_t, recorded as step t's ``kl_to_previous`` (estimator ``independent_two_sided``, or
  ``independent_next`` with ``heldout=0``), is the token KL along both samples combined by
  multiple importance sampling, its standard error across prompt groups. The last step has no
  next generation and no D_t.

Cost per step: one forward pass over the step's rollouts (pi_t, by a functional call on the kept
parameters): pi_{t+1}'s side of their scores is computed from the decoder's last hidden states
in the trainer's own loss forward (``loss_forward=True``; where the snapshot is beside whole
parameters, the model has no dropout on and one generation feeds one step; else a pass of the
tap's own) and, with held-out completions, generating h per prompt from pi_t
and two forward passes over them plus the reward functions; one snapshot of the trainable
parameters (|theta| x their dtype: 26 GiB for a 7B model in float32), beside the model
(``snapshot="device"``, swapped in by reference) or in host memory (``snapshot="cpu"``, pinned
on CUDA, copied in for each scoring pass and back: no second copy on the accelerator). Its
bytes are logged before training, and attach refuses a device snapshot that cannot fit.
``estimator="exact"`` instead samples ``n_exact`` fresh completions from pi_{t+1} for step t's
prompts right after the step (the rollouts are then scored only with ``paired=True``);
``estimator=None`` records the optimizer telemetry and the rollouts only.

With ``use_vllm`` the rollouts are vLLM's samples: where TRL hands over vLLM's per-token
log-probabilities (``sampling_per_token_logps``) the tap records their sum as ``logp_sampler``,
and the paired ledger refuses a step pair whose sampler departs from the policy by more than a
tenth of D_t (``PREMISE_FAILED`` sampler_mismatch); held-out completions are always drawn from
the trained model itself.

Log-probabilities are those of the distribution the trainer sampled from: logits divided by
the trainer's ``temperature`` (as TRL's own loss computes them). ``top_p`` / ``top_k``
truncation is recorded in the manifest but not applied: TRL's loss does not apply it either,
and between two truncated distributions the KL can be infinite; held-out completions are drawn
at the temperature alone, from the distribution the log-probabilities describe. Logits are
computed for ``chunk`` sequences at a time and, where the output layer is a plain linear map,
from the last hidden states a block of positions at a time (``whitebox.kl.BlockedLogits``); no
logits are kept.

Crash safety: the record is flushed every ``flush_every`` steps (new rollout and held-out
segments, rewritten telemetry, then the manifest as the commit point); a run killed mid-way
leaves a readable record of the steps flushed.

With ``num_iterations > 1`` (or ``steps_per_generation > gradient_accumulation_steps``)
rollouts are reused across R steps; they are recorded once, under the step whose policy
sampled them, and the next generation is scored under the policy of the previous generation
step (``logp_prev_step``): the paired ledger prices that window of R steps as one row, and no
per-step D_t is recorded.

Several processes (``accelerate launch`` / ``torchrun``, data-parallel: DDP on CPUs or GPUs).
Each process generates its slice of the global generation batch and holds a full replica of
the parameters, so each scores its own rollouts and draws the held-out completions of the
prompt groups that start in its slice; per-row numbers and finished rows are gathered with the
trainer's own process group (accelerate's ``gather_object``) and rank 0 alone writes. Rollout
and group ids are positions in the global batch, as TRL's ``process_slice`` defines them.
FSDP2 (``fully_shard``: transformers' ``from_pretrained(..., distributed_config=
DistributedConfig(fsdp_size=N))``, or accelerate's FSDP2 plugin): every parameter is a DTensor
of which each process holds 1/N. pi_t is kept as each process's local shards (|theta|/N), and
scoring under it copies them into the live shards and back, every process in lockstep (the
same number of forward passes, held-out draws run to the length cap); gathered parameters are
dropped around each swap, so no forward pass sees a stale gather. DeepSpeed, FSDP1 and
Megatron shard differently: ``attach`` refuses them and names FSDP2.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from reward_lens.measure.ledger.paired import independent_d_t
from reward_lens.measure.whitebox.kl import BlockedLogits, KlEstimate, WholeLogits, score_blocked
from reward_lens.measure.whitebox.policy import sample, sample_prompts
from reward_lens.record.importers.trl_output import record_config
from reward_lens.record.schema import OptimizerTelemetry, Rollout
from reward_lens.record.stream import RecordStream
from reward_lens.taps.settings import tap_settings

INDEX_KEY = "_reward_lens_index"
# accelerate's distributed types that shard the parameters across processes
SHARDED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
# What the tap adds to the trainer's own logs (W&B, TensorBoard, whatever `report_to` names):
# means over the optimizer steps since the previous log. eta is not among them: it needs the
# next step's rollouts and a book-wide noise decision, so it is a report's number, not a log's.
LOGGED = {"kl_to_previous": "reward_lens/kl_to_previous", "update_norm": "reward_lens/update_norm",
          "grad_norm": "reward_lens/grad_norm_clipped", "grad_norm_unclipped": "reward_lens/grad_norm_unclipped",
          "entropy": "reward_lens/entropy"}


@dataclass
class _Pending:
    """A generated rollout (or held-out completion) waiting for its step to end before it is written."""

    step: int
    group: int
    prompt: str
    completion: str
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    reward: float
    rewards: dict[str, float]
    advantage: float | None
    logp_pre: float | None = None
    logp_prev: float | None = None
    logp_prev_step: int | None = None
    kl_prev: float | None = None
    logp_sampler: float | None = None  # under the engine that sampled it (vLLM), where TRL hands it over


@dataclass
class _Awaiting:
    """A generation whose rollouts get their pi_{t+1} side from the trainer's loss forward: the
    previous policy kept until the step's micro-batches have run, the held-out rows already
    scored, and the entropy summed as the micro-batches come."""

    step: int
    prev_step: int | None
    params: dict[str, torch.Tensor] | None
    fresh: list[_Pending]
    held: list[_Pending]
    entropy: float = 0.0
    tokens: float = 0.0


def _keep_scores(rows: list[_Pending], s, prev_step: int | None) -> None:
    """Each row's scores from ``score_blocked``: log pi of the live policy and, when scored under
    the policy of ``prev_step`` too, that log pi and the token KL between the two."""
    for j, p in enumerate(rows):
        p.logp_pre = float(s.logp_new[j])
        if prev_step is not None:
            p.logp_prev, p.kl_prev, p.logp_prev_step = float(s.logp_old[j]), float(s.kl[j]), prev_step


def _dropout_free(model) -> bool:
    """True when the training forward is the policy itself: no dropout that is on."""
    cfg = getattr(model, "config", None)
    if any(float(getattr(cfg, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout",
                                                             "resid_pdrop", "embd_pdrop", "attn_pdrop")):
        return False
    return not any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter or gradient: a DTensor's local shard (FSDP2), else the
    tensor itself; no copy."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sharding(model) -> str | None:
    """None for whole parameters on every process; "fsdp2" when every parameter is a DTensor
    sharded along one mesh dimension (FSDP2's ``fully_shard``); ValueError for other layouts."""
    params = list(model.parameters())
    dt = [p for p in params if hasattr(p, "placements") and hasattr(p, "to_local")]
    if not dt:
        return None
    if len(dt) != len(params):
        raise ValueError("the reward-lens TRL tap found some parameters sharded (DTensor) and others whole: record a "
                         "model sharded whole by FSDP2 (fully_shard), or one not sharded")
    bad = sorted({str(p.placements) for p in dt if not all(type(x).__name__ == "Shard" for x in p.placements)})
    if bad:
        raise ValueError(f"the reward-lens TRL tap records FSDP2 (parameters sharded with Shard placements on one "
                         f"mesh); these parameters are laid out as {bad[:3]} (tensor parallel or replicated HSDP), "
                         "which it does not support")
    return "fsdp2"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def snapshot_plan(n_bytes: int, mode: str, device: str, free: int | None) -> str:
    """Where the tap keeps pi_t (``n_bytes`` of trainable parameters), in words, for the record's
    notes and the log before training; ValueError when ``snapshot='device'`` needs more than the
    accelerator's ``free`` bytes (a second copy that could not fit: say ``snapshot='cpu'``)."""
    if mode == "cpu":
        pinned = ", pinned" if device.startswith("cuda") else ""
        return (f"pi_t is kept in host memory{pinned} ({_gib(n_bytes)}, the trainable parameters), copied into "
                f"the model for each scoring pass and back: no second copy on {device}")
    if device.startswith("cuda") and free is not None and n_bytes > free:
        raise ValueError(f"RewardLensTap: keeping pi_t on {device} takes {_gib(n_bytes)} (a copy of the trainable "
                         f"parameters) and {_gib(free)} is free before training: pass snapshot='cpu' to keep it in "
                         "host memory")
    return f"pi_t is kept on {device} beside the model ({_gib(n_bytes)}, a copy of the trainable parameters)"


def _eos_id(trainer) -> int | None:
    """The token that ends a completion (features such as ``ends_with_eos`` need it)."""
    eos = getattr(trainer.processing_class, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if len(eos) == 1 else None
    return int(eos) if isinstance(eos, int) else None


logger = logging.getLogger("reward_lens")


def _noop(*_a, **_kw) -> None:
    return None


class RewardLensTap(TrainerCallback):
    def __init__(self, trainer, record_dir: str | Path, **settings):
        s = tap_settings(**settings)  # reward_lens/taps/settings.py: the audit validates the same model
        estimator, heldout, flush_every, paired = s.estimator, s.heldout, s.flush_every, s.paired
        n_exact, chunk, save_initial_checkpoint, overwrite, seed, model_description = (
            s.n_exact, s.chunk, s.save_initial_checkpoint, s.overwrite, s.seed, s.model_description)
        self.check_every, self.stop_on = s.check_every, s.stop_on
        self._unchecked: list[Rollout] = []  # rollouts written since the last check of the live findings
        self.findings_warned: set[str] = set()  # live findings already warned about (once each)
        self.findings_log: dict[int, list[str]] = {}  # step -> live findings holding there
        acc = trainer.accelerator
        kind = str(getattr(acc, "distributed_type", "NO")).split(".")[-1]
        accelerate_fsdp2 = kind == "FSDP" and bool(getattr(acc, "is_fsdp2", False))
        if kind in SHARDED and not accelerate_fsdp2:
            raise ValueError(f"the reward-lens TRL tap does not support {kind}: its sharding is not FSDP2's (DTensor "
                             "shards), the one layout in which the tap can keep pi_t as each process's shards and "
                             "score under it in lockstep; shard with FSDP2 instead (GRPOConfig(fsdp='full_shard', "
                             "fsdp_config={'fsdp_version': 2}), or load the model with transformers' "
                             "distributed_config=DistributedConfig(fsdp_size=N)), or record the run data-parallel "
                             "(DDP)")
        self.world = int(getattr(acc, "num_processes", 1) or 1)
        self.rank = int(getattr(acc, "process_index", 0) or 0)
        # FSDP2 (fully_shard, e.g. transformers' from_pretrained(distributed_config=...)): each
        # process holds 1/N of every parameter; pi_t is kept as its local shards, and every
        # forward pass is collective, so the processes score and draw in lockstep.
        # accelerate's FSDP2 plugin shards the model only when training starts (checked then)
        self.sharded = "fsdp2" if accelerate_fsdp2 else _sharding(trainer.model) if hasattr(trainer, "model") else None
        self._accelerate_fsdp2 = accelerate_fsdp2
        if self.sharded:
            if s.estimator == "exact":
                raise ValueError("RewardLensTap: estimator='exact' is not supported under FSDP2 (its per-prompt "
                                 "sampling is not collective); the default estimator, 'independent', is")
            if s.save_initial_checkpoint:
                raise ValueError("RewardLensTap: save_initial_checkpoint is not supported under FSDP2 (the shards "
                                 "would have to be gathered); save checkpoints with the trainer's save_strategy")
        self.trainer = trainer
        self.estimator = estimator
        self.paired = bool(paired) and estimator is not None  # score each generation under the kept previous policy
        self.heldout = int(heldout) if self.paired else 0
        self.n_exact = n_exact
        self.flush_every = int(flush_every)
        self.chunk = chunk
        self.save_initial_checkpoint = save_initial_checkpoint
        self.seed = seed
        self._host = s.snapshot == "cpu"  # pi_t kept in host memory, copied in and back
        self._sampler_noted = False
        self._copy = self._host or bool(self.sharded)  # pi_t copied into the live parameters (not swapped)
        # The rollouts' pi_{t+1} side from the trainer's loss forward: only where pi_t is a
        # functional call away (a snapshot beside whole parameters) and the forward is the policy
        # itself (no dropout), decided at attach; num_iterations 1 is checked at each generation.
        self.loss_forward = (s.loss_forward and estimator == "independent" and bool(paired) and not self._copy
                             and _dropout_free(trainer.model) if hasattr(trainer, "model") else False)
        self._awaiting: _Awaiting | None = None
        self.estimates: dict[int, dict[str, KlEstimate]] = {}
        self._pending: dict[int, _Pending] = {}
        self._pending_heldout: list[_Pending] = []
        self._next_index = 0
        self._used: list[int] = []
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._prev: tuple[int, dict[str, torch.Tensor]] | None = None  # (t, pi_t) kept for the next generation
        self.temperature = float(getattr(trainer, "temperature", None) or getattr(trainer.args, "temperature", 1.0)
                                 or 1.0)
        self._row: dict[str, Any] = {}
        self._late: dict[int, dict[str, Any]] = {}  # telemetry of earlier steps measured at a later generation
        self._log_acc: dict[str, list[float]] = {}
        self._unclipped: float | None = None
        self._generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + 7 + self.rank)
        args = trainer.args
        cfg = record_config(args.to_dict())
        from reward_lens.findings import LiveFindings
        from reward_lens.measure.ledger.basis import load_basis

        self.live = LiveFindings(load_basis(s.features) if s.features else None, cfg, eos_token_id=_eos_id(trainer))
        import trl

        model = trainer.model
        n_params = sum(p.numel() for p in model.parameters())
        first = next(model.parameters(), None)
        dev = str(first.device) if first is not None else "cpu"
        # this process's bytes: 1/N of the parameters under FSDP2 (about 1/N before accelerate shards them)
        self.snapshot_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if accelerate_fsdp2:
            self.snapshot_bytes = -(-self.snapshot_bytes // self.world)
        free = None
        if dev.startswith("cuda") and not self._host and estimator is not None:
            free = torch.cuda.mem_get_info(first.device)[0]
        where = snapshot_plan(self.snapshot_bytes, s.snapshot, dev, free) if estimator is not None else None
        if where and not self.rank:
            logging.getLogger("reward_lens").warning("reward-lens tap: %s", where)
        notes = [f"recorded by the reward-lens TRL tap (estimator {estimator}, held-out {self.heldout} per prompt, "
                 f"flush every {self.flush_every} steps)",
                 f"log-probabilities at the sampling temperature {self.temperature:g}"
                 + ("; step t's rollouts are also scored under pi_{t-1} (logp_prev, kl_prev) for the paired ledger"
                    if self.paired else "")] + ([where] if where else [])
        if getattr(args, "fsdp", None) and kind not in SHARDED:
            # e.g. use_cpu: accelerate runs the model data-parallel and the fsdp setting is not applied
            notes.append(f"the trainer config sets fsdp={args.fsdp!r} but accelerate runs the model as {kind} "
                         "(the fsdp setting was not applied by the launcher): recorded as data-parallel, whole "
                         "parameters on every process")
        if (getattr(args, "top_p", 1.0) or 1.0) < 1.0 or (getattr(args, "top_k", 0) or 0) > 0:
            notes.append(f"sampling truncation top_p={getattr(args, 'top_p', None)}, top_k={getattr(args, 'top_k', None)} "
                         "is not applied to the recorded log-probabilities (as in TRL's loss), nor to the held-out "
                         "completions")
        if args.logging_steps != 1:
            notes.append(f"logging_steps={args.logging_steps}: TRL's `kl` is a window mean, so kl_to_ref is not "
                         "recorded")
        if self.world > 1 and self.sharded:
            notes.append(f"recorded from {self.world} processes under FSDP2 (parameters sharded, 1/{self.world} "
                         "on each; pi_t kept as each process's local shards, copied in and back in lockstep); "
                         "rollouts and D_t gathered over all of them, written by rank 0")
        elif self.world > 1:
            notes.append(f"recorded from {self.world} data-parallel processes; rollouts and D_t gathered over all "
                         "of them, written by rank 0")
        if accelerate_fsdp2:
            notes.append("sharded by accelerate's FSDP2 plugin: the tap's FSDP2 path is tested on CPUs with the model "
                         "sharded by transformers (fully_shard, the same DTensor shards); this launcher itself was "
                         "not run in reward-lens's tests")
        # Only rank 0 writes; the other ranks measure and send what they measured to it.
        self.stream = None if self.rank else RecordStream(record_dir, framework={"name": "trl", "version": trl.__version__},
                                   model={"description": model_description or str(
                                       getattr(model.config, "_name_or_path", "") or type(model).__name__),
                                          "architecture": type(model).__name__, "n_parameters": n_params,
                                          "vocab_size": getattr(model.config, "vocab_size", None),
                                          "eos_token_id": _eos_id(trainer)},
                                   optimizer=str(getattr(args.optim, "value", args.optim)), trainer_config=cfg,
                                   notes=notes, overwrite=overwrite)

    # ------------------------------------------------------------------ attaching
    @classmethod
    def attach(cls, trainer, record_dir: str | Path, **kwargs) -> RewardLensTap:
        """Add the tap to ``trainer`` (one line, before ``trainer.train()``)."""
        tap = cls(trainer, record_dir, **kwargs)
        gen = trainer._generate_and_score_completions
        loss = trainer.compute_loss
        orig_grad_norm = trainer._get_grad_norm

        def generate_and_score(inputs, *a, **kw):
            out = gen(inputs, *a, **kw)
            if trainer.model.training:
                tap._on_generation(out, inputs)
            return out

        def compute_loss(model, inputs, *a, **kw):
            if INDEX_KEY in inputs:
                tap._used.extend(inputs[INDEX_KEY].tolist())
            if tap._awaiting is None or INDEX_KEY not in inputs:
                return loss(model, inputs, *a, **kw)
            with tap._hidden_of_output_layer() as hidden:
                result = loss(model, inputs, *a, **kw)
            tap._score_from_loss(inputs, hidden)
            return result

        def get_grad_norm(model, grad_norm=None):  # noqa: F811 -- transformers passes it by name
            value = orig_grad_norm(model, grad_norm=grad_norm)
            tap._unclipped = float(value.item() if hasattr(value, "item") else value)
            return value

        orig_log = trainer.log

        def log(logs, *a, **kw):  # the tap's numbers go through the trainer's own logging (report_to)
            return orig_log({**logs, **tap._drain_log()} if "loss" in logs or "reward" in logs else logs, *a, **kw)

        trainer._generate_and_score_completions = generate_and_score
        trainer.compute_loss = compute_loss
        trainer._get_grad_norm = get_grad_norm
        trainer.log = log
        trainer.add_callback(tap)
        return tap

    # ------------------------------------------------------------------ generation
    def _on_generation(self, out: dict[str, Any], inputs: list[dict[str, Any]] | None = None) -> None:
        tr = self.trainer
        n = out["completion_ids"].shape[0]
        # TRL's own layout of the global batch: equal slices, rank-major (its process_slice);
        # rewards, prompts and completions in its logs are gathered over all ranks.
        total, offset = n * self.world, n * self.rank
        t = tr.state.global_step
        names = list(tr.reward_func_names)
        weights = tr.reward_weights.detach().cpu().numpy().astype(float)
        logged = {name: list(tr._logs["rewards"][name])[-total:] for name in names}
        prompts = list(tr._logs["prompt"])[-total:]
        completions = list(tr._logs["completion"])[-total:]
        if len(prompts) != total or any(len(v) != total for v in logged.values()):
            raise RuntimeError(f"reward-lens tap: TRL logged {len(prompts)} prompts for a generation batch of "
                               f"{n} x {self.world} processes; the tap cannot place this rank's rollouts")
        everyone = np.array([[logged[name][j] for name in names] for j in range(total)], float).reshape(total, len(names))
        self._batch_rewards(t, np.nansum(everyone * weights, axis=1), max(1, int(tr.num_generations)))
        rewards = everyone[offset:offset + n]
        prompts, completions = prompts[offset:offset + n], completions[offset:offset + n]
        group = max(1, int(tr.num_generations))
        idx = torch.arange(self._next_index + offset, self._next_index + offset + n)
        self._next_index += total
        fresh, starts = [], []  # this rank's rollouts, and those that begin a prompt group
        # Where an inference engine sampled the rollouts (vLLM), TRL hands over its per-token
        # log-probabilities (processed: at the sampling temperature): summed, the sequence's.
        sampler = out.get("sampling_per_token_logps")
        if sampler is not None and not self._sampler_noted and self.stream is not None:
            self._sampler_noted = True
            self.stream.add_note("the rollouts were sampled by an inference engine (TRL's sampling_per_token_logps, "
                                 "e.g. vLLM), not by the trained model: each rollout's log-probability under it is "
                                 "recorded as logp_sampler, and the paired ledger refuses a step pair whose engine "
                                 "departs from the policy by more than a tenth of D_t (PREMISE_FAILED "
                                 "sampler_mismatch)")
        for i in range(n):
            pmask = out["prompt_mask"][i].bool().cpu()
            cmask = out["completion_mask"][i].bool().cpu()
            self._pending[int(idx[i])] = p = _Pending(
                step=t, group=(offset + i) // group, prompt=str(prompts[i]), completion=str(completions[i]),
                prompt_ids=out["prompt_ids"][i].cpu()[pmask], completion_ids=out["completion_ids"][i].cpu()[cmask],
                reward=float(np.nansum(rewards[i] * weights)),
                rewards={nm: float(v) for nm, v in zip(names, rewards[i]) if not math.isnan(v)},
                advantage=float(out["advantages"][i]))
            if sampler is not None:
                tokens = sampler[i].detach().double().cpu()[cmask]
                # a token vLLM gave no log-probability (NaN) leaves the sequence's unknown
                p.logp_sampler = float(tokens.sum()) if bool(torch.isfinite(tokens).all()) else None
            fresh.append(p)
            if (offset + i) % group == 0:  # a group straddling two ranks is drawn on the first
                starts.append(i)
        out[INDEX_KEY] = idx.to(out["completion_ids"].device)
        if self.paired:
            model = tr.model
            was = model.training
            model.eval()
            try:
                self._score_generation(t, fresh, starts, inputs)
            finally:
                model.train(was)

    def _score_generation(self, t: int, fresh: list[_Pending], starts: list[int],
                          inputs: list[dict[str, Any]] | None) -> None:
        """Score step t's new rollouts under pi_t (live) and the kept previous policy, draw and
        score pi_prev's held-out completions of the same prompts, and record D of the step pair
        (prev, t) from both (every rank takes part: the numbers are gathered)."""
        reuse = self._reuse(self.trainer.args)
        kept = self._prev if self._prev is not None and self._prev[0] == t - reuse else None
        fuse = self.loss_forward and reuse == 1 and self._head_is_linear
        if kept is None:
            if fuse:  # pi_t's own numbers from the loss forward
                self._awaiting = _Awaiting(t, None, None, fresh, [])
            else:
                self._score(fresh, None, t, entropy_of=t)  # the first generation: pi_t's own numbers only
            return
        prev_step, params = kept
        if not fuse:
            self._score(fresh, params, prev_step, entropy_of=t)
        held = self._draw_heldout(fresh, starts, params, t, inputs) if self.heldout else []
        self._score(held, params, prev_step)
        self._pending_heldout.extend(held)
        self._prev = None  # kept by the awaiting generation where the loss forward scores the rollouts
        if fuse:
            self._awaiting = _Awaiting(t, prev_step, params, fresh, held)
            return
        self._record_d_t(prev_step, fresh, held, reuse)

    def _record_d_t(self, prev_step: int, fresh: list[_Pending], held: list[_Pending], reuse: int) -> None:
        """D of the step pair (prev_step, the generation's step) from the scored rollouts and
        held-out rows of every rank (gathered: every rank calls it)."""
        rows = self._gather([(p.group, False, p.logp_pre - p.logp_prev, p.kl_prev) for p in fresh] +
                            [(p.group, True, p.logp_pre - p.logp_prev, p.kl_prev) for p in held])
        if reuse == 1 and rows:
            groups = np.array([r[0] for r in rows])
            labels, codes = np.unique(groups, return_inverse=True)
            side = np.array([r[1] for r in rows], dtype=bool)
            mean, se = independent_d_t(np.array([r[2] for r in rows]), side if side.any() else None,
                                       np.array([r[3] for r in rows]), codes, len(labels))
            name = "independent_two_sided" if side.any() else "independent_next"
            self.estimates.setdefault(prev_step, {})[name] = KlEstimate(mean, se, len(rows), (), name)
            if self.estimator == "independent":
                self._set_late(prev_step, {"kl_to_previous": mean, "kl_to_previous_se": se if se == se else None,
                                           "kl_to_previous_estimator": name})

    def _score(self, items: list[_Pending], params: dict[str, torch.Tensor] | None, prev_step: int,
               entropy_of: int | None = None) -> None:
        """logp_pre under the live policy and, with ``params``, logp_prev and kl_prev under it, for
        every item (``chunk`` sequences at a time); with ``entropy_of``, the live policy's mean
        token entropy along the items becomes that step's ``entropy``."""
        if not items and self.world == 1:
            return
        tok = self.trainer.processing_class
        pad = getattr(tok, "pad_token_id", None)
        pad = 0 if pad is None else pad
        ent = tokens = 0.0
        with torch.no_grad():
            chunks = [items[a:a + self.chunk] for a in range(0, len(items), self.chunk)]
            if self.sharded:  # every forward is collective: as many chunks on every process
                most = max(self._gather([len(chunks)]))
                chunks += [[]] * (most - len(chunks))
            batches = [self._batch([(p.prompt_ids, p.completion_ids) for p in chunk] or [self._filler], pad)
                       for chunk in chunks]
            olds = self._forwards_under(params, [(b[0], b[1]) for b in batches]) if params is not None else None
            olds = iter(olds) if olds is not None else None
            for chunk, (ids, att, comp, pw) in zip(chunks, batches):
                new = self._forward(None, ids, att).positions(pw - 1, -1)
                old = next(olds).positions(pw - 1, -1) if olds is not None else None
                if not chunk:  # a filler pass of a process with fewer chunks: nothing to record
                    continue
                s = score_blocked(new, old, ids[:, pw:], comp)
                _keep_scores(chunk, s, prev_step if params is not None else None)
                ent += float(s.entropy_new.sum())
                tokens += float(comp.sum())
        if entropy_of is not None:
            ent, tokens = (sum(x) for x in zip(*self._gather([(ent, tokens)])))
            if tokens > 0:
                self._set_late(entropy_of, {"entropy": ent / tokens})

    def _draw_heldout(self, fresh: list[_Pending], starts: list[int], params: dict[str, torch.Tensor], t: int,
                      inputs: list[dict[str, Any]] | None) -> list[_Pending]:
        """``heldout`` completions per prompt group starting on this rank (``starts``: the
        positions of its first rollouts), drawn from the kept policy pi_prev (its parameters
        swapped into the model for the draw), with the trainer's reward functions' scores.
        Never in the loss. Every rank draws (in lockstep with the others' gathers)."""
        tr = self.trainer
        mine = {fresh[i].group: i for i in starts}
        if not mine and not self.sharded:
            return []
        tok = tr.processing_class
        eos = _eos_id(tr)
        pad = getattr(tok, "pad_token_id", None)
        pad = 0 if pad is None else pad
        cap = int(tr.args.max_completion_length)
        prompts = [fresh[i].prompt_ids.tolist() for i in mine.values()]
        with self._policy(params):
            if self.sharded:  # collective forwards: every process draws (a filler prompt where it has none) to the cap
                filler = [] if prompts else [self._filler[0].tolist()]
                drawn = sample_prompts(tr.model, prompts + filler, self.heldout, cap, eos, pad, self._generator,
                                       temperature=self.temperature, synced=True)[:len(prompts) * self.heldout]
            else:
                drawn = sample_prompts(tr.model, prompts, self.heldout, cap, eos, pad, self._generator,
                                       temperature=self.temperature)
        if not mine:
            return []
        rows, k = [], 0
        texts = tok.batch_decode(drawn, skip_special_tokens=True) if drawn else []
        for g, i in mine.items():
            for _ in range(self.heldout):
                ids = drawn[k]
                rows.append(_Pending(step=t, group=g, prompt=fresh[i].prompt, completion=texts[k],
                                     prompt_ids=fresh[i].prompt_ids, completion_ids=torch.tensor(ids, dtype=torch.long),
                                     reward=float("nan"), rewards={}, advantage=None))
                k += 1
        examples = [inputs[i] if inputs is not None and i < len(inputs) else {}
                    for i in mine.values() for _ in range(self.heldout)]
        self._reward(rows, examples)
        return rows

    def _reward(self, rows: list[_Pending], examples: list[dict[str, Any]]) -> None:
        """The trainer's reward functions on the held-out completions, as TRL calls them (the
        dataset row's columns as keyword arguments), on this rank alone: no gather, and no
        entry in TRL's logged completions or metrics."""
        tr = self.trainer
        if not rows:
            return
        from trl.data_utils import is_conversational

        prompts = [ex.get("prompt", r.prompt) for ex, r in zip(examples, rows)]
        conv = is_conversational({"prompt": prompts[0]})
        completions = [[{"role": "assistant", "content": r.completion}] if conv else r.completion for r in rows]
        completion_ids = [r.completion_ids.tolist() for r in rows]
        keys = [k for k in (examples[0] if examples else {}) if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [ex.get(k) for ex in examples] for k in keys}
        # ``reward_lens_heldout`` tells a reward function with side effects (a counter, a log) that
        # these completions are the tap's, not the trainer's
        kwargs.update(trainer_state=tr.state, log_extra=_noop, log_metric=_noop, reward_lens_heldout=True)
        values = np.full((len(rows), len(tr.reward_funcs)), np.nan)
        for j, (fn, proc) in enumerate(zip(tr.reward_funcs, tr.reward_processing_classes)):
            if isinstance(fn, torch.nn.Module):
                texts = [p + c for p, c in zip(prompts, completions)] if not conv else None
                if texts is None:
                    continue  # a reward model on conversations: its chat template is TRL's business; left unscored
                enc = proc(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
                dev = next(fn.parameters()).device
                with torch.inference_mode():
                    values[:, j] = fn(**{k: v.to(dev) for k, v in enc.items()}).logits[:, 0].float().cpu().numpy()
                continue
            call = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            if inspect.isawaitable(call):
                loop = getattr(tr, "async_loop", None)
                call = (asyncio.run_coroutine_threadsafe(call, loop).result() if loop is not None
                        else asyncio.run(call))
            values[:, j] = [np.nan if v is None else float(v) for v in call]
        weights = tr.reward_weights.detach().cpu().numpy().astype(float)
        for r, v in zip(rows, values):
            r.rewards = {nm: float(x) for nm, x in zip(tr.reward_func_names, v) if not math.isnan(x)}
            r.reward = float(np.nansum(v * weights))

    @contextmanager
    def _policy(self, params: dict[str, torch.Tensor]):
        """The model with ``params`` (a kept snapshot) in place of its own parameters and back,
        without gradients: swapped by reference when the snapshot is beside whole parameters;
        copied in (the live values parked in host memory meanwhile) when it is kept on the host
        or holds FSDP2 shards."""
        self._reshard()  # FSDP2 registers the gathered parameters while unsharded: take the shards
        named = dict(self.trainer.model.named_parameters())
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
            yield self.trainer.model
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    if self._copy:
                        _local(named[name].data).copy_(value)
                    else:
                        named[name].data = value
            self._reshard()

    @contextmanager
    def _hidden_of_output_layer(self):
        """The decoder's last hidden states (after its final norm: what the output layer reads)
        during the trainer's loss forward, one tensor per call (TRL may split a micro-batch),
        detached: the pi_{t+1} side of the rollouts' scores is computed from them with the output
        layer's weights of this moment. TRL computes its log-probabilities with a fused output
        layer (``fused_lm_head``) that never calls the output module, so the decoder is hooked."""
        model = self.trainer.model
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

    @cached_property
    def _head_is_linear(self) -> bool:
        """The output layer is a plain linear map of the last hidden states (no soft-capping or
        logit scale): logits can then be computed from the hidden states a block at a time."""
        model = self.trainer.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return isinstance(head, torch.nn.Linear) and not any(
            getattr(model.config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))

    @torch.no_grad()
    def _score_from_loss(self, inputs: dict[str, Any], hidden: list[torch.Tensor]) -> None:
        """Score the micro-batch's rollouts of the awaiting generation: pi_{t+1}'s side from the
        hidden states the trainer's loss forward produced (``hidden``), pi_t's by a functional
        call on the kept parameters. Where the loss forward did not go through the output layer
        as expected (another loss implementation), pi_{t+1}'s side is a forward pass of the tap's own."""
        aw = self._awaiting
        idx = inputs[INDEX_KEY].tolist()
        rows = [self._pending.get(i) for i in idx]
        if not rows or any(r is None or r.step != aw.step for r in rows):
            return
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        pw, cw = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
        comp = inputs["completion_mask"].bool().cpu()
        targets = inputs["completion_ids"].cpu()
        h = torch.cat(hidden, dim=0) if hidden else None
        head = self.trainer.model.get_output_embeddings()
        if h is not None and h.shape[0] == len(rows) and h.shape[1] == pw + cw:
            new = BlockedLogits(h, head.weight.detach(), None if head.bias is None else head.bias.detach(),
                                self.temperature).positions(pw - 1, -1)
        else:
            new = self._forward(None, ids, att).positions(pw - 1, -1)
        old = self._forward(aw.params, ids, att).positions(pw - 1, -1) if aw.params is not None else None
        s = score_blocked(new, old, targets, comp)
        _keep_scores(rows, s, aw.prev_step if aw.params is not None else None)
        aw.entropy += float(s.entropy_new.sum())
        aw.tokens += float(comp.sum())

    def _finish_awaiting(self) -> None:
        """After the step's micro-batches (every rank): score what no micro-batch did, the step's
        entropy along its rollouts, and D of the step pair from the rollouts and held-out rows."""
        aw, self._awaiting = self._awaiting, None
        missing = [p for p in aw.fresh if p.logp_pre is None or (aw.params is not None and p.logp_prev is None)]
        if missing:  # not in any micro-batch (not expected in GRPO): scored here, not in the step's entropy
            self._score(missing, aw.params, aw.prev_step if aw.prev_step is not None else aw.step)
        ent, tokens = (sum(x) for x in zip(*self._gather([(aw.entropy, aw.tokens)])))
        if tokens > 0:
            self._set_late(aw.step, {"entropy": ent / tokens})
        if aw.params is not None:
            self._record_d_t(aw.prev_step, aw.fresh, aw.held, 1)

    def _reshard(self) -> None:
        """Under FSDP2, drop every gathered (unsharded) parameter, so that the next forward pass
        gathers the shards as they are now: a module kept unsharded after an eval forward
        (reshard_after_forward=False, as transformers' plan does for the output layer) would
        otherwise go on using the parameters of before a swap."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in self.trainer.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _forwards_under(self, params: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]):
        """The kept policy's logits over each (ids, mask) of ``batches``: by a functional call per
        batch (lazily) when the snapshot is beside the model; under one copy-in for all of them when
        it is in host memory (the last hidden states of every batch kept, the output layer cloned)."""
        if not self._copy:
            return (self._forward(params, ids, att) for ids, att in batches)
        with self._policy(params):
            return [self._forward(None, ids, att, own_head=True) for ids, att in batches]

    # ------------------------------------------------------------------ the step
    def _gather(self, items: list) -> list:
        """All ranks' lists, concatenated in rank order (the trainer's process group)."""
        if self.world == 1:
            return list(items)
        from accelerate.utils import gather_object

        return list(gather_object(list(items)))

    def _batch_rewards(self, t: int, total: np.ndarray, group: int) -> None:
        """The generation batch's mean reward and the share of its prompt groups (over every rank:
        TRL's logged rewards are gathered) whose rewards have zero spread, as step t's telemetry."""
        if not len(total):
            return
        groups = [total[i:i + group] for i in range(0, len(total), group)]
        sized = [g for g in groups if len(g) > 1]
        values = {"reward_mean": float(np.mean(total))}
        if sized:
            values["frac_reward_zero_std"] = float(np.mean([np.ptp(g) == 0 for g in sized]))
        self._late.setdefault(t, {}).update(values)

    def _set_late(self, step: int, values: dict[str, Any]) -> None:
        """Telemetry of ``step`` measured after its row was started (D_t at the next generation)."""
        if self._row and self._row.get("step") == step:
            self._row.update(values)
        else:
            self._late.setdefault(step, {}).update(values)

    def on_train_begin(self, args, state, control, **kwargs):
        if self._accelerate_fsdp2:  # prepared now: the shards must be FSDP2's, or the tap would be wrong
            if _sharding(self.trainer.model) != "fsdp2":
                raise RuntimeError("RewardLensTap: accelerate reports FSDP2, but the prepared model's parameters are "
                                   "not DTensor shards; the tap cannot keep pi_t, so it stops the run here")
            self.snapshot_bytes = sum(_local(p).numel() * p.element_size() for p in self.trainer.model.parameters()
                                      if p.requires_grad)
        if self.save_initial_checkpoint and self.stream is not None:
            d = self.stream.path / "checkpoints" / f"step-{state.global_step}"
            self.trainer.model.save_pretrained(d)
            if self.trainer.processing_class is not None:
                self.trainer.processing_class.save_pretrained(d)
            self.stream.add_checkpoint(state.global_step, d)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._awaiting is not None:
            was = self.trainer.model.training
            self.trainer.model.eval()
            try:
                self._finish_awaiting()
            finally:
                self.trainer.model.train(was)
        model = self.trainer.model
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        grads = [_local(p.grad.detach()) for p in params.values() if p.grad is not None]
        sq = float(sum((g.double() ** 2).sum() for g in grads)) if grads else 0.0
        if self.sharded:  # each process holds 1/N of the gradient
            sq = sum(self._gather([sq]))
        applied = math.sqrt(sq)
        opt = self.trainer.optimizer
        row = {"step": state.global_step, "learning_rate": float(opt.param_groups[0]["lr"]),
               "grad_norm": applied, "grad_norm_unclipped": self._unclipped,
               "max_grad_norm": float(args.max_grad_norm) if args.max_grad_norm else None,
               "beta": float(self.trainer.beta)}
        self._row = {**self._late.pop(state.global_step, {}), **row}
        if self._host:  # pinned host buffers on CUDA, so that copying in and back is a DMA
            pin = next(iter(params.values())).is_cuda if params else False
            self._snapshot = {n: torch.empty(_local(p).shape, dtype=p.dtype, pin_memory=pin).copy_(_local(p.detach()))
                              for n, p in params.items()}
        else:  # under FSDP2 this process's shards only
            self._snapshot = {n: _local(p.detach()).clone() for n, p in params.items()}

    def on_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.model
        t = state.global_step
        snap = self._snapshot
        with torch.no_grad():
            sq = float(sum(((_local(p.detach()) - snap[n].to(p.device)) ** 2).sum().double()
                           for n, p in model.named_parameters() if n in snap))
        if self.sharded:
            sq = sum(self._gather([sq]))
        self._row["update_norm"] = math.sqrt(sq)
        used = [i for i in dict.fromkeys(self._used) if i in self._pending]
        self._used = []
        if self.estimator == "exact" and (used or self.world > 1):
            was = model.training
            model.eval()
            try:
                est = self._exact(used, t, snap)
            finally:
                model.train(was)
            if est is not None:
                self.estimates.setdefault(t, {})["exact"] = est
                self._row.update(kl_to_previous=est.mean, kl_to_previous_se=est.se,
                                 kl_to_previous_estimator=est.estimator)
        # pi_t is kept until the next generation's samples have been scored under it.
        if self.paired and t % self._reuse(args) == 0:
            self._prev = (t, snap)
        self._snapshot = None

    def _forward(self, params: dict[str, torch.Tensor] | None, ids: torch.Tensor, mask: torch.Tensor,
                 own_head: bool = False):
        """The policy's logits over ``ids`` (at the sampling temperature), under the live
        parameters or ``params``: as ``BlockedLogits`` (computed a block of positions at a time
        from the last hidden states) where the output layer is a plain linear map, else as
        ``WholeLogits``. ``own_head``: the output layer is cloned, so the logits stay those of the
        parameters in the model now after they are swapped back."""
        model = self.trainer.model
        dev = next(model.parameters()).device
        kwargs = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        blocked = not self.sharded and self._head_is_linear
        hidden: list[torch.Tensor] = []
        if blocked:
            def keep(m, inputs):  # take the last hidden states, let the output layer see no position
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

    @cached_property
    def _filler(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A (prompt, completion) of one token each, for the forward passes a process makes only
        to keep in step with the others under FSDP2."""
        return torch.tensor([0], dtype=torch.long), torch.tensor([0], dtype=torch.long)

    @cached_property
    def _head_key(self) -> str | None:
        """The name under which the output layer's weight appears in a parameter snapshot
        (an embedding's name when the two are tied); found once."""
        head = self.trainer.model.get_output_embeddings()
        return next((n for n, p in self.trainer.model.named_parameters() if p is head.weight), None)

    def _batch(self, items: list[tuple[torch.Tensor, torch.Tensor]], pad: int):
        """Left-pad prompts, right-pad completions (TRL's layout); return ids, attention mask,
        the completion-token mask, and the prompt width."""
        pw = max(len(p) for p, _ in items)
        cw = max(len(c) for _, c in items)
        ids = torch.full((len(items), pw + cw), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        comp = torch.zeros((len(items), cw), dtype=torch.bool)
        for i, (p, c) in enumerate(items):
            ids[i, pw - len(p):pw] = p
            ids[i, pw:pw + len(c)] = c
            att[i, pw - len(p):pw + len(c)] = 1
            comp[i, :len(c)] = True
        return ids, att, comp, pw

    @torch.no_grad()
    def _exact(self, used: list[int], t: int, snap: dict[str, torch.Tensor]) -> KlEstimate | None:
        """D_t from ``n_exact`` fresh samples of pi_{t+1} for step t's prompts (the whole batch's:
        this rank's share, spread over its prompts), the token KL to pi_t summed along each."""
        tok = self.trainer.processing_class
        pad = getattr(tok, "pad_token_id", None)
        pad = 0 if pad is None else pad
        prompts = list(dict.fromkeys(tuple(self._pending[i].prompt_ids.tolist()) for i in used))
        share = self.n_exact // self.world + (1 if self.rank < self.n_exact % self.world else 0)
        per = []
        eos = getattr(tok, "eos_token_id", None)
        cap = int(self.trainer.args.max_completion_length)
        for k, prompt in enumerate(prompts):
            m = share // len(prompts) + (1 if k < share % len(prompts) else 0)
            if m == 0:
                continue
            seqs = sample(self.trainer.model, list(prompt), m, cap, eos, pad,
                          self.seed + 7919 * t + k + 104729 * self.rank, temperature=self.temperature)
            ids, comp_full = seqs.ids, seqs.completion_mask
            att = torch.ones_like(ids)
            new = self._forward(None, ids, att).positions(0, -1)
            (old,) = self._forwards_under(snap, [(ids, att)])
            old = old.positions(0, -1)
            per.extend(score_blocked(new, old, ids[:, 1:], comp_full[:, 1:]).kl.tolist())
        per = self._gather(per)
        return KlEstimate.of(per) if len(per) > 1 else None

    def _reuse(self, args) -> int:
        """How many optimizer steps use one generation batch."""
        spg = int(getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps)
        return max(1, int(getattr(args, "num_iterations", 1))) * max(1, spg // max(1, args.gradient_accumulation_steps))

    @staticmethod
    def _rollout(p: _Pending) -> Rollout:
        return Rollout(step=p.step, group_id=f"{p.step}:{p.group}", prompt=p.prompt, completion=p.completion,
                       completion_ids=p.completion_ids.tolist(), num_tokens=int(len(p.completion_ids)),
                       reward=p.reward if p.reward == p.reward else None, rewards=p.rewards or None,
                       advantage=p.advantage, logp_pre=p.logp_pre, logp_prev=p.logp_prev,
                       logp_prev_step=p.logp_prev_step,
                       # a sum of KLs is >= 0; max() only removes float64 rounding below 0
                       kl_prev=None if p.kl_prev is None else max(p.kl_prev, 0.0), logp_sampler=p.logp_sampler)

    def on_step_end(self, args, state, control, **kwargs):
        t = state.global_step - 1
        if self._row:
            self._commit_row(self._row)
            self._row = {}
        for step in sorted(s for s in self._late if s <= t):  # measured after their step ended (D_t)
            self._commit_row({"step": step, **self._late.pop(step)})
        # A generation batch is written once the last step that uses it has ended.
        reuse = self._reuse(args)
        ready = sorted(i for i, p in self._pending.items() if p.step + reuse - 1 <= t)
        self._write(ready)
        if (t + 1) % self.flush_every == 0 and self.stream is not None:
            self.stream.flush()
        if self.check_every and (t + 1) % self.check_every == 0:
            self._check(t, control)

    def _check(self, t: int, control) -> None:
        """The live findings on the steps so far (rank 0 holds the telemetry): each logged as
        ``reward_lens/finding/<id>`` (1 while it holds), a warning the first time one holds, and
        with ``stop_on`` the training stopped on every rank."""
        from reward_lens.findings import RANK

        stop = False
        if self.stream is not None:
            rows, self._unchecked = self._unchecked, []
            held = []
            tel = {step: row.model_dump(exclude_none=True) for step, row in self.stream._telemetry.items()}
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
            stop = any(self._gather([stop]))  # every rank stops at the same step
            if stop:
                control.should_training_stop = True

    def _commit_row(self, row: dict[str, Any]) -> None:
        row = {k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        if self.stream is not None:  # the same on every rank: DDP averaged the gradients
            self.stream.set_telemetry(OptimizerTelemetry(**row))
        for key, name in LOGGED.items():
            if key in row:
                self._log_acc.setdefault(name, []).append(float(row[key]))

    def _write(self, ready: list[int]) -> None:
        """Rank 0 writes every rank's finished rollouts, and the held-out completions drawn so
        far, in global-batch order."""
        rows = [self._rollout(self._pending.pop(i)) for i in ready]
        held = [self._rollout(p) for p in self._pending_heldout]
        self._pending_heldout = []
        if self.world > 1:
            rows = [r for _, r in sorted(self._gather(list(zip(ready, rows))), key=lambda x: x[0])]
            held = sorted(self._gather(held), key=lambda r: (r.step, int(r.group_id.split(":")[1])))
        if self.stream is not None:
            if rows and self.check_every:
                self._unchecked.extend(rows)
            if rows:
                self.stream.add_rollouts(rows)
            if held:
                self.stream.add_heldout(held)

    def _drain_log(self) -> dict[str, float]:
        out = {name: sum(v) / len(v) for name, v in self._log_acc.items() if v}
        self._log_acc = {}
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and args.logging_steps == 1 and "kl" in logs and logs["kl"] is not None:
            t = state.global_step - 1
            if self.stream is not None and t in self.stream._telemetry:
                self.stream.set_telemetry(OptimizerTelemetry(step=t, kl_to_ref=float(logs["kl"])))

    def on_train_end(self, args, state, control, **kwargs):
        self._write(sorted(self._pending))
        for step in sorted(s for s in self._late if s < state.global_step):
            self._commit_row({"step": step, **self._late.pop(step)})
        if self.stream is not None:
            self.stream.flush()
