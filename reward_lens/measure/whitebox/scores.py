"""Per-sequence score vectors s_i = grad_theta log pi(y_i | x_i) at the pre-step policy.

These are the rows of S (n x |theta|) for the rung-2 Fisher-kernel metric. The rollouts of
the step were *sampled from* that policy, so their scores are Monte-Carlo samples of the true
Fisher F = E[s s^T]; the empirical-Fisher pitfall (gradients of the loss at the data) does
not apply. It would if the rollouts were filtered or reweighted (e.g. dropped groups with
zero reward variance): then they are no longer samples of pi and this refuses.

Speed. One backward pass per sequence. Per-sample gradients by ``torch.func.vmap`` over
``torch.func.grad`` are faster on small policies (``bench/scores_vmap.py``: 1.4-1.8x on a
7.2M-parameter Qwen3) but hold a batch of B gradients at once, B * |theta| floats beyond S;
they are not used here yet (issue 14 keeps them open). For large policies the sketch is the
route, not a faster S.

Memory. S holds n * |theta| floats (float32). While a row is computed, autograd's gradients
and their concatenation hold two more: (n + 2) * |theta| * 4 bytes at peak (98 MB for 8
rollouts of a 2.45M-parameter policy, 280 GB for 8 rollouts of a 7B one). The metric then
builds K = S S^T block by block (``metric.kernel_from_scores``) without a float64 copy. The
figure is computed before anything is allocated, and above ``max_bytes`` this refuses with the
arithmetic; for large policies, ``sketch.sketched_kernel`` estimates K without S.
"""

from __future__ import annotations

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


def score_matrix(model, seqs: Sequences, *, reweighted: bool = False, max_bytes: int | None = None) -> np.ndarray:
    """S (n x |theta|), float32, one backward pass per sequence."""
    if reweighted:
        raise WhiteboxError("rollouts that were filtered or reweighted are not samples of the policy, so their "
                            "scores do not estimate its Fisher; pass the step's unfiltered rollouts")
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    check_memory(seqs.n, n_params, max_bytes)
    out = np.empty((seqs.n, n_params), dtype=np.float32)
    was_training = model.training
    model.eval()
    try:
        for i in range(seqs.n):
            ids = seqs.ids[i:i + 1]
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            grads = torch.autograd.grad((logp * seqs.completion_mask[i:i + 1, 1:]).sum(), params)
            row = torch.cat([g.reshape(-1) for g in grads])
            if not bool(torch.isfinite(row).all()):  # row by row: no mask the size of S
                raise WhiteboxError(f"non-finite scores for sequence {i}: the policy's log-probabilities "
                                    "overflowed; no metric is built from them")
            out[i] = row.numpy()
            del grads, row
    finally:
        model.train(was_training)
    return out
