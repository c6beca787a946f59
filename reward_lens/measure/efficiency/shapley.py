"""Exact Shapley shares of KL_min over the features.

The game is v(S) = 1/2 dz_S^T (G_SS)^-1 dz_S, with v(N) = KL_min. The marginal value of
adding feature i to S is a Schur complement,

    v(S + i) - v(S) = 1/2 r_i(S)^2 / g_ii(S),
    r_i(S) = dz_i - G_iS G_SS^-1 dz_S,   g_ii(S) = G_ii - G_iS G_SS^-1 G_Si > 0,

so every marginal is >= 0 and the Shapley sum phi_i = sum_S w(|S|) (v(S+i) - v(S)) adds
non-negative terms only.

All 2^k subsets are enumerated by doubling over the features in basis order: processing
feature b splits every subset T of {0..b-1} into T and T + b, and T + b's conditional
residuals and covariance (of the features not yet processed) come from T's by one rank-one
Schur step, while v(T + b) = v(T) + 1/2 r_b(T)^2 / g_bb(T) accumulates non-negative terms.
The shares are then summed from v alone, phi_i = sum_{S ni i} w(|S|-1) v(S) - sum_{S not ni i}
w(|S|) v(S), by halving on the top bit (``_bit_sums``): about 3 * 2^k additions per weighted
copy of v, no masks or gathers. Every term v(S + i) - v(S) is a non-negative Schur complement, so a
negative share can only be rounding (of order k eps v(N)) and is set to zero. Work is
sum_b 2^b (k-b)^2 ~ 6 * 2^k per step pair for the sweep plus 2k 2^k for the sum; memory at stage b is 2^b (k-b)^2 floats per step pair, and step pairs
are processed in chunks that keep it under ``CHUNK_FLOATS``, split over threads from
``PARALLEL_MIN_FEATURES`` on or when there are several chunks (numpy releases the GIL inside
each array operation; the result does not depend on the split). Everything is vectorised across subsets and step pairs: no
linear solve per subset.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from math import factorial

import numpy as np

# Exact enumeration up to 20 features: 2^19 subsets per target, ~10^8 flops per step pair.
EXACT_MAX_FEATURES = 20
# Floats per chunk of step pairs at the widest stage (x8 bytes, plus temporaries ~3x): 2 MB, so
# that a chunk's stages stay in cache (with the threads below, 10,000 step pairs at k = 7 take
# 1.6-2.1x less than in one 4M-float chunk on one thread: bench/blocks.py).
CHUNK_FLOATS = 1 << 18


class ShapleyLimitError(ValueError):
    """More features than the exact method's stated limit."""


def _check(delta_z: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dz = np.asarray(delta_z, dtype=np.float64)
    gg = np.asarray(g, dtype=np.float64)
    squeeze = dz.ndim == 1
    dz = np.atleast_2d(dz)
    if gg.ndim == 2:
        gg = np.broadcast_to(gg, (dz.shape[0], *gg.shape))
    k = dz.shape[1]
    if gg.shape != (dz.shape[0], k, k):
        raise ValueError(f"G has shape {np.shape(g)}, delta_z {np.shape(delta_z)}: they must share the basis size")
    if k > EXACT_MAX_FEATURES:
        raise ShapleyLimitError(f"exact Shapley shares are computed for at most {EXACT_MAX_FEATURES} features "
                                f"(2^{EXACT_MAX_FEATURES} subsets); this basis has {k}")
    if not (np.isfinite(dz).all() and np.isfinite(gg).all()):
        raise ValueError("delta_z and G must be finite")
    try:
        np.linalg.cholesky(gg)
    except np.linalg.LinAlgError:
        raise ValueError("G is not positive definite on this basis: exclude constant or collinear features "
                         "first (metric_g does this and names them)") from None
    return dz, gg if not squeeze else gg


def kl_min(delta_z: np.ndarray, g: np.ndarray) -> np.ndarray:
    """1/2 dz^T G^-1 dz, by Cholesky, for one (k,) or many (P, k) movements."""
    dz, gg = _check(delta_z, g)
    chol = np.linalg.cholesky(gg)
    y = np.linalg.solve(chol, dz[..., None])[..., 0]
    out = 0.5 * np.einsum("pk,pk->p", y, y)
    return out[0] if np.ndim(delta_z) == 1 else out


def _weights(k: int) -> np.ndarray:
    return np.array([factorial(s) * factorial(k - s - 1) / factorial(k) for s in range(k)])


# Chunks of step pairs go to threads from this many features on, or whenever there are several
# chunks (many step pairs): numpy releases the GIL inside each array operation, and either way
# the operations are large enough for that to pay.
PARALLEL_MIN_FEATURES = 14
# At most this many threads (1: every chunk on the calling thread).
THREADS = os.cpu_count() or 1


@lru_cache(maxsize=4)
def _subset_weights(k: int) -> tuple[np.ndarray, np.ndarray]:
    """For every subset S (index = bit mask): w(|S|-1) where S is non-empty and w(|S|) where S is
    not the full set, 0 elsewhere -- the two weightings of v in the Shapley sum. They depend on
    k only, so they are built once (read-only)."""
    w = _weights(k)
    sizes = np.zeros(1, dtype=np.int64)
    for _ in range(k):
        sizes = np.concatenate([sizes, sizes + 1])
    w_with = np.where(sizes > 0, w[np.maximum(sizes - 1, 0)], 0.0)
    w_without = np.where(sizes < k, np.r_[w, 0.0][np.minimum(sizes, k)], 0.0)
    w_with.flags.writeable = False
    w_without.flags.writeable = False
    return w_with, w_without


def _shares_chunk(dz: np.ndarray, gg: np.ndarray) -> np.ndarray:
    p, k = dz.shape
    r = dz[:, None, :].copy()  # (P, M, m): residuals of the unprocessed features given each subset
    gc = gg[:, None, :, :].copy()  # (P, M, m, m): their conditional covariance
    v = np.zeros((p, 2 ** k))  # (P, 2^k): v(T); subset index == bit mask, filled by doubling
    for b in range(k):
        n_sub = 2 ** b
        g00 = gc[:, :, 0, 0]
        marginal = 0.5 * r[:, :, 0] ** 2 / g00  # m(T, b) for every T within {0..b-1}: exact, >= 0
        np.add(v[:, :n_sub], marginal, out=v[:, n_sub:2 * n_sub])
        if b < k - 1:
            m = k - b - 1
            # the next stage's buffers, written in place: T's rows copied, T + b's by one Schur step
            r_next = np.empty((p, 2 * n_sub, m))
            gc_next = np.empty((p, 2 * n_sub, m, m))
            col = gc[:, :, 1:, 0]
            r_next[:, :n_sub] = r[:, :, 1:]
            np.subtract(r[:, :, 1:], col * (r[:, :, 0] / g00)[..., None], out=r_next[:, n_sub:])
            gc_next[:, :n_sub] = gc[:, :, 1:, 1:]
            outer = gc_next[:, n_sub:]
            np.multiply(col[..., :, None], (col / g00[..., None])[..., None, :], out=outer)
            np.subtract(gc[:, :, 1:, 1:], outer, out=outer)
            r, gc = r_next, gc_next
    # phi_i = sum_{S ni i} w(|S|-1) v(S) - sum_{S not ni i} w(|S|) v(S): two weighted copies of v,
    # then for each i two sums over a strided view (bit i is axis 2 of a (P, 2^(k-1-i), 2, 2^i)
    # reshape): k passes over 2^k values, no masks, no gathers.
    w_with, w_without = _subset_weights(k)
    phi = _bit_sums(v * w_with, k, bit=1) - _bit_sums(v * w_without, k, bit=0)
    # every term is v(S + i) - v(S) >= 0 (a Schur complement): a negative share is rounding
    return np.maximum(phi, 0.0)


def _bit_sums(x: np.ndarray, k: int, bit: int) -> np.ndarray:
    """For each feature i, the sum of x over the subsets whose bit i is ``bit``. Halving from the
    top bit: split on it, record one half's sum, fold the halves together and go on -- about
    3 * 2^k additions in all instead of k passes over 2^k."""
    out = np.empty((x.shape[0], k))
    cur = x
    for i in reversed(range(k)):
        half = cur.shape[1] // 2
        lo, hi = cur[:, :half], cur[:, half:]
        out[:, i] = (hi if bit else lo).sum(axis=1)
        cur = lo + hi
    return out


def shapley_shares(delta_z: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Exact Shapley values of v(S) = 1/2 dz_S^T G_SS^-1 dz_S; they sum to KL_min.

    ``delta_z`` is (k,) or (P, k); ``g`` is (k, k) or (P, k, k). Returns the shares in the
    same shape as ``delta_z``, each >= 0.
    """
    dz, gg = _check(delta_z, g)
    p, k = dz.shape
    widest = max((2 ** b) * (k - b) ** 2 for b in range(k))
    step = max(1, CHUNK_FLOATS // widest)
    starts = range(0, p, step)
    workers = min(len(starts), THREADS) if k >= PARALLEL_MIN_FEATURES or len(starts) > 1 else 1

    def chunk(a: int) -> np.ndarray:
        return _shares_chunk(dz[a:a + step], np.ascontiguousarray(gg[a:a + step]))

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(chunk, starts))
    else:
        parts = [chunk(a) for a in starts]
    out = np.concatenate(parts)
    return out[0] if np.ndim(delta_z) == 1 else out
