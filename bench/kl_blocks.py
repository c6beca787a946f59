"""D_t's token KL with whole logits against blocked logits, at a real vocabulary size.

A Qwen3-shaped policy with Qwen's vocabulary (151,936), narrow and shallow so that the
logits dominate (width 64, 2 layers), two parameter sets (pi_t and a perturbed pi_{t+1}),
``--sequences`` sequences of ``--tokens`` tokens. Each way runs in its own process:

* ``whole``   -- the model's full logits for both policies, then ``summed_kl_and_logps``
  (what the tap did before: n x T x V float32 per policy, float64 temporaries of that size);
* ``blocked`` -- the last hidden states, then ``summed_kl_and_logps_blocked`` (what the tap
  does now: logits a block of positions at a time, at most ``BLOCK_ELEMENTS`` per block).

Printed: seconds and peak RSS of each over the same baseline (the model and the hidden states
alone, measured in the same run), and the largest difference between the two results.

    .venv/bin/python bench/kl_blocks.py [--sequences 4] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def models():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    pre = Qwen3ForCausalLM(cfg).eval()
    post = Qwen3ForCausalLM(cfg).eval()
    post.load_state_dict(pre.state_dict())
    with torch.no_grad():
        for p in post.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    return pre, post


def hidden_and_head(model, ids):
    import torch

    from reward_lens.measure.whitebox.kl import BlockedLogits

    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
    return BlockedLogits(h, model.lm_head.weight, model.lm_head.bias, 1.0)


def part(name: str, args, out: Path) -> None:
    import resource

    import torch

    from reward_lens.measure.whitebox.kl import summed_kl_and_logps, summed_kl_and_logps_blocked

    pre, post = models()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151936, (args.sequences, args.tokens), generator=g)
    targets, mask = ids[:, 1:], torch.ones(args.sequences, args.tokens - 1, dtype=torch.bool)
    t = time.perf_counter()
    if name == "baseline":
        a, b = hidden_and_head(post, ids), hidden_and_head(pre, ids)
        res = None
    elif name == "whole":
        with torch.no_grad():
            new, old = post(input_ids=ids).logits[:, :-1].float(), pre(input_ids=ids).logits[:, :-1].float()
        res = summed_kl_and_logps(new, old, targets, mask)
    else:
        a, b = hidden_and_head(post, ids).positions(0, -1), hidden_and_head(pre, ids).positions(0, -1)
        res = summed_kl_and_logps_blocked(a, b, targets, mask)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps({"s": seconds, "peak_mib": peak, "kl": None if res is None else res[0].tolist()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part")
    ap.add_argument("--out")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    if args.part:
        return part(args.part, args, Path(args.out))
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("baseline", "whole", "blocked"):
            out = Path(tmp) / f"{name}.json"
            subprocess.run([sys.executable, __file__, "--part", name, "--out", str(out), "--sequences",
                            str(args.sequences), "--tokens", str(args.tokens)], check=True)
            res[name] = json.loads(out.read_text())
    base = res["baseline"]["peak_mib"]
    logits_gib = args.sequences * args.tokens * 151936 * 4 / 2 ** 30
    print(f"{args.sequences} sequences x {args.tokens} tokens x 151,936 vocabulary ({logits_gib:.2f} GiB of float32 "
          f"logits per policy); baseline (model + hidden states) peak RSS {base:.0f} MiB")
    for name in ("whole", "blocked"):
        r = res[name]
        print(f"{name}: {r['s']:.2f} s, peak RSS {r['peak_mib']:.0f} MiB (+{r['peak_mib'] - base:.0f} over the baseline)")
    diff = np.max(np.abs(np.array(res["whole"]["kl"]) - np.array(res["blocked"]["kl"])) / np.abs(res["whole"]["kl"]))
    print(f"largest relative difference of the summed KL: {diff:.1e}")


if __name__ == "__main__":
    main()
