"""Per-sequence score vectors s_i = grad_theta log pi(y_i | x_i) at the pre-step policy.

These are the rows of S (n x |theta|) for the rung-2 Fisher-kernel metric. The rollouts of
the step were *sampled from* that policy, so their scores are Monte-Carlo samples of the true
Fisher F = E[s s^T]; the empirical-Fisher pitfall (gradients of the loss at the data) does
not apply. It would if the rollouts were filtered or reweighted (e.g. dropped groups with
zero reward variance): then they are no longer samples of pi and this refuses.

Speed. One backward pass per sequence by default. ``batch=B`` computes B rows at a time by
``torch.func.vmap`` over ``torch.func.grad`` (equal to the loop to float32 rounding, tested);
measured on the CPU it is no faster (``bench/scores_vmap.py``: 0.8-1.0x on a 7.2M-parameter
Qwen3, where the copy of S into memory costs as much as the gradients), and it needs more
memory, so it is offered for accelerators, not chosen by default. A model vmap cannot trace
falls back to the loop.

Memory. S holds n * |theta| floats (float32). One sequence at a time, autograd's gradients
and their concatenation hold two more rows: (n + 2) * |theta| * 4 bytes at peak (98 MB for 8
rollouts of a 2.45M-parameter policy, 288 GB for 8 rollouts of a 7B one). A vmap batch of B
holds about ``ROWS_PER_BATCHED`` rows per sequence in flight (measured 3.2 on a 127M-parameter
Qwen3: per-sample gradients, their concatenation, functorch's buffers), so the figure is
(n + 4B) * |theta| * 4. The metric then builds
K = S S^T block by block (``metric.kernel_from_scores``) without a float64 copy. The figure is
computed before anything is allocated, and where even B = 1 does not fit this refuses with the
arithmetic; for large policies, ``sketch.sketched_kernel`` estimates K without S.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from reward_lens.measure.whitebox.policy import Sequences, WhiteboxError

BYTES_PER_FLOAT = 4
# Rows of |theta| floats in flight per sequence of a vmap batch (3.2 measured, rounded up).
ROWS_PER_BATCHED = 4


def default_max_bytes() -> int:
    """Half of physical memory: the score matrix must leave room for the model and K."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_memory(n: int, n_params: int, max_bytes: int | None = None) -> int:
    """Peak bytes of ``score_matrix``: S plus the two rows in flight; refused above the limit."""
    need = (n + 2) * n_params * BYTES_PER_FLOAT
    limit = default_max_bytes() if max_bytes is None else max_bytes
    if need > limit:
        raise WhiteboxError(
            f"the score matrix needs ({n} rollouts + 2 in flight) x {n_params:,} parameters x {BYTES_PER_FLOAT} "
            f"bytes = {need / 1e9:.1f} GB, above the {limit / 1e9:.1f} GB allowed; use the sketched kernel "
            "(reward_lens.measure.whitebox.sketch.sketched_kernel, memory O(n x sketch dimension + one layer)) "
            "and pass it as metric_g(..., kernel=)")
    return need


def peak_rows(n: int, b: int) -> int:
    """Rows of |theta| floats at peak: S, and what one step of the batch holds in flight."""
    return n + (2 if b == 1 else ROWS_PER_BATCHED * b)


def score_matrix(model, seqs: Sequences, *, reweighted: bool = False, max_bytes: int | None = None,
                 batch: int = 1) -> np.ndarray:
    """S (n x |theta|), float32: per-sample gradients, ``batch`` sequences at a time."""
    if reweighted:
        raise WhiteboxError("rollouts that were filtered or reweighted are not samples of the policy, so their "
                            "scores do not estimate its Fisher; pass the step's unfiltered rollouts")
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    n_params = sum(p.numel() for _, p in named)
    check_memory(seqs.n, n_params, max_bytes)
    b = max(1, min(int(batch), seqs.n))
    check_memory(peak_rows(seqs.n, b) - 2, n_params, max_bytes)
    out = np.empty((seqs.n, n_params), dtype=np.float32)
    was_training = model.training
    model.eval()
    try:
        rows = _rows_vmap(model, named, seqs, b) if b > 1 else None
        if rows is None:
            rows = _rows_loop(model, [p for _, p in named], seqs)
        for a, block in rows:
            if not bool(torch.isfinite(block).all()):  # block by block: no mask the size of S
                bad = a + int(torch.nonzero(~torch.isfinite(block).all(dim=1))[0, 0])
                raise WhiteboxError(f"non-finite scores for sequence {bad}: the policy's log-probabilities "
                                    "overflowed; no metric is built from them")
            out[a:a + len(block)] = block.numpy()
    finally:
        model.train(was_training)
    return out


def _logp(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (lp * mask[:, 1:]).sum()


def _rows_loop(model, params: list[torch.Tensor], seqs: Sequences):
    for i in range(seqs.n):
        grads = torch.autograd.grad(_logp(model, seqs.ids[i:i + 1], seqs.completion_mask[i:i + 1]), params)
        yield i, torch.cat([g.reshape(-1) for g in grads])[None]
        del grads


def _rows_vmap(model, named, seqs: Sequences, b: int):
    """Per-sample gradients by vmap(grad); None when this model cannot be vmapped (the first
    batch is tried before anything is yielded, so the caller can fall back)."""
    import warnings

    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in named}

    def one(p, ids, mask):
        return _logp(lambda **kw: functional_call(model, p, args=(), kwargs=kw), ids[None], mask[None])

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))

    def block(a: int) -> torch.Tensor:
        with warnings.catch_warnings():  # torch's note that some backward has no batching rule yet
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            g = per_sample(params, seqs.ids[a:a + b], seqs.completion_mask[a:a + b].float())
        return torch.cat([g[k].reshape(g[k].shape[0], -1) for k, _ in named], dim=1)

    try:
        first = block(0)
    except (RuntimeError, NotImplementedError, TypeError):
        return None

    def gen():
        yield 0, first
        for a in range(b, seqs.n, b):
            yield a, block(a)
    return gen()
