"""Surface features of a completion: the seed's default basis, declared in
``specs/features/surface.yaml``.

``SurfaceFeatures()`` is that file's default basis; ``SurfaceFeatures(["len_tokens",
"frac_lower"])`` picks its features by name, in that order. Both are ``FeatureBasis`` objects
(``reward_lens.measure.ledger.basis``): ``names`` is the basis, whole and in order, and the
join key of G, dz and the Shapley shares throughout the package; a user's own basis is a YAML
file of the same form (``--features FILE``).
"""

from __future__ import annotations

from collections.abc import Sequence

from reward_lens.measure.ledger.basis import FeatureBasis, load_basis, surface_definitions


def _defs():
    return surface_definitions()[0]


def default_basis() -> tuple[str, ...]:
    return surface_definitions()[1]


class SurfaceFeatures(FeatureBasis):
    """The named surface features of specs/features/surface.yaml; ``names`` is the ordered basis."""

    def __init__(self, names: Sequence[str] | None = None):
        defs = _defs()
        chosen = tuple(names) if names is not None else default_basis()
        unknown = [n for n in chosen if n not in defs]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; known: {sorted(defs)}")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"feature basis {chosen} names a feature twice")
        if not chosen:
            raise ValueError("a feature basis needs at least one feature")
        super().__init__([defs[n] for n in chosen], source="specs/features/surface.yaml", name="surface")

    def __repr__(self) -> str:
        return f"SurfaceFeatures({list(self.names)})"


def features_from(spec: str | None) -> FeatureBasis:
    """The basis a command names: ``None`` for the surface default, else a YAML file."""
    return SurfaceFeatures() if spec is None else load_basis(spec)


# The seed's names, kept importable.
DEFAULT_BASIS = default_basis()
