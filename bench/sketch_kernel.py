"""The sketched Fisher kernel against the exact one on a policy of >= 100M parameters.

A Qwen3 of 127M parameters (random init from a config in code, seeded; vocabulary 32,000,
width 768, 12 layers, untied output layer), n = 16 sequences of 16 prompt + 48 sampled
tokens. Each part runs in its own process so that its peak resident memory is its own:

* ``model``  -- build the policy and sample the sequences (the memory baseline);
* ``exact``  -- S by one backward pass per sequence (``score_matrix``), K = S S^T by blocks;
* ``sketch`` -- ``sketched_kernel`` at dimension m, rank r (one batched backward), two seeds;
* ``shard``  -- the same sketch split over 2 gloo processes (one all_reduce of K).

Printed: time and peak RSS of each, the sketch dimension, the relative error of KL_min
(0.5 dz^T G^-1 dz over the active features, damping chosen by leave-one-out for each
kernel) against the exact kernel's, the two seeds' disagreement, and the largest difference
between the 2-process and 1-process kernels. Features are functions of the sampled token ids
(a random policy has no text to read), dz = half a within-sample standard deviation each.

    .venv/bin/python bench/sketch_kernel.py [--dim 16384] [--sketch-rank 64] [--sequences 16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=6, head_dim=64, tie_word_embeddings=False, max_position_embeddings=256,
              eos_token_id=None, pad_token_id=0)
PROMPT, NEW = 16, 48


def build():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    model.eval()
    return model


def seqs_of(path: Path):
    import torch

    from reward_lens.measure.whitebox.policy import Sequences

    d = np.load(path)
    return Sequences(torch.from_numpy(d["ids"]), torch.from_numpy(d["mask"]), PROMPT)


def part(name: str, work: Path, args) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out: dict = {}
    if name == "model":
        from reward_lens.measure.whitebox.policy import sample

        model = build()
        rng = np.random.default_rng(0)
        prompt = rng.integers(1, CONFIG["vocab_size"], PROMPT).tolist()
        t = time.perf_counter()
        s = sample(model, prompt, args.n, NEW, None, 0, seed=1)
        out["sample_s"] = time.perf_counter() - t
        with torch.no_grad():  # the features: the policy's own log-probabilities of what it wrote
            lp = torch.log_softmax(model(input_ids=s.ids).logits[:, :-1].double(), -1)
            tok = lp.gather(-1, s.ids[:, 1:, None])[..., 0] * s.completion_mask[:, 1:]
        half = NEW // 2
        np.savez(work / "seqs.npz", ids=s.ids.numpy(), mask=s.completion_mask.numpy(),
                 z=np.column_stack([tok.sum(1).numpy(), tok[:, PROMPT - 1:PROMPT - 1 + half].sum(1).numpy(),
                                    (s.ids[:, PROMPT:] < CONFIG["vocab_size"] // 2).double().mean(1).numpy()]))
        out["n_parameters"] = sum(p.numel() for p in model.parameters())
    elif name == "backward":  # the floor: one batched forward and backward, no per-sequence work
        model, seqs = build(), seqs_of(work / "seqs.npz")
        t = time.perf_counter()
        emb: list = []
        h = model.get_input_embeddings().register_forward_hook(lambda m, i, o: emb.append(o))
        logits = model(input_ids=seqs.ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seqs.ids[:, 1:, None])[..., 0]
        torch.autograd.grad((logp * seqs.completion_mask[:, 1:]).sum(), emb)
        h.remove()
        out["s"] = time.perf_counter() - t
    elif name == "exact":
        from reward_lens.measure.efficiency.metric import kernel_from_scores
        from reward_lens.measure.whitebox.scores import check_memory, score_matrix

        model, seqs = build(), seqs_of(work / "seqs.npz")
        n_params = sum(p.numel() for p in model.parameters())
        out["guard_bytes"] = check_memory(seqs.n, n_params, batch=1)[1]
        t = time.perf_counter()
        s = score_matrix(model, seqs, batch=1)  # one row in flight: the memory figure measured here
        k = kernel_from_scores(s)
        out["s"] = time.perf_counter() - t
        np.save(work / "k_exact.npy", k)
        # two features linear in the scores (s_i . v, v a seeded random direction), so that
        # the kernel regression has something to find: z = S v + noise is predictable from K
        rng = np.random.default_rng(5)
        lin = np.stack([s @ rng.standard_normal(s.shape[1]).astype(np.float32) for _ in range(2)], axis=1)
        np.save(work / "z_linear.npy", lin.astype(np.float64))
    elif name == "sketch":
        from reward_lens.measure.whitebox.sketch import sketched_kernel

        model, seqs = build(), seqs_of(work / "seqs.npz")
        t = time.perf_counter()
        sk = sketched_kernel(model, seqs, dim=args.dim, rank=args.rank, seed=args.seed)
        out.update(s=time.perf_counter() - t, dim=sk.dim, n_exact=sk.n_exact, first=sk.first_stage)
        np.save(work / f"k_sketch_{args.seed}.npy", sk.kernel)
    elif name == "shard":
        import torch.distributed as dist

        from reward_lens.measure.whitebox.sketch import sketched_kernel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        model, seqs = build(), seqs_of(work / "seqs.npz")
        t = time.perf_counter()
        sk = sketched_kernel(model, seqs, dim=args.dim, rank=args.rank, seed=args.seed, group=dist.group.WORLD)
        out.update(s=time.perf_counter() - t, dim=sk.dim)
        if dist.get_rank() == 0:
            np.save(work / "k_shard.npy", sk.kernel)
        dist.barrier()
        dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)):
            return
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (work / f"{name}.json").write_text(json.dumps(out))


def run(name: str, work: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--part", name, "--work", str(work), *extra]
    if name == "shard":
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2", *cmd[1:]]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads((work / f"{name}.json").read_text())


def kl_min(k: np.ndarray, z: np.ndarray, dz: np.ndarray, rho: float | None = None) -> tuple[float, object]:
    from reward_lens.measure.efficiency.metric import fisher_kernel_metric
    from reward_lens.measure.ledger.price import StepSample

    g = fisher_kernel_metric([StepSample(0, ("logp", "logp_first_half", "linear_1", "linear_2"), z)], kernel=k, delta_z=dz,
                             rho=rho)
    idx = [g.names.index(a) for a in g.active]
    ga = g.matrix[np.ix_(idx, idx)]
    return float(0.5 * dz[idx] @ np.linalg.solve(ga, dz[idx])), g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part")
    ap.add_argument("--work")
    ap.add_argument("--sketch-rank", dest="rank", type=int, default=64)
    ap.add_argument("--dim", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequences", dest="n", type=int, default=16)
    args = ap.parse_args()
    if args.part:
        return part(args.part, Path(args.work), args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = ["--sketch-rank", str(args.rank), "--dim", str(args.dim), "--sequences", str(args.n)]
        base = run("model", work, common)
        floor = run("backward", work, common)
        exact = run("exact", work, common)
        sk = [run("sketch", work, [*common, "--seed", str(s)]) | {"seed": s} for s in (0, 1)]
        for s in (0, 1):
            sk[s]["k"] = np.load(work / f"k_sketch_{s}.npy")
        shard = run("shard", work, [*common, "--seed", "0"])
        z = np.load(work / "seqs.npz")["z"]
        lin = np.load(work / "z_linear.npy")
        k_exact = np.load(work / "k_exact.npy")
        k_shard = np.load(work / "k_shard.npy")
    # features: log pi(y) and its first half (which the random policy's kernel interpolates),
    # and the two linear ones with noise of their own size (a regression with an interior optimum)
    noise = np.random.default_rng(6).standard_normal(lin.shape) * lin.std(axis=0, ddof=1)
    z = np.column_stack([z[:, :2], lin + noise])
    dz = 0.5 * z.std(axis=0, ddof=1)
    ref, g_ref = kl_min(k_exact, z, dz)
    print(f"policy: Qwen3, {base['n_parameters'] / 1e6:.1f}M parameters; n = {args.n} sequences of {PROMPT} + {NEW} "
          f"tokens; model + sampling peak RSS {base['peak_mib']:.0f} MiB")
    print(f"floor (one batched forward + backward, no per-sequence work): {floor['s']:.1f} s, peak RSS "
          f"{floor['peak_mib']:.0f} MiB (+{floor['peak_mib'] - base['peak_mib']:.0f})")
    print(f"exact kernel: {exact['s']:.1f} s, peak RSS {exact['peak_mib']:.0f} MiB (+{exact['peak_mib'] - base['peak_mib']:.0f}"
          f" over the model; the guard's figure for S and the rows in flight {exact['guard_bytes'] / 2 ** 20:.0f} MiB); KL_min {ref:.4g}, "
          f"damping stable: {g_ref.damping_stable}, rho {g_ref.diagnostics['rho']:.3g}, "
          f"df {g_ref.diagnostics['df']:.1f} of n = {args.n}")
    rhos = (0.01, 0.1, 1.0)
    refs = [kl_min(k_exact, z, dz, r)[0] for r in rhos]
    errs = []
    for s in sk:
        val, g = kl_min(s["k"], z, dz)
        errs.append(abs(val - ref) / ref)
        kerr = np.linalg.norm(s["k"] - k_exact) / np.linalg.norm(k_exact)
        fixed = [abs(kl_min(s["k"], z, dz, r)[0] - ref_r) / ref_r for r, ref_r in zip(rhos, refs)]
        print(f"sketch rank {args.rank}, seed {s['seed']}: dimension {s['dim']:,} (first stage {s['first']:,}), "
              f"{s['s']:.1f} s ({exact['s'] / s['s']:.1f}x faster), peak RSS {s['peak_mib']:.0f} MiB "
              f"(+{s['peak_mib'] - base['peak_mib']:.0f}); KL_min {val:.4g}, relative error {errs[-1]:.1%}; "
              f"at fixed damping rho = {', '.join(map(str, rhos))}: {', '.join(f'{e:.1%}' for e in fixed)}; "
              f"||K~ - K||_F / ||K||_F {kerr:.2%}")
    _, g2 = kl_min(sk[0]["k"], z, dz)
    from reward_lens.measure.efficiency.metric import fisher_kernel_metric
    from reward_lens.measure.ledger.price import StepSample

    both = fisher_kernel_metric([StepSample(0, ("logp", "logp_first_half", "linear_1", "linear_2"), z)], kernel=sk[0]["k"],
                                kernel_check=sk[1]["k"], delta_z=dz)
    print(f"two seeds: KL_min disagreement {both.diagnostics['sketch_disagreement']:.1%} "
          f"(damping_stable: {both.damping_stable})")
    diff = np.abs(k_shard - sk[0]["k"]).max() / np.abs(sk[0]["k"]).max()
    print(f"2 gloo processes (all_reduce of the {args.n}x{args.n} kernel): {shard['s']:.1f} s, "
          f"max relative difference from 1 process {diff:.1e}")


if __name__ == "__main__":
    main()
