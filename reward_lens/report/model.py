"""The report as data: one pydantic model that the Markdown, HTML and JSON views render.

``report.json`` is ``Report.model_dump_json``; its JSON Schema is exported to
``reports/report.schema.json`` by ``reward-lens publish`` (and checked current by a test).
Bump ``SCHEMA_VERSION`` on any change a consumer could notice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, WithJsonSchema

from reward_lens.findings import FindingOut
from reward_lens.measure.efficiency.section import EtaHeadlineOut
from reward_lens.measure.figures import FigureOut

SCHEMA_VERSION = "7.5"


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FieldPresence(_M):
    field: str
    unit: str
    steps_present: int
    steps_total: int


class RunSummary(_M):
    run_id: str
    framework: str
    framework_version: str | None
    model: str
    n_parameters: int | None
    optimizer: str | None
    steps: int
    first_step: int | None
    last_step: int | None
    rollouts: int
    rollouts_per_step: float | None = Field(description="mean rollouts per step that has rollouts")
    telemetry_per_step: bool
    fields: list[FieldPresence]
    notes: list[str]


class RefusalOut(_M):
    code: str
    severity: Literal["refused", "violated"]
    title: str
    book: str
    function: str
    run_id: str | None
    step_pairs: list[tuple[int, int]]
    detail: str
    remedy: str
    context: dict


class SampleRollout(_M):
    step: int
    prompt: str
    completion: str
    reward: float | None
    advantage: float | None


class BrowserRow(_M):
    step: int
    prompt: str
    completion: str
    reward: float | None
    advantage: float | None
    features: dict[str, float]


class BookOut(_M):
    id: str
    title: str
    series: str
    section: str
    function: str
    status: Literal["computed", "unresolved", "partial", "refused"] = Field(description=(
        "computed: numbers with no refusal and at least one resolved row; unresolved: numbers, none resolved "
        "from noise; partial: numbers and refusals; refused: no numbers"))
    headline: str | None = Field(None, description="one line: what the book says, or why it says nothing")
    refusals: list[RefusalOut]
    # A report built from a record holds the section model itself (templates read it, and
    # report.json serialises it, without a dump to dicts: 0.45 s at 10,000 steps); a report
    # read back from report.json holds the dict.
    data: Annotated[dict[str, Any] | SerializeAsAny[BaseModel] | None, WithJsonSchema(
        {"anyOf": [{"additionalProperties": True, "type": "object"}, {"type": "null"}]})] = Field(None, description=(
        "the book's own section, in the model its spec names under report.model (its schema: "
        "specs/schemas/books/<book>.schema.json)"))
    figures: list[FigureOut] = Field(default_factory=list, exclude=True)

    def data_dict(self) -> dict[str, Any] | None:
        """``data`` as it reads in report.json."""
        return self.data.model_dump(mode="json") if isinstance(self.data, BaseModel) else self.data

    def typed(self) -> BaseModel | None:
        """``data`` as the typed model the book's spec names (``report.model``)."""
        if self.data is None:
            return None
        if isinstance(self.data, BaseModel):
            return self.data
        from reward_lens.measure.books import import_object
        from reward_lens_spec import load_book

        return import_object(load_book(self.id).report.model).model_validate(self.data)


class BasisFeature(_M):
    name: str
    kind: str
    unit: str
    meaning: str
    target: Literal["higher", "lower"] | None = Field(None, description="a declared target: what the user wants "
                                                                        "of this behaviour (measure/ledger/basis.py)")


class BasisOut(_M):
    """The feature basis every book of the report was computed in: its id is the join key
    (results in different bases are never compared or combined)."""

    id: str = Field(description="'basis:' + 12 hex digits of the canonical definitions")
    name: str | None
    source: str
    features: list[BasisFeature]


class Share(_M):
    feature: str
    share: float = Field(description="fraction of KL_min over the resolved updates (0..1)")


class TargetLine(_M):
    """A declared target's own verdict on the first screen (measure.decisions.target_verdict_of)."""

    feature: str
    want: Literal["higher", "lower"]
    key: str = Field(description="one of measure.decisions.TARGET_VERDICTS")
    words: str
    wrong: bool = Field(description="moved, or is selected, against what the user wants")


class Glance(_M):
    """The first screen's numbers, taken once from the run's decisions and the books: every
    sentence of the summary card and every number on the first screen is one of these."""

    ledger: str = Field(description="'paired' | 'unpaired' | 'none'")
    ledger_fallback: str | None = Field(None, description="why the paired ledger could not form, where --ledger "
                                                          "auto used the unpaired one instead")
    features: int = Field(description="behaviours in the basis")
    updates: int = Field(description="step pairs (one optimizer update each) with a ledger or a refusal")
    usable: int
    refused: int
    refused_reasons: list[tuple[str, int]] = Field(description="(reason in words, updates)")
    priced: int = Field(description="updates whose KL_min is computed")
    resolved: int = Field(description="updates whose movement is resolved from noise")
    d_t_updates: int = Field(0, description="usable updates with a D_t: what d_t_total is over, in every basis")
    d_t_median: float | None = Field(description="median D_t over those updates, nats per sequence")
    d_t_total: float | None = Field(description="sum of D_t over those updates, nats per sequence: the run's spend, "
                                                "the same in every basis and on every page")
    eta_rows: int = Field(description="updates (or windows) in the run-level efficiency")
    eta_updates: int = Field(0, description="updates those rows cover: of the d_t_updates, those at which a named "
                                            "behaviour varies within prompt groups (KL_min is priced) and the row is "
                                            "not refused")
    eta_d_t: float | None = Field(None, description="sum of D_t over those updates: eta_run's denominator")
    kl_min_total: float | None = Field(description="sum of KL_min (debiased) over those rows")
    eta_run: float | None = Field(description="kl_min_total / eta_d_t: the fraction of the divergence the "
                                              "named behaviours required")
    eta_run_interval: tuple[float, float] | None
    eta_headline: EtaHeadlineOut | None = Field(None, description=(
        "what leads eta: single updates, or, where their intervals are too wide, windows of consecutive updates "
        "pooled until precise enough to resolve the run's eta (measure.decisions.headline_of); the run-level "
        "eta above stays"))
    shares: list[Share] = Field(description="over the resolved updates, largest first")
    reward_change: float | None = Field(description="total reward change over the updates with D_t")
    reward_per_nat: float | None
    reward_per_nat_se: float | None
    reward_resolved: bool
    moved: list[str] = Field(description="behaviours whose drift over the run is resolved")
    verdicts: dict[str, list[str]] = Field(description=(
        "each behaviour's verdict (measure/decisions.py), by key (measure.decisions.VERDICTS) -> behaviours"))
    asked_directly: list[str] = Field(default_factory=list, description="behaviours the reward asked for directly")
    asked_jointly: list[list[str]] = Field(default_factory=list, description=(
        "groups of behaviours the reward asked for jointly: too collinear within prompt groups to tell apart"))
    targets_declared: list[str] = Field(default_factory=list, description=(
        "the declared targets of the basis (what the user wants); none: the gaming checks are off"))
    targets: list[TargetLine] = Field(default_factory=list, description="each declared target's own verdict, "
                                                                        "the wrong-way ones first")
    no_net_change: list[Share] = Field(default_factory=list, description=(
        "of the shares the first screen states, those of behaviours with no net change over the run resolved "
        "from noise (a share counts movement update by update, in either direction)"))


class Report(_M):
    schema_version: str = SCHEMA_VERSION
    generator: str
    run: RunSummary
    basis: BasisOut
    glance: Glance | None = Field(None, description="the first screen's numbers (null when no book has any)")
    card: list[str] = Field(default_factory=list, description=(
        "the summary card, one sentence per entry, rendered from ``glance``: what each update spent, what the "
        "named behaviours required, on which, what the reward asked for and got, and what was not read"))
    findings: list[FindingOut] = Field(default_factory=list, description=(
        "the run's health (specs/findings/): each finding holds, is clear, or is not evaluated (naming what "
        "would enable it); they lead the first screen"))
    findings_counts: dict[str, int] = Field(default_factory=dict, description=(
        "checked, holds, clear, not_evaluated, and holds by severity: counted once, here"))
    headline_figure: FigureOut | None = Field(None, exclude=True)
    curves: list[FigureOut] = Field(default_factory=list, exclude=True)
    browser: list[BrowserRow] = Field(default_factory=list, exclude=True, description=(
        "a spread of rollouts for the HTML rollout browser (at most BROWSER_STEPS steps x BROWSER_PER_STEP)"))
    books: list[BookOut]
    samples: list[SampleRollout]

    @property
    def refusals(self) -> list[RefusalOut]:
        return [r for b in self.books for r in b.refusals]
