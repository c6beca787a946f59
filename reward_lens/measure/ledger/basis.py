r"""A declared feature basis: the behaviours a book prices, stated in YAML.

A basis file lists features, each with a name, a kind, a unit and a one-line meaning::

    features:
      - name: says_alpha          # regex: 1 if the completion matches, else 0
        kind: regex
        pattern: "\\balpha\\b"
      - name: exclaims            # regex count per 100 characters
        kind: regex
        pattern: "!"
        count: true
      - name: length_tokens
        kind: length
        of: tokens
      - name: reward_fmt          # the record's per-rollout score of reward function `fmt`
        kind: reward
        reward: fmt
      - name: correct             # what the user actually wants: a declared target
        kind: reward
        reward: correctness       # e.g. a function scored on every rollout with reward weight 0
        target: higher

A feature may be declared a **target** (``target: higher`` or ``target: lower``): what the user
actually wants of the policy, as opposed to what the reward pays for. Correctness on the task, a
held-out check, a grader's score the reward does not see. The findings that tell reward hacking
from learning (``proxy_gaming``, ``paid_for_drift``) read the targets; where the basis declares
none, they are *not evaluated* and name the field. A target is a statement about the run's
purpose, not a definition of a number: it is not part of the basis id, and books computed in
bases that differ only in their targets are the same books.

Kinds (every built-in kind is one vectorised ``pyarrow.compute`` pass over a column, except
``json``, which calls Python's JSON parser once per completion):

- ``regex``: ``pattern`` (RE2 syntax); 1/0 whether it matches, or with ``count: true`` matches
  per 100 characters, with ``count: raw`` the number of matches (plus ``offset``);
- ``length``: ``of: characters | tokens | words`` (tokens from ``completion_ids``, else
  ``num_tokens``; words are runs of characters other than space, \t, \n, \f, \r: RE2's ``\S+``);
- ``char_class``: ``class`` (an RE2 character class); the fraction of characters in it;
- ``ends_with_eos``: 1 if the last completion token is ``eos_token_id`` (from the feature or
  the record's model); ``truncated``: 1 if the completion reached ``cap`` tokens (default: the
  record's ``max_completion_length``) without ending in EOS;
- ``reward``: the record's per-rollout score of reward function ``reward`` (``rewards.NAME``);
- ``check``: the record's per-rollout score of ``check``, a declared target the reward does not
  pay for (``targets.NAME``: the tap's ``target=my_fn``);
- ``json``: 1 if the completion (surrounding whitespace stripped) parses as JSON;
- ``callable``: ``function: "module:function"``, called with a ``pyarrow`` array of completions
  and returning one finite value per completion. A report computes the features of several
  row groups at once on threads (``price.FEATURE_THREADS``), so the function may be called
  concurrently: it should not keep state between calls.

The basis id (``basis:`` + 12 hex digits) is a hash of the canonical definitions (names,
kinds, parameters, units; not the prose meanings): results computed in different bases are
never combined, and a book refuses UNIT_MISMATCH naming both ids.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import threading
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reward_lens.record.errors import RecordError
from reward_lens_spec.errors import SpecError
from reward_lens_spec.paths import specs_dir
from reward_lens_spec.yamlload import line_for, load_yaml_with_lines

NAME = r"^[A-Za-z_][A-Za-z0-9_.]*$"


class _Def(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME)
    unit: str | None = None
    meaning: str | None = None
    target: Literal["higher", "lower"] | None = Field(
        None, description="what the user actually wants of this behaviour (more of it: higher; less: lower), as "
                          "opposed to what the reward pays for; read by the findings, not part of the basis id")


class RegexDef(_Def):
    kind: Literal["regex"]
    pattern: str = Field(min_length=1)
    count: bool | Literal["raw"] = False
    offset: float = Field(0.0, allow_inf_nan=False, ge=-1e6, le=1e6,
                          description="added to every value: finite, at most 1e6 in magnitude (a larger shift "
                                      "would swamp the feature's own digits in float64)")


class LengthDef(_Def):
    kind: Literal["length"]
    of: Literal["characters", "tokens", "words"]


class CharClassDef(_Def):
    kind: Literal["char_class"]
    class_: str = Field(alias="class", min_length=3)


class EosDef(_Def):
    kind: Literal["ends_with_eos"]
    eos_token_id: int | None = None


class TruncatedDef(_Def):
    kind: Literal["truncated"]
    cap: int | None = Field(None, ge=1)
    eos_token_id: int | None = None


class RewardDef(_Def):
    kind: Literal["reward"]
    reward: str = Field(min_length=1)


class CheckDef(_Def):
    kind: Literal["check"]
    check: str = Field(min_length=1)


class JsonDef(_Def):
    kind: Literal["json"]


class CallableDef(_Def):
    kind: Literal["callable"]
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


KINDS = ("regex", "length", "char_class", "ends_with_eos", "truncated", "reward", "check", "json", "callable")
FeatureDef = Annotated[RegexDef | LengthDef | CharClassDef | EosDef | TruncatedDef | RewardDef | CheckDef | JsonDef
                       | CallableDef,
                       Field(discriminator="kind")]


class BasisFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    default: list[str] | None = None  # the features used when none are picked by name
    features: list[FeatureDef] = Field(min_length=1)


_UNITS = {"length": {"characters": "characters", "tokens": "tokens", "words": "words"}}
# Columns each kind reads (``length: tokens`` reads completion_ids or num_tokens).
_COLUMNS = {"regex": ["completion"], "char_class": ["completion"], "json": ["completion"],
            "callable": ["completion"], "reward": ["rewards"], "check": ["targets"], "ends_with_eos": ["completion_ids"],
            "truncated": ["completion_ids"]}


def _unit(d: Any) -> str:
    if d.unit:
        return d.unit
    if d.kind == "regex":
        return {False: "indicator (0/1)", True: "matches per 100 characters", "raw": "matches"}[d.count]
    if d.kind == "length":
        return _UNITS["length"][d.of]
    if d.kind == "char_class":
        return "fraction of characters"
    if d.kind == "reward":
        return "reward units"
    if d.kind == "check":
        return "as the check returns"
    if d.kind in ("ends_with_eos", "truncated", "json"):
        return "indicator (0/1)"
    return "as returned"


def _meaning(d: Any) -> str:
    if d.meaning:
        return d.meaning
    if d.kind == "regex":
        what = {False: "1 if the completion matches", True: "matches per 100 characters of",
                "raw": "number of matches of"}[d.count]
        return f"{what} /{d.pattern}/" if d.count else f"{what} /{d.pattern}/, else 0"
    if d.kind == "length" and d.of == "words":
        return "number of words: runs of characters other than space, \\t, \\n, \\f, \\r"
    if d.kind == "length":
        return f"length of the completion in {d.of}"
    if d.kind == "char_class":
        return f"fraction of characters in {d.class_}"
    if d.kind == "reward":
        return f"the record's per-rollout score of reward function `{d.reward}`"
    if d.kind == "check":
        return f"the record's per-rollout score of the check `{d.check}` (a target the reward does not pay for)"
    if d.kind == "ends_with_eos":
        return "1 if the completion ends with the end-of-sequence token"
    if d.kind == "truncated":
        return "1 if the completion reached the length cap without an end-of-sequence token"
    if d.kind == "json":
        return "1 if the completion parses as JSON"
    return f"value of {d.function}"


def _check_regex(pattern: str) -> str | None:
    try:
        pc.count_substring_regex(pa.nulls(1, pa.string()), pattern=pattern)  # pa.array([..]) would import pandas (0.2 s)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        return " ".join(str(exc).split())[:160]
    return None


# A `callable` feature is the user's code: it runs under a time limit per call and in total per
# basis, after which the basis is refused naming the feature (issue 61: a callable that never
# returned hung `check` forever, with nothing said). Per call: a generous bound for a vectorised
# function over one rollout segment (the tap's segments are at most a few thousand completions);
# in total: what a report over a long record may reasonably spend in user code.
CALLABLE_SECONDS = 60.0
CALLABLE_TOTAL_SECONDS = 600.0


class _Pending:
    """What a call running in its own thread left: its result, or the exception it raised."""

    result: Any = None
    error: BaseException | None = None


def call_with_limit(fn, arg, seconds: float) -> tuple[bool, Any]:
    """``fn(arg)`` in a daemon thread, waited on for at most ``seconds``: (True, result), or
    (False, None) when it has not returned by then (the thread is left behind: Python cannot stop
    a thread, and a daemon one does not keep the process alive). An exception it raises is
    re-raised here. A thread, not a signal: SIGALRM reaches only the main thread, and the tap's
    live findings may run in another; not a process: the completions would be copied per call."""
    box = _Pending()

    def run():
        try:
            box.result = fn(arg)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which names it
            box.error = exc

    worker = threading.Thread(target=run, name="reward-lens-callable", daemon=True)
    worker.start()
    worker.join(max(seconds, 0.0))
    if worker.is_alive():
        return False, None
    if box.error is not None:
        raise box.error
    return True, box.result


def _import(spec: str):
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # importing runs the module's code: a SyntaxError, a RuntimeError, sys.exit
        msg = " ".join(str(exc).split())[:200]
        raise ValueError(f"cannot import {spec} ({type(exc).__name__}: {msg})") from None
    if not callable(fn):
        raise ValueError(f"{spec} is not callable")
    return fn


class FeatureBasis:
    """An ordered, declared feature basis: ``names`` is the join key of G, dz and the shares."""

    def __init__(self, defs: Sequence[Any], *, source: str = "<basis>", name: str | None = None):
        self.defs = tuple(defs)
        self.source = source
        self.label = name
        seen: set[str] = set()
        for d in self.defs:
            if d.name in seen:
                raise SpecError(f"{source}: feature `{d.name}` is declared twice")
            seen.add(d.name)
        # the prose and the declared targets say what the numbers are for, not what they are
        payload = [d.model_dump(by_alias=True, exclude={"meaning", "target"}) | {"unit": _unit(d)} for d in self.defs]
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        self.basis_id = f"basis:{digest[:12]}"
        self.names = BasisNames([d.name for d in self.defs], self.basis_id)
        self._fns = {d.name: _import(d.function) for d in self.defs if d.kind == "callable"}
        self._callable_spent = 0.0  # seconds this basis's callables have run, over every call

    def __repr__(self) -> str:
        return f"FeatureBasis({list(self.names)}, id={self.basis_id})"

    def docs(self) -> dict[str, str]:
        return {d.name: _meaning(d) for d in self.defs}

    def units(self) -> dict[str, str]:
        return {d.name: _unit(d) for d in self.defs}

    def describe(self) -> list[dict[str, str | None]]:
        return [{"name": d.name, "kind": d.kind, "unit": _unit(d), "meaning": _meaning(d), "target": d.target}
                for d in self.defs]

    @property
    def targets(self) -> dict[str, str]:
        """The declared targets: feature name -> ``higher`` or ``lower`` (what the user wants)."""
        return {d.name: d.target for d in self.defs if d.target is not None}

    @property
    def columns(self) -> list[str]:
        """Record columns to read; ``length: tokens`` asks for both and uses what exists."""
        cols = set()
        for d in self.defs:
            if d.kind == "length":
                cols |= {"completion"} if d.of != "tokens" else {"completion_ids", "num_tokens"}
            else:
                cols |= set(_COLUMNS[d.kind])
        return sorted(cols)

    def needs(self) -> dict[str, list[list[str]]]:
        """Per feature, the record fields it needs, as alternatives (any one list will do)."""
        out: dict[str, list[list[str]]] = {}
        for d in self.defs:
            if d.kind == "length" and d.of == "tokens":
                out[d.name] = [["rollout.completion_ids"], ["rollout.num_tokens"]]
            elif d.kind == "length":
                out[d.name] = [["rollout.completion"]]
            else:
                out[d.name] = [[f"rollout.{c}" for c in _COLUMNS[d.kind]]]
        return out

    def compute(self, table: pa.Table, source: str = "rollouts", context: dict[str, Any] | None = None) -> np.ndarray:
        """The n x k feature matrix (float64) of the rows of ``table``. ``context`` carries the
        record's ``eos_token_id`` and ``max_completion_length`` where a feature needs them."""
        ctx = dict(context or {})  # a per-call scratch space too (the byte view of the completions)
        out = np.empty((table.num_rows, len(self.defs)), dtype=np.float64)
        for j, d in enumerate(self.defs):
            try:
                values = self._one(d, table, source, ctx)
            except pa.ArrowInvalid as exc:  # e.g. invalid UTF-8 that a writer let through
                steps = np.unique(table.column("step").to_numpy()) if "step" in table.column_names else None
                raise RecordError(source, f"feature `{d.name}` cannot be computed from this column "
                                  f"({' '.join(str(exc).split())[:120]})", field=_COLUMNS.get(d.kind, ["completion"])[0],
                                  steps=steps) from None
            out[:, j] = values
        return out

    # ------------------------------------------------------------ one feature
    def _col(self, d: Any, table: pa.Table, column: str, source: str) -> pa.Array:
        if column not in table.column_names:
            raise RecordError(source, f"feature `{d.name}` ({d.kind}) needs this column", field=column)
        col = table.column(column)
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if col.null_count:
            steps = table.column("step").filter(pc.is_null(col)).to_numpy() if "step" in table.column_names else None
            raise RecordError(source, f"feature `{d.name}` needs a value on every rollout; some are null",
                              field=column, steps=np.unique(steps) if steps is not None else None)
        return col

    def _one(self, d: Any, table: pa.Table, source: str, ctx: dict[str, Any]) -> np.ndarray:
        if d.kind == "regex":
            col = self._col(d, table, "completion", source)
            if not d.count:
                return _f(pc.match_substring_regex(col, pattern=d.pattern))
            n = _f(pc.count_substring_regex(col, pattern=d.pattern))
            if d.count == "raw":
                return n + d.offset
            return n * 100.0 / np.maximum(_f(pc.utf8_length(col)), 1.0) + d.offset
        if d.kind == "char_class":
            col = self._col(d, table, "completion", source)
            lut = byte_table(d.class_)
            if lut is not None:  # the UTF-8 bytes, viewed once for every class; identical counts
                if "_bytes" not in ctx:
                    ctx["_bytes"] = _byte_view(col)
                rows, data, chars = ctx["_bytes"]
                hits = np.bincount(rows[lut[data]], minlength=len(col)).astype(np.float64)
                return hits / np.maximum(chars, 1.0)
            return _f(pc.count_substring_regex(col, pattern=d.class_)) / np.maximum(_f(pc.utf8_length(col)), 1.0)
        if d.kind == "length":
            if d.of == "characters":
                return _f(pc.utf8_length(self._col(d, table, "completion", source)))
            if d.of == "words":
                return _f(pc.count_substring_regex(self._col(d, table, "completion", source), pattern=r"\S+"))
            if "completion_ids" in table.column_names:
                return _f(pc.list_value_length(self._col(d, table, "completion_ids", source)))
            return _f(self._col(d, table, "num_tokens", source))
        if d.kind in ("ends_with_eos", "truncated"):
            ids = self._col(d, table, "completion_ids", source)
            eos = d.eos_token_id if d.eos_token_id is not None else ctx.get("eos_token_id")
            if eos is None:
                raise RecordError(source, f"feature `{d.name}` needs the end-of-sequence token id: set "
                                  "`eos_token_id` on the feature (the record's model does not name it)",
                                  field="completion_ids")
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
            ends = np.asarray(ids.offsets)[1:] - 1 - np.asarray(ids.offsets)[0]
            last = np.where(lengths > 0, flat[np.clip(ends, 0, max(len(flat) - 1, 0))] if len(flat) else -1, -1)
            is_eos = (lengths > 0) & (last == eos)
            if d.kind == "ends_with_eos":
                return is_eos.astype(np.float64)
            cap = d.cap if d.cap is not None else ctx.get("max_completion_length")
            if cap is None:
                raise RecordError(source, f"feature `{d.name}` needs the length cap: set `cap` on the feature "
                                  "(the record's trainer config has no `max_completion_length`)",
                                  field="completion_ids")
            return ((lengths >= int(cap)) & ~is_eos).astype(np.float64)
        if d.kind in ("reward", "check"):
            column, key = ("rewards", d.reward) if d.kind == "reward" else ("targets", d.check)
            what = "reward function" if d.kind == "reward" else "check"
            col = self._col(d, table, column, source)
            v = pc.map_lookup(col, query_key=key, occurrence="first")
            if v.null_count and v.null_count < len(v):
                # a reward function (or check) that gave no score on some rollouts (None: TRL logs
                # NaN, the tap leaves it out): not a number there. The books refuse such a basis
                # naming the feature (RunContext.unmeasured) rather than a bad-input error (issue 61)
                return np.where(pc.is_null(v).to_numpy(zero_copy_only=False), np.nan, _f(pc.fill_null(v, 0.0)))
            if v.null_count:
                missing = pc.is_null(v)
                steps = table.column("step").filter(missing).to_numpy() if "step" in table.column_names else None
                keys = sorted(set(col.keys.unique().to_pylist()))
                raise RecordError(source, f"feature `{d.name}` reads {what} `{key}`, which "
                                  f"{'no' if v.null_count == len(v) else 'not every'} rollout has "
                                  f"(the record's {what}s: {keys})", field=column,
                                  steps=np.unique(steps) if steps is not None else None)
            return _f(v)
        if d.kind == "json":
            col = self._col(d, table, "completion", source)
            return np.fromiter((_parses(s) for s in col.to_pylist()), dtype=np.float64, count=len(col))
        fn = self._fns[d.name]
        col = self._col(d, table, "completion", source)
        left = CALLABLE_TOTAL_SECONDS - self._callable_spent
        limit = min(CALLABLE_SECONDS, left)
        started = time.perf_counter()
        try:
            done, out = call_with_limit(fn, col, limit)
            self._callable_spent += time.perf_counter() - started
            if not done:
                self._callable_spent = CALLABLE_TOTAL_SECONDS
                which = (f"the {CALLABLE_SECONDS:g} s limit per call" if limit == CALLABLE_SECONDS else
                         f"the {CALLABLE_TOTAL_SECONDS:g} s limit of the basis's callables in all")
                raise SpecError(f"{self.source}: feature `{d.name}`: {d.function} did not return within {which} "
                                f"on the completions of {source}; the basis is refused (docs/reliability.md)")
        except SpecError:
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the user's code: any failure (even sys.exit) is bad input, named
            msg = " ".join(str(exc).split())[:200]
            raise SpecError(f"{self.source}: feature `{d.name}`: {d.function} raised {type(exc).__name__}"
                            f"{': ' + msg if msg else ''} on the completions of {source}") from None
        try:
            res = np.asarray(out, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError, OverflowError) as exc:
            raise RecordError(source, f"feature `{d.name}`: {d.function} did not return numbers ({exc})") from None
        if res.shape[0] != len(col):
            raise RecordError(source, f"feature `{d.name}`: {d.function} returned {res.shape[0]} values for "
                              f"{len(col)} completions (it must return one per completion)")
        if not np.isfinite(res).all():
            raise RecordError(source, f"feature `{d.name}`: {d.function} returned a non-finite value")
        return res


_BRACKET = re.compile(r"^\[(?:[^\]\\]|\\.)+\]$")
_NON_ASCII_PROBES = ["é", "ß", "\u00a0", "\u2028", "\ufffd", "中", "😀"]


@lru_cache(maxsize=None)
def byte_table(char_class: str) -> np.ndarray | None:
    """A 256-entry table: does a UTF-8 byte start a character of ``char_class``? Built by
    asking RE2 itself (pyarrow's regex engine) about every ASCII character and about a probe
    set of non-ASCII ones, so the counts are those of ``count_substring_regex``. None when the
    class is not one bracket expression, or treats non-ASCII characters unevenly (then the
    regex is used)."""
    if not _BRACKET.match(char_class):
        return None
    ascii_hits = pc.count_substring_regex(pa.array([chr(b) for b in range(128)]), pattern=char_class).to_numpy()
    probes = pc.count_substring_regex(pa.array(_NON_ASCII_PROBES), pattern=char_class).to_numpy()
    if ascii_hits.max(initial=0) > 1 or len(set(probes.tolist())) != 1 or probes[0] > 1:
        return None
    lut = np.zeros(256, dtype=bool)
    lut[:128] = ascii_hits == 1
    lut[0xC0:] = bool(probes[0])  # a lead byte: one non-ASCII character; continuation bytes never count
    return lut


def _byte_view(col: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A string column's UTF-8 bytes, the row of each byte, and each row's character count
    (its lead bytes), without copying the strings."""
    n = len(col)
    col = col.cast(pa.large_string()) if col.type == pa.string() else col
    _, off_buf, data_buf = col.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64)[col.offset: col.offset + n + 1]
    data = (np.frombuffer(data_buf, dtype=np.uint8)[offsets[0]: offsets[-1]] if data_buf is not None and n
            else np.zeros(0, np.uint8))
    rows = np.repeat(np.arange(n), np.diff(offsets)) if n else np.zeros(0, np.int64)
    chars = np.bincount(rows[(data & 0xC0) != 0x80], minlength=n).astype(np.float64)
    return rows, data, chars


def _byte_counts(col: pa.Array, lut: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per string: characters whose first byte is in ``lut``, and characters."""
    rows, data, chars = _byte_view(col)
    return np.bincount(rows[lut[data]], minlength=len(col)).astype(np.float64), chars


class BasisNames(tuple):
    """Feature names that remember their basis: two bases with the same names but different
    definitions compare unequal, so every ``names`` check doubles as a basis check."""

    basis_id: str | None

    def __new__(cls, names: Sequence[str], basis_id: str | None):
        obj = super().__new__(cls, names)
        obj.basis_id = basis_id
        return obj

    def __eq__(self, other: object) -> bool:
        if not tuple.__eq__(self, other):
            return False
        other_id = getattr(other, "basis_id", None)
        return self.basis_id is None or other_id is None or self.basis_id == other_id

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__

    def __getnewargs__(self):
        return (tuple(self), self.basis_id)


def basis_id_of(names: Sequence[str]) -> str | None:
    return getattr(names, "basis_id", None)


def _f(a) -> np.ndarray:
    arr = a.to_numpy(zero_copy_only=False) if hasattr(a, "to_numpy") else np.asarray(a)
    return arr.astype(np.float64)


def _parses(s: str) -> float:
    try:
        json.loads(s)
    except (ValueError, RecursionError):
        return 0.0
    return 1.0


def load_basis(path: str | Path) -> FeatureBasis:
    """A basis from a YAML file; any problem is a SpecError naming file:line (or the feature)."""
    path = Path(path)
    if not path.exists():  # a FIFO or a directory is named by load_yaml_with_lines, unopened
        raise SpecError(f"{path}:1: feature basis file not found")
    data, lines = load_yaml_with_lines(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: a feature basis is a mapping with a `features:` list")
    try:
        parsed = BasisFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        if len(loc) >= 3 and loc[0] == "features" and loc[2] in KINDS:
            loc = loc[:2] + loc[3:]  # the discriminator's tag, not a key of the file
        where = ".".join(str(p) for p in loc) or "(top level)"
        msg = err["msg"]
        if err["type"] == "union_tag_invalid":
            tag = err["ctx"].get("tag") if err.get("ctx") else None
            msg = f"unknown kind {tag!r}; kinds: {', '.join(KINDS)}"
        name = _feature_name(data, loc)
        raise SpecError(f"{path}:{line_for(loc, lines)}: {where}{name}: {msg}") from None
    for i, d in enumerate(parsed.features):
        pattern = d.pattern if d.kind == "regex" else d.class_ if d.kind == "char_class" else None
        if pattern is not None:
            bad = _check_regex(pattern)
            if bad:
                key = "pattern" if d.kind == "regex" else "class"
                raise SpecError(f"{path}:{line_for(('features', i, key), lines)}: feature `{d.name}`: bad regex "
                                f"{pattern!r} ({bad})")
        if d.kind == "callable":
            try:
                _import(d.function)
            except ValueError as exc:
                raise SpecError(f"{path}:{line_for(('features', i, 'function'), lines)}: feature `{d.name}`: "
                                f"{exc}") from None
    defs = list(parsed.features)
    seen: set[str] = set()
    for i, d in enumerate(defs):
        if d.name in seen:
            raise SpecError(f"{path}:{line_for(('features', i, 'name'), lines)}: feature `{d.name}` is declared twice")
        seen.add(d.name)
    if parsed.default is not None:
        known = {d.name for d in defs}
        unknown = [n for n in parsed.default if n not in known]
        if unknown:
            raise SpecError(f"{path}:{line_for(('default',), lines)}: `default` names unknown feature(s) {unknown}")
    return FeatureBasis(defs, source=str(path), name=parsed.name or path.stem)


def _feature_name(data: dict, loc: tuple) -> str:
    if len(loc) >= 2 and loc[0] == "features" and isinstance(loc[1], int):
        feats = data.get("features") or []
        if loc[1] < len(feats) and isinstance(feats[loc[1]], dict) and "name" in feats[loc[1]]:
            return f" (feature `{feats[loc[1]]['name']}`)"
    return ""


@lru_cache(maxsize=None)
def _surface_file() -> tuple[tuple[Any, ...], tuple[str, ...]]:
    path = specs_dir() / "features" / "surface.yaml"
    basis = load_basis(path)
    data, _ = load_yaml_with_lines(path)
    return basis.defs, tuple(data.get("default") or basis.names)


def surface_definitions() -> tuple[dict[str, Any], tuple[str, ...]]:
    """specs/features/surface.yaml: every surface feature by name, and the default basis."""
    defs, default = _surface_file()
    return {d.name: d for d in defs}, default
