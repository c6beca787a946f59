"""``iproj.group_jackknife`` makes each group's tilt bias after the projections' batches, in
batches of its own (``TILT_BATCH``) and on threads, from each sample's lambda . z: the same numbers
to the last bit as ``fixed_tilt_bias`` at the jackknife's tilt, and to rounding as the per-group
definition (``_group_term`` deleting each row in turn) -- on groups of equal blocks with a
group whose features are constant, one whose rows are all on one side, heavy weights, and the
projections' batches and the bias's not aligned."""

from __future__ import annotations

import numpy as np
import pytest

from reward_lens.measure.efficiency import iproj


def _samples(seed, n_pairs=37, g=6, m=7, k=3):
    rng = np.random.default_rng(seed)
    codes = np.repeat(np.arange(g), m)
    side = np.tile(np.r_[np.zeros(4, bool), np.ones(m - 4, bool)], g)
    side[codes == 2] = False  # a group the held-out draw did not reach: no correction there
    z = rng.normal(size=(n_pairs, g * m, k)) * [1.0, 3.0, 0.1]
    z[:, codes == 4] = z[:, [4 * m]]  # a group whose features are constant: phi_g = 0, no correction
    r = 0.3 * z[:, :, 0] + 0.2 * rng.normal(size=(n_pairs, g * m))
    r[::5] = 2.0 * rng.standard_cauchy(size=(len(r[::5]), g * m))  # heavy weights
    return z, r, codes, side


@pytest.mark.parametrize("threads", [1, 2])
def test_the_jackknifes_tilt_bias_is_fixed_tilt_bias(threads, monkeypatch):
    z, r, codes, side = _samples(threads)
    monkeypatch.setattr(iproj, "THREADS", threads)
    monkeypatch.setattr(iproj, "BATCH_FLOATS", 3000)  # the projections in batches of a few samples
    monkeypatch.setattr(iproj, "TILT_BATCH", 10)  # the bias in batches of others
    jk = iproj.group_jackknife(z, r, codes, 6, side, "two_step")
    want = iproj.fixed_tilt_bias(z, r, codes, 6, side, jk.lam)
    assert np.array_equal(jk.bias, want)
    assert (jk.bias[:, 2] == 0).all() and (jk.bias[:, 4] == 0).all() and (jk.bias != 0).any()
    # the per-group definition (the loop over groups that layouts of unequal groups take)
    monkeypatch.setattr(iproj, "blocks", lambda codes, total: None)
    loop = iproj.fixed_tilt_bias(z, r, codes, 6, side, jk.lam)
    np.testing.assert_allclose(jk.bias, loop, rtol=1e-9, atol=1e-14 * np.abs(loop).max())
