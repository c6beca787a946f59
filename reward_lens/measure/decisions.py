"""One set of decisions per run, made once and read by every book, the card, the findings and
the diff: which step pairs are refused and why, which are usable, which are priced, whose
movement is resolved from noise, and which features moved at each.

A step pair (t, t+1) is one optimizer update, read on samples independent of it.

* **refused** -- no ledger could be formed for it (``NotFormed``: one rollout, too few prompt
  groups, no scores under the previous policy, ...) or its sample fails a premise of the
  estimate (``PairedLedger.premise``: heavy-tailed weights, too few effective samples). No book
  states a number or a direction for it.
* **usable** -- every other step pair: its dz can be read.
* **priced** -- usable, and at least one feature varies in its sample, so KL_min is computed.
* **resolved** -- priced, and Benjamini-Hochberg at q = 0.05 over the priced step pairs rejects
  "the features bought nothing of this update" (the cost book's per-row test: the F-test of the
  within-group regression of the log-ratio on the features, paired; Hotelling's T^2, unpaired).
* **identified** (a cell: a feature at a usable step pair) -- the feature varies within some
  prompt group of the sample (its standard error is positive); a feature constant in every
  group has a movement the sample cannot see, and is shown as not identified, never as 0.
* **moved** (a cell) -- identified, and BH at q = 0.05 over every identified cell rejects
  dz = 0 (t on G - 1 degrees of freedom where prompt groups are the units).

Shares of KL_min are summed over the resolved step pairs only: a share of an unresolved row is
noise and is never stated as a finding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from scipy import special

from reward_lens.measure.efficiency.eta import FDR_Q, benjamini_hochberg
from reward_lens.measure.ledger.price import ledger_arrays

# Words for the reasons a step pair is refused (``NotFormed.reason`` and the premises).
REASONS = {
    "no_logp_prev": "no scores under the previous policy",
    "prev_step": "scored under more than one earlier policy",
    "few_groups": "fewer than 2 prompt groups of 2 or more rollouts",
    "one_rollout": "a step with one rollout",
    "heldout_unscored": "held-out completions not scored under both policies",
    "partly_scored_group": "a prompt group scored under the previous policy on some rollouts only",
    "heavy_tails": "importance weights too heavy-tailed",
    "low_ess": "too few effective samples",
    "sampler_mismatch": "rollouts sampled by an engine (vLLM) that departs from the policy",
    "no_token_kl": "no token-level KL along the samples",
}


@dataclass(frozen=True)
class Decisions:
    names: tuple[str, ...]
    ledger: str  # "paired" | "unpaired" | "none"
    refused: Mapping[tuple[int, int], str]  # step pair -> reason (a key of REASONS)
    usable: tuple[tuple[int, int], ...]  # in step order
    delta_z: np.ndarray  # (U, k) dz of each usable step pair, feature units
    se: np.ndarray  # (U, k)
    t: np.ndarray  # (U, k) dz / SE, NaN where not identified
    p: np.ndarray  # (U, k) two-sided p of dz = 0, NaN where not identified
    identified: np.ndarray  # (U, k) bool
    moved: np.ndarray  # (U, k) bool: BH over the identified cells
    priced: tuple[tuple[int, int], ...]
    resolved: tuple[tuple[int, int], ...]
    kl_min: Mapping[tuple[int, int], float] = field(default_factory=dict)  # priced pair -> KL_min (the quadratic form)
    shares: Mapping[tuple[int, int], Mapping[str, float]] = field(default_factory=dict)  # priced pair -> shares (nats)
    # --ledger auto fell back to the unpaired ledger: why the paired one could not form, in words
    fallback: str | None = None

    # ---------------------------------------------------------------- counts, made here only
    @property
    def n_pairs(self) -> int:
        """Every step pair the record has a ledger for, or a refusal of one."""
        return len(self.usable) + len(self.refused)

    @cached_property
    def pairs_moved(self) -> tuple[tuple[int, int], ...]:
        """Usable step pairs at which at least one feature moved (per-feature tests)."""
        return tuple(p for p, row in zip(self.usable, self.moved) if row.any())

    def refused_by_reason(self) -> dict[str, list[tuple[int, int]]]:
        out: dict[str, list[tuple[int, int]]] = {}
        for pair, why in sorted(self.refused.items()):
            out.setdefault(why, []).append(pair)
        return out

    def cells_moved(self, feature: str) -> int:
        return int(self.moved[:, self.names.index(feature)].sum()) if len(self.usable) else 0

    def cells_not_identified(self) -> int:
        return int((~self.identified).sum())

    @cached_property
    def resolved_kl_min(self) -> float:
        """KL_min summed over the resolved step pairs (nats per sequence), in step order."""
        return float(sum(self.kl_min[p] for p in self.resolved))

    @cached_property
    def resolved_shares(self) -> dict[str, float] | None:
        """Each feature's share of KL_min over the resolved step pairs (fractions summing to 1),
        or None when no step pair is resolved: the one place a share is computed."""
        total = self.resolved_kl_min
        if not self.resolved or not total > 0:
            return None
        sums = {n: sum(self.shares[p].get(n, 0.0) for p in self.resolved) for n in self.names}
        return {n: v / total for n, v in sums.items()}

    def leads(self, feature: str) -> int:
        """Resolved step pairs whose largest share is ``feature``'s."""
        return sum(max(self.shares[p], key=self.shares[p].get) == feature for p in self.resolved if self.shares[p])

    def summary(self) -> dict[str, int | str]:
        """The counts every sentence on the page takes its numbers from."""
        return {"ledger": self.ledger, "fallback": self.fallback, "step_pairs": self.n_pairs,
                "usable": len(self.usable),
                "refused": len(self.refused), "priced": len(self.priced), "resolved": len(self.resolved),
                "moved": len(self.pairs_moved), "cells": int(self.identified.size),
                "cells_identified": int(self.identified.sum()), "cells_moved": int(self.moved.sum())}


def decide(priced_run, names: Sequence[str]) -> Decisions:
    """The decisions of a priced run (``efficiency.of_run.PricedRun``): its ledgers, the cost
    book's KL_min rows (their BH decision) and the step pairs that could not be formed."""
    if priced_run is None:
        return decide_from([], names, ledger="none")
    d = decide_from(priced_run.ledgers, names, ledger=priced_run.ledger, not_formed=priced_run.not_formed,
                    series=priced_run.book.kl_min if priced_run.book is not None else None)
    fb = priced_run.fallback
    if fb is None:
        return d
    words = f"{REASONS.get(fb.reason, fb.reason)} at every step (step {fb.step} has {fb.count})"
    return dataclasses.replace(d, fallback=words)


def decide_from(ledgers: Sequence, names: Sequence[str], *, ledger: str = "unpaired",
                not_formed: Mapping | None = None, series=None) -> Decisions:
    """The decisions of ``ledgers`` (with the step pairs that could not be formed, and the cost
    book's KL_min series where there is one: its premises and its BH decision)."""
    names = tuple(names)
    k = len(names)
    refused: dict[tuple[int, int], str] = {}
    for pair, why in (not_formed or {}).items():
        refused[tuple(pair)] = why.reason
    if series is not None:
        refused.update({tuple(p): why for p, why in series.premises.items() if why != "no_token_kl"})
    ledgers = list(ledgers) if ledgers is not None else []
    arrays = ledger_arrays(ledgers) if ledgers else None
    pairs = [tuple(p) for p in arrays.step_pairs.tolist()] if arrays is not None else []
    keep = np.array([p not in refused for p in pairs], dtype=bool)
    usable = tuple(p for p, ok in zip(pairs, keep) if ok)
    if arrays is not None and len(usable):
        dz, se = arrays.delta_z[keep], arrays.se[keep]
        groups = np.array([getattr(lg, "n_groups", 0) for lg, ok in zip(ledgers, keep) if ok])[:, None]
    else:
        dz = se = np.zeros((0, k))
        groups = np.zeros((0, 1), dtype=int)
    identified = se > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(identified, dz / np.where(identified, se, 1.0), np.nan)
        p = 2 * np.where(groups > 1, special.stdtr(np.maximum(groups - 1, 1), -np.abs(t)), special.ndtr(-np.abs(t)))
    p = np.where(identified, p, np.nan)
    moved = np.zeros(identified.shape, dtype=bool)
    moved[identified] = benjamini_hochberg(p[identified], FDR_Q)
    priced, resolved, kl, shares = [], [], {}, {}
    cols = series.columns if series is not None else None
    if cols is not None:  # the columns as lists once: 10,000 rows read element by element otherwise
        on_rows, share_rows = cols.priced.tolist(), cols.shares.tolist()
        for pair, on_row, share_row, kl_i, res in zip((tuple(q) for q in cols.step_pair.tolist()), on_rows,
                                                      share_rows, cols.kl_min.tolist(), cols.resolved.tolist()):
            if pair in refused or not any(on_row):
                continue
            priced.append(pair)
            kl[pair] = kl_i
            shares[pair] = {n: v for n, v, on in zip(cols.names, share_row, on_row) if on}
            if res:
                resolved.append(pair)
    ledger = ledger if ledgers or not_formed else "none"
    return Decisions(names, ledger, refused, usable, dz, se, t, p, identified, moved, tuple(priced), tuple(resolved),
                     kl, shares)
