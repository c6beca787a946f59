"""The cause book's column maxima and minima (``cause._column_extremes``) are numpy's own, by a
reduction over blocks of rows: a maximum does not depend on the order it is taken in."""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.measure.cause import _column_extremes


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 70_001])
def test_column_extremes_are_numpys(n):
    rng = np.random.default_rng(n)
    z = rng.normal(size=(n, 9)) * 10.0 ** rng.integers(-5, 5, size=9)
    z[rng.integers(0, n), 2] = np.inf
    for x in (z, np.asfortranarray(z), z[::2] if n > 1 else z):
        hi, lo = _column_extremes(x)
        assert np.array_equal(hi, x.max(axis=0)) and np.array_equal(lo, x.min(axis=0))
    z[rng.integers(0, n), 4] = np.nan  # NaN propagates, as numpy's does
    hi, lo = _column_extremes(z)
    assert np.array_equal(hi, z.max(axis=0), equal_nan=True) and np.array_equal(lo, z.min(axis=0), equal_nan=True)
