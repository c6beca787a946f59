"""Import an OpenRLHF PPO/GRPO run's TensorBoard scalars into a record (telemetry only).

What OpenRLHF leaves and what this reads (github.com/OpenRLHF/OpenRLHF at 3c3be6234e0c):

* OpenRLHF logs its metrics to TensorBoard or W&B only. With ``--logger.tensorboard_dir DIR``
  its ``TensorboardLogger`` (openrlhf/utils/logging_utils.py:112-138) writes
  ``DIR/<--logger.wandb.run_name>/events.out.tfevents.*`` with ``torch.utils.tensorboard``:
  every non-None value of a step's status as ``train/<key>`` at ``global_step`` (line 130),
  evaluation metrics as ``eval/<key>`` (line 135), one decoded sample as text. Either folder is
  read (the run's, or the tensorboard_dir holding exactly one run). The event files are read with
  tensorboard's own reader (``reward_lens.record.importers.tensorboard``).
* ``global_step`` counts rollout batches from 1 (ppo_trainer.py:263, 556) and the record's
  t = global_step - 1. One rollout batch may feed several optimizer steps (a train batch smaller
  than the rollout batch, or ``--train.max_epochs`` > 1); a row is then the whole batch's
  update, and ``actor_grad_norm`` is its last optimizer step's (ppo_actor.py:250-254). With
  ``--logger.logging_steps`` > 1 only every k-th step is logged, each with its own values.

Keys are mapped by meaning through ``specs/fields.yaml`` (its ``openrlhf`` entries name the exact
tags): ``train/ppo_kl`` is the in-loop k1 estimate against the rollout policy (``ppo_kl``, never
D_t); ``train/kl`` is KL to the reference by ``--algo.kl.estimator`` (``kl_to_ref``);
``train/vllm_kl`` is a k1 estimate of KL(pi_vllm || pi_old) per token along vLLM's tokens
(loss.py:218), recorded as ``sampler_kl_token`` with estimator ``k1``;
``train/actor_grad_norm`` is DeepSpeed's pre-clip norm. ``train/actor_lr`` is read *after* the
optimizer step (``get_last_lr()``, ppo_actor.py:376), the rate of the next update, so the
record's learning rate of step t is what step t-1 logged; the first step's is unknown.

OpenRLHF writes no per-rollout data, so the record has no rollouts. A NaN or infinite scalar of
a diverged run is kept as data: null in its column and an entry of the manifest's
``non_finite`` naming the step, the tag and the record it came from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from reward_lens.record.errors import RecordError
from reward_lens.record.importers import finite_number, one_based_step
from reward_lens.record.importers.tensorboard import read_scalars
from reward_lens.record.schema import NonFiniteValue, OptimizerTelemetry, RunManifest
from reward_lens.record.writer import write_run
from reward_lens_spec import load_fields

WHAT = ("OpenRLHF's --logger.tensorboard_dir, or its run folder <tensorboard_dir>/<--logger.wandb.run_name> "
        "(events.out.tfevents.*)")
_LR = "train/actor_lr"
STEP_KEY = "global_step"


def non_finite_name(v: float) -> str:
    """``nan``, ``+inf`` or ``-inf``: how RunManifest.non_finite names a value."""
    return "nan" if math.isnan(v) else ("+inf" if v > 0 else "-inf")


def import_openrlhf(source: str | Path, record_dir: str | Path, *, framework_version: str | None = None,
                    overwrite: bool = False) -> RunManifest:
    """Convert an OpenRLHF run's TensorBoard folder into a record at ``record_dir``; nothing is
    written unless the whole import succeeds."""
    folder = Path(source)
    scalars = read_scalars(folder, WHAT)
    train = {tag: steps for tag, steps in scalars.values.items() if tag.startswith("train/")}
    if not train:
        raise RecordError(folder, "no `train/*` scalars: OpenRLHF's TensorboardLogger writes each step's metrics as "
                          "`train/<key>` (is this an OpenRLHF PPO/GRPO run's folder?)")
    keys = load_fields().framework_keys("openrlhf")  # tag -> record field
    rows: dict[int, dict[str, Any]] = {}
    non_finite: list[NonFiniteValue] = []
    for tag in sorted(train):
        for step, (value, where) in sorted(train[tag].items()):
            if step < 1:
                raise RecordError(f"{folder}: {where}", f"`{tag}` is logged at {STEP_KEY} {step}: OpenRLHF's "
                                  f"{STEP_KEY} starts at 1", field=tag)
            t = one_based_step(step, f"{folder}: {where}", STEP_KEY)
            row = rows.setdefault(t, {"step": t})
            field = keys.get(tag)
            if not math.isfinite(value):
                non_finite.append(NonFiniteValue(step=t, field=field or tag, value=non_finite_name(value),
                                                 source=f"{where}: `{tag}` at {STEP_KEY} {step}"))
                continue
            if field is not None:
                row[field] = finite_number(value, f"{folder}: {where}", tag, step, STEP_KEY)
    # the rate step t used is the one step t-1 logged after its optimizer step
    lr = train.get(_LR, {})
    for t, row in rows.items():
        prev = lr.get(t)  # global_step t is record step t-1: the step before t
        if prev is not None and math.isfinite(prev[0]):
            row["learning_rate"] = finite_number(prev[0], f"{folder}: {prev[1]}", _LR, t, STEP_KEY)
        if row.get("sampler_kl_token") is not None:
            row["sampler_kl_token_estimator"] = "k1"  # masked_mean(rollout - old log-probs), loss.py:218
    steps = sorted(rows)
    notes = [f"OpenRLHF's TensorBoard scalars from {len(scalars.files)} event file(s); OpenRLHF writes no per-rollout "
             "data, so this record has no rollouts: the books and findings that read rollouts are not evaluated",
             "one row per OpenRLHF global_step (a rollout batch: several optimizer steps where the train batch is "
             "smaller than the rollout batch or max_epochs > 1; actor_grad_norm is then the last one's)",
             "learning rate of step t = `train/actor_lr` logged at step t-1 (OpenRLHF logs get_last_lr() after the "
             "optimizer step, the next update's rate); the first step's is unknown"]
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b - a > 1]
    if gaps:
        notes.append(f"steps are logged every {min(gaps)} or more (--logger.logging_steps): each row holds that "
                     "step's own values, and the steps between are absent")
    unmapped = sorted(tag for tag in scalars.values if keys.get(tag) is None and tag != _LR)
    if unmapped:
        notes.append(f"{len(unmapped)} OpenRLHF scalars have no record field and were not imported "
                     f"(e.g. {', '.join(unmapped[:4])})")
    if scalars.replaced:
        notes.append(f"{scalars.replaced} values were logged again by a later event file (a resumed run): the later "
                     "file's value is kept")
    if non_finite:
        first = min(non_finite, key=lambda v: v.step)
        notes.append(f"{len(non_finite)} logged values were NaN or infinite, kept as null (the manifest's non_finite); "
                     f"the first at {STEP_KEY} {first.step + 1} (`{first.field}`)")
    return write_run(record_dir, framework={"name": "openrlhf", "version": framework_version},
                     model={"description": "unknown policy (OpenRLHF's TensorBoard scalars do not name it)"},
                     telemetry=[OptimizerTelemetry(**rows[t]) for t in steps], rollouts=[], notes=notes,
                     overwrite=overwrite, non_finite=non_finite)
