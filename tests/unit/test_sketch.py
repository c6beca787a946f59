"""The sketched Fisher kernel, against S S^T from per-sequence backward passes (the exact
score matrix, itself checked against finite differences in test_whitebox)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from reward_lens.measure.efficiency.metric import fisher_kernel_metric, kernel_from_scores
from reward_lens.measure.ledger.price import StepSample
from reward_lens.measure.whitebox.policy import WhiteboxError, sample
from reward_lens.measure.whitebox.scores import score_matrix
from reward_lens.measure.whitebox.sketch import sketched_kernel

REPO = Path(__file__).resolve().parents[2]


def tiny(tie: bool, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie, eos_token_id=1, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg)
    seqs = sample(model, [5, 6, 7], 6, 10, 1, 0, seed=1)
    return model, seqs


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def case(request):
    model, seqs = tiny(request.param)
    s = score_matrix(model, seqs).astype(np.float64)
    return model, seqs, s @ s.T


def test_with_every_side_unprojected_the_sketch_is_the_exact_kernel(case):
    """rank >= every dimension: identity projections, so K~ must be S S^T to float32 precision.
    This checks the per-sequence plumbing: hooks, the one-hot embedding side, tied weights
    summed before the inner product, and the norm scales taken per sequence."""
    model, seqs, k = case
    sk = sketched_kernel(model, seqs, rank=10 ** 6)
    n_params = sum(p.numel() for p in model.parameters())
    assert sk.dim == sk.n_exact == sk.n_parameters == n_params
    np.testing.assert_allclose(sk.kernel, k, rtol=0, atol=1e-6 * np.abs(k).max())


def test_the_sketch_is_unbiased(case):
    """Over independent seeds the mean of K~ converges to K: every entry within 5 standard
    errors of the seed-to-seed spread (a biased sketch, e.g. projections scaled by 1/sqrt(r)
    on one side only, fails by tens of standard errors)."""
    model, seqs, k = case
    # rank 3: every kind of first stage (Kronecker sides, the dense embedding JL when untied,
    # dense JL of the norm scales); dim 60: the second stage reduces it
    ks = np.array([sketched_kernel(model, seqs, rank=3, dim=60, seed=s).kernel for s in range(150)])
    se = ks.std(axis=0, ddof=1) / np.sqrt(len(ks))
    z = np.abs(ks.mean(axis=0) - k) / se
    assert z.max() < 5, z.max()
    assert np.abs(ks[0] - k).max() > 3 * np.abs(ks.mean(0) - k).max()  # one seed alone is noisier


def test_the_sketch_is_seeded_and_reproducible(case):
    model, seqs, _ = case
    a, b, c = (sketched_kernel(model, seqs, rank=4, dim=100, seed=s) for s in (3, 3, 4))
    assert np.array_equal(a.kernel, b.kernel) and not np.allclose(a.kernel, c.kernel)
    # the first stage is at most r^2 per parameter; the second brings it to about dim
    assert a.dim <= a.first_stage < a.n_parameters and abs(a.dim - 100) <= a.matrices + 20


def _sample(n, rng):
    z = rng.normal(size=(n, 3))
    return StepSample(0, ("a", "b", "c"), z)


def test_the_metric_from_a_kernel_is_the_metric_from_the_scores():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(40, 300)) * np.linspace(3, 0.1, 300)
    z = np.column_stack([s[:, :3].sum(1) + rng.normal(size=40), rng.normal(size=40), s[:, 5] - s[:, 7]])
    smp = StepSample(0, ("a", "b", "c"), z)
    a = fisher_kernel_metric([smp], scores=s)
    b = fisher_kernel_metric([smp], kernel=s @ s.T)
    np.testing.assert_allclose(a.matrix, b.matrix, rtol=1e-9)
    assert a.damping == pytest.approx(b.damping, rel=1e-9)
    np.testing.assert_allclose(kernel_from_scores(s.astype(np.float32)), s.astype(np.float32).astype(float) @
                               s.astype(np.float32).astype(float).T, rtol=1e-12)
    with pytest.raises(ValueError, match=r"kernel has shape \(3, 3\).*\(40, 40\)"):
        fisher_kernel_metric([smp], kernel=np.eye(3))
    with pytest.raises(ValueError, match="exactly one"):
        fisher_kernel_metric([smp], scores=s, kernel=s @ s.T)


def test_two_sketch_seeds_that_disagree_make_the_damping_unstable():
    """A sketch too small to pin K gives two seeds different KL_min; the metric says so."""
    rng = np.random.default_rng(1)
    s = rng.normal(size=(40, 3000)) * np.linspace(3, 0.1, 3000)
    z = np.column_stack([s[:, :3].sum(1) + rng.normal(size=40), rng.normal(size=40), s[:, 5] - s[:, 7]])
    smp = StepSample(0, ("a", "b", "c"), z)

    def sketch(seed, m):
        p = np.random.default_rng(seed).normal(size=(3000, m)) / np.sqrt(m)
        return (s @ p) @ (s @ p).T

    dz = np.array([0.5, 0.1, 0.3])
    small = fisher_kernel_metric([smp], kernel=sketch(1, 4), kernel_check=sketch(2, 4), delta_z=dz)
    assert small.diagnostics["sketch_disagreement"] > 0.05 and not small.damping_stable
    assert "two sketch seeds disagree" in small.reading
    exact = s @ s.T
    same = fisher_kernel_metric([smp], kernel=exact, kernel_check=exact, delta_z=dz)
    assert same.diagnostics["sketch_disagreement"] == 0.0 and "two sketch seeds" not in same.reading


def test_a_parameter_without_a_per_sequence_form_is_refused_by_name():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.mix = torch.nn.Parameter(torch.randn(4, 10))

        def forward(self, input_ids):
            return type("O", (), {"logits": self.emb(input_ids) @ self.mix})()

    model = Odd()
    seqs = type(tiny(False)[1])(torch.randint(0, 10, (3, 5)), torch.ones(3, 5, dtype=torch.bool), 1)
    with pytest.raises(WhiteboxError, match=r"parameter mix \(shape \(4, 10\)\)"):
        sketched_kernel(model, seqs)


def _shard_worker(rank, world, path, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, seqs = tiny(True)
    sk = sketched_kernel(model, seqs, rank=4, dim=100, seed=7, group=dist.group.WORLD)
    if rank == 0:
        np.save(path, np.append(sk.kernel.ravel(), [sk.dim, sk.n_exact]))
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception"); the result is written, so leave without it
    import os

    os._exit(0)


def test_split_over_two_gloo_processes_the_kernel_is_the_one_process_kernel(tmp_path):
    """Each rank sketches half of the parameters; one all_reduce of the n x n matrix gives the
    single-process K~ (the projections depend on the seed and the parameter name only)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_shard_worker, args=(2, str(tmp_path / "k.npy"), port), nprocs=2, join=True)
    got = np.load(tmp_path / "k.npy")
    model, seqs = tiny(True)
    one = sketched_kernel(model, seqs, rank=4, dim=100, seed=7)
    np.testing.assert_allclose(got[:-2].reshape(one.kernel.shape), one.kernel, rtol=1e-12, atol=1e-12 * np.abs(
        one.kernel).max())
    assert (got[-2], got[-1]) == (one.dim, one.n_exact)


