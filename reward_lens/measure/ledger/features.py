"""Surface features of a completion: the behaviours the cost book prices.

Each feature is named, documented, and computed vectorised over an Arrow column with
``pyarrow.compute`` string kernels (no Python loop per completion). ``SurfaceFeatures.names``
is the feature basis, whole and in order: it is the join key of G, dz and the Shapley
shares throughout the package.

Fractions are over Unicode characters of the decoded completion; an empty completion has
every fraction 0. The default basis leaves out a character-class partition's last member
(control characters), since the fractions of a full partition sum to one and are exactly
collinear.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reward_lens.record.errors import RecordError


@dataclass(frozen=True)
class Feature:
    name: str
    doc: str
    column: str
    compute: Callable[[pa.ChunkedArray], pa.ChunkedArray | pa.Array]


def _len(col):
    return pc.utf8_length(col)


def _frac(pattern: str):
    def f(col):
        n = pc.max_element_wise(pc.utf8_length(col), 1)
        return pc.divide(pc.cast(pc.count_substring_regex(col, pattern=pattern), pa.float64()), pc.cast(n, pa.float64()))
    return f


FEATURES: dict[str, Feature] = {f.name: f for f in [
    Feature("len_chars", "length of the completion in characters", "completion", _len),
    Feature("n_lines", "number of lines (newlines + 1)", "completion",
            lambda c: pc.add(pc.count_substring(c, pattern="\n"), 1)),
    Feature("n_words", "number of whitespace-separated words", "completion",
            lambda c: pc.count_substring_regex(c, pattern=r"\S+")),
    Feature("frac_lower", "fraction of characters that are ASCII lowercase letters", "completion", _frac("[a-z]")),
    Feature("frac_upper", "fraction of characters that are ASCII uppercase letters", "completion", _frac("[A-Z]")),
    Feature("frac_digit", "fraction of characters that are ASCII digits", "completion", _frac("[0-9]")),
    Feature("frac_space", "fraction of characters that are ASCII whitespace", "completion", _frac(r"[ \t\n\r\f\v]")),
    Feature("frac_punct", "fraction of characters that are ASCII punctuation", "completion",
            _frac(r"[!-/:-@\[-`{-~]")),
    Feature("frac_nonascii", "fraction of characters outside ASCII (incl. U+FFFD from invalid bytes)", "completion",
            _frac(r"[^\x00-\x7F]")),
    Feature("frac_control", "fraction of ASCII control characters other than whitespace", "completion",
            _frac(r"[\x00-\x08\x0E-\x1F\x7F]")),
    Feature("len_tokens", "length of the completion in tokens (needs the record's num_tokens)", "num_tokens",
            lambda c: c),
]}

DEFAULT_BASIS = ("len_chars", "n_lines", "n_words", "frac_lower", "frac_upper", "frac_digit", "frac_space",
                 "frac_punct", "frac_nonascii")


class SurfaceFeatures:
    """The named surface features; ``names`` is the ordered basis.

    ``SurfaceFeatures()`` uses the default basis, computable from completion text alone;
    ``SurfaceFeatures(["len_tokens", "frac_lower"])`` picks features by name, in that order.
    """

    def __init__(self, names: Sequence[str] | None = None):
        chosen = tuple(names) if names is not None else DEFAULT_BASIS
        unknown = [n for n in chosen if n not in FEATURES]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; known: {sorted(FEATURES)}")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"feature basis {chosen} names a feature twice")
        if not chosen:
            raise ValueError("a feature basis needs at least one feature")
        self.names: tuple[str, ...] = chosen

    def __repr__(self) -> str:
        return f"SurfaceFeatures({list(self.names)})"

    @property
    def columns(self) -> list[str]:
        return sorted({FEATURES[n].column for n in self.names})

    def docs(self) -> dict[str, str]:
        return {n: FEATURES[n].doc for n in self.names}

    def compute(self, table: pa.Table, source: str = "rollouts") -> np.ndarray:
        """The n x k feature matrix (float64) of the rows of ``table``."""
        out = np.empty((table.num_rows, len(self.names)), dtype=np.float64)
        for j, name in enumerate(self.names):
            feat = FEATURES[name]
            if feat.column not in table.column_names:
                raise RecordError(source, f"feature `{name}` needs this column", field=feat.column)
            col = table.column(feat.column)
            if col.null_count:
                steps = table.column("step").filter(pc.is_null(col)).to_numpy() if "step" in table.column_names else None
                raise RecordError(source, f"feature `{name}` needs a value on every rollout; some are null",
                                  field=feat.column, steps=np.unique(steps) if steps is not None else None)
            try:
                values = feat.compute(col)
            except pa.ArrowInvalid as exc:  # e.g. invalid UTF-8 that a writer let through
                steps = np.unique(table.column("step").to_numpy()) if "step" in table.column_names else None
                raise RecordError(source, f"feature `{name}` cannot be computed from this column "
                                  f"({' '.join(str(exc).split())[:120]})", field=feat.column, steps=steps) from None
            out[:, j] = pa.chunked_array([values]).to_numpy() if isinstance(values, pa.Array) else values.to_numpy()
        return out
