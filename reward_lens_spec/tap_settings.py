"""The TRL tap's settings: one validated model, read by the tap (``RewardLensTap``; users import
it as ``reward_lens.taps.settings``) and by the audit (a config's ``reward_lens:`` section), so
that what the audit accepts is exactly what the tap runs with. In the spec layer, below both. Torch-free: the audit imports it without the ``trl`` extra."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

# Every integer setting is bounded (issue 61): a count past these is a typo, and a seed past 2**32
# overflows the generators it seeds (torch's, numpy's) with an error that does not name it.
COUNT_LIMIT = 2**31 - 1
SEED_LIMIT = 2**32 - 1

# Estimators of earlier versions, and why they are gone.
RETIRED = {"rollout": "it summed the token KL along the rollouts the step trained on, which the update inflates "
                      "(0.36-11x the truth)",
           "both": "it recorded the in-sample `rollout` estimate beside `exact`"}


_TARGET = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_.]*)(?::(?P<want>higher|lower))?$")
TARGET_FORMS = ("a reward function's name (TRL's reward_funcs names) or a feature of the basis, as 'NAME' or "
                "'NAME:lower'; a function the reward does not pay for (a held-out check, called like a reward "
                "function, one number per completion); {'NAME[:lower]': function}; or a list of these")


@dataclass(frozen=True)
class TapTarget:
    """One declared target of the tap: ``fn`` None names a reward function or a feature; a
    function is a check the reward does not pay for, scored on every rollout."""

    name: str
    want: str = "higher"
    fn: Callable | None = None


def _target_name(text: Any) -> tuple[str, str]:
    m = _TARGET.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a target name; a target is {TARGET_FORMS}")
    return m.group("name"), m.group("want") or "higher"


def _targets(value: Any) -> tuple[TapTarget, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out: list[TapTarget] = []
    for item in items:
        if isinstance(item, str):
            out.append(TapTarget(*_target_name(item)))
        elif isinstance(item, dict):
            for key, v in item.items():
                name, want = _target_name(key)
                if isinstance(v, str) and v in ("higher", "lower"):  # a YAML mapping NAME: lower
                    out.append(TapTarget(name, v))
                elif callable(v):
                    out.append(TapTarget(name, want, v))
                else:
                    raise ValueError(f"target `{name}`: {v!r} is neither a function nor higher/lower; a target is "
                                     f"{TARGET_FORMS}")
        elif callable(item):
            name = getattr(item, "__name__", "")
            if not _TARGET.match(name or "-"):
                raise ValueError(f"the target function {item!r} has no usable name: pass {{'NAME': function}}")
            out.append(TapTarget(name, "higher", item))
        else:
            raise ValueError(f"{item!r} is not a target; a target is {TARGET_FORMS}")
    names = [t.name for t in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"target {twice} is declared twice")
    return tuple(out)


class TapSettings(BaseModel):
    """``RewardLensTap.attach(trainer, DIR, **settings)``: every argument after the record folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: Literal["independent", "exact"] | None = Field(
        "independent", description="how D_t is measured: along the next generation's rollouts and pi_t's held-out "
                                   "completions ('independent'), from fresh samples of pi_{t+1} ('exact'), or not at all")
    heldout: StrictInt = Field(4, ge=0, le=COUNT_LIMIT, description="the most completions per prompt group and per policy the tap adds "
                                                    "to the trainer's own generation (pi_t's at step t, pi_{t+1}'s at "
                                                    "the next), never trained on: the paired ledger's two sides (0: "
                                                    "one-sided, the next generation's rollouts scored under pi_t)")
    budget: float | None = Field(0.10, gt=0, le=10, allow_inf_nan=False,
                                 description="the tap's time as a fraction of an untapped optimizer step: it measures "
                                             "as much of each step pair as that buys, chosen from timing alone "
                                             "(None: every step pair measured whole)")
    n_exact: StrictInt = Field(16, ge=2, le=COUNT_LIMIT, description="sequences the 'exact' estimator samples per step")
    flush_every: StrictInt = Field(10, ge=1, le=COUNT_LIMIT, description="steps between commits of the record")
    chunk: StrictInt = Field(16, ge=1, le=COUNT_LIMIT, description="sequences per forward pass when scoring")
    loss_forward: StrictBool = Field(True, description="take log pi_{t+1} of the rollouts (and pi_{t+1}'s side of "
                                                       "their token KL) from the trainer's own loss forward pass "
                                                       "instead of a forward pass of the tap's own, where it can")
    save_initial_checkpoint: StrictBool = False
    overwrite: StrictBool = False
    seed: StrictInt = Field(0, ge=0, le=SEED_LIMIT, description="seeds the tap's own draws (which groups a "
                                                                    "budget measures); 0 .. 2**32 - 1")
    model_description: str | None = None
    paired: StrictBool = Field(True, description="score each generation under the previous policy (the paired "
                                                 "ledger's input)")
    snapshot: Literal["device", "cpu"] = Field(
        "device", description="where pi_t's parameters are kept between the step and the next generation: beside "
                              "the model ('device': swapped in by reference) or in host memory ('cpu', pinned on "
                              "CUDA: copied in for each scoring pass and back, so the accelerator holds no second copy)")
    check_every: StrictInt = Field(1, ge=0, le=COUNT_LIMIT, description="steps between evaluations of the live findings "
                                                        "(specs/findings/ with live: true) on the steps so far; 0: never")
    stop_on: Literal["warn", "critical"] | None = Field(None, description="stop training (TrainerControl) when a "
                                                                          "live finding of this severity or above holds")
    features: str | None = Field(None, description="the feature basis the live findings read (a YAML file, as "
                                                   "`reward-lens check --features`; default: the surface basis, "
                                                   "check's default): the same basis gives the same findings")
    target: Any = Field(None, description="what you want of the policy, as opposed to what the reward pays for "
                                          "(recorded in the manifest, its values per rollout): " + TARGET_FORMS
                                          + ". Without one, proxy_gaming and paid_for_drift are not evaluated")

    @field_validator("target", mode="before")
    @classmethod
    def _target(cls, value):
        return None if value is None else _targets(value)

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_not_bool(cls, v):
        # pydantic reads True as 1.0 in a float field; every other setting is strict about booleans
        if isinstance(v, bool):
            raise ValueError("must be a number in (0, 10] or None, not a boolean")
        return v

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data):
        est = data.get("estimator") if isinstance(data, dict) else None
        if isinstance(est, str) and est in RETIRED:
            raise ValueError(f"estimator {est!r} is retired: {RETIRED[est]}; the default, 'independent', measures "
                             "D_t along the next generation's rollouts and pi_t's held-out completions")
        return data

    @field_validator("heldout")
    @classmethod
    def _heldout_pairs(cls, v):
        # one completion per group and side has no within-group information: the paired ledger drops
        # such groups (taps/budget.py MIN_PER_GROUP), so a record of heldout=1 would hold a D_t the books
        # cannot read (issue 61: the first screen said "no D_t" while the books priced it)
        if v == 1:
            raise ValueError("1 completion per group and side gives the paired ledger no within-group "
                             "information: pass 0 (one-sided: the next generation's rollouts scored under pi_t) "
                             "or 2 or more")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.estimator == "independent" and not self.paired:
            raise ValueError("estimator='independent' measures D_t on the next generation's rollouts scored under "
                             "the previous policy, which is paired scoring: pass paired=True (the default), or "
                             "estimator='exact' or None")
        if self.stop_on is not None and self.check_every == 0:
            raise ValueError(f"stop_on={self.stop_on!r} can never stop the run with check_every=0 (the live findings "
                             "are never evaluated): set check_every to 1 or more, or drop stop_on")
        return self


def settings_error(exc: ValidationError) -> str:
    """One line naming the setting and what is wrong with it."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "settings"
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"{loc}: {msg}{shown}"


def tap_settings(**kwargs) -> TapSettings:
    """Validated settings, or ValueError naming the setting."""
    try:
        return TapSettings(**kwargs)
    except ValidationError as exc:
        raise ValueError(f"RewardLensTap: {settings_error(exc)}") from None
