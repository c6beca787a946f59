"""Rung 2's exact score matrix: per-sample gradients by ``torch.func.vmap`` over ``grad`` (8
sequences at a time, written here) against ``score_matrix`` (one backward pass per sequence),
on a 7.2M-parameter Qwen3 (random init, seeded), 16 sequences of 16 + 48 tokens. Three
interleaved rounds; prints the median of each, their ratio, and the largest difference between
the two matrices. (The package does not use vmap yet; this measures what it would gain.)

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


def vmap_scores(model, seqs, b: int = 8) -> np.ndarray:
    import warnings

    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in model.named_parameters()}

    def logp(p, ids, mask):
        logits = functional_call(model, p, args=(), kwargs={"input_ids": ids[None]}).logits[0, :-1].float()
        return (torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[..., 0] * mask[1:]).sum()

    per_sample = vmap(grad(logp), in_dims=(None, 0, 0))
    out = np.empty((seqs.n, sum(p.numel() for p in params.values())), dtype=np.float32)
    for a in range(0, seqs.n, b):
        with warnings.catch_warnings():  # torch's note that some backward has no batching rule yet
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            g = per_sample(params, seqs.ids[a:a + b], seqs.completion_mask[a:a + b].float())
        out[a:a + b] = torch.cat([g[k].reshape(g[k].shape[0], -1) for k in params], dim=1).numpy()
    return out


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
            out[b] = score_matrix(model, seqs) if b == 1 else vmap_scores(model, seqs, b)
            times[b].append(time.perf_counter() - t)
    loop, vm = statistics.median(times[1]), statistics.median(times[8])
    diff = float(np.abs(out[8] - out[1]).max() / np.abs(out[1]).max())
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, 16 sequences: one backward per "
          f"sequence {loop:.2f} s, vmap 8 at a time {vm:.2f} s ({loop / vm:.1f}x); max |diff| / max |S| {diff:.1e}")


if __name__ == "__main__":
    main()
