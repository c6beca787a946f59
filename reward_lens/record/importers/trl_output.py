"""Import a plain TRL GRPO run (``GRPOTrainer``) into a record.

What TRL leaves on disk and what this reads:

* ``trainer_state.json`` -- ``log_history``, one entry per logging step. With
  ``logging_steps=1`` every optimizer step is logged; with a larger value the TRL metrics in
  an entry are means over the window (``GRPOTrainer.log`` averages them) and the record is
  marked ``telemetry_per_step = False`` rather than pretending otherwise.
* ``completions/completions_<step>.parquet`` -- written when ``log_completions=True``, with
  columns ``step, prompt, completion, <reward function names>, advantage``.
* The trainer arguments -- TRL saves them only as a pickle (``training_args.bin``), which
  is never unpickled here. Pass them as JSON or YAML (``trainer.args.to_dict()``), or leave
  a ``grpo_config.json`` in the output directory. Every argument read is validated through
  one typed model (``types`` in specs/frameworks/trl.yaml, the audit's too).
* Where the state lives. ``trainer.save_state()`` writes ``trainer_state.json`` into the
  output directory, but ``trainer.train()`` does not call it; what every run with a save
  strategy leaves is ``checkpoint-<global_step>/trainer_state.json`` (transformers
  ``Trainer._save_checkpoint``; with ``save_strategy="steps"`` the last step is saved too), each
  holding the whole ``log_history`` up to that step. Without the top-level file, the newest
  checkpoint's is read, and the record says which.
* TRL's version -- ``GRPOTrainer._save_checkpoint`` writes a model card, ``README.md`` in the
  output directory, whose "Framework versions" list has ``- TRL: <version>``. That is read
  when ``--framework-version`` is not given; without either the version is unknown, and said so.

Every file is checked to be a regular file before it is opened (a FIFO never blocks the
import), and every error names the file, the key and TRL's own ``step`` (not the record's t).
A NaN or infinite logged value (a diverged run's entropy, a reward function that returned None)
is data about the run: kept as null, with a ``NonFiniteValue`` in the manifest naming the entry,
the step and the key; a value of the wrong type (a string, a list) is still refused.

Fields are mapped by meaning through ``specs/fields.yaml``: TRL's ``grad_norm`` is what
``clip_grad_norm_`` returned, the pre-clip norm (``grad_norm_unclipped``); TRL's ``kl``
(only when ``beta != 0``) is a per-token k3 estimate of KL to the *reference* model
(``kl_to_ref``). TRL logs nothing that is ``kl_to_previous`` or ``update_norm``, so they
stay absent.

Step numbering: TRL tags both the log entry and the completions with ``global_step`` after
the optimizer step, so entry ``s`` describes the step that maps pi_{s-1} to pi_s, and the
completions tagged ``s`` were sampled from pi_{s-1} at the start of that step. The record
uses 0-based t = s - 1 for both.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reward_lens.record.errors import RecordError
from reward_lens.record.parse import config_mapping
from reward_lens.record.notes import ASSUMED_WEIGHTS, assumed_reward_weights  # noqa: F401 (re-exported)
from reward_lens.record.importers import (INT64_MAX, logged_number, one_based_step, shown,
                                          validate_config, whole_number)
from reward_lens.record.schema import NonFiniteValue, OptimizerTelemetry, RunManifest, arrow_schema
from reward_lens.record.writer import write_run
from reward_lens_spec import load_fields, load_frameworks
from reward_lens_spec.conditions import holds
from reward_lens_spec.files import UnreadableFile, read_text, require_regular

# torch.nn.utils.clip_grad_norm_ scales by max_norm / (total_norm + 1e-6), clamped at 1.
_CLIP_EPS = 1e-6
_COMPLETION_BASE = ("step", "prompt", "completion", "advantage")


def record_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The GRPOConfig arguments a record keeps (``record_config`` in specs/frameworks/trl.yaml)."""
    keys = load_frameworks()["trl"].record_config
    return {k: cfg[k] for k in keys if k in cfg}


def _text(path: Path, what: str) -> str:
    """A file of the output directory as text: a regular file (never a FIFO opened), UTF-8."""
    try:
        return read_text(path)
    except FileNotFoundError:
        raise RecordError(path, f"missing: {what}") from None
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    except OSError as exc:
        raise RecordError(path, f"cannot be read ({exc.strerror})") from None


def load_trainer_config(path: Path) -> dict[str, Any]:
    return config_mapping(path, _text(path, "the trainer config given"), what="a trainer config",
                          mapping="the trainer config must be a mapping of argument names to values")


_CHECKPOINT = re.compile(r"^checkpoint-([0-9]+)$")  # ASCII digits only, as transformers names them


def state_file(output_dir: Path) -> Path | None:
    """The ``trainer_state.json`` a TRL output directory's log is read from: the one
    ``trainer.save_state()`` leaves in the directory, else the newest checkpoint's (the highest
    ``checkpoint-<global_step>``, as transformers orders them), else None."""
    top = output_dir / "trainer_state.json"
    if top.exists() or top.is_symlink():
        return top
    found = []
    for d in output_dir.iterdir() if output_dir.is_dir() else []:
        m = _CHECKPOINT.match(d.name)
        if m and ((d / "trainer_state.json").exists() or (d / "trainer_state.json").is_symlink()):
            found.append((int(m.group(1)), d / "trainer_state.json"))
    return max(found)[1] if found else None


def _log_history(output_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any], Path]:
    path = state_file(output_dir)
    if path is None:
        raise RecordError(output_dir / "trainer_state.json", "missing, and no checkpoint-<step>/trainer_state.json "
                          "either: a TRL output directory has one in every checkpoint (save_strategy other than "
                          "\"no\"), or at its top after trainer.save_state()")
    text = _text(path, "the trainer state")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(path, f"not valid JSON, truncated or corrupt ({exc})") from None
    except RecursionError:
        raise RecordError(path, "JSON nested too deeply to be a trainer state") from None
    if not isinstance(state, dict):
        raise RecordError(path, f"is a JSON {type(state).__name__}, not the object `trainer.save_state()` writes")
    history = state.get("log_history")
    if not isinstance(history, list):
        raise RecordError(path, "has no `log_history` list", field="log_history")
    # The last entry of a finished run is a summary (train_runtime, train_loss): not a step.
    rows = [e for e in history if isinstance(e, dict) and "step" in e and "train_runtime" not in e
            and not any(k.startswith("eval_") for k in e)]
    return rows, state, path


_CARD_VERSION = re.compile(r"^- TRL: *(\S+) *$", re.MULTILINE)


def trl_version(output_dir: Path) -> str | None:
    """TRL's version as the run's model card states it (``README.md`` in the output directory,
    written by ``GRPOTrainer._save_checkpoint``: "- TRL: 1.16.0"), or None where there is none."""
    card = output_dir / "README.md"
    try:
        text = read_text(card, limit=1 << 20)
    except (OSError, UnreadableFile):
        return None
    m = _CARD_VERSION.search(text)
    return m.group(1)[:40] if m else None


def _read_completions(output_dir: Path) -> list[tuple[Path, pa.Table]]:
    folder = output_dir / "completions"
    files = sorted(folder.glob("completions_*.parquet"))
    if not files:
        raise RecordError(folder, "no completions_*.parquet files: run TRL with log_completions=True")
    out = []
    for f in files:
        try:
            require_regular(f)  # a FIFO would block pyarrow's open
        except UnreadableFile as exc:
            raise RecordError(f, exc.problem) from None
        try:
            table = pq.read_table(f)
        except (pa.ArrowInvalid, OSError) as exc:
            raise RecordError(f, f"not a readable Parquet file, truncated or corrupt ({exc})") from None
        for col in _COMPLETION_BASE:
            if col not in table.column_names:
                raise RecordError(f, "column missing from TRL's completions table", field=col)
        out.append((f, table))
    return out


def import_trl(
    output_dir: str | Path,
    record_dir: str | Path,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    checkpoint: str | Path | None = None,
    framework_version: str | None = None,
    model_description: str | None = None,
    overwrite: bool = False,
    scalars_only_ok: bool = False,
) -> RunManifest:
    """Convert a TRL GRPO output directory into a record at ``record_dir``.

    ``checkpoint`` is the directory of the policy the run *started from* (safetensors,
    config, tokenizer); it is stored in the record as step 0. Nothing is written unless the
    whole import succeeds.
    """
    out = Path(output_dir)
    if not out.is_dir():
        raise RecordError(out, "not a directory")
    history, state, state_path = _log_history(out)
    if config is None and ((out / "grpo_config.json").exists() or (out / "grpo_config.json").is_symlink()):
        config = out / "grpo_config.json"
    where = "the trainer config" if isinstance(config, Mapping) else Path(config) if config else out
    cfg = dict(config) if isinstance(config, Mapping) else (load_trainer_config(Path(config)) if config else {})
    spec = load_frameworks()["trl"]
    cfg = validate_config(cfg, spec, where)  # the typed model the audit reads a config with
    for rej in spec.rejects:
        conds = rej.when if isinstance(rej.when, list) else [rej.when]
        if cfg and all(c.key in cfg for c in conds) and _rejected(rej.when, cfg):
            key = conds[0].key
            raise RecordError(where, f"`{key}` is {shown(cfg[key])}: {rej.why}; no TRL run had this configuration",
                              field=key)
    notes: list[str] = []
    if state_path.parent != out:
        notes.append(f"the log is read from {state_path.parent.name}/trainer_state.json, the newest checkpoint's "
                     "(the output directory has no trainer_state.json of its own: trainer.save_state() was not "
                     "called); steps after that checkpoint are not in it")
    if not cfg:
        notes.append("no trainer config was given: optimizer, beta, max_grad_norm and the group size are unknown")

    logging_steps = _logging_steps(cfg, state, where, state_path)
    per_step = logging_steps == 1
    if not per_step:
        notes.append(f"logging_steps={logging_steps}: each telemetry row holds the TRL metrics averaged over "
                     f"{logging_steps} optimizer steps (grad_norm and learning_rate are the window's last step); "
                     "these are not per-step values")

    non_finite: list[NonFiniteValue] = []
    telemetry = _telemetry(history, cfg, state_path, non_finite)
    if non_finite:
        nf = non_finite[0]
        notes.append(f"{len(non_finite)} value(s) the run logged as NaN or infinite are kept as null (the manifest's "
                     f"non_finite); the first at record step {nf.step}: `{nf.field}` = {nf.value}")
    logged = {t.step for t in telemetry}
    reward_names = sorted({k.split("/")[1] for e in history for k in e
                           if k.startswith("rewards/") and k.endswith("/mean")})
    if scalars_only_ok and not any((out / "completions").glob("completions_*.parquet")):
        # `reward-lens check` on an output directory without completions: the logged scalars alone
        notes.append("no completions (TRL writes them with log_completions=True): this record holds the logged "
                     "scalars only; the books and the findings that read rollouts are not evaluated")
        rollouts = pa.Table.from_pylist([], schema=arrow_schema("rollouts"))
    else:
        rollouts = _rollouts(_read_completions(out), cfg, reward_names, logged, per_step)
        assumed = _assumed_weights(cfg, reward_names)
        if assumed is not None:
            notes.append(assumed)

    optimizer = cfg.get("optim")
    version = framework_version or trl_version(out)
    if framework_version is None and version is not None:
        notes.append(f"TRL {version}, as the run's model card (README.md) states it")
    elif version is None:
        notes.append("TRL version unknown: the output directory has no model card (README.md) naming it; "
                     "--framework-version says it")
    framework = {"name": "trl", "version": version}
    model = {"description": model_description or str(cfg.get("model_name_or_path") or "unknown policy")}
    if checkpoint is not None:
        model.update(_checkpoint_model_info(Path(checkpoint)))
    trainer_config = record_config(cfg)
    return write_run(record_dir, framework=framework, model=model, telemetry=telemetry, rollouts=rollouts,
                     optimizer=str(optimizer) if optimizer else None, trainer_config=trainer_config,
                     telemetry_per_step=per_step, logging_steps=logging_steps, notes=notes,
                     checkpoints={0: checkpoint} if checkpoint is not None else None, overwrite=overwrite,
                     non_finite=non_finite)


def _rejected(when, cfg: Mapping[str, Any]) -> bool:
    """A ``rejects`` condition of the TRL spec holds for ``cfg`` (the audit's reading of it)."""
    return holds(when, dict(cfg), {})


def _logging_steps(cfg: Mapping[str, Any], state: Mapping[str, Any], where, state_path: Path) -> int:
    """The logging window in steps: the trainer state's (transformers stores the resolved whole
    number there, a ratio in the config included), else the config's whole number, else 1."""
    if state.get("logging_steps") is not None:
        return whole_number(state["logging_steps"], state_path, "logging_steps", minimum=1)
    value = cfg.get("logging_steps")
    if value is None:
        return 1
    if isinstance(value, float) and value < 1:
        raise RecordError(where, f"`logging_steps` is a ratio ({value:g}) and {state_path.name} does not say the "
                          "window it resolved to", field="logging_steps")
    return int(value)


def _telemetry(history: list[dict[str, Any]], cfg: Mapping[str, Any], path: Path,
               non_finite: list[NonFiniteValue]) -> list[OptimizerTelemetry]:
    """The telemetry rows of TRL's log; a NaN or infinite logged value is appended to ``non_finite``
    and left out of its row (null)."""
    keys = load_fields().framework_keys("trl")  # TRL key -> record field, by meaning
    max_norm = cfg.get("max_grad_norm")
    beta = cfg.get("beta")
    seen: dict[int, dict[str, Any]] = {}
    for i, entry in enumerate(history):
        s = entry["step"]
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise RecordError(path, f"log_history entry {i} has `step` {shown(s)}: TRL's global_step is a whole "
                              "number from 1", field="step")
        t = one_based_step(s, path)
        if s in seen:
            # The final summary entry repeats the last step; two *metric* entries for one step do not happen.
            raise RecordError(path, "two log_history entries for the same step", field="step", steps=[s],
                              step_key="step")
        row: dict[str, Any] = {"step": t}
        for key, field in keys.items():
            if key in entry and entry[key] is not None:
                # transformers writes trainer_state.json with json.dumps: a NaN entropy or reward is the
                # literal NaN there, read back as a float nan: a diverged step, kept as null and named
                v, what = logged_number(entry[key], path, key, s)
                if what is not None:
                    non_finite.append(NonFiniteValue(step=t, field=field, value=what,
                                                     source=f"{path.name} log_history entry {i} (step {s}) `{key}`"))
                elif v is not None:
                    row[field] = v
        if max_norm is not None and max_norm > 0:
            row["max_grad_norm"] = float(max_norm)
            pre = row.get("grad_norm_unclipped")
            if pre is not None:
                row["grad_norm"] = pre * min(1.0, float(max_norm) / (pre + _CLIP_EPS))
        elif max_norm is not None and "grad_norm_unclipped" in row:
            row["grad_norm"] = row["grad_norm_unclipped"]  # no clipping configured
        if beta is not None:
            row["beta"] = float(beta)
        seen[s] = row
    return [OptimizerTelemetry(**seen[s]) for s in sorted(seen)]


def _weights(cfg: Mapping[str, Any], reward_names: list[str]) -> list[float]:
    """The weight of each reward function in the rollouts' `reward`: the config's
    ``reward_weights``, else 1 each (GRPOConfig's default when it is unset)."""
    weights = cfg.get("reward_weights") or [1.0] * len(reward_names)
    return list(weights) if len(weights) == len(reward_names) else [1.0] * len(reward_names)


def _assumed_weights(cfg: Mapping[str, Any], reward_names: list[str]) -> str | None:
    """The note saying which reward weights were assumed, or None when the config states them. A
    config holding ``reward_weights: null`` states them too (GRPOConfig's default: 1 each, which
    ``trainer.args.to_dict()`` writes out); a config without the key, or no config, does not."""
    if not reward_names:
        return None
    given = cfg.get("reward_weights")
    if "reward_weights" in cfg and (given is None or len(given) == len(reward_names)):
        return None
    pairs = ", ".join(f"`{n}` 1" for n in reward_names)
    why = (f"the config's reward_weights {list(given)} do not match the {len(reward_names)} reward functions "
           "logged" if given is not None else "no trainer config said what they were (grpo_config.json beside the output, "
           "or --config)")
    return (f"{ASSUMED_WEIGHTS}: each rollout's `reward` is its reward functions' scores summed at weight 1 "
            f"({pairs}: GRPOConfig's default), because {why}; if the run set reward_weights, the per-rollout "
            "reward and every number read from it are wrong (pass the config to the import)")


def _rollouts(files: list[tuple[Path, pa.Table]], cfg: Mapping[str, Any], reward_names: list[str],
              logged: set[int], per_step: bool) -> pa.Table:
    group_size = cfg.get("num_generations")
    weights = _weights(cfg, reward_names)
    columns: dict[str, list[Any]] = {k: [] for k in ("step", "group_id", "prompt", "completion", "reward",
                                                     "rewards", "advantage")}
    for f, table in files:
        col = table.column("step")
        if not pa.types.is_integer(col.type):
            raise RecordError(f, f"`step` holds {col.type}, not whole numbers", field="step")
        steps = np.unique(col.to_numpy(zero_copy_only=False))
        if len(steps) != 1:
            raise RecordError(f, "one completions file should hold one step", field="step", steps=steps[:8],
                              step_key="step")
        s = int(steps[0])
        t = one_based_step(s, f)
        at = {"steps": [s], "step_key": "step"}  # TRL's own numbering, as the file has it
        if t not in logged:
            raise RecordError(f, "completions for a step that trainer_state.json never logged "
                              "(logging_steps > 1, or the log was cut short)", field="step", **at)
        prompts = [str(p) for p in table.column("prompt").to_pylist()]
        completions = table.column("completion").to_pylist()
        if any(not isinstance(c, str) for c in completions):
            raise RecordError(f, "non-text completions (conversational or multimodal) are not supported yet",
                              field="completion", **at)
        missing = [n for n in reward_names if n not in table.column_names]
        if missing:
            raise RecordError(f, f"reward column(s) {missing} named in the log are missing", **at)
        per_func = np.column_stack([_numbers(table, n, f, at) for n in reward_names]) if reward_names \
            else np.zeros((len(prompts), 0))
        advantage = _numbers(table, "advantage", f, at)
        if not np.isfinite(advantage).all():
            raise RecordError(f, "non-finite advantage", field="advantage", **at)
        # GRPO groups: consecutive completions of the same prompt (TRL's RepeatSampler order).
        groups: list[int] = []
        g, start = 0, 0
        sizes = []
        for i in range(1, len(prompts) + 1):
            if i == len(prompts) or prompts[i] != prompts[start]:
                sizes.append(i - start)
                groups.extend([g] * (i - start))
                g, start = g + 1, i
        if group_size is None:
            group_size = sizes[0]
        bad = [sz for sz in sizes if sz % group_size]
        if bad:
            raise RecordError(f, f"group sizes {sizes} do not match num_generations={group_size}",
                              field="prompt", **at)
        total = np.nansum(per_func * np.asarray(weights, float), axis=1)
        columns["step"] += [t] * len(prompts)
        columns["group_id"] += [f"{t}:{gi}" for gi in groups]
        columns["prompt"] += prompts
        columns["completion"] += completions
        columns["reward"] += total.tolist()
        columns["rewards"] += [list(zip(reward_names, row.tolist())) for row in per_func]
        columns["advantage"] += advantage.tolist()
    schema = arrow_schema("rollouts")
    return pa.table({k: pa.array(v, type=schema.field(k).type) for k, v in columns.items()})


def _numbers(table: pa.Table, name: str, f: Path, at: dict[str, Any]) -> np.ndarray:
    """A numeric column of a completions table as floats, each within the record's magnitude
    limit, or a RecordError naming the file, the column and TRL's step."""
    col = table.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_null(col.type)):
        raise RecordError(f, f"`{name}` holds {col.type}, not numbers", field=name, **at)
    values = np.asarray(col.to_numpy(zero_copy_only=False), float)
    mag = load_fields().magnitude
    with np.errstate(invalid="ignore"):
        big = np.abs(values) > mag.limit if mag is not None else np.zeros(len(values), bool)
    if big.any():
        raise RecordError(f, f"`{name}` is {values[big][0]:.3g}, beyond ±{mag.limit:g}: {mag.why}", field=name, **at)
    return values


def _checkpoint_model_info(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise RecordError(path, "the starting checkpoint is a directory (safetensors, config.json, tokenizer)")
    for dirpath, _, filenames in os.walk(path):  # copied into the record: every file regular, no FIFO
        for n in filenames:
            try:
                require_regular(Path(dirpath, n))
            except UnreadableFile as exc:
                raise RecordError(exc.path, f"in the starting checkpoint: {exc.problem}") from None
            except FileNotFoundError:
                raise RecordError(Path(dirpath, n), "in the starting checkpoint: a broken symbolic link") from None
    cfg_path = path / "config.json"
    text = _text(cfg_path, "the starting checkpoint needs config.json")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(cfg_path, f"not valid JSON ({exc}): the checkpoint's model config, as "
                          "save_pretrained writes it") from None
    except RecursionError:
        raise RecordError(cfg_path, "JSON nested too deeply to be a model config") from None
    if not isinstance(cfg, dict):
        raise RecordError(cfg_path, f"is a JSON {type(cfg).__name__}, not the object save_pretrained writes")
    arch = cfg.get("architectures") or [cfg.get("model_type")]
    vocab = cfg.get("vocab_size")
    if not isinstance(arch, list) or not arch or not isinstance(arch[0], (str, type(None))):
        raise RecordError(cfg_path, f"`architectures` is {shown(arch)}, not a list of class names", field="architectures")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= INT64_MAX):
        raise RecordError(cfg_path, f"`vocab_size` is {shown(vocab)}, not a positive whole number", field="vocab_size")
    info: dict[str, Any] = {"architecture": arch[0], "vocab_size": vocab}
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise RecordError(path, "the starting checkpoint has no .safetensors weights")
    total = sum(_safetensors_numel(w) for w in weights)
    if total > INT64_MAX:
        raise RecordError(path, f"the safetensors headers declare {total:,} parameters, beyond 2^63 - 1")
    info["n_parameters"] = total
    return info


# safetensors refuses a header larger than this (its MAX_HEADER_SIZE, 100 MB).
_MAX_HEADER = 100_000_000


def _safetensors_numel(path: Path) -> int:
    """Count parameters from a safetensors header (8-byte little-endian length + JSON), no torch
    needed; a header that is too long for the file or for safetensors, not JSON, or not a table
    of tensors with whole-number shapes is named."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if size < 8 or n > min(_MAX_HEADER, size - 8):
            raise RecordError(path, f"safetensors header length {n:,} is beyond the file ({size:,} bytes) or "
                              f"safetensors' {_MAX_HEADER:,}-byte limit: not a safetensors file, or a corrupt one")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise RecordError(path, f"safetensors header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise RecordError(path, "safetensors header is not a table of tensors")
    total = 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        shape = v.get("shape") if isinstance(v, dict) else None
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= INT64_MAX
                                               for d in shape):
            raise RecordError(path, f"safetensors header: tensor {shown(k)} has shape {shown(shape)}, not a list of "
                              "whole numbers", field=str(k)[:80])
        total += math.prod(shape)
    return total
