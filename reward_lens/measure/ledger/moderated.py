"""Standard errors moderated across neighbouring updates: D_t's, and a paired eta's.

The token KL along a completion is heavy-tailed: most completions of a prompt carry about the
same KL and a few carry many times it, and a sample of 4 + 4 completions per prompt usually
holds none of the tail. Its own standard error (the stratified jackknife over each prompt's
completions, ``paired.Strata``) is then small exactly when the estimate is off: right on average,
tiny on the draws that missed the tail and large on the few that caught it. On the truth
harness's runs (``tools/truth.py``, the tap's sampling redrawn 100 times for the same prompts)
its intervals cover the truth on well under 95 % of the draws (docs/science.md quotes how many).

The shape of that tail is a property of the policy, which moves little from one update to the
next; whether this update's sample caught it is chance. So each update's relative variance per
prompt group is half its own and half the mean over it and the ``MODERATION_WINDOW`` measured
updates on either side -- the variance moderation of empirical Bayes (Smyth 2004, limma), with a
window's mean as the prior and the sample's own weighing alike:

    u_s = G_s (SE_s / D_s)^2     (a relative variance per prompt group: SEs scale as 1 / sqrt G)
    v_t = w u_t + (1 - w) mean_{s in window(t)} u_s,   w = ``OWN_WEIGHT`` = 1/2
    SE_t = D_t sqrt(v_t / G_t)

with Welch-Satterthwaite degrees of freedom over the independent samples it sums. Where the tap's
budget measured a subset of an update's prompt groups, SE_s is the ledger's two-stage SE (the
sampling of the groups added, ``paired.group_sampling``) and its degrees of freedom those of that
SE: what is pooled is then the relative variance of the step's D_t over all its prompts. It is the
relative variance that is pooled, not the variance: D_t itself ranges over orders of magnitude
within a run (7 nats at the first updates of the collapsing run, 0.001 at its last). What it
costs: an update whose tail is heavier than its neighbours' borrows their lighter one, and one
whose tail is lighter borrows a heavier, so per update the SE is off in both directions more
often than the sample's own (the harness prints on how many updates its real spread leaves
[0.8, 1.25] of it) while on average, and in coverage, it is far nearer. On a run whose every
update has the same tail, pooling alone (w = 0) covers best; the harness's real runs, whose
updates differ, favoured the half weight. Window and weight were chosen on the harness's runs
(its lines print the other windows); an update whose sample the book refuses (a failed
premise) still lends its relative variance to its neighbours, as the harness measures it.

A paired eta's SE (the delete-one-group jackknife's, by the delta method) has the same fault on a
sharpened policy: the jackknife's spread rests on the two or three prompt groups of a 4 + 4 sample
in which a priced behaviour varies, small on most samples and large on a few. Its variance is
pooled the same way (``moderated_eta_se``; eta is on one scale across updates, so the variance
itself, not a relative one), with the same window and weight, which the harness's runs were not
re-tuned for: ``pooled_variances`` is the one pooling both use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

# Measured updates on either side of an update whose relative variance its SE pools.
MODERATION_WINDOW = 3
# The weight of the sample's own relative variance beside the window's mean (which holds it too):
# the sample's and its neighbours' weigh alike.
OWN_WEIGHT = 0.5


def pooled_variances(u, dof, window: int = MODERATION_WINDOW, own_weight: float = OWN_WEIGHT
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The pooling both moderations share, over a run's measured updates in step order: ``u`` (n,)
    the variances to pool (each in a scale comparable across updates) and ``dof`` their degrees
    of freedom (NaN or <= 0: no spread to pool, any will do). Returns each update's pooled
    variance ``v_t = w u_t + (1 - w) mean_{s in window(t)} u_s`` and its Welch-Satterthwaite
    degrees of freedom, (sum of the terms)^2 / sum of (term^2 / its dof) (NaN where v_t is 0). A
    term of infinite degrees of freedom (a known variance) adds nothing to that sum's denominator."""
    u = np.asarray(u, dtype=np.float64)
    f = np.asarray(dof, dtype=np.float64)
    if u.ndim != 1 or u.shape != f.shape:
        raise ValueError(f"u and dof must be 1-d of one length, not {u.shape}, {f.shape}")
    if not np.isfinite(u).all() or (u < 0).any():
        raise ValueError("u must hold finite variances of at least 0 (leave the others out)")
    _check(window, own_weight)
    # each term's dof: an infinite one (a known variance) divides its term to 0; NaN or <= 0 (no
    # spread to pool) reads as 1, any will do
    fo = np.where(f > 0, f, 1.0)
    n = len(u)
    # each update's window, in measured updates, summed directly: a difference of cumulative sums
    # loses a small term beside a large one (an update of relative SE 1e-2 beside a window of 1e-5)
    lo = np.maximum(np.arange(n) - window, 0)
    hi = np.minimum(np.arange(n) + window + 1, n)
    pad = np.r_[np.zeros(window), u, np.zeros(window)]
    pad2 = np.r_[np.zeros(window), u * u / fo, np.zeros(window)]
    tot = np.lib.stride_tricks.sliding_window_view(pad, 2 * window + 1).sum(axis=1)  # zeros beyond the run
    tot2 = np.lib.stride_tricks.sliding_window_view(pad2, 2 * window + 1).sum(axis=1)
    # the own term weighs a = w + (1 - w) / m (it is in its own window too), each other one
    # b = (1 - w) / m
    m = (hi - lo).astype(np.float64)
    a = own_weight + (1.0 - own_weight) / m
    b = (1.0 - own_weight) / m
    var = np.maximum(a * u + b * (tot - u), 0.0)
    den = a * a * u * u / fo + b * b * (tot2 - u * u / fo)
    with np.errstate(divide="ignore", invalid="ignore"):
        out_dof = np.where(den > 0, var * var / np.where(den > 0, den, 1.0), np.nan)
    return var, out_dof


def _check(window: int, own_weight: float) -> None:
    if window < 0:
        raise ValueError(f"window must be at least 0, not {window}")
    if not 0.0 <= own_weight <= 1.0:
        raise ValueError(f"own_weight must be in [0, 1], not {own_weight}")


def moderated_d_t_se(d_t, se, dof, groups, window: int = MODERATION_WINDOW,
                     own_weight: float = OWN_WEIGHT) -> tuple[np.ndarray, np.ndarray]:
    """D_t's moderated standard errors and their degrees of freedom, for a run's updates in step
    order: ``d_t`` (nats per sequence), ``se`` (each sample's own SE), ``dof`` (its degrees of
    freedom; NaN where its strata have none) and ``groups`` (the prompt groups it was measured on),
    each of length P (None or NaN where missing). An update without a positive D_t and a finite SE takes no part (NaN out)
    and is no one's neighbour: the window counts measured updates. Where every pooled SE is 0 the
    result is 0 with NaN degrees of freedom. What is pooled is the relative variance per prompt
    group, u_s = G_s (SE_s / D_s)^2 (``pooled_variances``)."""
    d, s, f, g = (np.asarray(x, dtype=np.float64) for x in (d_t, se, dof, groups))  # None reads as NaN
    if not (d.shape == s.shape == f.shape == g.shape) or d.ndim != 1:
        raise ValueError(f"d_t, se, dof and groups must be 1-d of one length, not {d.shape}, {s.shape}, "
                         f"{f.shape}, {g.shape}")
    _check(window, own_weight)
    out_se = np.full(d.shape, np.nan)
    out_dof = np.full(d.shape, np.nan)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        u = g * (s / d) ** 2  # beyond the float range (an SE of 1e154 on a D_t of 1) it takes no part
    ok = np.flatnonzero((d > 0) & np.isfinite(d) & (s >= 0) & np.isfinite(s) & (g >= 1) & np.isfinite(u))
    if not len(ok):
        return out_se, out_dof
    var, out_dof[ok] = pooled_variances(u[ok], f[ok], window, own_weight)
    out_se[ok] = d[ok] * np.sqrt(var / g[ok])
    return out_se, out_dof


def moderated_eta_se(se, dof, window: int = MODERATION_WINDOW, own_weight: float = OWN_WEIGHT
                     ) -> tuple[np.ndarray, np.ndarray]:
    """eta's moderated standard errors and their degrees of freedom, for a book's paired rows that
    state an interval, in step order: ``se`` each row's own (the delete-one-group jackknife's,
    delta method) and ``dof`` its degrees of freedom (the groups that vary, less one). A row
    without a finite SE takes no part (NaN out) and is no one's neighbour.

    eta is a ratio of nats over nats, on one scale across a run's updates, so its variance itself
    is pooled (``pooled_variances``), not a relative one (eta near 0 would make that unbounded).
    Why: on a sharpened policy a 4 + 4 sample of an update varies in two or three of its prompt
    groups, and the jackknife's SE rests on them: small on many samples, large on a few. On the
    truth harness's collapsing run the typical sample's SE was about two thirds of the real spread
    and the 95 % intervals covered under nine in ten of the redraws; pooled with the neighbouring
    updates, as D_t's is, nine in ten and more, with the moderate run's unchanged
    (docs/science.md quotes the harness)."""
    s, f = np.asarray(se, dtype=np.float64), np.asarray(dof, dtype=np.float64)
    if s.shape != f.shape or s.ndim != 1:
        raise ValueError(f"se and dof must be 1-d of one length, not {s.shape}, {f.shape}")
    _check(window, own_weight)
    out_se = np.full(s.shape, np.nan)
    out_dof = np.full(s.shape, np.nan)
    with np.errstate(over="ignore", invalid="ignore"):
        u = s * s  # beyond the float range it takes no part
    ok = np.flatnonzero(np.isfinite(s) & (s >= 0) & np.isfinite(u))
    if len(ok):
        var, out_dof[ok] = pooled_variances(u[ok], f[ok], window, own_weight)
        out_se[ok] = np.sqrt(var)
    return out_se, out_dof


def moderated_by_pair(ledgers) -> dict[tuple[int, int], tuple[float, float]]:
    """Step pair -> (SE, degrees of freedom) of D_t for a run's paired ledgers: ``moderated_d_t_se``
    over those with a D_t and an SE, in step order (what the cost book states, and the truth
    harness checks); NaN where an update takes no part (``moderated_d_t_se``)."""
    have = sorted(((tuple(lg.step_pair), lg) for lg in ledgers
                   if getattr(lg, "d_t", None) is not None and getattr(lg, "d_t_se", None) is not None),
                  key=lambda x: x[0])
    if not have:
        return {}
    se, dof = moderated_d_t_se([lg.d_t for _, lg in have], [lg.d_t_se for _, lg in have],
                               [lg.d_t_dof for _, lg in have], [lg.n_groups for _, lg in have])
    return {pair: (a, b) for (pair, _), a, b in zip(have, se.tolist(), dof.tolist())}


def moderated_by_step(d_t: Mapping[int, float], d_se: Mapping[int, float], groups: Mapping[int, float]
                      ) -> dict[int, float]:
    """D_t's SE by step, each step's own (the tap's ``kl_to_previous_se``) moderated across its
    measured neighbours as the cost book moderates it (``moderated_d_t_se``, as
    ``moderated_by_pair`` does for ledgers: its own SE is small exactly on the samples that missed
    the token KL's tail). ``groups``: the prompt groups each step's D_t was measured on
    (``tap_groups``), where every step has it; else each step's relative variance is read as it
    stands (equal counts, as a budget measuring whole pairs gives). Steps without a positive D_t
    and a finite SE are left out."""
    steps = sorted(s for s, v in d_t.items() if v > 0 and math.isfinite(v) and d_se.get(s) is not None
                   and math.isfinite(d_se[s]) and d_se[s] >= 0)
    if not steps:
        return {}
    g = [groups.get(s) for s in steps]
    g = [float(x) for x in g] if all(x is not None and x >= 1 for x in g) else [1.0] * len(steps)
    se, _ = moderated_d_t_se([d_t[s] for s in steps], [d_se[s] for s in steps], [float("nan")] * len(steps), g)
    return {s: v for s, v in zip(steps, se.tolist()) if v == v}


def t975(dof: float) -> float:
    """The 97.5 % quantile of Student's t on ``dof`` degrees of freedom (at least one); the
    normal's where ``dof`` is NaN or infinite."""
    from scipy import special

    if not (dof == dof) or math.isinf(dof):
        return 1.959963984540054
    return float(special.stdtrit(max(float(dof), 1.0), 0.975))


__all__ = ["MODERATION_WINDOW", "OWN_WEIGHT", "moderated_by_pair", "moderated_by_step", "moderated_d_t_se",
           "moderated_eta_se", "pooled_variances", "t975"]
