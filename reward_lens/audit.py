"""``reward-lens audit``: before training, which books will a logging setup support?

A configuration (TRL GRPOConfig arguments as JSON or YAML, a veRL Hydra config, a record's
manifest, or a record directory) is projected onto record fields through
``specs/frameworks/<framework>.yaml`` -- and, with ``--with-tap`` or a ``reward_lens:``
section, through ``specs/taps/<framework>.yaml`` for what ``RewardLensTap`` adds. The
projection goes to the same resolver and refusal templates ``reward-lens report`` uses on a
finished record. No second list of rules lives here.

Every statement is derived from the config: a value the config sets, a framework default
(said so), or the fact that the config does not say. Each refusal names its cause: the key,
its value, and what that value means for the record.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reward_lens.measure.efficiency.cost import denominator_context, rollouts_context
from reward_lens.record.errors import RecordError
from reward_lens.record.parse import config_mapping
from reward_lens.record.importers import validate_config, whole_number
from reward_lens_spec import (Presence, Refusal, Subject, load_books, load_fields, load_frameworks, load_taps,
                              make_refusal, resolve)
from reward_lens_spec.conditions import config_value, empty, holds
from reward_lens_spec.models import BookSpec, Condition, FrameworkSpec
from reward_lens_spec.files import UnreadableFile, read_text
from reward_lens_spec.render import first_sentence, render_macro

SCHEMA_VERSION = "1.0"
Origin = Literal["config", "default", "unset", "tap default", "record"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Cause(_Out):
    """Why a requirement is not met: the key (None when no setting of the framework helps),
    its value and where the value came from, and what it means for the record."""

    key: str | None
    value: Any = None
    origin: Origin
    says: str


class Statement(_Out):
    key: str | None
    value: Any = None
    origin: Origin
    says: str


class FieldCoverage(_Out):
    cadence: str = Field(description="on which steps the field will be present, in words")
    steps_present: int | None = Field(description="null when the config does not set the run's length")
    steps_total: int | None


class RefusalOut(_Out):
    code: str
    requirement: str
    cause: Cause
    detail: str
    remedy: str
    remedy_first: str = Field(description="the remedy's first sentence (the text view's default)")


class BookOut(_Out):
    book: str
    function: str
    verdict: Literal["will compute", "will refuse", "will not run"]
    ledger: str | None = Field(description="how the feature movement will be estimated (paired/unpaired)")
    ledger_cause: Cause | None = None
    still_computable: list[str]
    refusals: list[RefusalOut]
    cause: Cause | None = Field(default=None, description="set when the run will not start at all: the trainer, or the tap at attach, refuses the configuration")


class FeatureVerdict(_Out):
    name: str
    kind: str
    unit: str
    verdict: Literal["supported", "not supported", "depends"]
    needs: list[list[str]] = Field(description="record fields, as alternatives (any one list will do)")
    cause: Cause | None = None
    says: str


class Detection(_Out):
    """How early a sequential finding will catch a stated sustained change at the config's batch
    (reward_lens/power.py: the finding's own rule on simulated runs, read from specs/power_table.yaml)."""

    change: float = Field(description="the stated change per step: points of a 0/1 rate, or tokens of length")
    unit: Literal["points", "tokens"]
    base: float = Field(description="the level it starts from: a rate in [0, 1], or a mean length in tokens")
    direction: Literal[-1, 1]
    prompt_groups: int = Field(description="prompt groups per step the config gives")
    completions: int = Field(description="completions per prompt group the config gives")
    read_at: str = Field(description="the table's batch read (<groups>x<completions>): the nearest at or below")
    step_se: float = Field(description="one step's standard error of the level at read_at, in the unit, for "
                                       "completions alike across prompts")
    icc: float | None = Field(None, description="the simulation's spread of a 0/1 rate over prompts (an intraclass "
                                                "correlation; 0: prompts alike in difficulty); null for a length")
    cv: float | None = Field(None, description="the simulation's length SD over its mean; null for a 0/1 rate")
    median: int | None = Field(description="changed steps seen when it first holds, median; null: past the horizon")
    within_90: int | None = Field(description="the 90 % quantile of that delay; null: past the horizon")
    false_alarm: float = Field(description="the chance one watched behaviour's CUSUM false-alarms over run_length "
                                           "steps with no change (Brook & Evans)")
    run_length: int
    says: str


class FindingSupport(_Out):
    finding: str
    title: str
    severity: str
    verdict: Literal["will evaluate", "will not evaluate"]
    live: bool = Field(description="evaluated by the tap while training")
    missing: list[str] = Field(default_factory=list, description="the fields (one alternative) or books it lacks")
    detection: Detection | None = Field(default=None, description="a sequential finding that will evaluate: how "
                                                                  "early it catches a stated change at this batch")


class AuditOut(_Out):
    schema_version: Literal["1.0"] = SCHEMA_VERSION
    source: str
    kind: Literal["config", "manifest", "record"]
    framework: str
    with_tap: bool
    subject: str = Field(description="what the verdicts are about, in words")
    statements: list[Statement]
    fields: dict[str, FieldCoverage]
    books: list[BookOut]
    basis: str | None = Field(default=None, description="the feature basis id audited (--features)")
    features: list[FeatureVerdict] = Field(default_factory=list)
    findings: list[FindingSupport] = Field(default_factory=list, description="which findings (specs/findings/) "
                                                                             "the run will support")


def json_schema() -> dict[str, Any]:
    """The JSON Schema of ``audit --format json`` (specs/schemas/audit.schema.json)."""
    return AuditOut.model_json_schema()


# ---------------------------------------------------------------- reading a config

# One reading of a spec's conditions, shared with the importers (reward_lens_spec.conditions).
_get = config_value
_holds = holds
_empty = empty


def _first_failing(cond: Condition | list[Condition], cfg: dict[str, Any], defaults: dict[str, Any]) -> Condition:
    for c in cond if isinstance(cond, list) else [cond]:
        if not _holds(c, cfg, defaults):
            return c
    raise AssertionError("the condition holds")


def _keys(cfg: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in cfg.items():
        out.add(prefix + str(k))
        if isinstance(v, dict):
            out |= _keys(v, prefix + str(k) + ".")
    return out


def _say(macro: str, **kwargs: Any) -> str:
    """One sentence of the audit, from templates/audit/says.j2."""
    return render_macro("audit/says.j2", macro, **kwargs)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def _origin_words(origin: str, spec: FrameworkSpec) -> str:
    if origin == "default":
        return f" ({spec.name} default)"
    if origin == "tap default":
        return " (tap default)"
    return ""


# ---------------------------------------------------------------- the projection

class Projection:
    """Record fields a config will supply (with presence), what it says, and why each field
    it will not supply is missing."""

    def __init__(self) -> None:
        self.supplied: dict[str, Presence] = {}
        self.cadence: dict[str, str] = {}
        self.statements: list[Statement] = []
        self.why_missing: dict[str, Cause] = {}
        self.steps: int | None = None
        self.window = 1
        self.rejected: Cause | None = None
        self.blocked: dict[str, Cause] = {}  # ledger id -> why it cannot form
        self.prompt_groups: int | None = None  # prompt groups a step will hold, where known
        self.completions: int | None = None  # completions per prompt group, where known
        self.batch_default: str | None = None  # the batch key read at the framework's default, where it was
        self.targets: dict[str, str] = {}  # declared targets (the tap's `target:`, a record's manifest)


def project(spec: FrameworkSpec, cfg: dict[str, Any], where: str | Path = "config",
            tap: FrameworkSpec | None = None) -> Projection:
    """What a run logged with ``cfg`` (and, with ``tap``, recorded by it) will hold."""
    d = dict(spec.defaults)
    if tap is not None:
        d.update(tap.defaults)
    pr = Projection()
    if spec.steps_key:
        raw, _ = _get(cfg, spec.steps_key, d)
        steps = None if raw is None else whole_number(raw, where, spec.steps_key, minimum=-1)
        pr.steps = steps if steps is not None and steps > 0 else None
    raw_window, w_origin = _get(cfg, spec.window_key, d) if spec.window_key else (None, "unset")
    if raw_window is None:
        window = 1
    elif isinstance(raw_window, float) and 0 < raw_window < 1:
        # transformers reads a logging_steps below 1 as a ratio of the total training steps
        if pr.steps is None:
            raise RecordError(where, _say("ratio_unknown", key=spec.window_key, raw=f"{raw_window:g}",
                                          steps_key=spec.steps_key), field=spec.window_key)
        window = max(1, math.ceil(raw_window * pr.steps))
        pr.statements.append(Statement(key=spec.window_key, value=raw_window, origin=w_origin, says=_say(
            "ratio_window", key=spec.window_key, raw=f"{raw_window:g}", window=window, steps=pr.steps)))
    else:
        window = whole_number(raw_window, where, spec.window_key, minimum=1)
    pr.window = window
    for rej in [*spec.rejects, *(tap.rejects if tap is not None else [])]:  # the trainer's, then the tap's
        if pr.rejected is None and _holds(rej.when, cfg, d):
            key = (rej.when[0] if isinstance(rej.when, list) else rej.when).key
            v, o = _get(cfg, key, d)
            pr.rejected = Cause(key=key, value=v, origin=o, says=rej.why)
    logged = None if pr.steps is None else math.ceil(pr.steps / window)
    if spec.prompt_groups is not None:
        _prompt_groups(spec.prompt_groups, cfg, d, pr, where)

    def presence(kind: str) -> tuple[Presence, str]:
        if kind in ("config", "every_step") or window == 1:
            words = "every step" if kind != "config" else "every step (a configuration value)"
            return (Presence(pr.steps, pr.steps) if pr.steps else Presence(1, 1)), words
        words = f"one step in {window}" + (f" ({logged} of {pr.steps})" if logged else "")
        return (Presence(logged, pr.steps) if pr.steps else Presence(1, window)), words

    layers = [(spec, cfg)] + ([(tap, cfg)] if tap is not None else [])
    for layer, _ in layers:
        for sup in layer.supplies:
            if sup.when is not None and not _holds(sup.when, cfg, d):
                c = _first_failing(sup.when, cfg, d)
                v, o = _get(cfg, c.key, d)
                o = "tap default" if layer is tap and o == "default" else o
                for f in sup.fields:
                    pr.why_missing.setdefault(f, Cause(key=c.key, value=v, origin=o, says=_say(
                        "key_and_why", key=c.key, value=_show(v), origin=_origin_words(o, layer), why=sup.why)))
                continue
            kind = sup.per_window if layer is spec else "every_step"
            for f in sup.fields:
                p, words = presence(kind)
                old = pr.supplied.get(f)
                if old is None or (p.count / p.of) > (old.count / old.of):
                    pr.supplied[f] = p
                    pr.cadence[f] = words
                if kind == "last_step" and window > 1 and p.count < p.of:
                    v, o = _get(cfg, spec.window_key, d)
                    pr.why_missing.setdefault(f, Cause(key=spec.window_key, value=window, origin=o, says=_say(
                        "key_and_why", key=spec.window_key, value=window, origin=_origin_words(o, spec),
                        why=sup.why)))
    for st in spec.settings + (tap.settings if tap is not None else []):
        if st.when is None or _holds(st.when, cfg, d):
            v, o = _get(cfg, st.key, d)
            owner = tap if tap is not None and st in tap.settings else spec
            o = "tap default" if owner is tap and o == "default" else o
            says = st.says.format(value=_show(v), origin=_origin_words(o, owner))
            if tap is not None and st.about and all(pr.cadence.get(f) == "every step" for f in st.about):
                says += _say("tap_records_anyway", fields=st.about)
            pr.statements.append(Statement(key=st.key, value=v, origin=o, says=says))
    if window > 1:
        pr.statements.append(Statement(key=spec.window_key, value=window, origin=w_origin, says=_say(
            "window", key=spec.window_key, window=window, origin=_origin_words(w_origin, spec), tap=tap is not None)))
    for f, why in sorted(spec.never.items()):
        if f in pr.supplied:
            continue
        if tap is None and spec.framework in load_taps():
            section = load_taps()[spec.framework].section
            pr.why_missing.setdefault(f, Cause(key=section, value=None, origin="unset",
                                               says=_say("never_without_tap", why=why, section=section)))
        else:
            pr.why_missing.setdefault(f, Cause(key=None, value=None, origin="unset", says=_say("never", why=why)))
        pr.statements.append(Statement(key=None, value=None, origin="unset", says=_say("absent", field=f, why=why)))
    return pr


def _record_prompt_groups(run) -> int | None:
    """The most prompt groups of two or more rollouts any step of the record has (None without
    group ids): what the paired ledger needs at least two of."""
    if "group_id" not in run.rollout_columns() or not run.n_rollouts:
        return None
    most = 0
    for table in run.iter_rollouts(["group_id"]):
        steps = table.column("step").to_numpy()
        ids = table.column("group_id").to_pylist()
        per: dict[int, dict] = {}
        for s, g in zip(steps.tolist(), ids):
            per.setdefault(s, {}).setdefault(g, 0)
            per[s][g] += 1
        most = max([most] + [sum(c >= 2 for c in gs.values()) for gs in per.values()])
    return most


def _prompt_groups(pg, cfg: dict[str, Any], d: dict[str, Any], pr: Projection, where) -> None:
    """The ledgers that cannot form on one process because a generation batch holds fewer
    prompt groups than they need (``prompt_groups`` of the framework spec)."""
    gens, _ = _get(cfg, pg.generations, d)
    if pg.prompts is not None:  # a key that counts a step's prompts itself (veRL)
        prompts, p_origin = _get(cfg, pg.prompts, d)
        if prompts is None or gens is None:
            return
        if p_origin == "default":
            pr.batch_default = pg.prompts
        pr.prompt_groups = whole_number(prompts, where, pg.prompts, minimum=1)
        pr.completions = whole_number(gens, where, pg.generations, minimum=1)
        return
    batch, b_origin = _get(cfg, pg.batch, d)
    if b_origin == "default":
        pr.batch_default = pg.batch
    steps, s_key, s_origin = None, None, "unset"
    for key in pg.steps:
        steps, s_origin = _get(cfg, key, d)
        if steps is not None:
            s_key = key
            break
    if batch is None or gens is None:
        return
    b = whole_number(batch, where, pg.batch, minimum=1)
    s = whole_number(steps, where, s_key, minimum=1) if steps is not None else 1
    g = whole_number(gens, where, pg.generations, minimum=1)
    groups = b * s // g
    pr.prompt_groups = groups
    pr.completions = g
    if groups >= pg.minimum:
        return
    says = _say("prompt_groups", batch_key=pg.batch, batch=b, steps_key=s_key, steps=s, gen_key=pg.generations,
                gens=g, groups=groups, why=pg.why)
    for led in pg.blocks:
        pr.blocked[led] = Cause(key=pg.batch, value=b, origin=b_origin, says=says)
    pr.statements.append(Statement(key=pg.batch, value=b, origin=b_origin, says=says))


# ---------------------------------------------------------------- loading

def load_config(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise RecordError(path, "is a directory without a manifest.json: not a reward-lens record")
    try:
        text = read_text(path)  # a FIFO is refused, never waited on
    except FileNotFoundError:
        raise RecordError(path, "no such file") from None
    except UnreadableFile as exc:
        raise RecordError(path, exc.problem) from None
    except UnicodeDecodeError as exc:
        raise RecordError(path, f"not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({exc})") from None
    return config_mapping(path, text, what="a configuration", mapping="a configuration must be a mapping")


def audit(path: str | Path, framework: str | None = None, *, with_tap: bool = False, features=None,
          model_parameters: int | None = None) -> AuditOut:
    """Audit a configuration, record directory or manifest; with ``features`` (a FeatureBasis),
    also say which of its features the logging setup supports; with ``model_parameters`` (the
    policy's trainable parameters), the bytes the tap's snapshot of pi_t will take."""
    result, pr, record = _audit(Path(path), framework, with_tap, model_parameters)
    # what declares a target: the tap section's `target:` or the record's manifest, and the basis
    targets = {**pr.targets, **(features.targets if features is not None else {})}
    result.findings = _finding_support(result, pr, targets)
    if features is not None:
        result.basis = features.basis_id
        result.features = _feature_verdicts(features, result, pr, record)
    return result


def _audit(path: Path, framework: str | None, with_tap: bool, model_parameters: int | None = None
           ) -> tuple[AuditOut, Projection, dict[str, Any] | None]:
    """The audit, the projection it was derived from, and (for a record) what the record's
    rollouts and model say that a projection cannot: reward function names, the EOS id."""
    if path.is_dir() and (path / "manifest.json").is_file():
        path = path / "manifest.json"  # a record directory is audited as a record
    cfg = load_config(path)
    frameworks = load_frameworks()
    if "run_id" in cfg and "format_version" in cfg:
        return _audit_manifest(path, cfg, frameworks)
    if framework is None:
        keys = _keys(cfg)
        matches = [n for n, s in frameworks.items() if any(k in keys for k in s.detect)]
        if len(matches) != 1:
            raise RecordError(path, f"cannot tell which framework this configuration is for (matches: "
                              f"{matches or 'none'}); pass --framework {'|'.join(sorted(frameworks))}")
        framework = matches[0]
    if framework not in frameworks:
        raise RecordError(path, f"unknown framework {framework!r}; known: {', '.join(sorted(frameworks))}")
    spec = frameworks[framework]
    cfg = validate_config(cfg, spec, path)  # the one typed model the importer reads it with too
    taps = load_taps()
    tap = None
    if with_tap or any(t.section in cfg for t in taps.values()):
        if framework not in taps:
            raise RecordError(path, f"reward-lens has no tap for {framework}; audit without --with-tap")
        tap = taps[framework]
        section = cfg.get(tap.section, {})
        if section is not None and not isinstance(section, dict):
            raise RecordError(path, f"`{tap.section}:` must be a mapping of the tap's arguments", field=tap.section)
        _check_tap_section(path, tap.section, section or {})
    pr = project(spec, cfg, path, tap)
    if tap is not None and pr.rejected is None:
        pr.rejected = _tap_rejects(path, tap.section, section or {})
    if tap is not None:
        pr.targets = tap_targets(section or {})
    if tap is not None and model_parameters is not None:
        pr.statements.append(_snapshot_statement(cfg, model_parameters, tap.defaults))
    optimizer, _ = _get(cfg, "optim", spec.defaults)
    beta, _ = _get(cfg, "beta", spec.defaults)
    subject = ("a run logged with this configuration" if tap is None
               else "a run recorded by the reward-lens tap with this configuration")
    books = _verdicts(pr, subject=subject, audit_words=True, optimizer=str(optimizer) if optimizer else None,
                      betas=[float(beta)] if isinstance(beta, (int, float)) else [], framework=framework)
    out = AuditOut(source=str(path), kind="config", framework=framework, with_tap=tap is not None,
                   subject=subject, statements=pr.statements, fields=_coverage(pr), books=books)
    return out, pr, None


# bytes per parameter of the dtypes a model_init_kwargs may name
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


def _snapshot_statement(cfg: dict[str, Any], n_parameters: int, defaults: dict[str, Any]) -> Statement:
    """What the tap's copy of pi_t takes, from the parameter count and the dtype the config loads
    the model in (``model_init_kwargs.dtype``; else the checkpoint's, unknown here: both sizes)."""
    where, origin = _get(cfg, "reward_lens.snapshot", defaults)  # the tap spec's default
    init = cfg.get("model_init_kwargs") if isinstance(cfg.get("model_init_kwargs"), dict) else {}
    dtype = str(init.get("dtype", init.get("torch_dtype", "")) or "").removeprefix("torch.")
    gib = lambda b: f"{n_parameters * b / 2**30:.3g} GiB"  # noqa: E731
    size = (f"{gib(_DTYPE_BYTES[dtype])} in {dtype} (`model_init_kwargs.dtype`)" if dtype in _DTYPE_BYTES else
            f"{gib(4)} in float32 or {gib(2)} in bfloat16 (the checkpoint's dtype: `model_init_kwargs.dtype` "
            "does not say)")
    place = ("in host memory: none on the accelerator" if where == "cpu"
             else "on the accelerator, beside the model (`reward_lens.snapshot: cpu` keeps it in host memory)")
    return Statement(key="reward_lens.snapshot", value=where, origin=origin, says=_say(
        "snapshot_bytes", n=f"{n_parameters:,}", size=size, place=place))


def _check_tap_section(path: Path, section: str, values: dict[str, Any]) -> None:
    """The `reward_lens:` section against the tap's own settings model (reward_lens_spec/tap_settings.py):
    the audit accepts exactly what ``RewardLensTap.attach`` runs with, and names the key otherwise."""
    from pydantic import ValidationError

    from reward_lens_spec.tap_settings import TapSettings, settings_error

    values = dict(values)
    if values.get("stop_on") is not None and values.get("check_every") == 0:
        values.pop("check_every")  # attach raises on the pair: a run that will not start (_tap_rejects)
    try:
        TapSettings(**values)
    except ValidationError as exc:
        if any(e["type"] == "extra_forbidden" for e in exc.errors()):
            unknown = sorted(set(values) - set(TapSettings.model_fields))
            raise RecordError(path, f"`{section}` has unknown tap argument(s) {unknown}; the tap takes "
                              f"{sorted(TapSettings.model_fields)}", field=section) from None
        raise RecordError(path, f"`{section}.{settings_error(exc)}`: RewardLensTap.attach would raise on it",
                          field=section) from None


def _tap_rejects(path: Path, section: str, values: dict[str, Any]) -> Cause | None:
    """A tap section that RewardLensTap.attach raises on though each value is valid alone: a
    `features` file that is not there, or a `stop_on` that can never fire (`check_every: 0`)."""
    feats = values.get("features")
    if isinstance(feats, str) and not any((base / feats).is_file() for base in (Path.cwd(), path.parent)):
        return Cause(key=f"{section}.features", value=feats, origin="config", says=_say("tap_features_missing",
                                                                                       value=feats))
    if values.get("stop_on") is not None and values.get("check_every") == 0:
        return Cause(key=f"{section}.check_every", value=0, origin="config", says=_say("tap_stop_never",
                                                                                     stop_on=values["stop_on"]))
    return None


def tap_targets(values: dict[str, Any]) -> dict[str, str]:
    """The targets a tap section declares (`target:`), by name: what the user wants."""
    from reward_lens_spec.tap_settings import tap_settings

    targets = tap_settings(target=values.get("target")).target if values.get("target") is not None else ()
    return {t.name: t.want for t in targets or ()}


def _finding_support(result: AuditOut, pr: Projection, targets=None) -> list[FindingSupport]:
    """Each finding: evaluated when one alternative of its fields is supplied, its books will
    compute (the same resolution as the books') and the run will log them on at least the
    finding's ``min_steps`` steps; never for a config the trainer rejects; with a basis
    (``targets``: its declared targets), a finding that reads a target needs one declared."""
    from reward_lens.findings import missing_inputs, missing_target
    from reward_lens_spec import load_findings

    books = {b.book: ("computed" if b.verdict == "will compute" else "refused") for b in result.books}

    def present(f: str) -> bool:
        p = pr.supplied.get(f)
        return bool(p is not None and p.any)

    out = []
    for spec in load_findings().values():
        # a config the trainer rejects logs nothing: no finding evaluates, whatever it would read
        lack = ([_say("run_rejected", key=pr.rejected.key)] if pr.rejected is not None
                else missing_inputs(spec, present, books) + missing_target(spec, targets))
        if not lack:  # a run shorter than the finding judges on, or with too few prompt groups a
            # step for it to read a step: not evaluated, as the report will say
            lack = _too_short_for(spec, pr) or _too_few_groups_for(spec, pr)
        out.append(FindingSupport(finding=spec.id, title=spec.title, severity=spec.severity, live=spec.live,
                                  verdict="will not evaluate" if lack else "will evaluate", missing=lack,
                                  detection=None if lack else _detection(spec.id, pr)))
    return out


def _detection(finding: str, pr: Projection) -> Detection | None:
    """The delay a sequential finding will take to catch its stated change at the config's batch
    (None for the other findings, or where the config does not give the batch)."""
    from reward_lens.power import power_at

    if pr.prompt_groups is None or pr.completions is None:
        return None
    pw = power_at(finding, pr.prompt_groups, pr.completions)
    if pw is None:
        return None
    ctx = pw.context()
    return Detection(change=pw.change, unit="points" if pw.kind == "rate" else "tokens", base=pw.base,
                     direction=pw.direction, prompt_groups=pr.prompt_groups, completions=pr.completions,
                     read_at=f"{pw.cell[0]}x{pw.cell[1]}", step_se=round(pw.se, 4),
                     icc=ctx["icc"] if pw.kind == "rate" else None, cv=ctx["cv"] if pw.kind != "rate" else None,
                     median=pw.median,
                     within_90=pw.upper, false_alarm=pw.false_alarm, run_length=pw.run_length,
                     says=_say("detection_delay", default_key=pr.batch_default,
                               **{k: ctx[k] for k in _DELAY_WORDS}))


# what the audit's sentence on a detection delay reads (templates/audit/says.j2, detection_delay)
_DELAY_WORDS = ("finding", "what", "scenario", "kind", "base", "direction", "change", "median", "upper", "se", "icc", "cv",
                "false_alarm_below", "run_length", "quantile", "groups", "completions", "cell_groups",
                "cell_completions", "horizon")


def _too_short_for(spec, pr: Projection) -> list[str]:
    """What a finding with a ``min_steps`` lacks where the run will log its inputs on fewer steps
    than that (the best of its alternatives whose fields are all supplied); nothing where the run's
    length is not known."""
    need = spec.params.get("min_steps")
    if not isinstance(need, int) or pr.steps is None:
        return []
    best: tuple[int, list[str]] | None = None
    for alt in spec.inputs:
        counts = [pr.supplied[f].count for f in alt if f in pr.supplied and pr.supplied[f].any]
        if len(counts) == len(alt) and (best is None or min(counts) > best[0]):
            best = (min(counts), alt)
    if best is None or best[0] >= need:
        return []
    return [_say("too_few_steps", need=need, fields=best[1], steps=best[0])]


def _too_few_groups_for(spec, pr: Projection) -> list[str]:
    """What a finding with a ``min_groups`` lacks where each step will hold fewer prompt groups
    (the sequential findings read a step's level and spread across its groups); nothing where
    the number is not known."""
    need = spec.params.get("min_groups")
    if not isinstance(need, int) or pr.prompt_groups is None or pr.prompt_groups >= need:
        return []
    return [_say("too_few_prompt_groups", need=need, groups=pr.prompt_groups)]


def _coverage(pr: Projection) -> dict[str, FieldCoverage]:
    out = {}
    for f, p in sorted(pr.supplied.items()):
        known = pr.steps is not None
        out[f] = FieldCoverage(cadence=pr.cadence.get(f, ""), steps_present=p.count if known else None,
                               steps_total=p.of if known else None)
    return out


def _audit_manifest(path: Path, cfg: dict[str, Any], frameworks: dict[str, FrameworkSpec]) -> AuditOut:
    from reward_lens.record.reader import open_run

    if any(path.parent.glob("telemetry*.parquet")):
        run = open_run(path.parent)
        pr = Projection()
        pr.supplied = run.fields()
        pr.steps = next(iter(pr.supplied.values())).of if pr.supplied else 0
        pr.cadence = {f: f"{p.count} of {p.of} steps" for f, p in pr.supplied.items()}
        pr.window = run.manifest.logging_steps
        pr.statements = [Statement(key=None, value=None, origin="record", says=n) for n in run.manifest.notes]
        for f in load_fields().fields:
            if f not in pr.supplied:
                pr.why_missing[f] = Cause(key=f, value=None, origin="record", says=_say("record_lacks", field=f))
        groups = _record_prompt_groups(run)
        pr.prompt_groups = groups
        pr.targets = {t.name: t.want for t in run.manifest.targets}
        if groups is not None and groups < 2:  # as --ledger auto: the paired ledger cannot form on any step
            pr.blocked["paired"] = Cause(key="rollout.group_id", value=groups, origin="record",
                                         says=_say("record_prompt_groups", groups=groups))
        betas = sorted(set(run.telemetry_column("beta").values()))
        books = _verdicts(pr, subject=run.run_id[:12], audit_words=False,
                          optimizer=run.manifest.optimizer, betas=betas, framework=run.manifest.framework.name)
        out = AuditOut(source=str(path.parent), kind="record", framework=run.manifest.framework.name,
                       with_tap=any(n.startswith("recorded by the reward-lens") for n in run.manifest.notes),
                       subject=f"this record ({run.run_id[:12]})",
                       statements=pr.statements, fields=_coverage(pr), books=books)
        return out, pr, {"rewards": _reward_names(run), "eos_token_id": run.manifest.model.eos_token_id}
    from pydantic import ValidationError

    from reward_lens.record.schema import RunManifest

    try:
        RunManifest.model_validate(cfg)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise RecordError(path, err["msg"], field=".".join(str(p) for p in err["loc"])) from None
    fw = cfg["framework"]["name"]
    if fw not in frameworks:
        raise RecordError(path, f"a manifest without its data files can only be audited through its trainer "
                          f"config, and framework {fw!r} has no spec in specs/frameworks/")
    tc = validate_config(cfg.get("trainer_config") or {}, frameworks[fw], path)
    pr = project(frameworks[fw], tc, path)
    pr.targets = {t["name"]: t["want"] for t in cfg.get("targets") or []}
    subject = "a run logged with the trainer configuration this manifest keeps"
    books = _verdicts(pr, subject=subject, audit_words=True, optimizer=cfg.get("optimizer"),
                      betas=[float(tc["beta"])] if isinstance(tc.get("beta"), (int, float)) else [], framework=fw)
    out = AuditOut(source=str(path), kind="manifest", framework=fw, with_tap=False, subject=subject,
                   statements=pr.statements, fields=_coverage(pr), books=books)
    return out, pr, None


# ---------------------------------------------------------------- verdicts

def _cause_for(resolution, rid: str, pr: Projection) -> Cause:
    status = resolution.status(rid)
    for alt in status.alternatives:
        for f in list(alt.missing) + list(alt.partial):
            if f in pr.why_missing:
                return pr.why_missing[f]
    missing = sorted({f for a in status.alternatives for f in a.missing + a.partial})
    return Cause(key=None, value=None, origin="unset", says=_say("nothing_supplies", fields=missing))


def _ledger(book: BookSpec, pr: Projection) -> tuple[str | None, Cause | None]:
    if not book.ledgers:
        return None, None
    chosen, cause = None, None
    for led in book.ledgers:
        lacking = [f for f in led.fields if not (f in pr.supplied and pr.supplied[f].any)]
        if not lacking and led.id not in pr.blocked:
            chosen = led.id
            break
        if cause is None:
            cause = pr.blocked.get(led.id) if not lacking else (
                pr.why_missing.get(lacking[0]) or Cause(key=None, value=None, origin="unset",
                                                        says=_say("not_every_step", field=lacking[0])))
    if chosen is not None and chosen == book.ledgers[0].id:
        cause = None
    return chosen, cause


def _verdicts(pr: Projection, *, subject: str, audit_words: bool, optimizer: str | None, betas: list[float],
              framework: str) -> list[BookOut]:
    out = []
    for book in load_books().values():
        if pr.rejected is not None:
            out.append(BookOut(book=book.id, function=book.function, verdict="will not run", ledger=None,
                               still_computable=[], refusals=[], cause=pr.rejected))
            continue
        resolution = resolve(book, pr.supplied, optimizer=optimizer)
        refusals = []
        for st in resolution.requirements:
            if st.satisfied_by is not None:
                continue
            rid = st.requirement.id
            cause = _cause_for(resolution, rid, pr)
            ctx_common = {"subject_words": subject, "cause": cause.model_dump()}
            if rid == "rollouts":
                p = pr.supplied.get("rollout.completion")
                ctx = rollouts_context(run_label=subject, steps_with_rollouts=p.count if p else 0,
                                       steps=pr.steps, logging_steps=pr.window, framework=framework,
                                       audit=audit_words)
            elif rid != "denominator":
                alt = resolution.status(rid).alternatives[0]
                ctx = {"requirement": rid, "audit": audit_words, "run": subject, "framework": framework,
                       "missing": [f.removeprefix("rollout.") for f in (*alt.missing, *alt.partial)]}
            else:
                p = pr.supplied.get("kl_to_previous")
                pairs = max((pr.steps or 0) - 1, 0)  # on a record: step pairs; a config says nothing of counts
                ctx = denominator_context(resolution, run_label=subject, n_missing=max(pairs - (p.count if p else 0), 0),
                                          n_total=pairs, optimizer=optimizer, betas=betas, framework=framework,
                                          audit=audit_words)
                for m in ctx["near_misses"]:
                    m["cadence"] = pr.cadence.get(m["field"], "")
            ref = make_refusal("RECORD_INCOMPLETE", book, Subject(run_id=None), {**ctx, **ctx_common})
            refusals.append(_refusal_out(ref, rid, cause))
        failed = {st.requirement.id for st in resolution.requirements if st.satisfied_by is None}
        needs = {r.id: set(r.needed_by or book.outputs) for r in book.requires}
        blocked = set().union(*[needs[f] for f in failed]) if failed else set()
        partial = [o for o in book.outputs if o not in blocked] if refusals else list(book.outputs)
        ledger, ledger_cause = _ledger(book, pr) if "rollouts" not in failed else (None, None)
        out.append(BookOut(book=book.id, function=book.function, verdict="will refuse" if refusals else "will compute",
                           ledger=ledger, ledger_cause=ledger_cause, still_computable=partial, refusals=refusals))
    return out


def _refusal_out(ref: Refusal, rid: str, cause: Cause) -> RefusalOut:
    return RefusalOut(code=ref.code, requirement=rid, cause=cause, detail=ref.detail, remedy=ref.remedy,
                      remedy_first=first_sentence(ref.remedy))


# ---------------------------------------------------------------- the feature basis

def _reward_names(run) -> set[str] | None:
    if "rewards" not in run.rollout_columns():
        return None
    names: set[str] = set()
    for table in run.iter_rollouts(["rewards"]):
        col = table.column("rewards").combine_chunks()
        names |= set(col.keys.unique().to_pylist())
    return names


def _feature_verdicts(basis, result: AuditOut, pr: Projection, record: dict[str, Any] | None) -> list[FeatureVerdict]:
    rewards = record["rewards"] if record else None
    units = basis.units()
    out = []
    for d in basis.defs:
        needs = basis.needs()[d.name]
        ok = [alt for alt in needs if all(f in pr.supplied and pr.supplied[f].any for f in alt)]
        common = {"name": d.name, "kind": d.kind, "unit": units[d.name], "needs": needs}
        if not ok:
            missing = [f for f in needs[0] if not (f in pr.supplied and pr.supplied[f].any)]
            cause = pr.why_missing.get(missing[0]) or Cause(
                key=None, value=None, origin="unset",
                says=_say("feature_unsupplied", subject=result.subject, field=missing[0]))
            out.append(FeatureVerdict(**common, verdict="not supported", cause=cause,
                                      says=_say("feature_needs", alternatives=needs, cause=cause.says)))
            continue
        if d.kind == "reward":
            if rewards is not None:
                if d.reward in rewards:
                    out.append(FeatureVerdict(**common, verdict="supported",
                                              says=_say("reward_in_record", reward=d.reward)))
                else:
                    cause = Cause(key="rewards", value=sorted(rewards), origin="record",
                                  says=_say("reward_not_in_record", reward=d.reward, names=sorted(rewards)))
                    out.append(FeatureVerdict(**common, verdict="not supported", cause=cause, says=cause.says))
                continue
            out.append(FeatureVerdict(**common, verdict="depends", says=_say("reward_depends", reward=d.reward)))
            continue
        if d.kind in ("ends_with_eos", "truncated") and getattr(d, "eos_token_id", None) is None:
            if record is not None and record["eos_token_id"] is None:
                cause = Cause(key="eos_token_id", value=None, origin="record", says=_say("eos_not_in_record"))
                out.append(FeatureVerdict(**common, verdict="not supported", cause=cause, says=cause.says))
                continue
            if record is None and not result.with_tap:
                out.append(FeatureVerdict(**common, verdict="depends", says=_say("eos_depends")))
                continue
        out.append(FeatureVerdict(**common, verdict="supported", says=_say("computable_from", fields=ok[0])))
    return out
