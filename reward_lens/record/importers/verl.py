"""Import veRL's metric logs into a record (telemetry only).

veRL prints its per-step metrics through ``verl.utils.tracking``; two shapes are read here:

* JSON lines, one object per step: ``{"step": 12, "actor/ppo_kl": ..., ...}`` or
  ``{"step": 12, "data": {"actor/ppo_kl": ..., ...}}`` (what a file logger writes);
* the console logger's lines, ``step:12 - actor/ppo_kl:0.001 - actor/grad_norm:0.512 - ...``
  (``LocalLogger``), whose values are rounded to three decimals -- the record says so.

Keys are mapped by meaning through ``specs/fields.yaml``: ``actor/ppo_kl`` is an in-loop k1
estimate of KL(pi_old || pi_theta) taken before each mini-batch update, recorded as
``ppo_kl`` and never as ``kl_to_previous``; ``actor/kl_loss`` (KL to the reference) is
``kl_to_ref``; ``actor/grad_norm`` is the pre-clip norm; ``actor/lr`` the learning rate.
veRL's ``global_steps`` starts at 1 and tags the update it just made, so the record's
t = step - 1. veRL logs no per-rollout data in its metrics.

Rollouts come from ``trainer.rollout_data_dir`` (``rollouts=``, ``--rollouts DIR``): veRL's
``_dump_generations`` writes ``{global_steps}.jsonl`` after each step's update, one JSON
object per rollout with ``input`` (the decoded prompt), ``output`` (the decoded completion),
``score`` (the reward), ``step``, optionally ``gts``, and every per-sample entry of the reward
function's ``reward_extra_info`` (numeric ones become per-function rewards). veRL reorders a
batch to balance sequence lengths, so prompt groups are formed by identical ``input`` within
a step. The dumps hold no advantages and no per-rollout log-probabilities: the record says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from reward_lens.record.errors import RecordError
from reward_lens.record.importers import finite_number, one_based_step, whole_number
from reward_lens_spec.files import UnreadableFile, require_regular
from reward_lens.record.schema import OptimizerTelemetry, RunManifest, arrow_schema
from reward_lens.record.writer import write_run
from reward_lens_spec import load_fields

_CONSOLE = re.compile(r"^step:(\d+)\s+-\s+(.*)$")


def _parse_line(line: str, path: Path, lineno: int) -> tuple[int, dict[str, Any], bool] | None:
    line = line.strip()
    if not line:
        return None
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}:{lineno}", f"not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise RecordError(f"{path}:{lineno}", "JSON nested too deeply to be a metrics line") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{path}:{lineno}", f"a metrics line is a JSON object, not {type(obj).__name__}")
        if "step" not in obj:
            raise RecordError(f"{path}:{lineno}", "a metrics line needs a `step`", field="step")
        data = obj.get("data", {k: v for k, v in obj.items() if k != "step"})
        if not isinstance(data, dict):
            raise RecordError(f"{path}:{lineno}", "`data` is not an object of metrics", field="data")
        return whole_number(obj["step"], f"{path}:{lineno}", "step"), data, False
    m = _CONSOLE.match(line)
    if not m:
        return None  # other console output interleaved with the metrics
    data = {}
    for part in m.group(2).split(" - "):
        key, sep, value = part.rpartition(":")
        if sep:
            data[key.strip()] = value.strip()
    return int(m.group(1)), data, True


_DUMP_KEYS = ("input", "output", "score", "step")
_DUMP_NAME = re.compile(r"^[1-9][0-9]*\.jsonl$", re.ASCII)


def _read_dump(path: Path, t: int) -> tuple[dict[str, list[Any]], set[str]]:
    """One ``{step}.jsonl`` dump: columns for the record, and the extra keys left out."""
    cols: dict[str, list[Any]] = {"prompt": [], "completion": [], "reward": [], "extra": []}
    skipped: set[str] = set()
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(where, f"not UTF-8 text (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordError(where, f"not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise RecordError(where, "JSON nested too deeply to be a rollout") from None
            if not isinstance(obj, dict):
                raise RecordError(where, f"a rollout line is a JSON object, not {type(obj).__name__}")
            missing = [k for k in _DUMP_KEYS if k not in obj]
            if missing:
                raise RecordError(where, f"a veRL rollout dump line needs {list(_DUMP_KEYS)}; missing {missing}",
                                  field=missing[0])
            if whole_number(obj["step"], where, "step") != t + 1:
                raise RecordError(where, f"`step` is {obj['step']} in the dump of step {t + 1}", field="step")
            for k in ("input", "output"):
                if not isinstance(obj[k], str):
                    raise RecordError(where, f"`{k}` is not text (multi-turn dumps are not supported yet)", field=k)
                try:
                    obj[k].encode("utf-8")
                except UnicodeEncodeError as exc:  # a lone surrogate written as a \\ud800 escape
                    raise RecordError(where, f"`{k}` holds a lone surrogate (character {exc.start + 1}), which is not "
                                      "text", field=k) from None
            cols["prompt"].append(obj["input"])
            cols["completion"].append(obj["output"])
            cols["reward"].append(finite_number(obj["score"], where, "score", t + 1))
            extra = {}
            for k, v in obj.items():
                if k in _DUMP_KEYS or k == "gts":
                    continue
                if isinstance(v, (int, float)):  # bool included (an `acc` flag)
                    extra[k] = finite_number(float(v), where, k, t + 1)
                else:
                    skipped.add(k)
            cols["extra"].append(extra)
    if not cols["prompt"]:
        raise RecordError(path, "an empty rollout dump", steps=[t + 1], step_key="step")
    return cols, skipped


def read_rollout_dumps(dump_dir: str | Path, steps: set[int]) -> tuple[pa.Table, list[str]]:
    """veRL's ``trainer.rollout_data_dir`` as a rollouts table (record steps t = step - 1)."""
    root = Path(dump_dir)
    if not root.is_dir():
        raise RecordError(root, "no such rollout dump directory (veRL's `trainer.rollout_data_dir`)")
    files = {}
    for f in sorted(root.glob("*.jsonl")):
        if not _DUMP_NAME.match(f.name):
            if f.stem.isdecimal() or f.stem.isdigit():  # 03.jsonl, a non-ASCII digit, a superscript
                raise RecordError(f, "is named like a step's dump but veRL names them `{global_steps}.jsonl` in ASCII "
                                  "digits without leading zeros: rename or move it, so no dump is read twice or "
                                  "under the wrong step")
            continue
        if not f.is_file():
            raise RecordError(f, "is not a regular file (a FIFO, a device or a broken link): a rollout dump is a "
                              "JSON-lines file")
        files[int(f.stem) - 1] = f
    if not files:
        raise RecordError(root, "no `{step}.jsonl` rollout dumps (veRL writes them when "
                          "`trainer.rollout_data_dir` is set)")
    unknown = sorted(t for t in files if t not in steps)
    if unknown:
        raise RecordError(files[unknown[0]], "a rollout dump for a step the metrics log does not have",
                          steps=[t + 1 for t in unknown[:5]], step_key="step")
    out: dict[str, list[Any]] = {k: [] for k in ("step", "group_id", "prompt", "completion", "reward", "rewards")}
    skipped: set[str] = set()
    names: set[str] = set()
    for t in sorted(files):
        cols, sk = _read_dump(files[t], t)
        skipped |= sk
        first: dict[str, int] = {}
        for p in cols["prompt"]:
            first.setdefault(p, len(first))
        n = len(cols["prompt"])
        out["step"] += [t] * n
        out["group_id"] += [f"{t}:{first[p]}" for p in cols["prompt"]]
        out["prompt"] += cols["prompt"]
        out["completion"] += cols["completion"]
        out["reward"] += cols["reward"]
        out["rewards"] += [sorted(e.items()) for e in cols["extra"]]
        names |= {k for e in cols["extra"] for k in e}
    schema = arrow_schema("rollouts")
    table = pa.table({k: pa.array(v, type=schema.field(k).type) for k, v in out.items()})
    notes = [f"rollouts from veRL's generation dumps on {len(files)} steps; prompt groups formed by identical "
             "`input` within a step; the dumps hold no advantages and no per-rollout log-probabilities"]
    if names:
        notes.append(f"per-function rewards from the dumps' numeric `reward_extra_info` keys: {sorted(names)}")
    if skipped:
        notes.append(f"non-numeric dump keys not imported: {sorted(skipped)}")
    return table, notes


def import_verl(metrics: str | Path, record_dir: str | Path, *, framework_version: str | None = None,
                overwrite: bool = False, rollouts: str | Path | None = None) -> RunManifest:
    path = Path(metrics)
    try:
        require_regular(path)  # a FIFO is refused before it is opened
    except FileNotFoundError:
        raise RecordError(path, "no such metrics file") from None
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    keys = load_fields().framework_keys("verl")  # veRL key -> record field
    rows: dict[int, dict[str, Any]] = {}
    console = False
    unmapped: set[str] = set()
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(f"{path}:{lineno}", f"not UTF-8 text (byte {exc.start + 1} of the line)") from None
            parsed = _parse_line(line, path, lineno)
            if parsed is None:
                continue
            step, data, is_console = parsed
            console |= is_console
            if step < 1:
                raise RecordError(f"{path}:{lineno}", f"step {step}: veRL's global_steps start at 1", field="step")
            t = one_based_step(step, f"{path}:{lineno}")
            if t in rows:
                raise RecordError(f"{path}:{lineno}", "a second metrics line for this step", steps=[step], step_key="step")
            row: dict[str, Any] = {"step": t}
            for key, value in data.items():
                field = keys.get(key)
                if field is None:
                    unmapped.add(key)
                    continue
                row[field] = finite_number(value, f"{path}:{lineno}", key, step)
            rows[t] = row
    if not rows:
        raise RecordError(path, "no veRL metric lines found (JSON lines with `step`, or `step:N - key:value` lines)")
    table: pa.Table | list = []
    if rollouts is not None:
        table, notes = read_rollout_dumps(rollouts, set(rows))
    else:
        notes = ["veRL metrics carry no per-rollout data, and no rollout dumps were given (`--rollouts`, veRL's "
                 "`trainer.rollout_data_dir`): this record has no rollouts"]
    notes.append(f"{len(unmapped)} veRL metric keys have no record field and were not imported")
    if console:
        notes.append("read from veRL's console logger, which rounds every value to three decimals")
    return write_run(record_dir, framework={"name": "verl", "version": framework_version},
                     model={"description": "unknown policy (veRL metrics do not name it)"},
                     telemetry=[OptimizerTelemetry(**rows[t]) for t in sorted(rows)], rollouts=table,
                     notes=notes, overwrite=overwrite)
