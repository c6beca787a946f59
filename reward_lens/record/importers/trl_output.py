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
  a ``grpo_config.json`` in the output directory.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from reward_lens.record.errors import RecordError
from reward_lens.record.importers import finite_number
from reward_lens.record.schema import OptimizerTelemetry, RunManifest, arrow_schema
from reward_lens.record.writer import write_run
from reward_lens_spec import load_fields, load_frameworks

# The note a record carries when the importer had to assume the reward weights (its first words
# are how a reader of the record finds it: ``assumed_reward_weights``).
ASSUMED_WEIGHTS = "reward weights assumed"
# torch.nn.utils.clip_grad_norm_ scales by max_norm / (total_norm + 1e-6), clamped at 1.
_CLIP_EPS = 1e-6
_COMPLETION_BASE = ("step", "prompt", "completion", "advantage")


def record_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The GRPOConfig arguments a record keeps (``record_config`` in specs/frameworks/trl.yaml)."""
    keys = load_frameworks()["trl"].record_config
    return {k: cfg[k] for k in keys if k in cfg}


def load_trainer_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RecordError(path, f"cannot read the trainer config ({exc})") from None
    if not isinstance(data, dict):
        raise RecordError(path, "the trainer config must be a mapping of argument names to values")
    return data


def _log_history(output_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    path = output_dir / "trainer_state.json"
    if not path.is_file():
        raise RecordError(path, "missing: a TRL output directory has trainer_state.json (call trainer.save_state())")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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
    return rows, state


def _read_completions(output_dir: Path) -> list[tuple[Path, pa.Table]]:
    folder = output_dir / "completions"
    files = sorted(folder.glob("completions_*.parquet"))
    if not files:
        raise RecordError(folder, "no completions_*.parquet files: run TRL with log_completions=True")
    out = []
    for f in files:
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
    history, state = _log_history(out)
    if config is None and (out / "grpo_config.json").is_file():
        config = out / "grpo_config.json"
    cfg = dict(config) if isinstance(config, Mapping) else (load_trainer_config(Path(config)) if config else {})
    notes: list[str] = []
    if not cfg:
        notes.append("no trainer config was given: optimizer, beta, max_grad_norm and the group size are unknown")

    logging_steps = int(cfg.get("logging_steps") or state.get("logging_steps") or 1)
    per_step = logging_steps == 1
    if not per_step:
        notes.append(f"logging_steps={logging_steps}: each telemetry row holds the TRL metrics averaged over "
                     f"{logging_steps} optimizer steps (grad_norm and learning_rate are the window's last step); "
                     "these are not per-step values")

    telemetry = _telemetry(history, cfg, out / "trainer_state.json")
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
    framework = {"name": "trl", "version": framework_version}
    model = {"description": model_description or str(cfg.get("model_name_or_path") or "unknown policy")}
    if checkpoint is not None:
        model.update(_checkpoint_model_info(Path(checkpoint)))
    trainer_config = record_config(cfg)
    return write_run(record_dir, framework=framework, model=model, telemetry=telemetry, rollouts=rollouts,
                     optimizer=str(optimizer) if optimizer else None, trainer_config=trainer_config,
                     telemetry_per_step=per_step, logging_steps=logging_steps, notes=notes,
                     checkpoints={0: checkpoint} if checkpoint is not None else None, overwrite=overwrite)


def _telemetry(history: list[dict[str, Any]], cfg: Mapping[str, Any], path: Path) -> list[OptimizerTelemetry]:
    keys = load_fields().framework_keys("trl")  # TRL key -> record field, by meaning
    max_norm = cfg.get("max_grad_norm")
    beta = cfg.get("beta")
    seen: dict[int, dict[str, Any]] = {}
    for entry in history:
        s = entry["step"]
        if not isinstance(s, int) or s < 1:
            raise RecordError(path, f"log_history has a step {s!r}; TRL's global_step starts at 1", field="step")
        if s in seen:
            # The final summary entry repeats the last step; two *metric* entries for one step do not happen.
            raise RecordError(path, "two log_history entries for the same step", field="step", steps=[s - 1])
        row: dict[str, Any] = {"step": s - 1}
        for key, field in keys.items():
            if key in entry and entry[key] is not None:
                row[field] = finite_number(entry[key], path, key, s - 1)
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
           "logged" if given else "no trainer config said what they were (grpo_config.json beside the output, "
           "or --config)")
    return (f"{ASSUMED_WEIGHTS}: each rollout's `reward` is its reward functions' scores summed at weight 1 "
            f"({pairs}: GRPOConfig's default), because {why}; if the run set reward_weights, the per-rollout "
            "reward and every number read from it are wrong (pass the config to the import)")


def assumed_reward_weights(notes: Sequence[str]) -> str | None:
    """The record's note that its reward weights were assumed at import, if it has one."""
    return next((n for n in notes if n.startswith(ASSUMED_WEIGHTS)), None)


def _rollouts(files: list[tuple[Path, pa.Table]], cfg: Mapping[str, Any], reward_names: list[str],
              logged: set[int], per_step: bool) -> pa.Table:
    group_size = cfg.get("num_generations")
    weights = _weights(cfg, reward_names)
    columns: dict[str, list[Any]] = {k: [] for k in ("step", "group_id", "prompt", "completion", "reward",
                                                     "rewards", "advantage")}
    for f, table in files:
        steps = np.unique(table.column("step").to_numpy())
        if len(steps) != 1:
            raise RecordError(f, "one completions file should hold one step", field="step", steps=steps - 1)
        t = int(steps[0]) - 1
        if t not in logged:
            raise RecordError(f, "completions for a step that trainer_state.json never logged "
                              "(logging_steps > 1, or the log was cut short)", field="step", steps=[t])
        prompts = [str(p) for p in table.column("prompt").to_pylist()]
        completions = table.column("completion").to_pylist()
        if any(not isinstance(c, str) for c in completions):
            raise RecordError(f, "non-text completions (conversational or multimodal) are not supported yet",
                              field="completion", steps=[t])
        missing = [n for n in reward_names if n not in table.column_names]
        if missing:
            raise RecordError(f, f"reward column(s) {missing} named in the log are missing", steps=[t])
        per_func = np.column_stack([np.asarray(table.column(n).to_numpy(zero_copy_only=False), float)
                                    for n in reward_names]) if reward_names else np.zeros((len(prompts), 0))
        advantage = table.column("advantage").to_numpy(zero_copy_only=False).astype(float)
        if not np.isfinite(advantage).all():
            raise RecordError(f, "non-finite advantage", field="advantage", steps=[t])
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
                              field="prompt", steps=[t])
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


def _checkpoint_model_info(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise RecordError(cfg_path, "the starting checkpoint needs config.json")
    cfg = json.loads(cfg_path.read_text())
    info: dict[str, Any] = {"architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
                            "vocab_size": cfg.get("vocab_size")}
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise RecordError(path, "the starting checkpoint has no .safetensors weights")
    info["n_parameters"] = sum(_safetensors_numel(w) for w in weights)
    return info


def _safetensors_numel(path: Path) -> int:
    """Count parameters from a safetensors header (8-byte length + JSON), no torch needed."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
