"""A reference for eta's bias-aware interval (``eta.bias_aware_halves``), worked out apart from
the book: scipy's root finder on scipy's t (its normal where the degrees of freedom are
infinite). The tests of the interval, of the pooled SE and of the tail allowance check against it."""

import math

from scipy import optimize, stats


def bias_aware_half(dof: float, se: float, bound: float) -> float:
    """se times the c with P(|T + bound / se| <= c) = 0.95, by brentq over [0, bound / se + 100]."""
    dist = stats.norm() if math.isinf(dof) else stats.t(dof)
    b = bound / se
    c = optimize.brentq(lambda c: dist.cdf(c - b) - dist.cdf(-c - b) - 0.95, 0.0, b + 100.0, xtol=1e-14, rtol=1e-14)
    return c * se
