"""Rung 2's exact score matrix, the package's two paths: ``score_matrix(batch=8)`` (per-sample
gradients by ``torch.func.vmap`` over ``grad``, 8 sequences at a time) against
``score_matrix(batch=1)`` (one backward pass per sequence, the default), on a 7.2M-parameter Qwen3 (random
init, seeded), 16 sequences of 16 + 48 tokens. Three interleaved rounds; prints the median of
each, their ratio, and the largest difference between the two matrices.

Also timed, as the baseline of both: S formed the way ``score_matrix`` formed it until
2026-12-01 (each row's gradients concatenated into a new tensor, then ``torch.isfinite`` over
it, then copied into S), kept here verbatim. The package now copies each gradient once, into
its place in S, and tests finiteness by one float32 sum (``isfinite`` only when the sum is not
finite); on this model the concatenation and the mask were about half the loop's time.

    .venv/bin/python bench/scores_vmap.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reward_lens.measure.whitebox.policy import sample  # noqa: E402
from reward_lens.measure.whitebox.scores import score_matrix  # noqa: E402


def formed_before(model, seqs) -> np.ndarray:
    """The one-backward-per-sequence path as it was: cat, isfinite mask, copy."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = np.empty((seqs.n, sum(p.numel() for p in params)), dtype=np.float32)
    for i in range(seqs.n):
        ids = seqs.ids[i:i + 1]
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        grads = torch.autograd.grad((logp * seqs.completion_mask[i:i + 1, 1:]).sum(), params)
        chunk = torch.cat([g.reshape(-1) for g in grads])[None]
        assert bool(torch.isfinite(chunk).all(dim=1).all())
        out[i:i + 1] = chunk.numpy()
    return out


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         tie_word_embeddings=False)).eval()
    seqs = sample(model, list(range(1, 17)), 16, 48, None, 0, seed=1)
    times: dict[int, list[float]] = {0: [], 1: [], 8: []}
    out = {}
    for _ in range(3):
        for b in (0, 1, 8):
            t = time.perf_counter()
            out[b] = formed_before(model, seqs) if b == 0 else score_matrix(model, seqs, batch=b)
            times[b].append(time.perf_counter() - t)
    before, loop, vm = (statistics.median(times[b]) for b in (0, 1, 8))
    diff = float(np.abs(out[8] - out[1]).max() / np.abs(out[1]).max())
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, 16 sequences, medians of 3 "
          f"interleaved rounds:\n  one backward per sequence as S was formed before: {before:.2f} s\n"
          f"  score_matrix(batch=1): {loop:.2f} s ({before / loop:.1f}x faster)\n"
          f"  score_matrix(batch=8), vmap over grad: {vm:.2f} s ({loop / vm:.1f}x batch=1, {before / vm:.1f}x before)\n"
          f"  max |S(batch=8) - S(batch=1)| / max |S| {diff:.1e}; before vs batch=1 "
          f"{float(np.abs(out[0] - out[1]).max()):.1e}")


if __name__ == "__main__":
    main()
