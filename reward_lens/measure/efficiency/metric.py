"""The behavioural metric G = J F^-1 J^T (seed, section "The three numbers").

Rung 1 (``covariance_bound``) estimates G by the pooled within-step covariance C of the
features. Since G <= C in the Loewner order (the part of a feature's variance a parameter
move can reach is at most its variance), KL_min computed from C is a *lower* bound on the
true minimum. Rung 2 (``fisher_kernel``, from per-sequence score vectors) is the whitebox
extra's and is not in this version; asking for it raises rather than returning rung 1
under its name.

The rung-2 limit stated where it is defined: with fewer rollouts than parameters (every
real policy), the undamped kernel plug-in gives G-hat = C-hat exactly and h^2 = 1 for every
feature, whatever is true. The damping is the entire content of that estimate, which is
why every MetricG carries ``damping`` and ``damping_stable``, and a reading with
``damping_stable = False`` is to be read as the covariance bound with a shrinkage applied,
not as a measurement of G.

Degenerate features are handled by name, never by a LinAlgError: a feature whose pooled
within-step variance is zero (constant in every step, e.g. length at the cap) is excluded
as ``constant``; a feature whose variance is explained by the features before it in the
basis to within a fraction ``COLLINEAR_TOL`` is excluded as ``collinear``. Excluded
features keep their place in ``names``; they carry no share and their movement is named,
not priced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from reward_lens.measure.ledger.price import StepSample

# Relative SD below which a feature counts as constant: 1e-12 of max(1, |mean|), i.e. at
# float64 round-off, so that only genuinely constant features are excluded.
CONSTANT_TOL = 1e-12
# A feature whose residual variance fraction, given the features before it, is below this
# is collinear. 1e-10 keeps the condition number of the active correlation matrix under
# about 1e10, where a float64 Cholesky still has ~6 correct digits.
COLLINEAR_TOL = 1e-10

METHODS = ("covariance_bound", "fisher_kernel")


@dataclass(frozen=True, eq=False)
class MetricG:
    """An estimate of G in the basis ``names``.

    ``matrix`` is k x k in feature units squared. ``active`` are the features KL_min is
    computed over; ``excluded`` says why each other feature is left out. ``h2[f]`` is
    G_ff / C_ff: 1 for the covariance bound by construction.
    """

    matrix: np.ndarray
    names: tuple[str, ...]
    method: str
    n: int
    damping: float
    damping_stable: bool
    h2: dict[str, float]
    active: tuple[str, ...]
    excluded: dict[str, str] = field(default_factory=dict)
    reading: str = ""

    @property
    def active_index(self) -> np.ndarray:
        return np.array([self.names.index(a) for a in self.active], dtype=int)


def pooled_covariance(samples: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Pooled within-step covariance, grand mean, total rollouts, degrees of freedom."""
    k = len(samples[0].names)
    scatter = np.zeros((k, k))
    dof = 0
    total = np.zeros(k)
    n = 0
    for s in samples:
        if s.n >= 2:
            zc = s.z - s.z.mean(axis=0)
            scatter += zc.T @ zc
            dof += s.n - 1
        total += s.z.sum(axis=0)
        n += s.n
    if dof < 1:
        raise ValueError("metric_g needs at least one step with two or more rollouts")
    return scatter / dof, total / max(n, 1), n, dof


def _active_set(c: np.ndarray, mean: np.ndarray, names: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    excluded: dict[str, str] = {}
    sd = np.sqrt(np.clip(np.diag(c), 0, None))
    keep: list[int] = []
    for j, name in enumerate(names):
        if sd[j] <= CONSTANT_TOL * max(1.0, abs(mean[j])):
            excluded[name] = "constant: its within-step variance is zero in every step of the window"
            continue
        if keep:
            r = c[np.ix_(keep + [j], keep + [j])] / np.outer(sd[keep + [j]], sd[keep + [j]])
            rss = r[:-1, :-1]
            rsj = r[:-1, -1]
            resid = 1.0 - rsj @ np.linalg.solve(rss, rsj)
            if resid < COLLINEAR_TOL:
                with_ = ", ".join(names[i] for i in keep)
                excluded[name] = (f"collinear: {1 - resid:.12f} of its variance is explained by earlier "
                                  f"features ({with_})")
                continue
        keep.append(j)
    return tuple(names[i] for i in keep), excluded


def metric_g(samples: Sequence[StepSample], method: str = "covariance_bound", **kwargs) -> MetricG:
    """Estimate G from per-step samples.

    ``method="covariance_bound"``: G ~ C, the pooled within-step covariance; KL_min from it
    is a lower bound. ``damping`` is 0 and ``damping_stable`` True: no damping enters.
    """
    if not samples:
        raise ValueError("metric_g needs at least one StepSample")
    names = samples[0].names
    for s in samples:
        if s.names != names:
            raise ValueError(f"step {s.step} is in basis {s.names}, not {names}")
    if method == "covariance_bound":
        if kwargs:
            raise TypeError(f"covariance_bound takes no options, got {sorted(kwargs)}")
        c, mean, n, _ = pooled_covariance(samples)
        active, excluded = _active_set(c, mean, names)
        return MetricG(
            matrix=c, names=names, method=method, n=n, damping=0.0, damping_stable=True,
            h2={a: 1.0 for a in active}, active=active, excluded=excluded,
            reading="covariance bound: G is taken as the within-step covariance C >= G, so KL_min is a lower "
                    "bound on the true minimum",
        )
    if method == "fisher_kernel":
        raise ValueError("metric_g(method='fisher_kernel') needs per-sequence score vectors from the whitebox "
                         "extra, which this version does not ship; use method='covariance_bound' (a lower bound "
                         "on KL_min) and read it as such")
    raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
