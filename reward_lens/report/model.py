"""The report as data: one pydantic model that the Markdown, HTML and JSON views render.

``report.json`` is ``Report.model_dump_json``; its JSON Schema is exported to
``reports/report.schema.json`` by ``reward-lens publish`` (and checked current by a test).
Bump ``SCHEMA_VERSION`` on any change a consumer could notice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, WithJsonSchema

from reward_lens.measure.figures import FigureOut

SCHEMA_VERSION = "5.0"


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
    card: str | None = Field(None, description="what this book adds to the report's summary card")
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


class BasisOut(_M):
    """The feature basis every book of the report was computed in: its id is the join key
    (results in different bases are never compared or combined)."""

    id: str = Field(description="'basis:' + 12 hex digits of the canonical definitions")
    name: str | None
    source: str
    features: list[BasisFeature]


class Report(_M):
    schema_version: str = SCHEMA_VERSION
    generator: str
    run: RunSummary
    basis: BasisOut
    card: list[str] = Field(default_factory=list, description=(
        "the summary card: what the run bought, what it spent on collateral, what could not be computed and "
        "the one change that would compute it"))
    curves: list[FigureOut] = Field(default_factory=list, exclude=True)
    browser: list[BrowserRow] = Field(default_factory=list, exclude=True, description=(
        "a spread of rollouts for the HTML rollout browser (at most BROWSER_STEPS steps x BROWSER_PER_STEP)"))
    books: list[BookOut]
    samples: list[SampleRollout]

    @property
    def refusals(self) -> list[RefusalOut]:
        return [r for b in self.books for r in b.refusals]
