"""``reward-lens audit``: before training, which books will a logging setup support?

A configuration (TRL GRPOConfig arguments, a veRL Hydra config, or a reward-lens manifest)
is projected onto record fields through ``specs/frameworks/<framework>.yaml``; the
projection goes to the same resolver and the same refusal templates that
``reward-lens report`` uses on a finished record. No second list of rules lives here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from reward_lens.measure.efficiency.cost import denominator_context, rollouts_context
from reward_lens.record.errors import RecordError
from reward_lens.record.importers import whole_number
from reward_lens_spec.yamlload import YamlTooLarge, safe_load_bounded
from reward_lens_spec import Presence, Refusal, Subject, load_books, load_frameworks, make_refusal, resolve
from reward_lens_spec.models import Condition, FrameworkSpec

# Steps assumed for a projection when the config does not say (only ratios matter).
NOMINAL_STEPS = 1000


@dataclass
class BookVerdict:
    book: str
    function: str
    verdict: str  # "will compute" | "will refuse"
    partial: list[str]
    refusals: list[Refusal]


@dataclass
class AuditResult:
    source: str
    kind: str
    framework: str
    notes: list[str] = field(default_factory=list)
    supplied: dict[str, Presence] = field(default_factory=dict)
    books: list[BookVerdict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "kind": self.kind, "framework": self.framework, "notes": self.notes,
            "fields": {k: {"steps_present": v.count, "steps_total": v.of} for k, v in sorted(self.supplied.items())},
            "books": [{"book": b.book, "function": b.function, "verdict": b.verdict, "still_computable": b.partial,
                       "refusals": [json.loads(r.model_dump_json()) for r in b.refusals]} for b in self.books],
        }


def _get(cfg: dict[str, Any], dotted: str, defaults: dict[str, Any]) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return defaults.get(dotted)
        node = node[part]
    return node


def _holds(cond: Condition, cfg: dict[str, Any], defaults: dict[str, Any]) -> bool:
    v = _get(cfg, cond.key, defaults)
    if cond.op == "set":
        return v not in (None, "", False)
    if cond.op == "eq":
        return v == cond.value
    if cond.op == "ne":
        return v != cond.value
    try:
        return v is not None and float(v) > float(cond.value)
    except (TypeError, ValueError):
        return False


def _keys(cfg: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in cfg.items():
        out.add(prefix + str(k))
        if isinstance(v, dict):
            out |= _keys(v, prefix + str(k) + ".")
    return out


def project(spec: FrameworkSpec, cfg: dict[str, Any], where: str | Path = "config"
            ) -> tuple[dict[str, Presence], list[str], int]:
    """Record fields this config will supply, with presence over a nominal run. ``where``
    names the file in errors about a value of the wrong type."""
    d = spec.defaults
    raw_steps = _get(cfg, "max_steps", d)
    steps = 0 if raw_steps in (None, -1) else whole_number(raw_steps, where, "max_steps")
    steps = steps if steps > 0 else NOMINAL_STEPS
    notes = []
    raw_window = _get(cfg, spec.window_key, d) if spec.window_key else None
    if raw_window is None:
        window = 1
    elif isinstance(raw_window, float) and 0 < raw_window < 1:
        # transformers reads a logging_steps below 1 as a ratio of the total training steps
        window = max(1, math.ceil(raw_window * steps))
        notes.append(f"`{spec.window_key}` = {raw_window:g} is a ratio of the run's steps: every {window} steps "
                     f"of {steps}")
    else:
        window = whole_number(raw_window, where, spec.window_key, minimum=1)
    if window > 1:
        notes.append(f"`{spec.window_key}` = {window}: telemetry will be means over {window}-step windows, "
                     "not per-step values")
    logged = math.ceil(steps / window)
    supplied: dict[str, Presence] = {}
    for sup in spec.supplies:
        if sup.when is not None and not _holds(sup.when, cfg, d):
            continue
        for f in sup.fields:
            supplied[f] = Presence(steps, steps) if sup.per_window == "config" else Presence(logged, steps)
    for f, why in sorted(spec.never.items()):
        notes.append(f"`{f}` will be absent: {why}")
    return supplied, notes, window


def load_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else safe_load_bounded(text)
    except FileNotFoundError:
        raise RecordError(path, "no such file") from None
    except IsADirectoryError:
        raise RecordError(path, "is a directory: audit a record through its manifest.json") from None
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise RecordError(path, f"not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({msg})") from None
    except YamlTooLarge as exc:
        raise RecordError(path, str(exc)) from None
    except RecursionError:
        raise RecordError(path, "nested too deeply to be a configuration") from None
    if not isinstance(data, dict):
        raise RecordError(path, "a configuration must be a mapping")
    return data


def audit(path: str | Path, framework: str | None = None) -> AuditResult:
    path = Path(path)
    cfg = load_config(path)
    frameworks = load_frameworks()
    kind = "config"
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
    supplied, notes, window = project(spec, cfg, path)
    optimizer = _get(cfg, "optim", spec.defaults)
    beta = _get(cfg, "beta", spec.defaults)
    result = AuditResult(str(path), kind, framework, notes, supplied)
    result.books = _verdicts(supplied, optimizer=str(optimizer) if optimizer else None,
                             betas=[float(beta)] if isinstance(beta, (int, float)) else [],
                             framework=framework, window=window)
    return result


def _audit_manifest(path: Path, cfg: dict[str, Any], frameworks: dict[str, FrameworkSpec]) -> AuditResult:
    from reward_lens.record.reader import open_run

    if (path.parent / "telemetry.parquet").is_file():
        run = open_run(path.parent)
        supplied = run.fields()
        betas = sorted(set(run.telemetry_column("beta").values()))
        res = AuditResult(str(path), "record", run.manifest.framework.name, list(run.manifest.notes), supplied)
        res.books = _verdicts(supplied, optimizer=run.manifest.optimizer, betas=betas,
                              framework=run.manifest.framework.name, window=run.manifest.logging_steps)
        return res
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
    supplied, notes, window = project(frameworks[fw], cfg.get("trainer_config") or {}, path)
    res = AuditResult(str(path), "manifest", fw, notes, supplied)
    beta = (cfg.get("trainer_config") or {}).get("beta")
    res.books = _verdicts(supplied, optimizer=cfg.get("optimizer"), betas=[float(beta)] if beta is not None else [],
                          framework=fw, window=window)
    return res


def _verdicts(supplied: dict[str, Presence], *, optimizer: str | None, betas: list[float], framework: str,
              window: int) -> list[BookVerdict]:
    out = []
    for book in load_books().values():
        resolution = resolve(book, supplied, optimizer=optimizer)
        refusals = []
        for st in resolution.requirements:
            if st.satisfied_by is not None:
                continue
            if st.requirement.id == "rollouts":
                ctx = rollouts_context(run_label="(planned run)", steps_with_rollouts=None, steps=None,
                                       logging_steps=window, framework=framework, audit=True)
            else:
                ctx = denominator_context(resolution, run_label="(planned run)", n_missing=None, n_total=None,
                                          optimizer=optimizer, betas=betas, framework=framework, audit=True)
            refusals.append(make_refusal("RECORD_INCOMPLETE", book, Subject(run_id=None), ctx))
        # What stays computable: outputs that do not need a failed requirement.
        failed = {st.requirement.id for st in resolution.requirements if st.satisfied_by is None}
        needs = {r.id: set(r.needed_by or book.outputs) for r in book.requires}
        blocked = set().union(*[needs[f] for f in failed]) if failed else set()
        partial = [o for o in book.outputs if o not in blocked] if refusals else []
        out.append(BookVerdict(book.id, book.function, "will refuse" if refusals else "will compute", partial, refusals))
    return out
