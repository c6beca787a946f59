"""Rung 2's exact score matrix, the package's two paths: ``score_matrix(batch=8)`` (per-sample
gradients by ``torch.func.vmap`` over ``grad``, 8 sequences at a time) against
``score_matrix(batch=1)`` (one backward pass per sequence, the default), on a 7.2M-parameter Qwen3 (random
init, seeded), 16 sequences of 16 + 48 tokens. Three interleaved rounds; prints the median of
each, their ratio, and the largest difference between the two matrices.

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


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         tie_word_embeddings=False)).eval()
    seqs = sample(model, list(range(1, 17)), 16, 48, None, 0, seed=1)
    times: dict[int, list[float]] = {1: [], 8: []}
    out = {}
    for _ in range(3):
        for b in (1, 8):
            t = time.perf_counter()
            out[b] = score_matrix(model, seqs, batch=b)
            times[b].append(time.perf_counter() - t)
    loop, vm = statistics.median(times[1]), statistics.median(times[8])
    diff = float(np.abs(out[8] - out[1]).max() / np.abs(out[1]).max())
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, 16 sequences: one backward per "
          f"sequence {loop:.2f} s, vmap 8 at a time {vm:.2f} s ({loop / vm:.1f}x); max |diff| / max |S| {diff:.1e}")


if __name__ == "__main__":
    main()
