"""Whitebox pieces on their own: the token KL's precision, pair checks, the score matrix,
the rung-2 kernel metric against its closed forms, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reward_lens.measure.efficiency import metric_g
from reward_lens.measure.ledger.price import StepSample
from reward_lens.measure.whitebox.kl import token_kl
from reward_lens.measure.whitebox.policy import Sequences, WhiteboxError, check_pair, load_policy
from reward_lens.measure.whitebox.scores import check_memory, score_matrix
from reward_lens.record import open_run
from tests.conftest import LONG


def _reference_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.longdouble), b.astype(np.longdouble)
    la = a - a.max(-1, keepdims=True)
    la = la - np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    return (np.exp(la) * (la - lb)).sum(-1)


def test_token_kl_is_accurate_where_naive_float32_is_not():
    rng = np.random.default_rng(0)
    old = rng.normal(scale=3.0, size=(64, 260)).astype(np.float32)
    new = old + rng.normal(scale=3e-4, size=old.shape).astype(np.float32)  # a tiny step: KL ~ 1e-7
    ref = _reference_kl(new, old)
    ours = token_kl(torch.from_numpy(new), torch.from_numpy(old)).numpy()
    np.testing.assert_allclose(ours, ref.astype(float), rtol=1e-6)
    lp_new = torch.log_softmax(torch.from_numpy(new), -1)
    lp_old = torch.log_softmax(torch.from_numpy(old), -1)
    naive = (lp_new.exp() * (lp_new - lp_old)).sum(-1).numpy()
    rel = np.abs(naive - ref.astype(float)) / ref.astype(float)
    assert np.median(rel) > 0.05  # float32 differences of log-softmaxes lose the answer
    # ... and at a huge step (logits moved by hundreds) the float64 form stays finite.
    far = token_kl(torch.from_numpy(old * 100), torch.from_numpy(old))
    assert torch.isfinite(far).all() and (far > 0).all()


@pytest.fixture(scope="module")
def policy():
    run = open_run(LONG)
    return load_policy(LONG / run.manifest.checkpoints[0].path)


def test_checkpoints_that_do_not_belong_together_are_refused(policy):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model, tok = policy
    other_cfg = Qwen3Config(**{**model.config.to_dict(), "vocab_size": 300})
    with pytest.raises(WhiteboxError, match="vocab_size: 260 vs 300"):
        check_pair(model, Qwen3ForCausalLM(other_cfg))
    other_run = Qwen3ForCausalLM(Qwen3Config(**{**model.config.to_dict(), "hidden_size": 16}))
    with pytest.raises(WhiteboxError, match="hidden_size: 8 vs 16"):
        check_pair(model, other_run)
    check_pair(model, model)


def test_no_pickle_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WhiteboxError, match="no .safetensors weights"):
        load_policy(tmp_path)


def test_score_matrix_rows_are_gradients_of_log_probs(policy):
    model, tok = policy
    ids = torch.tensor([[65, 66, 67, 68, 69], [65, 66, 70, 71, 72]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.bool)
    s = score_matrix(model, Sequences(ids, mask, 2))
    assert s.shape == (2, sum(p.numel() for p in model.parameters()))
    # Finite-difference check of row 0 along a random direction.
    d = torch.randn(s.shape[1], dtype=torch.float64)
    d /= d.norm()

    def logp(eps: float) -> float:
        import copy

        m = copy.deepcopy(model).double()
        off = 0
        with torch.no_grad():
            for p in m.parameters():
                p += eps * d[off:off + p.numel()].view_as(p)
                off += p.numel()
            lp = torch.log_softmax(m(input_ids=ids[:1]).logits[:, :-1], -1).gather(-1, ids[:1, 1:, None])[..., 0]
        return float((lp * mask[:1, 1:]).sum())

    # eps = 1e-3: parts of the model (RoPE tables) stay float32 even in a float64 copy, so
    # smaller steps drown in their rounding; at 1e-3 the central difference is good to ~1e-4.
    fd = (logp(1e-3) - logp(-1e-3)) / 2e-3
    assert s[0] @ d.numpy() == pytest.approx(fd, rel=2e-3)
    with pytest.raises(WhiteboxError, match="filtered or reweighted"):
        score_matrix(model, Sequences(ids, mask, 2), reweighted=True)


def test_memory_is_estimated_before_allocating():
    # the seed's 78 MB of S, plus autograd's gradients and their concatenation for the rows in flight
    assert check_memory(8, 2_453_368, max_bytes=1 << 40, batch=1) == (1, (8 + 2) * 2_453_368 * 4)
    assert check_memory(8, 2_453_368, max_bytes=1 << 40, batch=8) == (8, (8 + 16) * 2_453_368 * 4)
    # a batch that does not fit is halved until it does: (8 + 2 x 2) rows fit in 12 rows' bytes
    assert check_memory(8, 1000, max_bytes=12 * 1000 * 4, batch=8) == (2, 12 * 1000 * 4)
    with pytest.raises(WhiteboxError, match=r"8 rollouts \+ 2 in flight\) x 7,000,000,000 parameters x 4 bytes = "
                                            r"280\.0 GB.*sketched_kernel"):
        check_memory(8, 7_000_000_000, max_bytes=64 << 30)


def test_batched_scores_equal_one_backward_per_sequence(policy):
    model, _ = policy
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(65, 90, (5, 7), generator=g)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[:, 3:] = True
    mask[2, 6] = False  # a shorter completion
    seqs = Sequences(ids, mask, 3)
    loop = score_matrix(model, seqs, batch=1)
    for b in (2, 8):  # 5 = 2 + 2 + 1: a short last batch; 8 > n
        got = score_matrix(model, seqs, batch=b)
        assert np.abs(got - loop).max() <= 1e-5 * np.abs(loop).max(), b


def test_a_forward_that_cannot_be_vmapped_is_refused_with_the_remedy(policy):
    model, _ = policy

    class Branchy(torch.nn.Module):  # data-dependent control flow: vmap cannot batch it
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            out = self.inner(input_ids=input_ids)
            if bool(out.logits.sum() > 0):
                return out
            return out

    seqs = Sequences(torch.tensor([[65, 66, 67, 68]] * 3), torch.tensor([[0, 0, 1, 1]] * 3, dtype=torch.bool), 2)
    with pytest.raises(WhiteboxError, match="pass batch=1"):
        score_matrix(Branchy(model), seqs, batch=2)
    assert score_matrix(Branchy(model), seqs, batch=1).shape[0] == 3


def _kernel_case(n=40, p=300, seed=0):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(n, p)) * np.linspace(3, 0.1, p)
    z = np.column_stack([s[:, :3].sum(1) + rng.normal(size=n), rng.normal(size=n), s[:, 5] - s[:, 7]])
    return StepSample(0, ("a", "b", "c"), z), s


def test_fisher_kernel_equals_the_primal_formula():
    sample, s = _kernel_case()
    n = sample.n
    g = metric_g([sample], method="fisher_kernel", scores=s, rho=0.3)
    zc = sample.z - sample.z.mean(0)
    lam = g.damping
    # Primal: J (F + lambda)^-1 J^T with J = Zc^T S / n and F = S^T S / n (|theta| x |theta|).
    j = zc.T @ s / n
    f = s.T @ s / n
    primal = j @ np.linalg.solve(f + lam * np.eye(s.shape[1]), j.T)
    np.testing.assert_allclose(g.matrix, primal, rtol=1e-8, atol=1e-12)
    assert lam == pytest.approx(0.3 * np.trace(s @ s.T) / n / n)
    c = zc.T @ zc / n
    assert g.h2 == pytest.approx({k: g.matrix[i, i] / c[i, i] for i, k in enumerate(g.names)})


def test_undamped_kernel_gives_the_covariance_exactly():
    """The seed's warning: with n < |theta| and lambda -> 0, G-hat = C-hat and h2 = 1."""
    sample, s = _kernel_case()
    g = metric_g([sample], method="fisher_kernel", scores=s, rho=1e-12)
    assert all(v == pytest.approx(1.0, abs=1e-6) for v in g.h2.values())
    assert not g.damping_stable and "covariance bound with a shrinkage" in g.reading
    assert g.diagnostics["df"] > 0.99 * sample.n


def test_kernel_metric_bad_input():
    sample, s = _kernel_case()
    with pytest.raises(ValueError, match="NaN or infinite"):
        metric_g([sample], method="fisher_kernel", scores=np.where(np.arange(s.size).reshape(s.shape) == 3, np.nan, s))
    with pytest.raises(ValueError, match="one row per rollout"):
        metric_g([sample], method="fisher_kernel", scores=s[:5])
    with pytest.raises(ValueError, match="1 rollout"):
        metric_g([StepSample(0, ("a",), np.ones((1, 1)))], method="fisher_kernel", scores=np.ones((1, 4)))
    const = StepSample(0, ("a", "k"), np.column_stack([sample.z[:, 0], np.full(sample.n, 7.0)]))
    g = metric_g([const], method="fisher_kernel", scores=s, rho=0.1)
    assert g.active == ("a",) and g.excluded["k"].startswith("constant")


def test_kl_spent_from_checkpoints_in_a_record(policy, tmp_path):
    """A record holding the checkpoints of steps 0 and 1 gets D_t from them, and the cost
    book carries the estimator's name with the number."""
    import numpy as np

    from reward_lens.measure.efficiency import cost_series
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import ledger_series, steps_from_run
    from reward_lens.measure.whitebox.experiment import grpo_gradient, rollout_sequences, stepped
    from reward_lens.measure.whitebox.kl import kl_spent_from_checkpoints
    from reward_lens.record import write_run
    from reward_lens.record.reader import Window

    model, tok = policy
    src = open_run(LONG)
    step0 = src.read_rollouts(["prompt", "completion", "advantage"], Window(0, 0)).to_pydict()
    seqs = rollout_sequences(tok, step0["prompt"][0], step0["completion"], 32)
    post = stepped(model, grpo_gradient(model, seqs, np.array(step0["advantage"])), 10.0)
    ck1 = tmp_path / "ck1"
    post.save_pretrained(ck1)
    tok.save_pretrained(ck1)
    rollouts = src.read_rollouts(["group_id", "prompt", "completion", "reward", "advantage"], Window(0, 1))
    write_run(tmp_path / "rec", framework={"name": "trl"}, model={"description": "two checkpoints"},
              telemetry=[], rollouts=rollouts, trainer_config={"max_completion_length": 32},
              checkpoints={0: LONG / src.manifest.checkpoints[0].path, 1: ck1})
    run = open_run(tmp_path / "rec")
    spent = kl_spent_from_checkpoints(run, n=8)
    assert set(spent) == {0} and spent[0].n == 8 and spent[0].mean > 0 and spent[0].se > 0
    samples = steps_from_run(run, SurfaceFeatures())
    from reward_lens.measure.efficiency import metric_g

    book = cost_series(ledger_series(samples), metric_g(samples), run_=run, kl_spent=spent)
    labels = [r.kl_spent_source for r in book.rows] + [r.context.get("source") for r in book.refusals]
    assert labels == ["kl_spent (exact_post_samples)"]


def test_damping_at_the_edge_of_its_range_refuses_rung_2():
    """Features that are pure noise with respect to the scores: leave-one-out wants infinite
    damping, the optimum runs to RHO_MAX, and the cost book refuses rather than report an
    eta set by the search range."""
    from reward_lens.measure.efficiency import kl_min_series
    from reward_lens.measure.ledger.price import Ledger

    rng = np.random.default_rng(4)
    s = rng.normal(size=(40, 300))
    sample = StepSample(0, ("a", "b"), rng.normal(size=(40, 2)))
    g = metric_g([sample], method="fisher_kernel", scores=s)
    assert g.diagnostics["at_boundary"]  # on the plateau towards RHO_MAX, wherever the search stopped
    assert not g.damping_stable and "edge of its search range" in g.reading
    lg = Ledger((0, 1), ("a", "b"), np.array([0.1, 0.0]), np.array([0.05, 0.05]), np.eye(2) * 0.0025, 40, 40)
    series = kl_min_series([lg], g)
    (ref,) = series.refusals
    assert series.rows == () and ref.code == "ENVELOPE_VIOLATED" and ref.context["premise"] == "damping_unidentified"
    assert "not identified" in ref.detail


def test_an_informative_basis_gets_an_interior_damping():
    sample, s = _kernel_case()
    g = metric_g([sample], method="fisher_kernel", scores=s)
    assert not g.diagnostics["at_boundary"] and "leave-one-out" in g.reading


def test_blocked_logits_give_the_sums_of_whole_ones():
    """D_t a block of positions at a time (peak independent of T x V) equals the whole-tensor
    computation, for sub-views of rows and positions as the tap takes them."""
    from reward_lens.measure.whitebox.kl import (
        BlockedLogits,
        WholeLogits,
        summed_kl_and_logps,
        summed_kl_and_logps_blocked,
    )

    g = torch.Generator().manual_seed(0)
    n, t, d, v = 5, 11, 6, 40
    h_new, h_old = torch.randn(n, t, d, generator=g), torch.randn(n, t, d, generator=g)
    w_new, w_old = torch.randn(v, d, generator=g), torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n, t - 3), generator=g)
    mask = torch.rand(n, t - 3, generator=g) > 0.3
    whole = [summed_kl_and_logps((h @ w.T / 0.7)[:, 2:-1], (h2 @ w2.T / 0.7)[:, 2:-1], targets, mask)
             for h, w, h2, w2 in [(h_new, w_new, h_old, w_old)]][0]
    a = BlockedLogits(h_new, w_new, None, 0.7).positions(2, -1)
    b = BlockedLogits(h_old, w_old, None, 0.7).positions(2, -1)
    assert a.shape == (n, t - 3, v)
    for block in (1, 3 * n * v, 10 ** 9):  # one position per block, three, all at once
        got = summed_kl_and_logps_blocked(a, b, targets, mask, block_elements=block)
        for x, y in zip(got, whole):  # logits are float32 as the model's: matmul rounding only
            np.testing.assert_allclose(x, y, rtol=1e-6)
    rows = [0, 3]
    got = summed_kl_and_logps_blocked(a.rows(rows), b.rows(rows), targets[rows], mask[rows], block_elements=n * v)
    np.testing.assert_allclose(got[0], whole[0][rows], rtol=1e-6)
    # logits held whole (an output layer with soft-capping) behind the same interface
    wa = WholeLogits(h_new @ w_new.T / 0.7).positions(2, -1)
    wb = WholeLogits(h_old @ w_old.T / 0.7).positions(2, -1)
    assert wa.shape == (n, t - 3, v)
    got = summed_kl_and_logps_blocked(wa.rows(rows), wb.rows(rows), targets[rows], mask[rows], block_elements=3 * n * v)
    for x, y in zip(got, whole):
        np.testing.assert_allclose(x, y[rows], rtol=1e-12)


def test_non_finite_scores_are_refused_naming_the_sequence_and_a_sum_that_overflowed_is_not():
    from reward_lens.measure.whitebox.scores import _check_finite

    block = torch.zeros(4, 6)
    block[2, 5] = float("nan")
    with pytest.raises(WhiteboxError, match="non-finite scores for sequence 12"):
        _check_finite(block, 10)
    block[2, 5] = -float("inf")
    with pytest.raises(WhiteboxError, match="sequence 12"):
        _check_finite(block, 10)
    big = torch.full((2, 3), 3e38)  # every entry finite, their float32 sum is not
    assert not torch.isfinite(big.sum())
    _check_finite(big, 0)


def test_a_policy_with_an_infinite_weight_is_refused(policy):
    import copy

    model = copy.deepcopy(policy[0])
    with torch.no_grad():
        model.get_input_embeddings().weight[65, 0] = float("inf")  # token 65 opens every sequence
    ids = torch.tensor([[65, 66, 67, 68]] * 2)
    with pytest.raises(WhiteboxError, match="non-finite scores for sequence 0"):
        score_matrix(model, Sequences(ids, torch.tensor([[0, 0, 1, 1]] * 2, dtype=torch.bool), 2))
