"""The report as data: one pydantic model that the Markdown, HTML and JSON views render.

``report.json`` is ``Report.model_dump_json``; its JSON Schema is exported to
``reports/report.schema.json`` by ``reward-lens publish`` (and checked current by a test).
Bump ``SCHEMA_VERSION`` on any change a consumer could notice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "2.1"


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


class FeatureOut(_M):
    name: str
    doc: str
    unit: str = Field(description="the feature's unit (shares and KL_min are in nats whatever it is)")
    status: str = Field(description="'priced', or why the feature is excluded from KL_min")


class MetricOut(_M):
    method: str
    scope: str = Field(description="'pooled' over the window, or 'per_step' (each step its own estimate)")
    n: int = Field(description="rollouts the estimate uses, over all steps")
    damping: float
    damping_stable: bool
    reading: str


class KlMinOut(_M):
    step_pair: tuple[int, int]
    kl_min: float = Field(description="nats per sequence: 1/2 dz^T G^-1 dz")
    noise_floor: float = Field(description="nats per sequence: 1/2 tr(G^-1 Sigma_dz)")
    clears_noise_floor: bool = Field(description="KL_min > floor + 2 null SD (a per-row test, no multiplicity control)")
    p_value: float = Field(description="of dz = 0 (unpaired: Hotelling T^2; paired: F-test of r on z within groups)")
    resolved: bool = Field(description="rejected by Benjamini-Hochberg at q = 0.05 across the book's rows")
    leading_feature: str | None
    shares: dict[str, float] = Field(description="nats per sequence, by feature; sums to kl_min")
    shares_inexact: bool = Field(False, description="the share sum misses kl_min by more than 1e-6 relative "
                                                    "(G ill-conditioned: see condition)")
    condition: float = Field(1.0, description="condition number of the active correlation matrix of G")


class EfficiencyOut(_M):
    step_pair: tuple[int, int] = Field(description="first and last step of the row (a window when steps > 1)")
    steps: int = Field(description="step pairs the row prices (its window)")
    status: Literal["resolved", "unresolved", "nothing_priced"]
    kl_min: float = Field(description="nats per sequence (paired: the exact I-projection on the sample)")
    kl_spent: float = Field(description="D_t, nats per sequence: the denominator of this eta")
    efficiency: float | None = Field(ge=0.0, le=1.0, description="KL_min / D_t, dimensionless; null when nothing "
                                                                 "was priced")
    efficiency_null: float | None = Field(description="what noise alone gives eta in expectation")
    efficiency_debiased: float | None = Field(description="(eta - null) / (1 - null); may be below 0")
    interval: tuple[float, float] | None = Field(description="95 % interval of efficiency_debiased")
    p_value: float | None
    source: str
    resolved: bool
    d_t_checks: dict[str, tuple[float, float | None]] = Field(
        default_factory=dict, description="D_t by source (nats per sequence, SE): same_sample, token_kl, record")
    d_t_disagrees: bool = Field(False, description="token_kl and record differ by more than 3 combined SEs")


class FeatureMeans(_M):
    step: int
    n: int
    mean: list[float]
    se: list[float]


class SampleRollout(_M):
    step: int
    prompt: str
    completion: str
    reward: float | None
    advantage: float | None


class CostSection(_M):
    features: list[FeatureOut]
    metric: MetricOut
    kl_min: list[KlMinOut]
    efficiency: list[EfficiencyOut]
    feature_means: list[FeatureMeans]
    summary: dict[str, float | int | str | list[float] | None] = Field(description=(
        "ledger ('paired' | 'unpaired'), window, rows_total, rows_resolved, rows_unresolved, rows_refused, "
        "rows_nothing_priced, eta_median (debiased, resolved rows only; null when none), eta_interval ([lo, hi] or "
        "null), false_discoveries_expected, and the KL_min half's counts"))
    still_works: str | None = Field(description="what part of the book is readable despite its refusals")


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
    cost: CostSection | None = None


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
    books: list[BookOut]
    samples: list[SampleRollout]

    @property
    def refusals(self) -> list[RefusalOut]:
        return [r for b in self.books for r in b.refusals]
