"""The segmented pass over all steps gives each step's moments as step_moments does alone."""

from __future__ import annotations

import numpy as np

from reward_lens.measure.ledger.price import StepSample, all_step_moments, step_moments


def test_all_step_moments_equal_step_moments():
    rng = np.random.default_rng(0)
    samples = []
    for t in range(40):
        n = int(rng.integers(2, 40))
        # no groups; one group (rollouts become the units); several groups of unequal sizes
        groups = None if t % 5 == 0 else rng.integers(0, 1 if t % 7 == 0 else 4, n).astype(str)
        samples.append(StepSample(t, ("a", "b", "c"), rng.normal(size=(n, 3)) * [1, 10, 0.1], groups=groups))
    together = all_step_moments(samples)
    assert sorted(together) == list(range(40))
    for s in samples:
        mean, cov, units = step_moments(s)
        m2, c2, u2 = together[s.step]
        assert u2 == units
        np.testing.assert_allclose(m2, mean, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(c2, cov, rtol=1e-10, atol=1e-15 * np.abs(cov).max())


def test_group_codes_are_first_appearance_codes_for_any_labels():
    """Labels of any type (including integer labels that already are, or are not, codes in order
    of first appearance) get the codes of the definition: the order in which they first appear."""
    from reward_lens.measure.ledger.price import group_codes

    rng = np.random.default_rng(0)
    for _ in range(500):
        g = rng.integers(0, 5, int(rng.integers(1, 12)))
        for labels in (g, g.astype(str)):
            seen: dict = {}
            expected = [seen.setdefault(x, len(seen)) for x in labels.tolist()]
            codes, n = group_codes(labels)
            assert codes.tolist() == expected and n == len(seen)


def test_selection_differentials_equal_the_per_step_ones():
    from reward_lens.measure.cause import selection_differential, selection_differentials

    rng = np.random.default_rng(1)
    samples = []
    for t in range(40):
        n = int(rng.integers(2, 30))
        groups = rng.integers(0, 1 if t % 4 == 0 else 5, n).astype(str)  # every 4th step: one group
        samples.append(StepSample(t, ("a", "b"), rng.normal(size=(n, 2)) * [1, 50], advantages=rng.normal(size=n),
                                  groups=groups))
    together = selection_differentials(samples)
    for x in samples:
        s, se = selection_differential(x)
        s2, se2 = together[x.step]
        np.testing.assert_allclose(s2, s, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(se2, se, rtol=1e-8, atol=1e-13, equal_nan=True)
