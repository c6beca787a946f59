"""Importers: convert what a framework leaves on disk into a reward-lens record."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from reward_lens.record.errors import RecordError


def shown(value: Any, limit: int = 80) -> str:
    """A value from a user's file as it appears in an error line: its repr, cut to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 1]}… ({len(text):,} characters)"


def finite_number(value: Any, where: str | Path, key: str, step: int, step_key: str | None = "step") -> float:
    """A logged metric as a finite float within the record's magnitude limit (specs/fields.yaml),
    or a RecordError naming where, which key and which step: ``step`` is the user's own number
    from the file (its ``step_key``), the one they will find there, not the record's 0-based t."""
    from reward_lens_spec import load_fields

    at = {"field": key, "steps": [step], "step_key": step_key}
    if isinstance(value, bool):
        raise RecordError(where, f"`{key}` is {shown(value)}, not a number", **at)
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise RecordError(where, f"`{key}` is {shown(value)}, not a number", **at) from None
    except OverflowError:  # an int beyond float range
        raise RecordError(where, f"`{key}` is {shown(value)}, beyond a float's range", **at) from None
    if not math.isfinite(v):
        raise RecordError(where, f"`{key}` is {v}", **at)
    mag = load_fields().magnitude
    if mag is not None and abs(v) > mag.limit:
        raise RecordError(where, f"`{key}` is {v:.3g}, beyond ±{mag.limit:g}: {mag.why}", **at)
    return v


def logged_number(value: Any, where: str | Path, key: str, step: int, step_key: str | None = "step",
                  null_is: str | None = None) -> tuple[float | None, str | None]:
    """A logged metric of a run as ``(value, None)``, or ``(None, what)`` where the run logged a
    NaN or an infinity (``what``: ``nan``, ``+inf`` or ``-inf``): a diverged step is data about the
    run, kept as null with a ``NonFiniteValue`` in the manifest (ARCHITECTURE.md), never a reason
    to refuse the file. ``null_is``: what a JSON null stands for in a log whose writer turns
    non-finite numbers into null (veRL's file logger: orjson writes NaN and +-inf as null);
    elsewhere a null is ``None, None`` (not logged). Anything else that is not a number (a string
    of words, a list, a bool) is still a RecordError naming where, the key and the step."""
    if value is None:
        return None, null_is
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
        if math.isnan(v):
            return None, "nan"
        if math.isinf(v):
            return None, "+inf" if v > 0 else "-inf"
    return finite_number(value, where, key, step, step_key), None


# Steps and counts are stored as int64.
INT64_MAX = 2 ** 63 - 1


def whole_number(value: Any, where: str | Path, key: str, *, minimum: int = 0) -> int:
    """A config or log value that must be a whole number (a step, a count), or a RecordError
    naming where and which key: not a bool, not a list, not 1e400, not beyond int64."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(where, f"`{key}` is {shown(value)}, not a whole number", field=key)
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise RecordError(where, f"`{key}` is {value!r}, not a whole number", field=key)
    v = int(value)
    if not minimum <= v <= INT64_MAX:
        raise RecordError(where, f"`{key}` is {v}, outside [{minimum}, 2^63 - 1]", field=key)
    return v


def one_based_step(value: Any, where: str | Path, key: str = "step") -> int:
    """A framework's 1-based step (TRL's ``global_step``, veRL's ``global_steps``: the update just
    made) as the record's 0-based t = step - 1, or a RecordError naming where and the key, quoting
    the value as the file has it: a whole number from 1, with t within the record's step limit
    (specs/fields.yaml)."""
    from reward_lens_spec import load_fields

    step = whole_number(value, where, key, minimum=1)
    spec = load_fields().fields["step"].constraints
    if spec.maximum is not None and step - 1 > spec.maximum:
        raise RecordError(where, f"`{key}` is {step}, beyond {int(spec.maximum) + 1} ({spec.maximum_why})", field=key)
    return step - 1


# What a value of each argument type must be, in the words an error uses.
_EXPECT = {"int": "a whole number", "number": "a finite number", "steps_or_ratio": "a whole number of steps "
           "from 1, or a ratio between 0 and 1", "numbers": "a list of finite numbers", "bool": "true or false",
           "string": "a string", "string_or_bool": "a string or true/false"}


def _typed(spec) -> Any:
    """The pydantic type of one ``ArgType`` (specs/frameworks/*.yaml ``types``)."""
    from typing import Annotated, Optional, Union

    from pydantic import BeforeValidator, Field, StrictBool, StrictStr

    def no_bool(v: Any) -> Any:  # true is not 1 here, as whole_number says
        if isinstance(v, bool):
            raise ValueError("a boolean")
        return v

    lo = spec.minimum
    hi = spec.maximum
    if spec.type == "int":
        hi = INT64_MAX if hi is None else min(hi, INT64_MAX)
        lo = -INT64_MAX if lo is None else lo
        t = Annotated[int, BeforeValidator(no_bool), Field(ge=lo, le=hi)]
    elif spec.type == "number":
        t = Annotated[float, BeforeValidator(no_bool), Field(ge=lo, le=hi, allow_inf_nan=False)]
    elif spec.type == "steps_or_ratio":
        t = Union[Annotated[int, BeforeValidator(no_bool), Field(ge=1, le=INT64_MAX)],
                  Annotated[float, BeforeValidator(no_bool), Field(gt=0, lt=1)]]
    elif spec.type == "numbers":
        t = list[Annotated[float, BeforeValidator(no_bool), Field(allow_inf_nan=False)]]
    elif spec.type == "bool":
        t = bool
    elif spec.type == "string":
        t = StrictStr
    else:
        t = Union[StrictBool, StrictStr]
    return Optional[t]


_MODELS: dict[str, Any] = {}


def config_model(framework) -> Any:
    """The one typed model of a framework's configuration arguments (its spec's ``types``),
    built once; other keys pass through untouched."""
    from pydantic import ConfigDict, create_model

    if framework.framework not in _MODELS:
        fields = {k: (_typed(t), None) for k, t in framework.types.items()}
        _MODELS[framework.framework] = create_model(f"{framework.name}Config",
                                                    __config__=ConfigDict(extra="allow"), **fields)
    return _MODELS[framework.framework]


def validate_config(cfg: dict[str, Any], framework, where: str | Path) -> dict[str, Any]:
    """``cfg`` with every typed argument read as its type (``"1e-5"`` -> 1e-5, as the framework's
    argument parser reads it), or a RecordError naming ``where``, the key, its value and what it
    must be. Untyped keys are returned as they are."""
    from pydantic import ValidationError

    typed = {k: v for k, v in cfg.items() if k in framework.types}
    try:
        model = config_model(framework).model_validate(typed)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0])
        spec = framework.types[key]
        value = cfg[key]
        bounds = []
        if spec.minimum is not None:
            bounds.append(f"at least {spec.minimum:g}")
        if spec.maximum is not None:
            bounds.append(f"at most {spec.maximum:g}")
        if spec.type == "int" and spec.maximum is None:
            bounds.append("up to 2^63 - 1")
        what = _EXPECT[spec.type] + (f" ({', '.join(bounds)})" if bounds else "")
        raise RecordError(where, f"`{key}` is {shown(value)}, not {what}", field=key) from None
    return {**cfg, **{k: getattr(model, k) for k in typed}}


# `reward-lens import <name>`: the function that reads each framework's output, by module path so
# that naming one imports nothing of the others (specs/importers.yaml says what each reads).
IMPORTERS = {
    "trl": "reward_lens.record.importers.trl_output:import_trl",
    "verl": "reward_lens.record.importers.verl:import_verl",
    "nemo-rl": "reward_lens.record.importers.nemo_rl:import_nemo_rl",
    "openrlhf": "reward_lens.record.importers.openrlhf:import_openrlhf",
}


def importer(name: str):
    """The import function registered for framework ``name`` (a key of IMPORTERS)."""
    from importlib import import_module

    module, func = IMPORTERS[name].split(":")
    return getattr(import_module(module), func)
