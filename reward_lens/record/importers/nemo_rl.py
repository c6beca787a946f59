"""Import a NeMo-RL GRPO run's log folder into a record: rollouts with advantages and both
log-probabilities, its TensorBoard metrics, and its validation rewards.

What NeMo-RL leaves in ``logger.log_dir`` (``logs/exp_NNN`` by default) and what this reads
(github.com/NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909):

* ``train_data_step{N}.jsonl`` -- ``grpo_train`` dumps every step's training batch
  (nemo_rl/algorithms/grpo.py:3630-3653) through ``Logger.log_batched_dict_as_jsonl``
  (nemo_rl/utils/logger.py:1071-1098): one JSON line per rollout, every key a one-row slice of the
  padded batch (``[value]``) plus ``idx``. N is ``total_steps + 1``: the rollouts of update N,
  sampled from the policy before it, so the record's t = N - 1.

  - ``content``: the rollout's message contents, the prompt's messages then the completion
    (single turn). The record's prompt is the messages before the last, joined as NeMo-RL's
    templates leave them; the completion is the last.
  - ``token_loss_mask`` marks the completion's tokens within ``input_lengths`` (the rest is
    prompt and right padding). A rollout whose trained tokens are not one run at its end (a
    multi-turn rollout, or an environment turn after the completion) is refused for now.
  - ``generation_logprobs``: the inference engine's per-token log-probabilities (vLLM's), 0 on
    the prompt. Their sum over the completion's tokens is ``logp_sampler`` (nats per sequence).
  - ``prev_logprobs``: the trainer's per-token log-probabilities under pi_t (``policy.get_logprobs``
    before the update). Their sum over the same tokens is ``logp_pre``. Both sums run over exactly
    the tokens the loss masks in (loss_functions.py:381-391 reads both shifted together), so
    ``logp_sampler - logp_pre`` is the engine's log-ratio to pi_t per sequence. NeMo-RL scores
    ``prev_logprobs`` at the generation's temperature and top-k/top-p (TrainingSamplingParams,
    nemo_rl/models/automodel/train.py:180, 385), as the record's ``logp_pre`` is defined. Under
    ``async_grpo_train`` (grpo.py:5258-5281, the same keys) a rollout may come from a policy some
    updates older, and that staleness is part of the gap.
  - ``advantages``: per token; GRPO's are one value per rollout expanded over the sequence
    (advantage_estimator.py:69-98), read as the rollout's ``advantage``. Token-level advantages
    that differ within a completion (another estimator) are not a per-rollout advantage: the
    record then has none, and says so.
  - ``rewards``: the total reward; ``completion_ids`` and ``num_tokens`` from the completion's tokens.
  - ``sample_loss_mask`` 0 marks a rollout left out of the loss (overlong filtering): kept, counted
    in a note.

  Prompt groups: GRPO repeats each prompt ``num_generations_per_prompt`` times in a row
  (``repeat_interleave``); the dump carries no prompt id, so a group is the rollouts of one step
  with identical prompt text.
* ``val_data_step{N}.jsonl`` -- ``validate`` (grpo.py:4016-4021): ``content`` (role/content
  dicts) and ``rewards`` of the validation rollouts of the policy after N updates (N = 0 before
  training). Other prompts, no log-probabilities: never held-out completions of a step's prompts
  (``heldout``). Their mean reward is the telemetry's ``validation_reward_mean`` at t = N; the
  final policy's (N past the last update) has no step row and is stated in a note.
* ``tensorboard/events.out.tfevents.*`` -- with ``logger.tensorboard_enabled`` (logger.py:997-1003):
  ``train/<metric>`` at N (t = N - 1) and ``validation/<metric>`` at N (t = N), mapped by meaning
  through ``specs/fields.yaml`` (the ``nemo_rl`` entries name the exact tags). ``train/gen_kl_error``
  is a k3 estimate (NeMo-RL's default ``loss_fn.reference_policy_kl_type``) of KL(pi_gen || pi_t)
  per token: ``sampler_kl_token`` with estimator ``k3``; a run configured with k1 or k2 logs that
  estimator under the same name, which the record cannot tell.

A NaN or infinite value (a diverged run) is kept as data: null in its column and an entry of the
manifest's ``non_finite``. A line that is not what NeMo-RL writes is refused, naming the file,
the line and the key; nothing is written.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from reward_lens.record.errors import RecordError
from reward_lens.record.parse import jsonl_objects
from reward_lens.record.importers import INT64_MAX, finite_number, one_based_step, shown
from reward_lens.record.importers.openrlhf import non_finite_name
from reward_lens.record.importers.tensorboard import read_scalars
from reward_lens.record.schema import NonFiniteValue, OptimizerTelemetry, RunManifest, arrow_schema
from reward_lens.record.writer import write_run
from reward_lens_spec import load_fields

_TRAIN = re.compile(r"^train_data_step([1-9][0-9]*)\.jsonl$", re.ASCII)
_VAL = re.compile(r"^val_data_step(0|[1-9][0-9]*)\.jsonl$", re.ASCII)
_TRAIN_KEYS = ("content", "rewards", "input_lengths", "token_ids", "token_loss_mask", "sample_loss_mask",
               "advantages", "generation_logprobs", "prev_logprobs")
_TOKEN_KEYS = ("token_ids", "token_loss_mask", "advantages", "generation_logprobs", "prev_logprobs")
# GRPO's advantage is one number per rollout, expanded over the sequence; token values that differ by
# more than this (relative to the largest) are a token-level estimator's, not a per-rollout advantage
_ADV_TOL = 1e-6
STEP_KEY = "N"  # the number in train_data_step{N}.jsonl, NeMo-RL's total_steps + 1


def _lines(path: Path):
    """(line number, ``file:line``, parsed JSON object) of a NeMo-RL dump, or a RecordError naming
    file and line. NeMo-RL's json.dumps writes NaN and Infinity as such, and they parse."""
    return jsonl_objects(path, corrupt="truncated or corrupt", nested="a NeMo-RL dump line", line="a dump line")


def _one(obj: dict, key: str, where: str) -> Any:
    """The value of ``key`` in a dump line: NeMo-RL writes each as a one-row slice ``[value]``."""
    if key not in obj:
        raise RecordError(where, f"a NeMo-RL dump line needs `{key}` (log_batched_dict_as_jsonl writes every key of "
                          "the step's batch)", field=key)
    v = obj[key]
    if not isinstance(v, list) or len(v) != 1:
        raise RecordError(where, f"`{key}` is {shown(v, 60)}: NeMo-RL writes each key as a one-row slice `[value]`",
                          field=key)
    return v[0]


def _numbers(v: Any, where: str, key: str, n: int | None = None) -> np.ndarray:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
        raise RecordError(where, f"`{key}` is not a list of numbers ({shown(v, 60)})", field=key)
    if n is not None and len(v) != n:
        raise RecordError(where, f"`{key}` has {len(v)} positions, `token_ids` {n}: the padded rows of one batch are "
                          "all as long", field=key)
    return np.asarray(v, dtype=np.float64)


class _Rollouts:
    """The rollouts of every train_data_step{N}.jsonl, as record columns."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {k: [] for k in ("step", "group_id", "prompt", "completion", "completion_ids",
                                                           "num_tokens", "reward", "advantage", "logp_pre",
                                                           "logp_sampler")}
        self.non_finite: list[NonFiniteValue] = []
        self.token_advantages = 0  # rollouts whose per-token advantages differ within the completion
        self.left_out = 0  # sample_loss_mask 0

    def _value(self, v: float, t: int, field: str, where: str, key: str, step: int) -> float | None:
        if not math.isfinite(v):
            file, _, line = where.rpartition(":")
            self.non_finite.append(NonFiniteValue(step=t, field=field, value=non_finite_name(v),
                                                  source=f"{Path(file).name}:{line}: `{key}`"))
            return None
        return finite_number(v, where, key, step, STEP_KEY)

    def read(self, path: Path, step: int) -> None:
        t = one_based_step(step, path, STEP_KEY)
        first: dict[str, int] = {}
        n_before = len(self.cols["step"])
        for _, where, obj in _lines(path):
            content = _one(obj, "content", where)
            if (not isinstance(content, list) or len(content) < 2
                    or any(not isinstance(c, str) for c in content)):
                raise RecordError(where, f"`content` is {shown(content, 60)}: NeMo-RL writes a rollout's message "
                                  "contents, the prompt's then the completion (text)", field="content")
            for k in _TRAIN_KEYS:
                _one(obj, k, where)
            ids = _numbers(obj["token_ids"][0], where, "token_ids")
            if not np.all(ids == np.round(ids)) or (ids < 0).any() or (ids >= INT64_MAX).any():
                raise RecordError(where, "`token_ids` are not whole numbers from 0 to 2^63 - 1", field="token_ids")
            n = len(ids)
            tok = {k: _numbers(obj[k][0], where, k, n) for k in _TOKEN_KEYS[1:]}
            length = obj["input_lengths"][0]
            if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= n:
                raise RecordError(where, f"`input_lengths` is {shown(length)}, not a length within the row's {n} "
                                  "positions", field="input_lengths")
            mask = tok["token_loss_mask"][:length]
            if not np.isin(mask, (0, 1)).all():
                raise RecordError(where, "`token_loss_mask` holds values other than 0 and 1", field="token_loss_mask")
            on = np.flatnonzero(mask)
            if len(on) == 0:
                raise RecordError(where, "`token_loss_mask` marks no completion token within `input_lengths`",
                                  field="token_loss_mask")
            if on[-1] - on[0] + 1 != len(on) or on[-1] != length - 1:
                raise RecordError(where, "the trained tokens (`token_loss_mask`) are not one run ending the rollout: a "
                                  "multi-turn rollout, or an environment turn after the completion, which this import "
                                  "does not read yet", field="token_loss_mask")
            sel = slice(on[0], length)
            self.cols["step"].append(t)
            prompt = "".join(content[:-1])
            first.setdefault(prompt, len(first))
            self.cols["group_id"].append(f"{t}:{first[prompt]}")
            self.cols["prompt"].append(prompt)
            self.cols["completion"].append(content[-1])
            self.cols["completion_ids"].append([int(x) for x in ids[sel]])
            self.cols["num_tokens"].append(len(on))
            self.cols["reward"].append(self._value(_scalar(obj["rewards"][0], where, "rewards"), t, "rollout.reward",
                                                   where, "rewards", step))
            self.cols["logp_sampler"].append(self._value(float(tok["generation_logprobs"][sel].sum()), t,
                                                         "rollout.logp_sampler", where, "generation_logprobs", step))
            self.cols["logp_pre"].append(self._value(float(tok["prev_logprobs"][sel].sum()), t, "rollout.logp_pre",
                                                     where, "prev_logprobs", step))
            adv = tok["advantages"][sel]
            a = self._value(float(adv[0]), t, "rollout.advantage", where, "advantages", step)
            if a is not None and np.isfinite(adv).all() and np.ptp(adv) > _ADV_TOL * max(1.0, float(np.abs(adv).max())):
                self.token_advantages += 1
            self.cols["advantage"].append(a)
            if _scalar(obj["sample_loss_mask"][0], where, "sample_loss_mask") == 0:
                self.left_out += 1
        if len(self.cols["step"]) == n_before:
            raise RecordError(path, "an empty training dump", steps=[step], step_key=STEP_KEY)

    def table(self) -> pa.Table:
        cols = dict(self.cols)
        if self.token_advantages:
            cols["advantage"] = [None] * len(cols["advantage"])
        schema = arrow_schema("rollouts")
        return pa.table({k: pa.array(v, type=schema.field(k).type) for k, v in cols.items()})


def _scalar(v: Any, where: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RecordError(where, f"`{key}` is {shown(v)}, not a number", field=key)
    return float(v)


def _validation(path: Path, step: int) -> tuple[float, int]:
    """The mean reward of a val_data_step{N}.jsonl (NaN or infinite where a reward was) and its count."""
    rewards = []
    for _, where, obj in _lines(path):
        content = _one(obj, "content", where)
        if not isinstance(content, list) or any(not isinstance(m, dict) for m in content):
            raise RecordError(where, f"`content` is {shown(content, 60)}: NeMo-RL's validation dump holds the message "
                              "log as role/content objects", field="content")
        rewards.append(_scalar(_one(obj, "rewards", where), where, "rewards"))
    if not rewards:
        raise RecordError(path, "an empty validation dump", steps=[step], step_key=STEP_KEY)
    return float(np.mean(rewards)), len(rewards)


def _dumps(folder: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    train, val = {}, {}
    for f in folder.iterdir():
        m, v = _TRAIN.match(f.name), _VAL.match(f.name)
        if m:
            train[int(m.group(1))] = f
        elif v:
            val[int(v.group(1))] = f
        elif re.match(r"^(train|val)_data_step.*\.jsonl$", f.name):
            raise RecordError(f, "is named like a NeMo-RL dump, but NeMo-RL names them train_data_step{N}.jsonl (N from 1) "
                              "and val_data_step{N}.jsonl with N in ASCII digits without leading zeros: rename or move "
                              "it, so no dump is read under the wrong step")
    return train, val


def import_nemo_rl(source: str | Path, record_dir: str | Path, *, framework_version: str | None = None,
                   overwrite: bool = False) -> RunManifest:
    """Convert a NeMo-RL GRPO log folder into a record at ``record_dir``; nothing is written
    unless the whole import succeeds."""
    folder = Path(source)
    if not folder.is_dir():
        raise RecordError(folder, "not a directory: NeMo-RL's run log folder (logger.log_dir, logs/exp_NNN)")
    train, val = _dumps(folder)
    tb = folder / "tensorboard"
    scalars = read_scalars(tb, "NeMo-RL's metrics (logger.tensorboard_enabled)") if tb.is_dir() else None
    if not train and scalars is None:
        raise RecordError(folder, "no train_data_step{N}.jsonl dumps and no tensorboard/ folder: not a NeMo-RL GRPO "
                          "run's log folder (logger.log_dir)")
    notes: list[str] = []
    rows: dict[int, dict[str, Any]] = {}
    non_finite: list[NonFiniteValue] = []
    keys = load_fields().framework_keys("nemo_rl")
    tb_val: dict[int, float] = {}  # validation/accuracy by the policy's step, where no dump gives it
    if scalars is not None:
        for tag in sorted(scalars.values):
            field = keys.get(tag)
            validation = tag.startswith("validation/")
            if not (tag.startswith("train/") or validation):
                continue
            for step, (value, where) in sorted(scalars.values[tag].items()):
                at = f"{tb}: {where}"
                if validation:  # the policy after `step` updates: pi_t with t = step
                    if step < 0:
                        raise RecordError(at, f"`{tag}` is logged at step {step}", field=tag)
                    t = step
                else:
                    t = one_based_step(step, at, STEP_KEY)
                    rows.setdefault(t, {"step": t})
                if not math.isfinite(value):
                    non_finite.append(NonFiniteValue(step=t, field=field or tag, value=non_finite_name(value),
                                                     source=f"tensorboard/{where}: `{tag}` at step {step}"))
                elif field is not None and validation:
                    tb_val[t] = finite_number(value, at, tag, step, STEP_KEY)
                elif field is not None:
                    rows[t][field] = finite_number(value, at, tag, step, STEP_KEY)
        for t, row in rows.items():
            if row.get("sampler_kl_token") is not None:
                row["sampler_kl_token_estimator"] = "k3"
        unmapped = sorted(t for t in scalars.values if t not in keys and t.startswith(("train/", "validation/")))
        notes.append(f"metrics from NeMo-RL's TensorBoard folder ({len(scalars.files)} event file(s)); {len(unmapped)} "
                     f"`train/` and `validation/` scalars have no record field (e.g. {', '.join(unmapped[:3])})")
        if any("sampler_kl_token" in r for r in rows.values()):
            notes.append("`train/gen_kl_error` read as a k3 estimate of KL(pi_gen || pi_t) per token, NeMo-RL's default "
                         "loss_fn.reference_policy_kl_type; a run that set k1 or k2 logged that estimator instead")
        if scalars.replaced:
            notes.append(f"{scalars.replaced} values were logged again by a later event file (a resumed run): the "
                         "later file's value is kept")
    else:
        notes.append("no tensorboard/ folder (NeMo-RL writes one with logger.tensorboard_enabled): no logged metrics, "
                     "only the dumps' rollouts")
    rollouts = _Rollouts()
    for step in sorted(train):
        rollouts.read(train[step], step)
        rows.setdefault(step - 1, {"step": step - 1})
    non_finite += rollouts.non_finite
    if train:
        notes.append(f"rollouts from NeMo-RL's train_data_step{{N}}.jsonl dumps on {len(train)} steps: logp_sampler and "
                     "logp_pre are the sums of generation_logprobs and prev_logprobs over each completion's trained "
                     "tokens; prompt groups formed by identical prompt text within a step")
    if rollouts.token_advantages:
        notes.append(f"{rollouts.token_advantages} rollouts have per-token advantages that differ within the completion "
                     "(not GRPO's one advantage per rollout): the record holds no advantages")
    if rollouts.left_out:
        notes.append(f"{rollouts.left_out} rollouts have sample_loss_mask 0 (left out of the loss, e.g. overlong "
                     "filtering); they are kept")
    validation = {n: _validation(val[n], n) for n in sorted(val)} or {t: (v, None) for t, v in tb_val.items()}
    last = max(rows) if rows else -1
    for n, (mean, count) in validation.items():
        if not math.isfinite(mean):
            non_finite.append(NonFiniteValue(step=n, field="validation_reward_mean", value=non_finite_name(mean),
                                             source=f"{val[n].name}: `rewards`"))
        elif n <= last:
            rows.setdefault(n, {"step": n})["validation_reward_mean"] = mean
        else:
            over = f" over {count} rollouts (val_data_step{n}.jsonl)" if count else " (`validation/accuracy`)"
            notes.append(f"the final policy (after {n} updates) has validation reward {mean:.6g}{over}; the record has "
                         "no step row past the last update")
    if validation:
        src = "val_data_step{N}.jsonl dumps" if val else "`validation/accuracy` scalars"
        notes.append(f"validation_reward_mean from NeMo-RL's {src} ({len(validation)} validations): the policy after N "
                     "updates is the record's step N; other prompts than training's, never read as held-out "
                     "completions")
    if non_finite:
        first = min(non_finite, key=lambda v: v.step)
        notes.append(f"{len(non_finite)} values were NaN or infinite, kept as null (the manifest's non_finite); the "
                     f"first at record step {first.step} (`{first.field}`)")
    table = rollouts.table() if train else []
    return write_run(record_dir, framework={"name": "nemo-rl", "version": framework_version},
                     model={"description": "unknown policy (NeMo-RL's logs do not name it)"},
                     telemetry=[OptimizerTelemetry(**rows[t]) for t in sorted(rows)], rollouts=table, notes=notes,
                     overwrite=overwrite, non_finite=non_finite)
