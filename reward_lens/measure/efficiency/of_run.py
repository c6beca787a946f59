"""The cost book of a record, end to end: which ledger, which metric, which window.

``ledger="auto"`` uses the paired ledger where the record has independent scored rollouts
(``logp_prev`` on the rollouts of at least one step: on all of them, or on the prompt groups a
tap under a cost budget scored) -- with the held-out completions of pi_t
as its second side where the record has them -- else the unpaired one; and the unpaired one
too where no paired ledger can form for a structural reason (one prompt group per step, which
no step escapes: ``fallback`` says so). The book says which it used, and why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from reward_lens.measure.efficiency.cost import CostBook, _denominators, cost_series
from reward_lens.measure.efficiency.metric import MetricG, metric_g, within_group_metric
from reward_lens.measure.ledger.paired import NotFormed, has_scored_groups, paired_ledger_series
from reward_lens.measure.ledger.price import StepSample, ledger_arrays, ledger_series, learning_rates
from reward_lens.record.reader import Run

LEDGERS = ("auto", "paired", "unpaired")


@dataclass(frozen=True)
class PricedRun:
    book: CostBook | None
    metric: MetricG | None
    ledger: str
    not_formed: dict[tuple[int, int], NotFormed]  # step pairs no ledger could be formed for, and why
    ledgers: Sequence = ()  # the ledgers the book was priced on, as priced (the effect and cause books read them)
    # --ledger auto: the paired ledger the record seemed to support and why it could not be used
    # (every step pair refused for one structural reason), when the unpaired one was used instead
    fallback: NotFormed | None = None
    # D_t of each step pair a ledger formed for, nats per sequence: the paired ledger's own (the
    # token-level KL along samples independent of the update), else the record's kl_to_previous.
    # It reads no feature, so it is the same in every basis (``spent_of``); the decisions keep it
    # for the usable step pairs, and every book and the card quote their totals from there.
    spent: Mapping[tuple[int, int], float] = field(default_factory=dict)


def price_run(run: Run, samples: list[StepSample], *, ledger: str = "auto", window: int | str = 1) -> PricedRun:
    if ledger not in LEDGERS:
        raise ValueError(f"--ledger takes one of {', '.join(LEDGERS)}, not {ledger!r}")
    lrs = learning_rates(run)
    fallback = None
    paired = None
    pairs = paired_samples(samples)
    if ledger == "auto":
        ledger = "paired" if any(has_scored_groups(s) for s in pairs) else "unpaired"
        if ledger == "paired":
            paired = paired_ledger_series(pairs, lrs, _heldout(samples))
            ledgers, why = paired
            reasons = {w.reason for w in why.values()}
            if not ledgers and reasons <= STRUCTURAL:  # e.g. one prompt group per step: no paired ledger can form
                fallback = min(why.values(), key=lambda w: w.step)
                ledger = "unpaired"
    if ledger == "paired":
        ledgers, why = paired if paired is not None else paired_ledger_series(pairs, lrs, _heldout(samples))
        why = _unmeasured(run, why)
        if not ledgers:
            return PricedRun(None, None, ledger, why)
        g = within_group_metric(ledgers)
    else:
        ledgers, why = unpaired_ledgers(samples, lrs)
        if not ledgers:
            return PricedRun(None, None, ledger, why)
        ok = [s for s in samples if s.n >= 2]
        g = metric_g(ok, method="covariance_bound", scope="auto")
    return PricedRun(cost_series(ledgers, g, run_=run, window=window), g, ledger, why, ledgers, fallback,
                     spent_of(ledgers, run, ledger))


def spent_of(ledgers: Sequence, run: Run, ledger: str) -> dict[tuple[int, int], float]:
    """D_t of each step pair of ``ledgers`` that has one, in step order (nats per sequence): a
    paired ledger's own token-level KL (None without it: not listed), else the record's
    ``kl_to_previous`` at the pair's first step, as the cost book divides by it. No feature
    enters it: the one definition of what each update spent, whatever the basis."""
    if not len(ledgers):
        return {}
    pairs = [tuple(int(x) for x in p) for p in ledger_arrays(ledgers).step_pairs.tolist()]
    if ledger == "paired":
        out = {pair: float(lg.d_t) for pair, lg in zip(pairs, ledgers) if lg.d_t is not None}
    else:
        denoms, _ = _denominators(ledgers, run, None, "nats_per_sequence")
        out = {pair: denoms[pair[0]][0] for pair in pairs if pair[0] in denoms}
    return dict(sorted(out.items()))


# Reasons a paired ledger cannot form that no step of the run escapes (the run's layout, not a
# step's sample): under --ledger auto the unpaired ledger is used instead, and the book says why.
STRUCTURAL = frozenset({"few_groups"})


def _unmeasured(run: Run, why: dict[tuple[int, int], NotFormed]) -> dict[tuple[int, int], NotFormed]:
    """Step pairs the tap did not measure under its cost budget (telemetry ``tap_groups`` 0 at
    the pair's first step) are refused as that, not as a record that lacks scores."""
    groups = run.telemetry_column("tap_groups")
    if not groups:
        return why
    return {pair: NotFormed("not_measured", pair[0]) if w.reason == "no_logp_prev" and groups.get(pair[0]) == 0
            else w for pair, w in why.items()}


def _heldout(samples: list[StepSample]) -> dict[int, StepSample]:
    return {s.step: s.heldout for s in samples if s.heldout is not None}


def paired_samples(samples: list[StepSample]) -> list[StepSample]:
    """Each step's side b of the paired ledger: the completions its policy drew for the previous
    generation's prompts beside its own generation (``sample.fresh``), where the record has them,
    else its rollouts (scored under the previous policy by taps that score them)."""
    return [s.fresh if s.fresh is not None else s for s in samples]


def unpaired_ledgers(samples: list[StepSample], lrs) -> tuple[list, dict[tuple[int, int], NotFormed]]:
    """Two-sample ledgers for the step pairs whose steps both have >= 2 rollouts; the others
    are named, not fatal (a step with one rollout refuses only the pairs that touch it)."""
    steps = {s.step: s for s in samples}
    why = {}
    for t, s in steps.items():
        if s.n < 2:
            for pair in ((t - 1, t), (t, t + 1)):
                if pair[0] in steps and pair[1] in steps:
                    why[pair] = NotFormed("one_rollout", t, s.n)
    ok = [s for s in samples if s.n >= 2]
    ledgers = ledger_series(ok, eta_by_step=lrs)
    if why:  # the pairs named above are refused, not priced
        ledgers = ledgers.where(np.array([tuple(p) not in why for p in ledgers.arrays.step_pairs.tolist()], dtype=bool))
    return ledgers, why
