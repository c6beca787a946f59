"""The TRL tap: a reward-lens record written while ``GRPOTrainer`` trains, with D_t.

One line in a GRPO script::

    from reward_lens.taps.trl import RewardLensTap

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    RewardLensTap.attach(trainer, "runs/my-run")  # <- the tap
    trainer.train()

``attach`` adds a ``TrainerCallback`` and wraps three methods *of this trainer instance*
(no class is patched): ``_generate_and_score_completions`` (to see every rollout as
generated: exact token ids, per-function rewards, advantages), ``compute_loss`` (to see
which rollouts each micro-batch used, so the record is right under gradient accumulation
and TRL's shuffling) and ``_get_grad_norm`` (what ``clip_grad_norm_`` returned).

Per optimizer step t (pi_t -> pi_{t+1}) it records: the learning rate the optimizer used,
``grad_norm_unclipped`` (the clip function's return value), ``grad_norm`` (the norm of the
gradient actually applied, measured after clipping), ``max_grad_norm``, ``update_norm``
(||theta_{t+1} - theta_t||, measured around ``optimizer.step()``), ``beta``, ``kl_to_ref``
when TRL computes it (per-token mean; recorded only with ``logging_steps=1``, where TRL's
value is per-step), and ``kl_to_previous`` = D_t in nats per sequence with its standard error
and the estimator that produced it:

* ``"rollout"`` (default) -- the full-vocabulary token-level KL(pi_{t+1} || pi_t) summed over
  the completion positions of the step's own rollouts (teacher-forced prefixes from pi_t).
  Cost: two extra forward passes over the step's rollouts (one per policy), no generation.
  The prefixes come from pi_t rather than pi_{t+1}; the two expectations differ by a term of
  third order in the step, so it agrees with the exact estimator for small steps (tested).
* ``"exact"`` -- sample ``n_exact`` sequences from pi_{t+1} for the step's prompts and sum the
  token KL to pi_t along them (``reward_lens.measure.whitebox.kl``). Cost: generating
  ``n_exact`` completions and two forward passes. Off by default.
* ``"both"`` records the exact one and keeps both in ``tap.estimates`` for comparison.

Per rollout: the exact completion token ids and their count, the total reward and the reward
of each reward function, the advantage, and log pi_t(y) and log pi_{t+1}(y) (from the
rollout estimator's forward passes) for the rollouts the step used. ``logp_post`` is
*in-sample* (the step was computed from these rollouts) and no estimate is built on it.

The paired ledger's input: pi_t's parameters are kept one step longer, and step t+1's
rollouts (sampled from pi_{t+1} before any gradient touched them) are also scored under
pi_t (with one generation batch feeding R steps, the next generation's rollouts under the
policy of the previous generation step, and ``logp_prev_step`` says which): ``logp_prev`` = log pi_t(y) and ``kl_prev`` = the full-vocabulary token KL(pi_{t+1} ||
pi_t) summed along y's prefixes, whose mean over the step's rollouts is D_t without the
noise of the sequence log-ratio (chain rule). Cost: one more forward pass over each step's
rollouts, and a second parameter snapshot in memory (``paired=False`` turns it off).

Log-probabilities are those of the distribution the trainer sampled from: logits divided by
the trainer's ``temperature`` (as TRL's own loss computes them). ``top_p`` / ``top_k``
truncation is recorded in the manifest but not applied: TRL's loss does not apply it either,
and between two truncated distributions the KL can be infinite.

Memory: pi_t is kept as a parameter snapshot from ``on_pre_optimizer_step`` (after
clipping, before the step) until the step's estimates are done: |theta| floats of the
parameters' dtype (4 bytes each in float32; 28 GB for a 7B model: use a smaller policy or
``estimator=None`` there). Logits are computed for ``chunk`` sequences at a time and, where
the output layer is a plain linear map, from the last hidden states a block of positions at a
time (``whitebox.kl.BlockedLogits``: at most 4M float64 logits per block, so the peak does not
grow with positions x vocabulary); no logits are kept.

Crash safety: the record is flushed every ``flush_every`` steps (new rollout segment,
rewritten telemetry, then the manifest as the commit point); a run killed mid-way leaves a
readable record of the steps flushed. ``kl_to_ref`` of the last step arrives in TRL's log
after that step's flush and is written by the next flush.

With ``num_iterations > 1`` (or ``steps_per_generation > gradient_accumulation_steps``)
rollouts are reused across steps; they are recorded once, under the step whose policy
sampled them, and the rollout estimator of a later step is marked ``rollout_stale`` (its
prefixes come from an older policy).

Several processes (``accelerate launch`` / ``torchrun``, data-parallel: DDP on CPUs or GPUs).
Each process generates its slice of the global generation batch (TRL gathers the rewards,
computes advantages over whole groups and slices them back), and holds a full replica of the
parameters, so each can score its own rollouts under pi_t and pi_{t+1}. The tap does exactly
that on every rank, then gathers with the trainer's own process group (accelerate's
``gather_object``): the per-sequence KLs, so D_t and its standard error are those of the
global batch, and the finished rollouts, which rank 0 alone writes (crash-safe as above).
Rollout and group ids are positions in the global batch, as TRL's ``process_slice`` defines
them. DeepSpeed, FSDP and Megatron shard the parameters, so no rank can evaluate pi_t on its
own: ``attach`` refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from reward_lens.measure.whitebox.kl import BlockedLogits, KlEstimate, WholeLogits, summed_kl_and_logps_blocked
from reward_lens.measure.whitebox.policy import sample
from reward_lens.record.importers.trl import record_config
from reward_lens.record.schema import OptimizerTelemetry, Rollout
from reward_lens.record.stream import RecordStream

INDEX_KEY = "_reward_lens_index"
ESTIMATORS = ("rollout", "exact", "both", None)
# accelerate's distributed types that shard the parameters across processes
SHARDED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
# What the tap adds to the trainer's own logs (W&B, TensorBoard, whatever `report_to` names):
# means over the optimizer steps since the previous log. eta is not among them: it needs the
# next step's rollouts and a book-wide noise decision, so it is a report's number, not a log's.
LOGGED = {"kl_to_previous": "reward_lens/kl_to_previous", "update_norm": "reward_lens/update_norm",
          "grad_norm": "reward_lens/grad_norm_clipped", "grad_norm_unclipped": "reward_lens/grad_norm_unclipped"}


@dataclass
class _Pending:
    """A generated rollout waiting for its step's estimates before it is written."""

    step: int
    group: int
    prompt: str
    completion: str
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    reward: float
    rewards: dict[str, float]
    advantage: float
    logp_pre: float | None = None
    logp_post: float | None = None
    logp_prev: float | None = None
    logp_prev_step: int | None = None
    kl_prev: float | None = None


def _eos_id(trainer) -> int | None:
    """The token that ends a completion (features such as ``ends_with_eos`` need it)."""
    eos = getattr(trainer.processing_class, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if len(eos) == 1 else None
    return int(eos) if isinstance(eos, int) else None


class RewardLensTap(TrainerCallback):
    def __init__(self, trainer, record_dir: str | Path, *, estimator: str | None = "rollout", n_exact: int = 16,
                 flush_every: int = 10, chunk: int = 16, save_initial_checkpoint: bool = False,
                 overwrite: bool = False, seed: int = 0, model_description: str | None = None,
                 paired: bool = True):
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
        acc = trainer.accelerator
        kind = str(getattr(acc, "distributed_type", "NO")).split(".")[-1]
        if kind in SHARDED:
            raise ValueError(f"the reward-lens TRL tap does not support {kind}: it shards the parameters, so no "
                             "process can evaluate pi_t and pi_{t+1} on its own rollouts (the rollouts' "
                             "log-probabilities and D_t need both); record the run data-parallel instead "
                             "(accelerate's multi-GPU or multi-CPU launch, i.e. DDP)")
        self.world = int(getattr(acc, "num_processes", 1) or 1)
        self.rank = int(getattr(acc, "process_index", 0) or 0)
        self.trainer = trainer
        self.estimator = estimator
        self.paired = paired  # keep pi_t one step longer and score step t+1's rollouts under it
        self.n_exact = n_exact
        self.flush_every = max(1, int(flush_every))
        self.chunk = chunk
        self.save_initial_checkpoint = save_initial_checkpoint
        self.seed = seed
        self.estimates: dict[int, dict[str, KlEstimate]] = {}
        self._pending: dict[int, _Pending] = {}
        self._next_index = 0
        self._used: list[int] = []
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._prev: tuple[int, dict[str, torch.Tensor]] | None = None  # (t, pi_t) kept for the next generation
        self.temperature = float(getattr(trainer, "temperature", None) or getattr(trainer.args, "temperature", 1.0)
                                 or 1.0)
        self._row: dict[str, Any] = {}
        self._log_acc: dict[str, list[float]] = {}
        self._unclipped: float | None = None
        args = trainer.args
        cfg = record_config(args.to_dict())
        import trl

        model = trainer.model
        n_params = sum(p.numel() for p in model.parameters())
        notes = [f"recorded by the reward-lens TRL tap (estimator {estimator}, flush every {self.flush_every} steps)",
                 f"log-probabilities at the sampling temperature {self.temperature:g}; step t's rollouts are also "
                 "scored under pi_{t-1} (logp_prev, kl_prev) for the paired ledger"]
        if (getattr(args, "top_p", 1.0) or 1.0) < 1.0 or (getattr(args, "top_k", 0) or 0) > 0:
            notes.append(f"sampling truncation top_p={getattr(args, 'top_p', None)}, top_k={getattr(args, 'top_k', None)} "
                         "is not applied to the recorded log-probabilities (as in TRL's loss)")
        if args.logging_steps != 1:
            notes.append(f"logging_steps={args.logging_steps}: TRL's `kl` is a window mean, so kl_to_ref is not "
                         "recorded")
        if self.world > 1:
            notes.append(f"recorded from {self.world} data-parallel processes; rollouts and D_t gathered over all "
                         "of them, written by rank 0")
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
                tap._on_generation(out)
            return out

        def compute_loss(model, inputs, *a, **kw):
            if INDEX_KEY in inputs:
                tap._used.extend(inputs[INDEX_KEY].tolist())
            return loss(model, inputs, *a, **kw)

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
    def _on_generation(self, out: dict[str, Any]) -> None:
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
        rewards = np.array([[logged[name][offset + i] for name in names] for i in range(n)], float)
        prompts, completions = prompts[offset:offset + n], completions[offset:offset + n]
        group = max(1, int(tr.num_generations))
        idx = torch.arange(self._next_index + offset, self._next_index + offset + n)
        self._next_index += total
        for i in range(n):
            pmask = out["prompt_mask"][i].bool().cpu()
            cmask = out["completion_mask"][i].bool().cpu()
            self._pending[int(idx[i])] = _Pending(
                step=t, group=(offset + i) // group, prompt=str(prompts[i]), completion=str(completions[i]),
                prompt_ids=out["prompt_ids"][i].cpu()[pmask], completion_ids=out["completion_ids"][i].cpu()[cmask],
                reward=float(np.nansum(rewards[i] * weights)),
                rewards={nm: float(v) for nm, v in zip(names, rewards[i]) if not math.isnan(v)},
                advantage=float(out["advantages"][i]))
        out[INDEX_KEY] = idx.to(out["completion_ids"].device)

    # ------------------------------------------------------------------ the step
    def _gather(self, items: list) -> list:
        """All ranks' lists, concatenated in rank order (the trainer's process group)."""
        if self.world == 1:
            return list(items)
        from accelerate.utils import gather_object

        return list(gather_object(list(items)))

    def on_train_begin(self, args, state, control, **kwargs):
        if self.save_initial_checkpoint and self.stream is not None:
            d = self.stream.path / "checkpoints" / f"step-{state.global_step}"
            self.trainer.model.save_pretrained(d)
            if self.trainer.processing_class is not None:
                self.trainer.processing_class.save_pretrained(d)
            self.stream.add_checkpoint(state.global_step, d)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.model
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        grads = [p.grad for p in params.values() if p.grad is not None]
        applied = float(torch.sqrt(sum((g.detach().double() ** 2).sum() for g in grads))) if grads else 0.0
        opt = self.trainer.optimizer
        self._row = {"step": state.global_step, "learning_rate": float(opt.param_groups[0]["lr"]),
                     "grad_norm": applied, "grad_norm_unclipped": self._unclipped,
                     "max_grad_norm": float(args.max_grad_norm) if args.max_grad_norm else None,
                     "beta": float(self.trainer.beta)}
        self._snapshot = {n: p.detach().clone() for n, p in params.items()}

    def on_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.model
        t = state.global_step
        snap = self._snapshot
        with torch.no_grad():
            sq = sum(((p.detach() - snap[n]) ** 2).sum().double() for n, p in model.named_parameters() if n in snap)
        self._row["update_norm"] = float(torch.sqrt(sq))
        used = [i for i in dict.fromkeys(self._used) if i in self._pending]
        self._used = []
        # Under several processes every rank takes part (its slice may be empty), since the
        # estimates are gathered.
        if self.estimator is not None and (used or self.world > 1):
            was = model.training
            model.eval()
            try:
                est = self._estimate(used, t, snap)
            finally:
                model.train(was)
            if est:
                self.estimates[t] = est
        if t in self.estimates:
            est = self.estimates[t]
            primary = est.get("exact") or est.get("rollout") or est.get("rollout_stale")
            self._row.update(kl_to_previous=primary.mean, kl_to_previous_se=primary.se,
                             kl_to_previous_estimator=primary.estimator)
        # pi_t is kept until the next generation's rollouts have been scored under it (the
        # paired ledger): the next step's, or with reused rollouts the next generation step's.
        if self.estimator is not None and self.paired and t % self._reuse(args) == 0:
            self._prev = (t, snap)
        self._snapshot = None

    def _forward(self, params: dict[str, torch.Tensor] | None, ids: torch.Tensor, mask: torch.Tensor):
        """The policy's logits over ``ids`` (at the sampling temperature), under the live
        parameters or ``params``: as ``BlockedLogits`` (computed a block of positions at a time
        from the last hidden states) where the output layer is a plain linear map, else as
        ``WholeLogits``."""
        model = self.trainer.model
        dev = next(model.parameters()).device
        kwargs = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        blocked = isinstance(head, torch.nn.Linear) and not any(
            getattr(model.config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
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
        return BlockedLogits(hidden[0], weight, head.bias, self.temperature)

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
    def _estimate(self, used: list[int], t: int, snap: dict[str, torch.Tensor]) -> dict[str, KlEstimate]:
        tok = self.trainer.processing_class
        pad = getattr(tok, "pad_token_id", None)
        pad = 0 if pad is None else pad
        out: dict[str, KlEstimate] = {}
        stale = any(self._gather([any(self._pending[i].step != t for i in used)]))
        # pi_{t-1}, kept from the previous step: scores step t's rollouts for the paired ledger.
        # With one generation batch feeding R optimizer steps (num_iterations > 1), the
        # independent sample of the window t-R .. t is the generation at step t, scored under
        # the policy of the previous generation step, t - R.
        reuse = self._reuse(self.trainer.args)
        prev = self._prev[1] if self._prev is not None and self._prev[0] == t - reuse else None
        if self.estimator in ("rollout", "both"):
            per: list[float] = []
            for a in range(0, len(used), self.chunk):
                chunk = used[a:a + self.chunk]
                ids, att, comp, pw = self._batch([(self._pending[i].prompt_ids, self._pending[i].completion_ids)
                                                  for i in chunk], pad)
                new = self._forward(None, ids, att).positions(pw - 1, -1)
                old = self._forward(snap, ids, att).positions(pw - 1, -1)
                kl, lp_old, lp_new = summed_kl_and_logps_blocked(new, old, ids[:, pw:], comp)
                per.extend(kl.tolist())
                fresh = [j for j, i in enumerate(chunk) if self._pending[i].step == t]
                if prev is not None and fresh:
                    older = self._forward(prev, ids[fresh], att[fresh]).positions(pw - 1, -1)
                    kl_prev, lp_prev, _ = summed_kl_and_logps_blocked(old.rows(fresh), older, ids[fresh][:, pw:],
                                                                      comp[fresh])
                    for q, j in enumerate(fresh):
                        self._pending[chunk[j]].logp_prev = float(lp_prev[q])
                        self._pending[chunk[j]].logp_prev_step = t - reuse
                        self._pending[chunk[j]].kl_prev = float(kl_prev[q])
                for j in fresh:
                    i = chunk[j]
                    self._pending[i].logp_pre = float(lp_old[j])
                    self._pending[i].logp_post = float(lp_new[j])
            name = "rollout_stale" if stale else "rollout"
            per = self._gather(per)
            if per:
                out[name] = KlEstimate.of(per, name)
        if self.estimator in ("exact", "both"):
            prompts = list(dict.fromkeys(tuple(self._pending[i].prompt_ids.tolist()) for i in used))
            # n_exact sequences over the whole batch: this rank's share, spread over its prompts
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
                old = self._forward(snap, ids, att).positions(0, -1)
                kl, _, _ = summed_kl_and_logps_blocked(new, old, ids[:, 1:], comp_full[:, 1:])
                per.extend(kl.tolist())
            per = self._gather(per)
            if len(per) > 1:
                out["exact"] = KlEstimate.of(per)
        return out

    def _reuse(self, args) -> int:
        """How many optimizer steps use one generation batch."""
        spg = int(getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps)
        return max(1, int(getattr(args, "num_iterations", 1))) * max(1, spg // max(1, args.gradient_accumulation_steps))

    def _rows(self, ready: list[int]) -> list[Rollout]:
        rows = []
        for i in ready:
            p = self._pending.pop(i)
            rows.append(Rollout(step=p.step, group_id=f"{p.step}:{p.group}", prompt=p.prompt, completion=p.completion,
                                completion_ids=p.completion_ids.tolist(), num_tokens=int(len(p.completion_ids)),
                                reward=p.reward, rewards=p.rewards, advantage=p.advantage, logp_pre=p.logp_pre,
                                logp_post=p.logp_post, logp_prev=p.logp_prev, logp_prev_step=p.logp_prev_step,
                                # a sum of KLs is >= 0; max() only removes float64 rounding below 0
                                kl_prev=None if p.kl_prev is None else max(p.kl_prev, 0.0)))
        return rows

    def on_step_end(self, args, state, control, **kwargs):
        t = state.global_step - 1
        if self._row:
            row = {k: v for k, v in self._row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if self.stream is not None:  # the same on every rank: DDP averaged the gradients
                self.stream.set_telemetry(OptimizerTelemetry(**row))
            for key, name in LOGGED.items():
                if key in row:
                    self._log_acc.setdefault(name, []).append(float(row[key]))
            self._row = {}
        # A generation batch is written once the last step that uses it has ended.
        reuse = self._reuse(args)
        ready = sorted(i for i, p in self._pending.items() if p.step + reuse - 1 <= t)
        self._write(ready)
        if (t + 1) % self.flush_every == 0 and self.stream is not None:
            self.stream.flush()

    def _write(self, ready: list[int]) -> None:
        """Rank 0 writes every rank's finished rollouts, in global-batch order."""
        rows = self._rows(ready) if ready else []
        if self.world > 1:
            rows = [r for _, r in sorted(self._gather(list(zip(ready, rows))), key=lambda x: x[0])]
        if rows and self.stream is not None:
            self.stream.add_rollouts(rows)

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
        if self.stream is not None:
            self.stream.flush()
