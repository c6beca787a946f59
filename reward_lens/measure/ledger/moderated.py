"""D_t's standard error moderated across neighbouring updates.

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

with Welch-Satterthwaite degrees of freedom over the independent samples it sums. It is the
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
"""

from __future__ import annotations

import math

import numpy as np

# Measured updates on either side of an update whose relative variance its SE pools.
MODERATION_WINDOW = 3
# The weight of the sample's own relative variance beside the window's mean (which holds it too):
# the sample's and its neighbours' weigh alike.
OWN_WEIGHT = 0.5


def moderated_d_t_se(d_t, se, dof, groups, window: int = MODERATION_WINDOW,
                     own_weight: float = OWN_WEIGHT) -> tuple[np.ndarray, np.ndarray]:
    """D_t's moderated standard errors and their degrees of freedom, for a run's updates in step
    order: ``d_t`` (nats per sequence), ``se`` (each sample's own SE), ``dof`` (its degrees of
    freedom; NaN where its strata have none) and ``groups`` (the prompt groups it was measured on),
    each of length P (None or NaN where missing). An update without a positive D_t and a finite SE takes no part (NaN out)
    and is no one's neighbour: the window counts measured updates. Where every pooled SE is 0 the
    result is 0 with NaN degrees of freedom."""
    d, s, f, g = (np.asarray(x, dtype=np.float64) for x in (d_t, se, dof, groups))  # None reads as NaN
    if not (d.shape == s.shape == f.shape == g.shape) or d.ndim != 1:
        raise ValueError(f"d_t, se, dof and groups must be 1-d of one length, not {d.shape}, {s.shape}, "
                         f"{f.shape}, {g.shape}")
    if window < 0:
        raise ValueError(f"window must be at least 0, not {window}")
    if not 0.0 <= own_weight <= 1.0:
        raise ValueError(f"own_weight must be in [0, 1], not {own_weight}")
    out_se = np.full(d.shape, np.nan)
    out_dof = np.full(d.shape, np.nan)
    ok = np.flatnonzero((d > 0) & np.isfinite(d) & (s >= 0) & np.isfinite(s) & (g >= 1))
    if not len(ok):
        return out_se, out_dof
    u = g[ok] * (s[ok] / d[ok]) ** 2
    # an update whose strata give no degrees of freedom has no spread to pool (u = 0): any f will do
    fo = np.where(np.isfinite(f[ok]) & (f[ok] > 0), f[ok], 1.0)
    n = len(ok)
    # each update's window, in measured updates, summed directly: a difference of cumulative sums
    # loses a small term beside a large one (an update of relative SE 1e-2 beside a window of 1e-5)
    lo = np.maximum(np.arange(n) - window, 0)
    hi = np.minimum(np.arange(n) + window + 1, n)
    pad = np.r_[np.zeros(window), u, np.zeros(window)]
    pad2 = np.r_[np.zeros(window), u * u / fo, np.zeros(window)]
    span = np.lib.stride_tricks.sliding_window_view(pad, 2 * window + 1)  # (n, 2W + 1): zeros beyond the run
    tot, tot2 = span.sum(axis=1), np.lib.stride_tricks.sliding_window_view(pad2, 2 * window + 1).sum(axis=1)
    # v_t = w u_t + (1 - w) mean_window(u): the own term weighs a = w + (1 - w) / m (it is in its
    # own window too), each other one b = (1 - w) / m; Welch-Satterthwaite over the independent
    # samples, (sum of the terms)^2 / sum of (term^2 / its dof)
    m = (hi - lo).astype(np.float64)
    a = own_weight + (1.0 - own_weight) / m
    b = (1.0 - own_weight) / m
    var = a * u + b * (tot - u)
    den = a * a * u * u / fo + b * b * (tot2 - u * u / fo)
    out_se[ok] = d[ok] * np.sqrt(np.maximum(var, 0.0) / g[ok])
    with np.errstate(divide="ignore", invalid="ignore"):
        out_dof[ok] = np.where(den > 0, var * var / np.where(den > 0, den, 1.0), np.nan)
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


def t975(dof: float) -> float:
    """The 97.5 % quantile of Student's t on ``dof`` degrees of freedom (at least one); the
    normal's where ``dof`` is NaN or infinite."""
    from scipy import special

    if not (dof == dof) or math.isinf(dof):
        return 1.959963984540054
    return float(special.stdtrit(max(float(dof), 1.0), 0.975))


__all__ = ["MODERATION_WINDOW", "OWN_WEIGHT", "moderated_by_pair", "moderated_d_t_se", "t975"]
