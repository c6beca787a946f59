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
t = step - 1. veRL logs no per-rollout data in its metrics, so the record has no rollouts
(dump them with ``trainer.rollout_data_dir``; importing those dumps is not implemented).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from reward_lens.record.errors import RecordError
from reward_lens.record.importers import finite_number, whole_number
from reward_lens.record.schema import OptimizerTelemetry, RunManifest
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


def import_verl(metrics: str | Path, record_dir: str | Path, *, framework_version: str | None = None,
                overwrite: bool = False) -> RunManifest:
    path = Path(metrics)
    if not path.is_file():
        raise RecordError(path, "no such metrics file")
    keys = load_fields().framework_keys("verl")  # veRL key -> record field
    rows: dict[int, dict[str, Any]] = {}
    console = False
    unmapped: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            parsed = _parse_line(line, path, lineno)
            if parsed is None:
                continue
            step, data, is_console = parsed
            console |= is_console
            t = step - 1
            if t < 0:
                raise RecordError(f"{path}:{lineno}", f"step {step}: veRL's global_steps start at 1", field="step")
            if t in rows:
                raise RecordError(f"{path}:{lineno}", "a second metrics line for this step", steps=[t])
            row: dict[str, Any] = {"step": t}
            for key, value in data.items():
                field = keys.get(key)
                if field is None:
                    unmapped.add(key)
                    continue
                row[field] = finite_number(value, f"{path}:{lineno}", key, t)
            rows[t] = row
    if not rows:
        raise RecordError(path, "no veRL metric lines found (JSON lines with `step`, or `step:N - key:value` lines)")
    notes = ["veRL metrics carry no per-rollout data: this record has no rollouts",
             f"{len(unmapped)} veRL metric keys have no record field and were not imported"]
    if console:
        notes.append("read from veRL's console logger, which rounds every value to three decimals")
    return write_run(record_dir, framework={"name": "verl", "version": framework_version},
                     model={"description": "unknown policy (veRL metrics do not name it)"},
                     telemetry=[OptimizerTelemetry(**rows[t]) for t in sorted(rows)], rollouts=[],
                     notes=notes, overwrite=overwrite)
