"""The TRL adapter: a reward-lens record written while ``GRPOTrainer`` trains, with D_t.

One line in a GRPO script::

    from reward_lens.taps.trl import RewardLensTap

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    RewardLensTap.attach(trainer, "runs/my-run", target="correctness")  # <- the tap
    trainer.train()

``target=`` names what you want of the policy, as opposed to what the reward pays for: one of the
trainer's ``reward_funcs`` (by TRL's name for it), a feature of the basis (``"n_words:lower"``),
or a function the reward does not pay for (a held-out verifier, called like a reward function:
``target={"vowels": my_fn}``). The record keeps the declaration and the values per rollout, so
the live findings and every later report tell gaming from learning without a basis file.

Everything that is not TRL's lives in the trainer-neutral core (``taps/core.py``: the
measurement, the budget, the record, the live findings); this module only hooks TRL. ``attach``
adds a ``TrainerCallback`` and wraps five methods *of this trainer instance* (no class is
patched):

* ``_generate_and_score_completions``: to see every rollout as generated (exact token ids,
  per-function rewards, advantages, TRL's logged prompt and completion texts);
* ``_generate_single_turn``: the first call of each generation appends the core's extra prompts
  to TRL's own generation batch -- the completions the step pair is measured on, drawn by the
  trainer's own generation path (``unwrapped_model.generate`` with TRL's ``generation_config``:
  its temperature, top_p, top_k, min_p and repetition penalty; or vLLM, colocate or server, with
  the weights it holds for that generation) -- and takes them out of the returned batch before
  TRL computes a reward, an advantage or a loss on it;
* ``compute_loss``: which rollouts each micro-batch used, and the hidden states of TRL's own
  loss forward, from which the rollouts' log pi_t and entropy are computed (no pass of the tap's);
* ``_get_grad_norm`` (what ``clip_grad_norm_`` returned) and ``log`` (the tap's numbers go
  through the trainer's own logging, ``report_to``).

Log-probabilities are those TRL's loss computes: logits divided by the trainer's ``temperature``.
Where TRL's settings truncate or reshape the sampling distribution (``top_p`` < 1, ``top_k``,
``min_p``, ``repetition_penalty`` != 1), the completions are samples of the processed
distribution, not of the temperature-scaled policy the log-probabilities describe: the record's
notes say so, and where the engine hands over its own log-probabilities (vLLM: processed) they are
recorded as ``logp_sampler`` on the rollouts and on the extra rows, so that the paired ledger's
sampler-mismatch premise covers both sides of every step pair.

Several processes (``accelerate launch`` / ``torchrun``: DDP; FSDP2's ``fully_shard``): each
process generates and measures its slice of the global batch; numbers are gathered with
accelerate's ``gather_object`` and rank 0 alone writes. Under FSDP2 pi_t is kept as each
process's local shards (|theta|/N), and scoring under it copies them into the live shards and back,
every process in lockstep. DeepSpeed, FSDP1 and Megatron shard differently: ``attach`` refuses
them and names FSDP2. With vLLM in server mode over several processes, or with tensor-parallel
colocated engines, the extra completions cannot ride in TRL's batch (its slices assume equal
shares per process): the pairs are then measured one-sided, and the record says so.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from reward_lens.record.importers.trl_output import record_config
from reward_lens.taps.core import LOGGED, Generation, Row, TapCore, _local  # noqa: F401 -- LOGGED re-exported
from reward_lens_spec.tap_settings import tap_settings

INDEX_KEY = "_reward_lens_index"
# accelerate's distributed types that shard the parameters across processes
SHARDED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")

logger = logging.getLogger("reward_lens")


def _dropout_free(model) -> bool:
    """True when the training forward is the policy itself: no dropout that is on."""
    cfg = getattr(model, "config", None)
    if any(float(getattr(cfg, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout",
                                                             "resid_pdrop", "embd_pdrop", "attn_pdrop")):
        return False
    return not any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


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


def _noop(*_a, **_kw) -> None:
    return None


class _Accelerate:
    """The trainer's process group through accelerate (the core's ``Collective``)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    def gather(self, items: list) -> list:
        from accelerate.utils import gather_object

        return list(gather_object(list(items)))


def _truncation(args) -> list[str]:
    """TRL's generation settings that make the sampled distribution other than the policy at its
    temperature, as ``name=value``."""
    out = []
    if (getattr(args, "top_p", 1.0) or 1.0) < 1.0:
        out.append(f"top_p={args.top_p}")
    if (getattr(args, "top_k", 0) or 0) > 0:
        out.append(f"top_k={args.top_k}")
    if getattr(args, "min_p", None):
        out.append(f"min_p={args.min_p}")
    if (getattr(args, "repetition_penalty", 1.0) or 1.0) != 1.0:
        out.append(f"repetition_penalty={args.repetition_penalty}")
    return out


class RewardLensTap(TrainerCallback):
    def __init__(self, trainer, record_dir: str | Path, **settings):
        s = tap_settings(**settings)  # reward_lens_spec/tap_settings.py: the audit validates the same model
        self.settings = s
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
        world = int(getattr(acc, "num_processes", 1) or 1)
        rank = int(getattr(acc, "process_index", 0) or 0)
        sharded = "fsdp2" if accelerate_fsdp2 else _sharding(trainer.model) if hasattr(trainer, "model") else None
        self._accelerate_fsdp2 = accelerate_fsdp2
        if sharded:
            if s.estimator == "exact":
                raise ValueError("RewardLensTap: estimator='exact' is not supported under FSDP2 (its per-prompt "
                                 "sampling is not collective); the default estimator, 'independent', is")
            if s.save_initial_checkpoint:
                raise ValueError("RewardLensTap: save_initial_checkpoint is not supported under FSDP2 (the shards "
                                 "would have to be gathered); save checkpoints with the trainer's save_strategy")
        self.trainer = trainer
        self.save_initial_checkpoint = s.save_initial_checkpoint
        self._host = s.snapshot == "cpu"
        self._sampler_noted = False
        self._first_turn = False  # the next _generate_single_turn call is a generation's first
        self._inputs: list[dict[str, Any]] | None = None
        self._unclipped: float | None = None
        args = trainer.args
        self.temperature = float(getattr(trainer, "temperature", None) or getattr(args, "temperature", 1.0) or 1.0)
        model = trainer.model
        first = next(model.parameters(), None)
        dev = str(first.device) if first is not None else "cpu"
        self.snapshot_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if accelerate_fsdp2:
            self.snapshot_bytes = -(-self.snapshot_bytes // world)
        free = None
        if dev.startswith("cuda") and not self._host and s.estimator is not None:
            free = torch.cuda.mem_get_info(first.device)[0]
        where = snapshot_plan(self.snapshot_bytes, s.snapshot, dev, free) if s.estimator is not None else None
        if where and not rank:
            logger.warning("reward-lens tap: %s", where)
        reuse = self._reuse(args)
        engine = bool(getattr(trainer, "use_vllm", False)) or bool(getattr(trainer, "use_transformers_continuous_batching",
                                                                            False))
        notes = [f"recorded by the reward-lens TRL tap (estimator {s.estimator}, "
                 + (f"up to {s.heldout} completions per prompt group and policy drawn in TRL's own generation, "
                    "never trained on" if s.heldout else "one-sided on the next generation's rollouts")
                 + f", budget {'none' if s.budget is None else format(s.budget, 'g') + ' of an untapped step'}"
                 + f", flush every {s.flush_every} steps)",
                 f"log-probabilities at the sampling temperature {self.temperature:g}"] + ([where] if where else [])
        if getattr(args, "fsdp", None) and kind not in SHARDED:
            notes.append(f"the trainer config sets fsdp={args.fsdp!r} but accelerate runs the model as {kind} "
                         "(the fsdp setting was not applied by the launcher): recorded as data-parallel, whole "
                         "parameters on every process")
        cut = _truncation(args)
        if cut:
            notes.append(f"TRL samples with {', '.join(cut)}: the rollouts and the tap's extra completions are samples "
                         "of that processed distribution, while the recorded log-probabilities are the policy's at "
                         "its temperature (as in TRL's loss); where the engine hands over its own log-probabilities "
                         "they are recorded as logp_sampler")
        if args.logging_steps != 1:
            notes.append(f"logging_steps={args.logging_steps}: TRL's `kl` is a window mean, so kl_to_ref is not "
                         "recorded")
        if world > 1 and sharded:
            notes.append(f"recorded from {world} processes under FSDP2 (parameters sharded, 1/{world} "
                         "on each; pi_t kept as each process's local shards, copied in and back in lockstep); "
                         "rollouts and D_t gathered over all of them, written by rank 0")
        elif world > 1:
            notes.append(f"recorded from {world} data-parallel processes; rollouts and D_t gathered over all "
                         "of them, written by rank 0")
        if accelerate_fsdp2:
            notes.append("sharded by accelerate's FSDP2 plugin: the tap's FSDP2 path is tested on CPUs with the model "
                         "sharded by transformers (fully_shard, the same DTensor shards); this launcher itself was "
                         "not run in reward-lens's tests")
        import trl

        tok = trainer.processing_class
        pad = getattr(tok, "pad_token_id", None)
        self.core = TapCore(
            None if rank else record_dir, model, s, pad_id=0 if pad is None else pad, eos_id=_eos_id(trainer),
            decode=lambda ids: tok.batch_decode(ids, skip_special_tokens=True), temperature=self.temperature,
            collective=_Accelerate(world, rank) if world > 1 else None,
            framework={"name": "trl", "version": trl.__version__}, optimizer=str(getattr(args.optim, "value", args.optim)),
            trainer_config=record_config(args.to_dict()), notes=notes, model_description=s.model_description,
            sharded=sharded, reward=self._reward, reuse=reuse, captured=not engine,
            max_grad_norm=args.max_grad_norm, reward_names=list(trainer.reward_func_names))
        self.core._cap = int(args.max_completion_length)
        # the rollouts' log pi_t from the trainer's loss forward: where the forward is the policy
        # itself (no dropout) and pi_t's side needs no copy-in
        self.loss_forward = (s.loss_forward and s.estimator == "independent" and bool(s.paired) and not self.core._copy
                             and _dropout_free(model))
        self.core.settings = s.model_copy(update={"loss_forward": self.loss_forward})

    # the core's state, under the names earlier versions of the tap had
    @property
    def estimates(self):
        return self.core.estimates

    @property
    def findings_log(self):
        return self.core.findings_log

    @property
    def findings_warned(self):
        return self.core.findings_warned

    @property
    def stream(self):
        return self.core.stream

    @property
    def world(self) -> int:
        return self.core.world

    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def sharded(self):
        return self.core.sharded

    # ------------------------------------------------------------------ attaching
    @classmethod
    def attach(cls, trainer, record_dir: str | Path, **kwargs) -> RewardLensTap:
        """Add the tap to ``trainer`` (one line, before ``trainer.train()``)."""
        tap = cls(trainer, record_dir, **kwargs)
        gen = trainer._generate_and_score_completions
        single = trainer._generate_single_turn
        loss = trainer.compute_loss
        orig_grad_norm = trainer._get_grad_norm
        orig_log = trainer.log

        def generate_and_score(inputs, *a, **kw):
            training = trainer.model.training
            tap._first_turn, tap._inputs = training, (list(inputs) if training else None)
            try:
                out = gen(inputs, *a, **kw)
            finally:
                tap._first_turn = False
            if training:
                tap._on_generation(out)
            return out

        def single_turn(prompt_ids, images, multimodal_fields, num_generations, *a, **kw):
            if not tap._first_turn:
                return single(prompt_ids, images, multimodal_fields, num_generations, *a, **kw)
            tap._first_turn = False
            return tap._generate_with_extras(single, prompt_ids, images, multimodal_fields, num_generations, *a, **kw)

        def compute_loss(model, inputs, *a, **kw):
            if INDEX_KEY not in inputs:
                return loss(model, inputs, *a, **kw)
            ids = inputs[INDEX_KEY].tolist()
            tap.core.used(ids)
            if not tap.core.awaiting(ids):
                return loss(model, inputs, *a, **kw)
            with tap.core.loss_hidden() as hidden:
                result = loss(model, inputs, *a, **kw)
            tap.core.score_from_loss(ids, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                     inputs["completion_mask"], hidden)
            return result

        def get_grad_norm(model, grad_norm=None):  # noqa: F811 -- transformers passes it by name
            value = orig_grad_norm(model, grad_norm=grad_norm)
            tap._unclipped = float(value.item() if hasattr(value, "item") else value)
            return value

        def log(logs, *a, **kw):
            return orig_log({**logs, **tap.core.drain_log()} if "loss" in logs or "reward" in logs else logs, *a, **kw)

        trainer._generate_and_score_completions = generate_and_score
        trainer._generate_single_turn = single_turn
        trainer.compute_loss = compute_loss
        trainer._get_grad_norm = get_grad_norm
        trainer.log = log
        trainer.add_callback(tap)
        return tap

    # ------------------------------------------------------------------ generation
    def _generate_with_extras(self, single, prompt_ids, images, multimodal_fields, num_generations, *a, **kw):
        """TRL's first generation call of a step, with the core's extra prompts appended to its
        batch; the extra completions handed to the core, TRL's own returned."""
        tr, core = self.trainer, self.core
        n = len(prompt_ids)
        group = max(1, int(num_generations))
        server = bool(getattr(tr, "use_vllm", False)) and getattr(tr, "vllm_mode", None) == "server"
        tp = int(getattr(tr.args, "vllm_tensor_parallel_size", 1) or 1) if getattr(tr, "use_vllm", False) else 1
        can = (images is None or all(x is None for x in images)) and not multimodal_fields and tp == 1 and not (
            server and (core.world > 1 or n % group))
        if not can and not getattr(self, "_extras_noted", False) and core.settings.heldout:
            self._extras_noted = True
            core.note("the generation could not take the tap's extra completions (images, vLLM in server mode over "
                      "several processes, or tensor-parallel engines, whose batch slices assume equal shares): "
                      "step pairs measured one-sided, on the next generation's rollouts")
        examples = self._inputs
        extra = core.extra_requests(tr.state.global_step, prompt_ids, [""] * n, group_size=group, offset=n * core.rank,
                                    total=n * core.world, examples=examples, per_group=group if server else None,
                                    can_draw=can)
        if not extra:
            return single(prompt_ids, images, multimodal_fields, num_generations, *a, **kw)
        t0 = time.perf_counter()
        with core.capture(len(extra), n + len(extra)) if core.captured else nullcontext():
            completion_ids, logprobs = single(list(prompt_ids) + extra, images, multimodal_fields, num_generations,
                                              *a, **kw)
        seconds = time.perf_counter() - t0
        sampler = None
        if logprobs is not None:  # the engine's per-token log-probabilities (vLLM: processed)
            sampler = [float(sum(x)) if all(v is not None and math.isfinite(v) for v in x) else None
                       for x in logprobs[n:]]
        core.extras_generated(completion_ids[n:], sampler, seconds=seconds, rows=len(completion_ids),
                              decode_steps=max((len(c) for c in completion_ids), default=0))
        return completion_ids[:n], (logprobs[:n] if logprobs is not None else None)

    def _on_generation(self, out: dict[str, Any]) -> None:
        tr, core = self.trainer, self.core
        n = out["completion_ids"].shape[0]
        # TRL's own layout of the global batch: equal slices, rank-major (its process_slice);
        # rewards, prompts and completions in its logs are gathered over all ranks.
        total, offset = n * core.world, n * core.rank
        names = list(tr.reward_func_names)
        weights = tr.reward_weights.detach().cpu().numpy().astype(float)
        logged = {name: list(tr._logs["rewards"][name])[-total:] for name in names}
        prompts = list(tr._logs["prompt"])[-total:]
        completions = list(tr._logs["completion"])[-total:]
        if len(prompts) != total or any(len(v) != total for v in logged.values()):
            raise RuntimeError(f"reward-lens tap: TRL logged {len(prompts)} prompts for a generation batch of "
                               f"{n} x {core.world} processes; the tap cannot place this rank's rollouts")
        everyone = np.array([[logged[name][j] for name in names] for j in range(total)], float).reshape(total, len(names))
        sampler = out.get("sampling_per_token_logps")
        if sampler is not None and not self._sampler_noted:
            self._sampler_noted = True
            core.note("the rollouts were sampled by an inference engine (TRL's sampling_per_token_logps, e.g. vLLM), "
                      "not by the trained model: each rollout's log-probability under it is recorded as logp_sampler, "
                      "and the paired ledger refuses a step pair whose engine departs from the policy by more than a "
                      "tenth of D_t (PREMISE_FAILED sampler_mismatch)")
        pmasks = out["prompt_mask"].bool().cpu()
        cmasks = out["completion_mask"].bool().cpu()
        pids, cids = out["prompt_ids"].cpu(), out["completion_ids"].cpu()
        logp_sampler = None
        if sampler is not None:
            logp_sampler = []
            for i in range(n):
                tokens = sampler[i].detach().double().cpu()[cmasks[i]]
                # a token vLLM gave no log-probability (NaN) leaves the sequence's unknown
                logp_sampler.append(float(tokens.sum()) if bool(torch.isfinite(tokens).all()) else None)
        base = core._next_index
        batch = Generation(step=tr.state.global_step, prompts=prompts[offset:offset + n],
                           completions=completions[offset:offset + n],
                           prompt_ids=[pids[i][pmasks[i]] for i in range(n)],
                           completion_ids=[cids[i][cmasks[i]] for i in range(n)],
                           rewards=everyone[offset:offset + n], all_rewards=everyone, reward_names=names,
                           reward_weights=weights, advantages=[float(a) for a in out["advantages"]],
                           group_size=max(1, int(tr.num_generations)), offset=offset, total=total,
                           examples=self._inputs, logp_sampler=logp_sampler)
        core.on_generation(batch)
        idx = torch.arange(base + offset, base + offset + n)
        out[INDEX_KEY] = idx.to(out["completion_ids"].device)

    def _reward(self, rows: list[Row]) -> None:
        """The trainer's reward functions on the tap's extra completions, as TRL calls them (the
        dataset row's columns as keyword arguments), on this rank alone: no gather, and no entry in
        TRL's logged completions or metrics."""
        tr = self.trainer
        if not rows:
            return
        from trl.data_utils import is_conversational

        examples = [r.example or {} for r in rows]
        prompts = [ex.get("prompt", r.prompt) for ex, r in zip(examples, rows)]
        conv = is_conversational({"prompt": prompts[0]})
        completions = [[{"role": "assistant", "content": r.completion}] if conv else r.completion for r in rows]
        completion_ids = [r.completion_ids.tolist() for r in rows]
        keys = [k for k in examples[0] if k not in ("prompt", "completion", "completion_ids")]
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

    @staticmethod
    def _reuse(args) -> int:
        """How many optimizer steps use one generation batch."""
        spg = int(getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps)
        return max(1, int(getattr(args, "num_iterations", 1))) * max(1, spg // max(1, args.gradient_accumulation_steps))

    # ------------------------------------------------------------------ the trainer's callbacks
    def on_train_begin(self, args, state, control, **kwargs):
        if self._accelerate_fsdp2:  # prepared now: the shards must be FSDP2's, or the tap would be wrong
            if _sharding(self.trainer.model) != "fsdp2":
                raise RuntimeError("RewardLensTap: accelerate reports FSDP2, but the prepared model's parameters are "
                                   "not DTensor shards; the tap cannot keep pi_t, so it stops the run here")
            self.snapshot_bytes = sum(_local(p).numel() * p.element_size() for p in self.trainer.model.parameters()
                                      if p.requires_grad)
        if self.save_initial_checkpoint and self.core.stream is not None:
            d = self.core.stream.path / "checkpoints" / f"step-{state.global_step}"
            self.trainer.model.save_pretrained(d)
            if self.trainer.processing_class is not None:
                self.trainer.processing_class.save_pretrained(d)
            self.core.stream.add_checkpoint(state.global_step, d)
        self.core.begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        opt = self.trainer.optimizer
        self.core.before_optimizer_step(state.global_step, learning_rate=float(opt.param_groups[0]["lr"]),
                                        grad_norm_unclipped=self._unclipped, max_grad_norm=args.max_grad_norm,
                                        beta=float(self.trainer.beta))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.core.after_optimizer_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.core.end_step(state.global_step - 1):
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and args.logging_steps == 1 and "kl" in logs and logs["kl"] is not None:
            t = state.global_step - 1
            stream = self.core.stream
            if stream is None or t in stream._telemetry:
                self.core.set_telemetry(t, kl_to_ref=float(logs["kl"]))

    def on_train_end(self, args, state, control, **kwargs):
        self.core.end(state.global_step)
