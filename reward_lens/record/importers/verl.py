"""Import a veRL run (its metric log, its generation dumps, its Hydra config) into a record.

What a veRL run leaves, as veRL's own code writes it (checked on veRL 0.9.1's source and on
output that code wrote: tools/make_verl_fixtures.py; older versions where their source differs):

* **Metrics**, one line per ``global_steps`` through ``verl.utils.tracking.Tracking``:
  the ``file`` backend (``FileLogger``) writes JSON lines ``{"step": N, "data": {...}}`` with
  orjson, which writes NaN and +-inf as ``null``; it opens the file with ``"wb"``, so a resumed
  run's file holds only the steps after the resume. The ``console`` backend (``LocalLogger``)
  prints ``step:N - key:value - ...`` with ``pprint.pformat`` of each value: full precision since
  v0.5 (no rounding), ``np.float64(0.0042)`` under numpy 2 (veRL >= 0.9 requires it), ``nan``
  for a NaN. Under Ray every printed line carries the worker prefix ``(TaskRunner pid=N)``,
  often wrapped in ANSI colour codes; a resumed run prints its steps again, and the later line
  of a step is the one read (a note says which steps). ``trainer.val_before_train`` (default
  true) logs the validation metrics first, at ``step:0`` (and at the resumed step on a resume):
  a line of ``val-*`` keys only is validation, never an optimizer step.
* **Rollouts**, with ``trainer.rollout_data_dir``: ``{global_steps}.jsonl`` after each step's
  update, one JSON object per rollout: ``input``, ``output``, ``gts``, ``score``, ``step``, and
  the legacy trainer's (``ray_trainer``) ``reward_extra_info`` entries, dumped with
  ``default=str`` so a numpy float32 arrives as a JSON string (``"0.5"``); the v1 trainer
  (default since 0.9) writes ``uid`` (``{prompt_uid}_{session}_{turn}``) instead of the extras.
  Prompt groups are the uid's prompt part where there is one, else identical ``input`` within
  a step (veRL reorders a batch to balance lengths, so order says nothing). A multi-turn
  session's rows beyond its last turn are dropped, as GRPO uses only that turn.
* **Validation completions**, with ``trainer.validation_data_dir``: the same dump format,
  ``0.jsonl`` being pi_0's (``val_before_train``): completions of the validation set's prompts,
  which the run never trains on. They go to the record's ``validation.parquet`` (filed under the
  policy that drew them: ``s.jsonl`` is pi_s), apart from the rollouts and from ``heldout``:
  ``heldout`` holds draws for the *step's own prompts*, scored under both policies, which the
  paired ledger reads; these are other prompts with no log-probabilities, a held-out series of
  their own.
* **The Hydra config** (``.hydra/config.yaml`` of the run's output folder): ``grad_clip``
  (``max_grad_norm`` in the record: veRL clips with ``clip_grad_norm_``, and skips the update
  when the norm is not finite), ``rollout.n``, ``adv_estimator``, ``norm_adv_by_std_in_grpo``,
  ``use_kl_in_reward``, ``rollout_data_dir`` and ``validation_data_dir``.

Keys are mapped by meaning through ``specs/fields.yaml`` (``actor/ppo_kl`` is an in-loop k1
estimate of KL(pi_old || pi_theta), recorded as ``ppo_kl``, never ``kl_to_previous``; the
engine-trainer mismatch veRL logs with ``rollout.calculate_log_probs`` -- ``rollout_corr/k3_kl``
and ``rollout_corr/kl``, k3 and k1 estimates of KL(pi_rollout || pi_old) per token, and
``training/rollout_probs_diff_*``, |p_actor - p_rollout| of the sampled tokens, a probability gap
whose NaN means not measured -- is ``sampler_kl_token`` (estimator k3), ``sampler_kl_token_k1``
and ``sampler_prob_diff_*``, which ``engine_mismatch`` reads where no tap ran); the
keys veRL logs that the record has no field for are listed in ``specs/frameworks/verl.yaml``'s
``keys`` with their meaning. veRL's ``global_steps`` starts at 1 and tags the update it just
made, so the record's t = step - 1; a dump ``s.jsonl`` holds the rollouts of update s, sampled
from pi_{s-1}: record step t = s - 1 too.

veRL dumps no advantages. For GRPO (``adv_estimator: grpo``, ``use_kl_in_reward`` off, so the
dumped score is the token-level reward summed) they follow from score and group exactly as
``core_algos.compute_grpo_outcome_advantage`` forms them: (score - group mean) / (group std with
Bessel's correction + 1e-6), or score - group mean with ``norm_adv_by_std_in_grpo: false``, and a
group of one keeps its score. The record says they are derived (a manifest note,
``record.notes.DERIVED_ADVANTAGES``), and so does every finding that reads them.

A value veRL logged as NaN or infinite (a diverged run) is kept as null with a ``NonFiniteValue``
in the manifest; a file that is not what it claims (not JSON, a word where a number belongs,
a dump line without its keys) is refused by file, line and key, and nothing is written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from reward_lens.record.errors import RecordError
from reward_lens.record.parse import config_mapping, jsonl_objects
from reward_lens.record.importers import (finite_number, logged_number, one_based_step, shown, validate_config,
                                          whole_number)
from reward_lens.record.notes import DERIVED_ADVANTAGES
from reward_lens.record.schema import NonFiniteValue, OptimizerTelemetry, RunManifest, arrow_schema
from reward_lens.record.writer import write_run
from reward_lens_spec import load_fields, load_frameworks
from reward_lens_spec.files import UnreadableFile, read_text, require_regular

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Ray's worker prefix: "(TaskRunner pid=1234)", "(WorkerDict pid=99, ip=10.0.0.2)"
_RAY = re.compile(r"^\((?:[A-Za-z_][\w.:-]*\s+)?pid=\d+(?:,\s*ip=[^)]*)?\)\s*")
_CONSOLE = re.compile(r"^step:(\d+)(?:\s+-\s+(.*))?$")
# pprint of a numpy scalar under numpy 2: np.float64(0.1), np.int64(3), np.float32(nan)
_NP_SCALAR = re.compile(r"^np\.(?:float|int|uint)(?:16|32|64|128)?\((.*)\)$")
_BOOL = frozenset({"True", "False", "np.True_", "np.False_"})
_VALIDATION_KEY = re.compile(r"^val[-_/]")  # val-core/..., val-aux/...: metrics of the validation set


def _console_value(text: str, where: str, key: str, step: int) -> Any:
    """A console value as pprint printed it: a number, ``np.float64(...)``, ``nan``/``inf``."""
    m = _NP_SCALAR.match(text)
    if m:
        text = m.group(1)
    if text in _BOOL:
        return None
    try:
        return float(text)
    except ValueError:
        raise RecordError(where, f"`{key}` is {shown(text)}, not a number", field=key, steps=[step],
                          step_key="step") from None


@dataclass
class _Line:
    step: int
    data: dict[str, Any]
    console: bool
    where: str
    rounded: bool = False  # veRL < 0.5's console: f"{v:.3f}" for every value
    zeroed: frozenset[str] = frozenset()  # keys printed as 0.000 on a rounded line: |v| < 0.0005, not 0


_THREE = re.compile(r"^-?\d+\.\d{3}$")
_ZERO = re.compile(r"^-?0\.000$")


def _parse_line(line: str, path: Path, lineno: int) -> _Line | None:
    where = f"{path}:{lineno}"
    line = _RAY.sub("", _ANSI.sub("", line).strip()).strip()
    if not line:
        return None
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(where, f"not valid JSON ({exc.msg}): a truncated or corrupt metrics line") from None
        except RecursionError:
            raise RecordError(where, "JSON nested too deeply to be a metrics line") from None
        if not isinstance(obj, dict):
            raise RecordError(where, f"a metrics line is a JSON object, not {type(obj).__name__}")
        if "step" not in obj:
            raise RecordError(where, "a metrics line needs a `step`", field="step")
        data = obj.get("data", {k: v for k, v in obj.items() if k != "step"})
        if not isinstance(data, dict):
            raise RecordError(where, "`data` is not an object of metrics", field="data")
        return _Line(whole_number(obj["step"], where, "step"), data, False, where)
    m = _CONSOLE.match(line)
    if not m:
        return None  # other console output interleaved with the metrics
    step = int(m.group(1))
    raw = {}
    for part in (m.group(2) or "").split(" - "):
        key, sep, value = part.rpartition(":")
        if sep and key.strip():
            raw[key.strip()] = value.strip()
    data = {k: _console_value(v, where, k, step) for k, v in raw.items()}
    # veRL before 0.5 printed every value as f"{v:.3f}" (utils/logger/aggregate_logger.py,
    # concat_dict_to_str): a line whose every finite value has exactly three decimals was rounded
    # (decided for the whole log in read_metrics: a line of two values may have three decimals by chance)
    finite = [v for v in raw.values() if v not in ("nan", "-nan", "inf", "-inf")]
    rounded = bool(finite) and all(_THREE.match(v) for v in finite)
    zeroed = frozenset(k for k, v in raw.items() if rounded and _ZERO.match(v))
    return _Line(step, data, True, where, rounded, zeroed)


@dataclass
class Metrics:
    """What a metric log holds: telemetry rows by record step, non-finite values, and notes."""

    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    non_finite: dict[int, list[NonFiniteValue]] = field(default_factory=dict)
    unmapped: set[str] = field(default_factory=set)  # in neither fields.yaml's fields nor its logged_keys
    known: set[str] = field(default_factory=set)  # in logged_keys: meaning known, no record field
    not_measured: int = 0  # NaN values a key's catalogue entry says mean "not measured"
    rounded_lines: int = 0  # lines of a console that rounded to three decimals (veRL < 0.5)
    console_lines: int = 0
    finite_values: int = 0
    zeroed: set[str] = field(default_factory=set)  # record fields printed as 0.000 there, left null
    repeated: set[int] = field(default_factory=set)
    validation_lines: int = 0
    console: bool = False


def read_metrics(path: Path) -> Metrics:
    """veRL's metric log (file logger JSON lines or console output) read step by step."""
    try:
        require_regular(path)  # a FIFO is refused before it is opened
    except FileNotFoundError:
        raise RecordError(path, "no such metrics file") from None
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    catalog = load_fields()
    keys = catalog.framework_keys("verl")  # veRL key -> record field
    out = Metrics()
    zero_candidates: dict[int, set[str]] = {}  # record step -> fields printed 0.000 on a three-decimal line
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(f"{path}:{lineno}", f"not UTF-8 text (byte {exc.start + 1} of the line)") from None
            line = _parse_line(text, path, lineno)
            if line is None:
                continue
            out.console |= line.console
            if line.step == 0 or (line.data and all(_VALIDATION_KEY.match(k) for k in line.data)):
                out.validation_lines += 1  # val_before_train's line: pi_0's validation, not an update
                continue
            t = one_based_step(line.step, line.where)
            if line.console:
                out.console_lines += 1
                out.rounded_lines += line.rounded
                out.finite_values += sum(1 for v in line.data.values() if v is not None and math.isfinite(v))
            if t in out.rows:
                out.repeated.add(line.step)  # a resumed run logs its steps again: the later line wins
            row: dict[str, Any] = {"step": t}
            bad: list[NonFiniteValue] = []
            zero_candidates.pop(t, None)  # a step logged again: its later line's values only
            for key, value in line.data.items():
                name = keys.get(key)
                if _VALIDATION_KEY.match(key) or isinstance(value, bool):
                    continue  # the validation set's metrics; a flag is not a metric
                v, what = logged_number(value, line.where, key, line.step,
                                        null_is=None if line.console else "nan")
                entry = catalog.logged_key("verl", key) if name is None else None
                # a NaN that veRL logs for "not measured" (its key's catalogue entry, or the field's
                # veRL entry, says so): training/rollout_probs_diff_* without rollout log-probabilities
                nan_is_unmeasured = (entry.nan if entry is not None
                                     else name is not None and catalog.fields[name].frameworks["verl"].nan)
                if what is not None and nan_is_unmeasured:
                    out.not_measured += 1  # e.g. training/rollout_probs_diff_* without rollout log-probabilities
                    what = None
                if what is not None:
                    src = f"{line.where} (step {line.step}) `{key}`"
                    if value is None:
                        src += " (null in the file logger, which writes NaN and +-inf as null)"
                    bad.append(NonFiniteValue(step=t, field=name or key, value=what, source=src))
                if name is None:
                    (out.known if entry is not None else out.unmapped).add(key)
                elif v is not None:
                    row[name] = v
                    if key in line.zeroed:
                        zero_candidates.setdefault(t, set()).add(name)
            if row.get("sampler_kl_token") is not None:
                row["sampler_kl_token_estimator"] = "k3"  # rollout_corr/k3_kl (rollout_corr_helper.py:961-966)
            out.rows[t] = row
            out.non_finite[t] = bad
    # veRL before 0.5 printed every value with three decimals: a log whose every step line does is
    # rounded, and there a 0.000 is |v| < 0.0005, not known to be zero: left null, said in a note
    if out.console_lines and out.rounded_lines == out.console_lines and out.finite_values >= 3:
        for t, names in zero_candidates.items():
            for name in names:
                if out.rows.get(t, {}).get(name) == 0.0:
                    del out.rows[t][name]
                    out.zeroed.add(name)
    else:
        out.rounded_lines = 0
    return out


# ------------------------------------------------------------------------------ generation dumps
_DUMP_KEYS = ("input", "output", "score", "step")
_DUMP_NAME = re.compile(r"^(0|[1-9][0-9]*)\.jsonl$", re.ASCII)
# a numpy scalar dumped with default=str: "0.5", "1e-06", "nan", "True" -- never a bare "6"
_STR_NUMBER = re.compile(r"^[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+|nan|inf)$", re.IGNORECASE)
_NOT_EXTRA = frozenset({"gts", "uid", "request_id"})


def _extra_number(v: Any) -> float | None:
    """A reward extra as a number: a JSON number or bool, or the string a numpy scalar becomes
    under the legacy trainer's ``json.dumps(default=str)``; None where it is not one."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and (_STR_NUMBER.match(v) or v in ("True", "False")):
        return 1.0 if v == "True" else 0.0 if v == "False" else float(v)
    return None


@dataclass
class _Dump:
    prompt: list[str] = field(default_factory=list)
    completion: list[str] = field(default_factory=list)
    reward: list[float | None] = field(default_factory=list)
    group: list[str] = field(default_factory=list)
    extra: list[dict[str, float]] = field(default_factory=list)
    non_finite: list[NonFiniteValue] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)
    by_uid: bool = False
    later_turns: int = 0


def _read_dump(path: Path, s: int, t: int) -> _Dump:
    """One ``{s}.jsonl`` dump (veRL's ``_write_generations``), filed under record step ``t``."""
    rows: list[tuple[dict[str, Any], str]] = []
    for _, where, obj in jsonl_objects(path, corrupt="a truncated or corrupt dump line", nested="a rollout",
                                       line="a rollout line"):
        missing = [k for k in _DUMP_KEYS if k not in obj]
        if missing:
            raise RecordError(where, f"a veRL rollout dump line needs {list(_DUMP_KEYS)}; missing {missing}",
                              field=missing[0])
        if whole_number(obj["step"], where, "step") != s:
            raise RecordError(where, f"`step` is {obj['step']} in the dump of step {s}", field="step")
        for k in ("input", "output"):
            if not isinstance(obj[k], str):
                raise RecordError(where, f"`{k}` is not text (multi-modal dumps are not supported yet)", field=k)
            try:
                obj[k].encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate written as a \\ud800 escape
                raise RecordError(where, f"`{k}` holds a lone surrogate (character {exc.start + 1}), which is not "
                                  "text", field=k) from None
        if "uid" in obj and not isinstance(obj["uid"], str):
            raise RecordError(where, f"`uid` is {shown(obj['uid'])}, not text", field="uid")
        rows.append((obj, where))
    if not rows:
        raise RecordError(path, "an empty rollout dump", steps=[s], step_key="step")
    out = _Dump()
    uids = [o.get("uid") for o, _ in rows]
    keep = [True] * len(rows)
    if all(isinstance(u, str) for u in uids):
        out.by_uid = True
        # v1 keys: {prompt_uid}_{session}_{turn}; GRPO reads only each session's last turn
        parts = [u.rsplit("_", 2) for u in uids]
        last: dict[str, int] = {}
        for p in parts:
            if len(p) == 3 and p[2].isdigit():
                last[f"{p[0]}_{p[1]}"] = max(last.get(f"{p[0]}_{p[1]}", -1), int(p[2]))
        for i, p in enumerate(parts):
            if len(p) == 3 and p[2].isdigit() and int(p[2]) != last[f"{p[0]}_{p[1]}"]:
                keep[i] = False
        groups = [p[0] if len(p) == 3 else u for p, u in zip(parts, uids)]
        out.later_turns = keep.count(False)
    elif any(isinstance(u, str) for u in uids):
        i = next(i for i, u in enumerate(uids) if not isinstance(u, str))
        raise RecordError(rows[i][1], "`uid` missing on this line while other lines of the dump have one", field="uid")
    else:
        groups = [o["input"] for o, _ in rows]
    # which extras are numbers: a key whose every value is one (a word, a "6" prediction: skipped)
    extras = {k for o, _ in rows for k in o if k not in _DUMP_KEYS and k not in _NOT_EXTRA}
    numeric = {k for k in extras if all(k in o and _extra_number(o[k]) is not None for o, _ in rows)}
    out.skipped = extras - numeric
    for (obj, where), g, ok in zip(rows, groups, keep):
        if not ok:
            continue
        score, what = logged_number(obj["score"], where, "score", s)
        if what is not None or obj["score"] is None:
            out.non_finite.append(NonFiniteValue(step=t, field="reward", value=what or "nan",
                                                 source=f"{where} `score`"))
        extra = {}
        for k in sorted(numeric):
            v = _extra_number(obj[k])
            if math.isfinite(v):
                extra[k] = finite_number(v, where, k, s)
            else:
                out.non_finite.append(NonFiniteValue(step=t, field=f"rewards.{k}",
                                                     value="nan" if math.isnan(v) else "+inf" if v > 0 else "-inf",
                                                     source=f"{where} `{k}`"))
        out.prompt.append(obj["input"])
        out.completion.append(obj["output"])
        out.reward.append(score)
        out.group.append(g)
        out.extra.append(extra)
    return out


def _dump_files(root: Path, what: str, config_key: str, allow_zero: bool) -> dict[int, Path]:
    if not root.is_dir():
        raise RecordError(root, f"no such {what} directory (veRL's `{config_key}`)")
    files = {}
    for f in sorted(root.glob("*.jsonl")):
        if not _DUMP_NAME.match(f.name) or (f.name == "0.jsonl" and not allow_zero):
            if f.stem.isdecimal() or f.stem.isdigit():  # 03.jsonl, a non-ASCII digit, a superscript
                raise RecordError(f, "is named like a step's dump but veRL names them `{global_steps}.jsonl` in ASCII "
                                  "digits without leading zeros (and `0.jsonl` only in `validation_data_dir`): rename "
                                  "or move it, so no dump is read twice or under the wrong step")
            continue
        if not f.is_file():
            raise RecordError(f, "is not a regular file (a FIFO, a device or a broken link): a dump is a "
                              "JSON-lines file")
        files[int(f.stem)] = f
    if not files:
        raise RecordError(root, f"no `{{step}}.jsonl` dumps (veRL writes them when `{config_key}` is set)")
    return files


@dataclass
class Dumps:
    table: pa.Table
    notes: list[str]
    non_finite: list[NonFiniteValue]


def _table(dumps: dict[int, _Dump], advantages: dict[int, list[float]] | None) -> pa.Table:
    out: dict[str, list[Any]] = {k: [] for k in ("step", "group_id", "prompt", "completion", "reward", "rewards")}
    if advantages is not None:
        out["advantage"] = []
    for t in sorted(dumps):
        d = dumps[t]
        first: dict[str, int] = {}
        for g in d.group:
            first.setdefault(g, len(first))
        out["step"] += [t] * len(d.prompt)
        out["group_id"] += [f"{t}:{first[g]}" for g in d.group]
        out["prompt"] += d.prompt
        out["completion"] += d.completion
        out["reward"] += d.reward
        out["rewards"] += [sorted(e.items()) for e in d.extra]
        if advantages is not None:
            out["advantage"] += advantages[t]
    schema = arrow_schema("rollouts")
    return pa.table({k: pa.array(v, type=schema.field(k).type) for k, v in out.items()})


def grpo_advantages(rewards: list[float | None], groups: list[str], norm_by_std: bool,
                    eps: float = 1e-6) -> list[float | None]:
    """veRL's GRPO outcome advantage of each rollout from its score and prompt group, as
    ``core_algos.compute_grpo_outcome_advantage`` forms it (veRL 0.4 to 0.9.1: the group's mean
    and ``torch.std``, Bessel-corrected, ``epsilon=1e-6``; a group of one: mean 0, std 1), in
    float64 where veRL computes in float32 (so they agree to float32's precision). A group with a
    reward that is null (a non-finite score) has no advantage: null for each of its rollouts."""
    idx: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        idx.setdefault(g, []).append(i)
    adv: list[float | None] = [None] * len(rewards)
    for members in idx.values():
        r = [rewards[i] for i in members]
        if any(x is None for x in r):
            continue
        x = np.asarray(r, dtype=float)
        mean, std = (0.0, 1.0) if len(x) == 1 else (float(x.mean()), float(x.std(ddof=1)))
        a = (x - mean) / (std + eps) if norm_by_std else x - mean
        for i, v in zip(members, a.tolist()):
            adv[i] = v
    return adv


def read_rollout_dumps(dump_dir: str | Path, steps: set[int] | None = None, *, validation: bool = False,
                       derive: dict[str, Any] | None = None) -> Dumps:
    """veRL's ``trainer.rollout_data_dir`` (or, ``validation``, ``trainer.validation_data_dir``)
    as a rollouts table. Rollout dump ``s.jsonl`` is update s's rollouts, sampled from pi_{s-1}:
    record step s - 1, which ``steps`` (the metric log's) must hold; validation dump ``s.jsonl``
    is drawn by pi_s: filed under s. ``derive``: ``{"norm_adv_by_std_in_grpo": bool}`` to derive
    GRPO advantages (None: the rollouts carry none)."""
    root = Path(dump_dir)
    key = "trainer.validation_data_dir" if validation else "trainer.rollout_data_dir"
    files = _dump_files(root, "validation dump" if validation else "rollout dump", key, allow_zero=validation)
    record_step = (lambda s: s) if validation else (lambda s: s - 1)
    if steps is not None and not validation:
        unknown = sorted(s for s in files if record_step(s) not in steps)
        if unknown:
            raise RecordError(files[unknown[0]], "a rollout dump for a step the metrics log does not have",
                              steps=unknown[:5], step_key="step")
    dumps = {record_step(s): _read_dump(f, s, record_step(s)) for s, f in sorted(files.items())}
    advantages = None
    if derive is not None:
        norm = derive["norm_adv_by_std_in_grpo"]
        advantages = {t: grpo_advantages(d.reward, d.group, norm) for t, d in dumps.items()}
    table = _table(dumps, advantages)
    by_uid = all(d.by_uid for d in dumps.values())
    what = "validation dumps" if validation else "generation dumps"
    notes = [f"{'validation completions' if validation else 'rollouts'} from veRL's {what} on {len(files)} steps; "
             + ("prompt groups from each row's `uid` (the v1 trainer's `{prompt_uid}_{session}_{turn}`)" if by_uid else
                "prompt groups formed by identical `input` within a step (the dumps have no `uid`)")
             + "; the dumps hold no per-rollout log-probabilities"
             + ("" if derive is not None or validation else " and no advantages")]
    if validation:
        notes[-1] += ("; they answer the validation set's prompts, never trained on, and are kept apart "
                      "(validation.parquet: step s is pi_s's draw, 0 before any update)")
    turns = sum(d.later_turns for d in dumps.values())
    if turns:
        notes.append(f"{turns} multi-turn rows before their session's last turn were left out of the {what} "
                     "(GRPO reads each session's last turn only)")
    names = sorted({k for d in dumps.values() for e in d.extra for k in e})
    if names:
        notes.append(f"per-function rewards from the {what}' numeric `reward_extra_info` keys: {names}")
    skipped = sorted({k for d in dumps.values() for k in d.skipped})
    if skipped:
        notes.append(f"non-numeric keys of the {what} not imported: {skipped}")
    return Dumps(table, notes, [v for t in sorted(dumps) for v in dumps[t].non_finite])


# ------------------------------------------------------------------------------------ config
def _dig(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def load_config(path: Path) -> dict[str, Any]:
    """The run's Hydra config (``.hydra/config.yaml``) as the nested mapping Hydra saved."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise RecordError(path, "no such config file (Hydra saves the run's as .hydra/config.yaml)") from None
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    return config_mapping(path, text, what="a veRL config",
                          mapping="a veRL config is a mapping (actor_rollout_ref, algorithm, trainer, ...)")


@dataclass
class RunConfig:
    """What the importer reads of a veRL config, each value checked where it is read."""

    values: dict[str, Any]  # dotted key -> value, the ones set
    notes: list[str]


def read_config(cfg: dict[str, Any], where: Path | str) -> RunConfig:
    spec = load_frameworks()["verl"]
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key in spec.record_config:
        v = _dig(cfg, key)
        if isinstance(v, str) and "${" in v:
            notes.append(f"`{key}` is the interpolation {shown(v)} in the saved config, which the import does not "
                         "resolve: read as unset")
            continue
        if v is not None:
            out[key] = v
    out = validate_config(out, spec, where)  # the one typed model (specs/frameworks/verl.yaml `types`)
    return RunConfig(out, notes)


# ------------------------------------------------------------------------------------ a run folder
@dataclass
class RunFolder:
    """The files of a veRL run found in one folder."""

    metrics: Path
    config: Path | None = None
    rollouts: Path | None = None
    validation: Path | None = None
    also: list[Path] = field(default_factory=list)  # metric logs found and not read


def _head(path: Path, limit: int = 1 << 16) -> str:
    try:
        require_regular(path)
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", errors="replace")
    except (OSError, UnreadableFile):
        return ""


def _metric_kind(path: Path) -> str | None:
    """``file`` (veRL's file logger), ``console`` (a log with ``step:N - `` lines) or None."""
    head = _head(path)
    for line in head.splitlines()[:2000]:
        line = _RAY.sub("", _ANSI.sub("", line).strip()).strip()
        if line.startswith('{"step"') and '"data"' in line:
            return "file"
        if _CONSOLE.match(line) and " - " in line:
            return "console"
    return None


def _step_count(path: Path) -> int:
    """How many distinct training steps (from 1) a metric log has lines for: a quick scan, no parse."""
    steps: set[str] = set()
    pattern = re.compile(r'^\{"step":\s*([0-9]+)|^step:([0-9]+) - ')
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                line = _RAY.sub("", _ANSI.sub("", raw.decode("utf-8", errors="replace")).strip())
                m = pattern.match(line)
                if m and (m.group(1) or m.group(2)) not in ("0", None):
                    steps.add(m.group(1) or m.group(2))
    except OSError:
        return 0
    return len(steps)


def _is_dump_dir(d: Path) -> bool:
    names = [f.name for f in d.glob("*.jsonl")] if d.is_dir() else []
    return bool(names) and any(_DUMP_NAME.match(n) for n in names)


def find_run(folder: Path, config_path: Path | None = None) -> RunFolder | None:
    """The veRL run in ``folder``: a metric log (the file logger's ``*.jsonl`` preferred to a
    console log, as its values are the exact ones), the Hydra config (``.hydra/config.yaml``, or
    ``config.yaml`` with veRL's sections), and the dump folders the config names (relative to the
    folder when relative) or, without a config, subfolders of ``{step}.jsonl`` dumps (a name with
    ``val`` in it: validation). None when the folder holds no veRL metric log."""
    if not folder.is_dir():
        return None
    cands = [p for p in sorted(folder.rglob("*")) if p.is_file() and len(p.relative_to(folder).parts) <= 3
             and p.suffix in (".jsonl", ".log", ".txt", ".out") and not _DUMP_NAME.match(p.name)]
    kinds = [(p, _metric_kind(p)) for p in cands]
    logs = [p for p, k in kinds if k == "file"] + [p for p, k in kinds if k == "console"]
    if not logs:
        return None
    # the file logger's values are exact, but it truncates its file when a run resumes: a console
    # log holding more training steps than it (the steps before the resume) is read instead
    counts = {p: _step_count(p) for p in logs}
    best = max(counts.values())
    logs = [p for p in logs if counts[p] == best] + [p for p in logs if counts[p] != best]
    run = RunFolder(metrics=logs[0], also=logs[1:])
    cfg_path = config_path
    if cfg_path is None:
        # Hydra's own folder for the run, or under the launch folder Hydra's default run dir
        # (outputs/<date>/<time>/.hydra/config.yaml: the newest, as the names sort by time)
        nested = sorted(folder.glob("outputs/*/*/.hydra/config.yaml"))
        for c in (folder / ".hydra" / "config.yaml", *(nested[-1:]), folder / "config.yaml"):
            if c.is_file():
                cfg_path = c
                break
    cfg = load_config(cfg_path) if cfg_path is not None else None
    run.config = cfg_path
    for attr, key in (("rollouts", "trainer.rollout_data_dir"), ("validation", "trainer.validation_data_dir")):
        named = _dig(cfg, key) if cfg else None
        if isinstance(named, str) and named and "${" not in named:
            p = Path(named).expanduser()
            p = p if p.is_absolute() else folder / p
            if _is_dump_dir(p):
                setattr(run, attr, p)
    if cfg is None or (run.rollouts is None and run.validation is None):
        dirs = [d for d in sorted(folder.rglob("*")) if d.is_dir() and len(d.relative_to(folder).parts) <= 2
                and not d.name.startswith(".") and _is_dump_dir(d)]
        val = [d for d in dirs if "val" in d.name.lower()]
        roll = [d for d in dirs if d not in val]
        if run.rollouts is None and len(roll) == 1:
            run.rollouts = roll[0]
        elif run.rollouts is None and len(roll) > 1:
            raise RecordError(folder, f"holds {len(roll)} folders of `{{step}}.jsonl` dumps "
                              f"({', '.join(d.relative_to(folder).as_posix() for d in roll[:4])}): name the run's "
                              "`trainer.rollout_data_dir` with --rollouts")
        if run.validation is None and len(val) == 1:
            run.validation = val[0]
    return run


# ------------------------------------------------------------------------------------ the import
def import_verl(source: str | Path, record_dir: str | Path, *, framework_version: str | None = None,
                overwrite: bool = False, rollouts: str | Path | None = None, config: str | Path | None = None,
                validation: str | Path | None = None) -> RunManifest:
    """A veRL run into a record at ``record_dir``. ``source``: the metric log (file logger JSON
    lines or console output), or the run's folder (its log, ``.hydra/config.yaml`` and the dump
    folders are found there: ``find_run``). ``rollouts``/``validation``/``config`` name those
    files where they are elsewhere. Nothing is written unless the whole import succeeds."""
    src = Path(source)
    notes: list[str] = []
    cfg_path = Path(config) if config is not None else None
    if src.is_dir():
        found = find_run(src, cfg_path)
        if found is None:
            raise RecordError(src, "holds no veRL metric log: a file logger's `{\"step\": N, \"data\": ...}` lines "
                              "(trainer.logger includes `file`) or a console log with `step:N - key:value` lines")
        metrics_path = found.metrics
        cfg_path = cfg_path or found.config
        rollouts = rollouts if rollouts is not None else found.rollouts
        validation = validation if validation is not None else found.validation
        def rel(p: Path) -> str:
            return p.relative_to(src).as_posix() if p.is_relative_to(src) else str(p)

        notes.append(f"a veRL run folder: metrics from {rel(metrics_path)}"
                     + (f" ({len(found.also)} other metric log(s) not read: "
                        f"{', '.join(rel(p) for p in found.also[:3])})" if found.also else "")
                     + (f", config from {rel(cfg_path)}" if cfg_path is not None
                        else ", no config (.hydra/config.yaml)"))
    else:
        metrics_path = src
    m = read_metrics(metrics_path)
    if not m.rows:
        raise RecordError(metrics_path, "no veRL metric lines found (JSON lines with `step`, or `step:N - key:value` "
                          "lines, with or without Ray's `(TaskRunner pid=N)` prefix)")
    run_cfg = read_config(load_config(cfg_path), cfg_path) if cfg_path is not None else RunConfig({}, [])
    c = run_cfg.values
    notes += run_cfg.notes
    # clipping: veRL's grad_clip (FSDP and Megatron actors both clip with it)
    grad_clip = c.get("actor_rollout_ref.actor.grad_clip")
    for row in m.rows.values():
        if grad_clip is not None and grad_clip > 0:
            row["max_grad_norm"] = float(grad_clip)
            pre = row.get("grad_norm_unclipped")
            if pre is not None:
                row["grad_norm"] = pre * min(1.0, float(grad_clip) / (pre + 1e-6))  # clip_grad_norm_'s coefficient
    derive = None
    if rollouts is not None:
        est = c.get("algorithm.adv_estimator")
        if est == "grpo" and not c.get("algorithm.use_kl_in_reward", False):
            derive = {"norm_adv_by_std_in_grpo": c.get("algorithm.norm_adv_by_std_in_grpo", True)}
        elif est == "grpo":
            notes.append("advantages not derived: `algorithm.use_kl_in_reward` is on, so veRL's advantages are formed "
                         "from the score minus a KL penalty the dumps do not hold")
        elif est is None:
            notes.append("advantages not derived: no config says the run used GRPO (`algorithm.adv_estimator`); "
                         "pass the run's .hydra/config.yaml with --config")
        else:
            notes.append(f"advantages not derived: `algorithm.adv_estimator` is {shown(est)}, not grpo")
    non_finite = [v for t in sorted(m.non_finite) for v in m.non_finite[t]]
    table: pa.Table | list = []
    if rollouts is not None:
        d = read_rollout_dumps(rollouts, set(m.rows), derive=derive)
        table = d.table
        notes += d.notes
        non_finite += d.non_finite
        if derive is not None:
            notes.append(f"{DERIVED_ADVANTAGES} from each rollout's score and prompt group as veRL's GRPO forms them "
                         f"(norm_adv_by_std_in_grpo={str(derive['norm_adv_by_std_in_grpo']).lower()}): veRL dumps no "
                         "advantages; these are the ones its loss used only where the dumped score is the whole "
                         "reward it optimised")
    else:
        notes.append("no rollout dumps were given (`--rollouts`, veRL's `trainer.rollout_data_dir`): this record has "
                     "no rollouts")
    val_table = None
    if validation is not None:
        v = read_rollout_dumps(validation, validation=True)
        val_table = v.table
        notes += v.notes
        # kept, under `validation.*` fields: a NaN validation score is data, not the training diverging
        non_finite += [x.model_copy(update={"field": f"validation.{x.field}"}) for x in v.non_finite]
    if m.validation_lines:
        notes.append(f"{m.validation_lines} line(s) of validation metrics only (step 0, `trainer.val_before_train`, "
                     "and a resume's first validation) read as validation, not as optimizer steps")
    if m.repeated:
        rep = sorted(m.repeated)
        which = f"step {rep[0]} is" if len(rep) == 1 else f"steps {rep[0]}..{rep[-1]} ({len(rep)} steps) are"
        notes.append(f"a resumed run: {which} logged more than once; the later line of each is read (the run after "
                     "its resume)")
    first = min(m.rows) + 1
    if first > 1:
        notes.append(f"the log starts at step {first}: a resumed run's file logger truncates its file on restart, so "
                     "the steps before the resume are not in it (the console log keeps them)")
    if m.known:
        notes.append(f"{len(m.known)} veRL metric keys whose meaning is known have no record field and were not "
                     "imported (specs/fields.yaml `logged_keys` says what each means and why)")
    if m.unmapped:
        shown_keys = ", ".join(sorted(m.unmapped)[:8]) + (", ..." if len(m.unmapped) > 8 else "")
        notes.append(f"{len(m.unmapped)} veRL metric keys reward-lens does not know were not imported: {shown_keys}")
    if m.not_measured:
        notes.append(f"{m.not_measured} NaN value(s) of keys where veRL logs NaN for 'not measured' (specs/fields.yaml "
                     "`logged_keys`, e.g. training/rollout_probs_diff_* without rollout log-probabilities) were not "
                     "read as the run diverging")
    if m.console and m.rounded_lines:
        notes.append(f"read from veRL's console logger, which rounded every value to three decimals on "
                     f"{m.rounded_lines} line(s) (veRL before 0.5): the record's values are rounded"
                     + (f"; a value printed as 0.000 is under 0.0005, not zero, and is left null ({sorted(m.zeroed)})"
                        if m.zeroed else ""))
    elif m.console:
        notes.append("read from veRL's console logger (pprint of each value: full precision since veRL 0.5; earlier "
                     "versions' console rounded, the file logger never does)")
    if non_finite:
        nf = non_finite[0]
        notes.append(f"{len(non_finite)} value(s) the run logged as NaN or infinite are kept as null (the manifest's "
                     f"non_finite); the first at record step {nf.step}: `{nf.field}` = {nf.value}")
    model = c.get("actor_rollout_ref.model.path")
    trainer_config = {k: v for k, v in c.items()}
    if grad_clip is not None:
        trainer_config["max_grad_norm"] = grad_clip
    if c.get("actor_rollout_ref.rollout.n") is not None:
        trainer_config["num_generations"] = c["actor_rollout_ref.rollout.n"]
    return write_run(record_dir, framework={"name": "verl", "version": framework_version},
                     model={"description": str(model) if model else "unknown policy (veRL metrics do not name it)"},
                     telemetry=[OptimizerTelemetry(**m.rows[t]) for t in sorted(m.rows)], rollouts=table,
                     trainer_config=trainer_config, notes=notes, overwrite=overwrite, non_finite=non_finite,
                     validation=val_table)
