"""Per-sequence score vectors s_i = grad_theta log pi(y_i | x_i) at the pre-step policy.

These are the rows of S (n x |theta|) for the rung-2 Fisher-kernel metric. The rollouts of
the step were *sampled from* that policy, so their scores are Monte-Carlo samples of the true
Fisher F = E[s s^T]; the empirical-Fisher pitfall (gradients of the loss at the data) does
not apply. It would if the rollouts were filtered or reweighted (e.g. dropped groups with
zero reward variance): then they are no longer samples of pi and this refuses.

Speed. One backward pass per sequence by default, each gradient copied once into its place in
S and finiteness tested by one float32 sum per block of rows: the concatenation and the
``isfinite`` mask this path used before were about half its time (``bench/scores_vmap.py``
times both: 1.5-1.9x on a 7.2M-parameter Qwen3, S identical). ``batch=B`` computes B
sequences' gradients at once by ``torch.func.vmap`` over ``torch.func.grad`` (one batched
forward and backward); on two CPU cores it measured 1.1-1.4x the loop, within run-to-run noise
of it, so it is not the default: on a CPU the per-sample weight gradients (an outer product
over positions into |theta| floats per sequence) are the same work batched or not. A model
whose forward cannot be vmapped (data-dependent control flow, in-place updates of its
inputs) is refused under ``batch`` > 1 with the remedy ``batch=1``, never switched silently.
For large policies the sketch is the route, not a faster S.

Memory. S holds n * |theta| floats (float32). While a batch of B rows is computed, its
gradients and the previous batch's, still referenced, hold 2B more: the guard counts
(n + 2B) * |theta| * 4 bytes, beyond the model and B sequences' activations (98 MB for 8
rollouts of a 2.45M-parameter policy with B = 1, 280 GB for 8 rollouts of a 7B one;
``bench/sketch_kernel.py`` measured +9,398 MiB over the model against the guard's 8,722 MiB
at 127M parameters, n = 16, B = 1). B is lowered, down to 1, until that fits under
``max_bytes``; if even B = 1 does not, this refuses with the arithmetic before anything is
allocated (for large policies, ``sketch.sketched_kernel`` estimates K without S). The metric
then builds K = S S^T block by block (``metric.kernel_from_scores``) without a float64 copy.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from reward_lens.measure.whitebox.policy import Sequences, WhiteboxError

BYTES_PER_FLOAT = 4


def default_max_bytes() -> int:
    """Half of physical memory: the score matrix must leave room for the model and K."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_memory(n: int, n_params: int, max_bytes: int | None = None, batch: int = 1) -> tuple[int, int]:
    """The batch of rows computed at once and the peak bytes of ``score_matrix``: S plus two
    copies of the rows in flight, (n + 2B) |theta| 4. B is at most ``batch`` and lowered until
    the figure fits under the limit; refused when it does not fit with B = 1."""
    limit = default_max_bytes() if max_bytes is None else max_bytes
    b = max(1, min(batch, n))
    while b > 1 and (n + 2 * b) * n_params * BYTES_PER_FLOAT > limit:
        b //= 2
    need = (n + 2 * b) * n_params * BYTES_PER_FLOAT
    if need > limit:
        raise WhiteboxError(
            f"the score matrix needs ({n} rollouts + 2 in flight) x {n_params:,} parameters x {BYTES_PER_FLOAT} "
            f"bytes = {need / 1e9:.1f} GB, above the {limit / 1e9:.1f} GB allowed; use the sketched kernel "
            "(reward_lens.measure.whitebox.sketch.sketched_kernel, memory O(n x sketch dimension + one layer)) "
            "and pass it as metric_g(..., kernel=)")
    return b, need


def score_matrix(model, seqs: Sequences, *, reweighted: bool = False, max_bytes: int | None = None,
                 batch: int = 1) -> np.ndarray:
    """S (n x |theta|), float32: one backward pass per sequence, or ``batch`` sequences'
    gradients at a time by vmap over grad."""
    if reweighted:
        raise WhiteboxError("rollouts that were filtered or reweighted are not samples of the policy, so their "
                            "scores do not estimate its Fisher; pass the step's unfiltered rollouts")
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    n_params = sum(p.numel() for _, p in named)
    b, _ = check_memory(seqs.n, n_params, max_bytes, batch)
    out = np.empty((seqs.n, n_params), dtype=np.float32)
    dst = torch.from_numpy(out)  # each gradient is copied once, into its place in S
    was_training = model.training
    model.eval()
    try:
        rows = _rows_vmap(model, named, seqs, b) if b > 1 else _rows_loop(model, [p for _, p in named], seqs)
        for a, grads in rows:
            m, o = grads[0].shape[0], 0
            for g in grads:
                k = g[0].numel()
                dst[a:a + m, o:o + k].copy_(g.reshape(m, k))
                o += k
            del grads
            _check_finite(dst[a:a + m], a)
    finally:
        model.train(was_training)
    return out


def _check_finite(block: torch.Tensor, first: int) -> None:
    """Refuse non-finite scores, naming the first sequence that has one. A float32 sum is
    finite only if every term is (a NaN or an infinity carries through any sum), and it is 20x
    cheaper than ``isfinite`` over the block, which runs only when the sum is not finite (a
    NaN, an infinity, or a sum of finite terms that overflowed)."""
    if math.isfinite(float(block.sum())):
        return
    finite = torch.isfinite(block).all(dim=1)
    if not bool(finite.all()):
        i = first + int((~finite).nonzero()[0, 0])
        raise WhiteboxError(f"non-finite scores for sequence {i}: the policy's log-probabilities "
                            "overflowed; no metric is built from them")


def _rows_loop(model, params, seqs: Sequences):
    for i in range(seqs.n):
        ids = seqs.ids[i:i + 1]
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        grads = torch.autograd.grad((logp * seqs.completion_mask[i:i + 1, 1:]).sum(), params)
        yield i, [g[None] for g in grads]


def _rows_vmap(model, named, seqs: Sequences, b: int):
    import warnings

    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in named}

    def logp(p, ids, mask):
        logits = functional_call(model, p, args=(), kwargs={"input_ids": ids[None]}).logits[0, :-1].float()
        return (torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[..., 0] * mask[1:]).sum()

    per_sample = vmap(grad(logp), in_dims=(None, 0, 0))
    mask = seqs.completion_mask.float()
    for a in range(0, seqs.n, b):
        m = min(b, seqs.n - a)
        try:
            with warnings.catch_warnings():  # torch's note that some backward has no batching rule yet
                warnings.filterwarnings("ignore", message=".*batching rule.*")
                g = per_sample(params, seqs.ids[a:a + m], mask[a:a + m])
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise WhiteboxError(f"torch.func.vmap failed on this model's forward ({e}); a forward with "
                                "data-dependent control flow or in-place updates of its inputs cannot be vmapped: "
                                "pass batch=1 to score_matrix for one backward pass per sequence") from e
        yield a, [g.pop(k) for k, _ in named]
