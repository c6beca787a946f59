"""The record's data model: pydantic rows and the Arrow schemas they are stored with.

Units and meanings are declared once, in ``specs/fields.yaml``; this module holds the
shapes. A test keeps the two in step: every telemetry/rollout field here is in the spec
with the same type, and vice versa. Every optional field may be absent, and absent is
stored as null: not zero, not NaN.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from reward_lens_spec import load_fields

FORMAT_VERSION = 1
TELEMETRY_FILE = "telemetry.parquet"
ROLLOUTS_FILE = "rollouts.parquet"
# Held-out completions of pi_t (the tap's ``heldout``): never in the loss, scored under pi_t and
# pi_{t+1} after the step, rows of the rollouts schema filed under the step whose prompts they
# answer (t+1), kept apart from the rollouts so that nothing reading rollouts ever mixes them in.
HELDOUT_FILE = "heldout.parquet"
# Completions of a validation set's prompts that the trainer drew to validate pi_step (veRL's
# `trainer.validation_data_dir`, `0.jsonl` being pi_0's): other prompts than the run trained on,
# no log-probabilities, never in the loss. Rows of the rollouts schema filed under the policy that
# drew them (step s: pi_s, after s updates), kept apart from both the rollouts and the held-out
# draws, whose prompts are the step's own (the paired ledger must never read these as those).
VALIDATION_FILE = "validation.parquet"
MANIFEST_FILE = "manifest.json"
_TELEMETRY_VERSIONED = re.compile(r"^telemetry-(\d{5})\.parquet$")


# Estimators of kl_to_previous that read along the rollouts the step trained on (taps before
# schema 6): in-sample, inflated by the update (0.36-11x the truth on the task recipe). The
# reader keeps their values in the file but never hands them out as D_t.
IN_SAMPLE_ESTIMATORS = frozenset({"rollout", "rollout_stale", "rollout_teacher_forced"})
# The telemetry fields that are D_t or describe it, withheld at in-sample steps.
D_T_FIELDS = ("kl_to_previous", "kl_to_previous_se")
# The least share of the step pairs a tap's cost budget measures at its smallest sample (2 + 2
# completions per group, or one-sided), whatever the allowance: reward_lens/taps/budget.py says
# why; here so that the report, which reads records and not taps, can name it. The floor is a
# spend, not a count (``tap_floor``): a pair of k + k completions costs k / 2 of a 2 + 2 one.
TAP_MIN_SHARE = 0.25
# The fewest completions per group and side of a two-sided measurement (one row per side has no
# within-group information: the paired ledger drops such groups).
TAP_MIN_PER_GROUP = 2


def tap_floor(per_group: int | float | None) -> float:
    """The floor's probability for pairs measured at ``per_group`` completions per group and
    policy (0 or None: one-sided): ``TAP_MIN_SHARE`` of the pairs at 2 + 2 or one-sided, and the
    same spend at more, ``TAP_MIN_SHARE * 2 / k`` (an eighth of the pairs at 4 + 4). A pair
    planned at the floor records it as its ``tap_probability``."""
    k = float(per_group or 0)
    return TAP_MIN_SHARE * TAP_MIN_PER_GROUP / k if k > TAP_MIN_PER_GROUP else TAP_MIN_SHARE


def telemetry_name(name: str) -> bool:
    """``telemetry.parquet`` (a record written at once) or ``telemetry-NNNNN.parquet`` (the
    one a streamed record's manifest lists)."""
    return name == TELEMETRY_FILE or bool(_TELEMETRY_VERSIONED.match(name))


class OptimizerTelemetry(BaseModel):
    """One optimizer step t (pi_t -> pi_{t+1}). Units: specs/fields.yaml."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="optimizer_step: 0-based index t")
    learning_rate: float | None = Field(None, description="dimensionless: the rate this step used")
    grad_norm: float | None = Field(None, description="l2_norm: gradient applied, after clipping")
    grad_norm_unclipped: float | None = Field(None, description="l2_norm: before clipping")
    max_grad_norm: float | None = Field(None, description="l2_norm: clipping threshold")
    update_norm: float | None = Field(None, description="l2_norm: ||theta_{t+1} - theta_t||")
    kl_to_previous: float | None = Field(None, description="nats_per_sequence: D_t = KL(pi_{t+1} || pi_t)")
    kl_to_previous_estimator: str | None = Field(None, description="which estimator produced kl_to_previous")
    kl_to_previous_se: float | None = Field(None, description="nats_per_sequence: standard error of kl_to_previous")
    kl_to_ref: float | None = Field(None, description="nats_per_token: KL to the reference model")
    entropy: float | None = Field(None, description="nats_per_token: pi_t's token entropy along its own rollouts")
    reward_mean: float | None = Field(None, description="reward_units: mean total reward of the step's rollouts")
    frac_reward_zero_std: float | None = Field(None, description="share of prompt groups with zero reward spread")
    ppo_kl: float | None = Field(None, description="nats_per_token: in-loop k1 KL(pi_old || pi_theta)")
    beta: float | None = Field(None, description="dimensionless: KL-to-reference coefficient")
    # the engine-trainer mismatch as a framework logs it (specs/fields.yaml: each labelled with what it is)
    sampler_logp_diff_mean: float | None = Field(None, description="nats_per_token: mean |log pi_t - log pi_sampler|")
    sampler_logp_diff_max: float | None = Field(None, description="nats_per_token: largest |log pi_t - log pi_sampler|")
    sampler_is_ratio_min: float | None = Field(None, description="dimensionless: smallest applied pi_t / pi_sampler")
    sampler_is_ratio_mean: float | None = Field(None, description="dimensionless: mean applied pi_t / pi_sampler")
    sampler_is_ratio_max: float | None = Field(None, description="dimensionless: largest applied pi_t / pi_sampler")
    sampler_kl_token: float | None = Field(None, description="nats_per_token: estimate of KL(pi_sampler || pi_t)")
    sampler_kl_token_estimator: str | None = Field(None, description="which estimator gave sampler_kl_token (k1, k3)")
    sampler_kl_token_k1: float | None = Field(None, description="nats_per_token: k1 estimate beside a k3 sampler_kl_token")
    sampler_token_prob_error: float | None = Field(None, description="dimensionless: mean exp|log-ratio| per token")
    sampler_prob_diff_mean: float | None = Field(None, description="dimensionless: mean |p_t - p_sampler| per token")
    sampler_prob_diff_max: float | None = Field(None, description="dimensionless: largest |p_t - p_sampler| of a token")
    sampler_prob_diff_std: float | None = Field(None, description="dimensionless: spread of |p_t - p_sampler| per token")
    validation_reward_mean: float | None = Field(None, description="reward_units: mean reward of pi_t's validation rollouts")
    # what the tap measured of the step pair (t, next generation) under its cost budget, and what it cost
    tap_budget: float | None = Field(None, description="dimensionless: the tap's budget, a fraction of an untapped step")
    tap_groups: int | None = Field(None, ge=0, description="count: prompt groups measured for the step pair (t, next)")
    tap_groups_total: int | None = Field(None, ge=0, description="count: prompt groups the generation had")
    tap_per_group: int | None = Field(None, ge=0, description="count: completions per group and policy (0: one-sided)")
    tap_probability: float | None = Field(None, description="dimensionless: probability the pair was measured")
    tap_seconds: float | None = Field(None, ge=0, description="seconds: the tap's time inside this step")
    step_seconds: float | None = Field(None, ge=0, description="seconds: this step's wall time, the tap's included")


class Rollout(BaseModel):
    """One completion sampled from pi_step."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    group_id: str
    prompt: str
    completion: str
    completion_ids: list[int] | None = None
    num_tokens: int | None = Field(None, ge=0)
    reward: float | None = None
    rewards: dict[str, float] | None = None
    advantage: float | None = None
    logp_pre: float | None = None
    logp_post: float | None = None  # in-sample: never used for r-based estimates
    logp_prev: float | None = None
    logp_prev_step: int | None = Field(None, ge=0)
    kl_prev: float | None = Field(None, ge=0)
    # log-probability of the completion under the distribution that sampled it, where that is
    # not the policy itself (an inference engine such as vLLM: TRL's sampling_per_token_logps,
    # summed); the paired ledger compares it with logp_pre
    logp_sampler: float | None = None
    # held-out rows only: the step whose policy drew the completion -- logp_prev_step (pi_t: the
    # step pair's side a) or the row's own step (pi_{t+1}: side b, drawn beside the generation that
    # the step's rollouts came from, never trained on); null in records of earlier taps: pi_t's
    drawn_by_step: int | None = Field(None, ge=0)
    # the score of each declared target the reward does not pay for (a held-out check, the
    # manifest's ``targets`` with ``of: check``), by the target's name
    targets: dict[str, float] | None = None


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str
    bytes: int
    rows: int | None = None


class FrameworkInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    version: str | None = None


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str
    architecture: str | None = None
    n_parameters: int | None = None
    vocab_size: int | None = None
    eos_token_id: int | None = None


class CheckpointEntry(BaseModel):
    """A policy checkpoint stored with the record: pi_step, as safetensors + config."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    path: str
    files: dict[str, FileEntry]


class NonFiniteValue(BaseModel):
    """A value the run produced that was not a finite number (a diverged step's NaN loss, an
    infinite reward): data about the run, not a broken file. The record stores the field as
    null at that step and keeps here what it was and where it came from, so a finding can say
    the run diverged from that step (ARCHITECTURE.md: the record layer is the ground floor)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="the step whose value it was")
    field: str = Field(description="the record field it would have filled (specs/fields.yaml), or the "
                                   "framework's own key where the record has no such field")
    value: str = Field(pattern=r"^(nan|\+inf|-inf)$", description="what it was: nan, +inf or -inf")
    source: str = Field(description="where it was read: a file and line, a key, or the tap's call")


TARGET_NAME = r"^[A-Za-z_][A-Za-z0-9_.]*$"


class TargetDecl(BaseModel):
    """What the user wants of the policy, as opposed to what the reward pays for: a reward
    function, a feature of the basis, or a check the reward does not pay for, and the direction
    wanted. Declared where the user already is (the tap's ``target=``, ``--target``); the
    findings that tell gaming from learning read it (specs/fields.yaml: ``targets``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TARGET_NAME, description="the name findings cite")
    want: Literal["higher", "lower"] = Field(description="more of it (higher) or less (lower)")
    of: Literal["reward", "feature", "check"] = Field(
        description="where its value per rollout is: `rewards.NAME` (a reward function), a feature of the basis "
                    "computed from the completion (specs/features/surface.yaml or the report's basis), or "
                    "`targets.NAME` (a check the reward does not pay for, scored by the tap)")


class RunManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    run_id: str = ""
    framework: FrameworkInfo
    model: ModelInfo
    optimizer: str | None = None
    trainer_config: dict[str, Any] = Field(default_factory=dict)
    telemetry_per_step: bool = Field(True, description="False when telemetry rows are means over logging windows")
    logging_steps: int = 1
    created_by: str
    notes: list[str] = Field(default_factory=list)
    files: dict[str, FileEntry] = Field(default_factory=dict)
    checkpoints: list[CheckpointEntry] = Field(default_factory=list)
    non_finite: list[NonFiniteValue] = Field(
        default_factory=list, description="values stored as null because they were NaN or infinite")
    targets: list[TargetDecl] = Field(default_factory=list, description="what the user declared they want")


def content_run_id(manifest: RunManifest) -> str:
    """``run:`` + sha256 of the manifest's content (per-file checksums included).

    Checking it never re-reads the data files: the checksums it covers are in the manifest.
    ``run_id`` itself and ``created_by`` (which tool version wrote it) are left out, so the
    id is the same for every re-write of the same content.
    """
    payload = manifest.model_dump(mode="json", exclude={"run_id", "created_by"})
    # Optional fields added after records were first written hash only when set, so the id of
    # every earlier record is unchanged.
    for section, key in _LATER_OPTIONAL:
        if payload.get(section, {}).get(key, 0) is None:
            del payload[section][key]
    for key in _LATER_LISTS:
        if not payload.get(key):
            payload.pop(key, None)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"run:{digest}"


_LATER_OPTIONAL = (("model", "eos_token_id"),)
# Manifest lists added later: hashed only when non-empty, for the same reason.
_LATER_LISTS = ("non_finite", "targets")

_ARROW_TYPES = {
    "int64": pa.int64(),
    "float64": pa.float64(),
    "string": pa.string(),
    "list<int64>": pa.list_(pa.int64()),
    "map<string,float64>": pa.map_(pa.string(), pa.float64()),
}


def arrow_schema(source: str) -> pa.Schema:
    """The Arrow schema of ``telemetry`` or ``rollouts``, from specs/fields.yaml."""
    fields = load_fields().by_source(source)
    return pa.schema([pa.field(spec.column, _ARROW_TYPES[spec.dtype], nullable=not spec.constraints.required)
                      for spec in fields.values()])


def arrow_type(dtype: str) -> pa.DataType:
    return _ARROW_TYPES[dtype]
