"""Pydantic models of the specs. Parsing lives here; evaluation lives in the resolver."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Constraints(_Strict):
    required: bool = False
    nonnegative: bool = False
    finite: bool = False
    maximum: float | None = None
    maximum_why: str | None = None


class FrameworkEntry(_Strict):
    """How one framework supplies a field: a logged key, a config value, a derivation, or why not."""

    key: str | None = None
    config: str | None = None
    derived: str | None = None
    absent: str | None = None
    note: str | None = None
    nan: str | None = None  # a NaN logged under this key is "not measured" (said why), not a diverged value


class FieldSpec(_Strict):
    name: str = ""
    source: Literal["telemetry", "rollouts", "manifest", "caller"]
    dtype: str
    unit: str
    meaning: str
    constraints: Constraints = Constraints()
    companion: str | None = None
    frameworks: dict[str, FrameworkEntry] = Field(default_factory=dict)

    @property
    def column(self) -> str:
        """The column name inside its Parquet file (``rollout.step`` -> ``step``)."""
        return self.name.split(".", 1)[1] if "." in self.name else self.name


class Magnitude(_Strict):
    """The largest absolute value any number in a record may have, and why."""

    limit: float = Field(gt=0)
    why: str


class LoggedKey(_Strict):
    """A key a framework logs that fills no record field (or fills one only in part): what it
    means, since which version, why the record does not keep it, and what a NaN of it means where
    that is not the run diverging. A key ending in ``*`` names every key with that prefix."""

    meaning: str
    why_not: str
    versions: str | None = None
    nan: str | None = None  # a NaN of this key is "not measured" (said why), not a diverged value


class FieldsCatalog(_Strict):
    format_version: int
    units: dict[str, str]
    magnitude: Magnitude | None = None
    fields: dict[str, FieldSpec]
    # framework -> key (or prefix*) -> meaning: what a framework logs that the record keeps no field of
    logged_keys: dict[str, dict[str, LoggedKey]] = Field(default_factory=dict)

    def logged_key(self, framework: str, key: str) -> LoggedKey | None:
        """The catalogue entry of ``key`` (exact, else the longest ``prefix*`` that matches)."""
        keys = self.logged_keys.get(framework, {})
        if key in keys:
            return keys[key]
        best = max((k for k in keys if k.endswith("*") and key.startswith(k[:-1])), key=len, default=None)
        return keys[best] if best is not None else None

    def by_source(self, source: str) -> dict[str, FieldSpec]:
        return {n: f for n, f in self.fields.items() if f.source == source}

    def framework_keys(self, framework: str) -> dict[str, str]:
        """``{framework log key: record field}`` for the keys a framework logs."""
        out: dict[str, str] = {}
        for name, spec in self.fields.items():
            entry = spec.frameworks.get(framework)
            if entry is not None and entry.key is not None:
                out[entry.key] = name
        return out


class Alternative(_Strict):
    id: str
    fields: list[str]
    describe: str | None = None


class NearMiss(_Strict):
    field: str
    gives_denominator: bool = False
    why: str
    only_for_optimizers: list[str] | None = None


class Requirement(_Strict):
    id: str
    what: str
    symbol: str | None = None
    unit: str | None = None
    needed_by: list[str] | None = None
    alternatives: list[Alternative] = Field(min_length=1)
    near_misses: list[NearMiss] = Field(default_factory=list)


class Output(_Strict):
    unit: str
    meaning: str
    needs_denominator: bool = False


class EnvelopeBound(_Strict):
    min: float | None = None
    max: float | None = None
    on_violation: str


class Basis(_Strict):
    rule: str
    on_mismatch: str


class LedgerSpec(_Strict):
    """A way to estimate a book's feature movement, and the record fields it needs (in order
    of preference: the first whose fields a record supplies on every step is used)."""

    id: str
    fields: list[str]
    why: str


class BookReport(_Strict):
    """How a book appears in a report: the function that builds its section from a run
    context, the pydantic model of its data, its templates, and its place on the page."""

    builder: str = Field(pattern=r"^[\w.]+:\w+$")
    model: str = Field(pattern=r"^[\w.]+:\w+$")
    md: str
    html: str
    order: int = 0  # place of the section on the page
    # the books whose results the builder reads (``ctx.result``): built before it; the books
    # that need none of each other are built at once, on threads (``RunContext.results``)
    needs: list[str] = Field(default_factory=list)


class BookSpec(_Strict):
    id: str
    function: str
    title: str
    series: str
    section: str
    module: str
    outputs: dict[str, Output]
    basis: Basis | None = None
    envelope: dict[str, EnvelopeBound] = Field(default_factory=dict)
    requires: list[Requirement]
    ledgers: list[LedgerSpec] = Field(default_factory=list)
    refusals: dict[str, str]
    report: BookReport | None = None

    def requirement(self, rid: str) -> Requirement:
        for req in self.requires:
            if req.id == rid:
                return req
        raise KeyError(f"book `{self.id}` has no requirement `{rid}`")


class RefusalCodeSpec(_Strict):
    title: str
    meaning: str
    severity: Literal["refused", "violated"]


class RefusalCatalog(_Strict):
    codes: dict[str, RefusalCodeSpec]


class Condition(_Strict):
    key: str
    op: Literal["eq", "ne", "gt", "lt", "set", "unset"]
    value: Any = None


class Supply(_Strict):
    fields: list[str]
    when: Condition | list[Condition] | None = None  # a list: all must hold
    # "all": logged at each logging step; "last_step": only the window's last step's data;
    # "config": a configuration value, in force on every step whatever the window.
    # "every_step": written on every optimizer step whatever the window (the tap).
    per_window: Literal["all", "last_step", "config", "every_step"] = "all"
    why: str


class Reject(_Strict):
    """A configuration the framework refuses to start with, or (in a tap's spec) the tap refuses to attach to."""

    when: Condition | list[Condition]  # a list: all must hold; the first names the key
    why: str


class Setting(_Strict):
    """A configuration key whose value the audit states, with what it means for a record."""

    key: str
    says: str  # a template: {value} is the key's value, {origin} says where it came from
    when: Condition | list[Condition] | None = None  # a list: all must hold
    # Record fields the statement is about: when a tap supplies them all, the statement says so.
    about: list[str] = Field(default_factory=list)


class PromptGroups(_Strict):
    """How many prompt groups one generation batch holds, per process, from a config:
    ``batch`` x the first of ``steps`` that is set, divided by ``generations`` (TRL, which counts
    completions); or ``prompts``, a key that counts the prompts of a step itself (veRL's
    ``data.train_batch_size``). ``generations`` is the completions per prompt group. A ledger
    named in ``blocks`` needs at least ``minimum`` of them."""

    batch: str | None = None
    steps: list[str] = []
    prompts: str | None = None
    generations: str
    minimum: int = 2
    blocks: list[str]
    why: str

    @model_validator(mode="after")
    def _one_count(self):
        if (self.batch is None) == (self.prompts is None):
            raise ValueError("prompt_groups: give `batch` (completions, with `steps`) or `prompts`, one of them")
        return self


class ArgType(_Strict):
    """The type of one configuration argument, as the framework's own argument parser reads it
    (numbers may come as strings, as from a YAML file): ``int`` a whole number, ``number`` a
    finite number, ``steps_or_ratio`` a whole number >= 1 or a ratio in (0, 1) (transformers'
    ``logging_steps``), ``numbers`` a list of finite numbers, ``bool``, ``string``,
    ``string_or_bool``. Null always means "not set"."""

    type: Literal["int", "number", "steps_or_ratio", "numbers", "bool", "string", "string_or_bool"]
    minimum: float | None = None
    maximum: float | None = None


class FrameworkSpec(_Strict):
    """What a framework's training configuration makes the trainer log (specs/frameworks/)."""

    framework: str
    title: str
    name: str  # how prose names it ("TRL", "veRL", "tap")
    detect: list[str]
    defaults: dict[str, Any] = Field(default_factory=dict)
    window_key: str | None = None
    steps_key: str | None = None  # the key that sets the run's number of optimizer steps
    record_config: list[str] = Field(default_factory=list)
    # The arguments reward-lens reads, typed: one model built from this validates a config for
    # the audit and the importer alike (reward_lens.record.importers.validate_config).
    types: dict[str, ArgType] = Field(default_factory=dict)
    supplies: list[Supply]
    never: dict[str, str] = Field(default_factory=dict)
    rejects: list[Reject] = Field(default_factory=list)
    # Keys whose value the audit states when the config sets them (or the default applies).
    settings: list[Setting] = Field(default_factory=list)
    prompt_groups: PromptGroups | None = None
    # For a tap: the config section that holds its arguments, and the framework it taps.
    section: str | None = None
    taps: str | None = None


class FindingSpec(_Strict):
    """One finding (``specs/findings/<id>.yaml``): a question about the run's health, the record
    fields and book outputs it reads, a named predicate with its parameters, the evidence it
    cites and a remedy, both Jinja templates over the predicate's evidence."""

    id: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    title: str
    question: str
    severity: Literal["info", "warn", "critical"]
    inputs: list[list[str]] = Field(min_length=1, description=(
        "alternatives: the finding is evaluated when every field of one of them is present on the record"))
    books: list[str] = Field(default_factory=list, description="books whose output it reads (each must compute)")
    live: bool = Field(False, description="evaluable from the steps so far, by the tap while training")
    needs_target: bool = Field(False, description="reads the declared targets of the feature basis (a feature with "
                                                  "`target:`); without one it is not evaluated")
    predicate: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    params: dict[str, float | int | str | bool] = Field(default_factory=dict)
    evidence: str
    needs: str | None = Field(None, description=(
        "Jinja over the predicate's evidence: what would let it judge, where it cannot (too few steps, a number "
        "not resolved from noise); the finding is then *not evaluated*, never clear. A `min_steps` parameter "
        "is the fewest steps of its inputs it judges on, which the audit checks against a config's run length"))
    remedy: str
    reference: str | None = None
    validated: str = Field(description="how the finding was validated, in words (the docs' table)")


class ImporterSpec(_Strict):
    """What ``reward-lens import <name>`` reads and where a run of that framework leaves it
    (``specs/importers.yaml``): the words of ``import <name> --help``."""

    title: str
    name: str | None = Field(None, description="the framework's name as its users write it (a finding's evidence)")
    source: str = Field(description="what the SOURCE argument is")
    reads: list[str] = Field(min_length=1, description="each file or key read, and what it becomes")
    where: str = Field(description="where a run leaves it, and what to switch on for it")
    options: list[str] = Field(default_factory=list, description="the import options this framework reads")


class ImportersCatalog(_Strict):
    importers: dict[str, ImporterSpec]
