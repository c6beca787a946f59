"""D_t = KL(pi_{t+1} || pi_t), exactly, from two checkpoints.

By the chain rule, the KL between the two sequence distributions is

    KL(pi_new || pi_old) = E_{y ~ pi_new} [ sum_j KL(pi_new(.|y_<j) || pi_old(.|y_<j)) ],

so the full-vocabulary KL at every completion position of a sequence sampled from the
*post-step* policy, summed over the sequence, is an unbiased estimate of D_t in nats per
sequence, with much less variance than log pi_new(y) - log pi_old(y). Its standard error is
reported across sequences.

Precision. For small steps the per-token KL is ~1e-7 while each log-probability is ~5, so
the naive float32 difference of two log-softmaxes loses most of its digits (tens of percent
per sequence). Everything here is float64: log-softmax differences keep ~1e-15 absolute
accuracy, which holds at large steps too, where the expm1/log1p form would overflow once
logits move by hundreds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from reward_lens.measure.whitebox.policy import Sequences, check_pair, sample


def token_kl(logits_new: torch.Tensor, logits_old: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary KL(softmax(new) || softmax(old)) per position, in float64."""
    return _kl(torch.log_softmax(logits_new.double(), -1), torch.log_softmax(logits_old.double(), -1))


def _kl(lp_new: torch.Tensor, lp_old: torch.Tensor) -> torch.Tensor:
    return (lp_new.exp() * (lp_new - lp_old)).sum(-1)


def summed_kl_and_logps(logits_new: torch.Tensor, logits_old: torch.Tensor, targets: torch.Tensor,
                        mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sequence, over the positions where ``mask``: the summed token KL(new || old) and
    the summed log-probabilities of ``targets`` under old and new (float64)."""
    lp_new = torch.log_softmax(logits_new.double(), -1)
    lp_old = torch.log_softmax(logits_old.double(), -1)
    kl = _kl(lp_new, lp_old)
    m = mask.double()
    tok_new = lp_new.gather(-1, targets[..., None])[..., 0]
    tok_old = lp_old.gather(-1, targets[..., None])[..., 0]
    return (kl * m).sum(-1).numpy(), (tok_old * m).sum(-1).numpy(), (tok_new * m).sum(-1).numpy()


class BlockedLogits:
    """Logits computed a block of positions at a time from the last hidden states and the
    output layer, so that nothing of size positions x vocabulary is ever held whole: at a
    152k vocabulary, 16 sequences of 512 tokens are 10 GB of float64 logits per policy.
    ``hidden`` is (n, T, d); row j's logits are (hidden[:, j] @ weight^T + bias) / temperature."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                 start: int = 0, stop: int | None = None):
        self.hidden, self.weight, self.bias, self.temperature = hidden, weight, bias, temperature
        self.start, self.stop = start, hidden.shape[1] if stop is None else stop

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.hidden.shape[0], self.stop - self.start, self.weight.shape[0])

    def rows(self, index) -> BlockedLogits:
        """The same positions for a subset of the sequences."""
        return BlockedLogits(self.hidden[index], self.weight, self.bias, self.temperature, self.start, self.stop)

    def positions(self, a: int, b: int) -> BlockedLogits:
        """Positions a..b-1 of this view (negative b counts from its end, as in slicing)."""
        b = self.stop - self.start + b if b <= 0 else b
        return BlockedLogits(self.hidden, self.weight, self.bias, self.temperature, self.start + a, self.start + b)

    def block(self, a: int, b: int) -> torch.Tensor:
        with torch.no_grad():
            h = self.hidden[:, self.start + a:self.start + b]
            out = torch.nn.functional.linear(h, self.weight, self.bias)
        return (out.float() / self.temperature).cpu()


class WholeLogits:
    """Logits held whole (an output layer that is not a plain linear map: soft-capping, a
    logit scale), behind the interface of ``BlockedLogits``."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.logits.shape)

    def rows(self, index) -> WholeLogits:
        return WholeLogits(self.logits[index])

    def positions(self, a: int, b: int) -> WholeLogits:
        """Positions a..b-1 (negative b counts from the end, as in slicing)."""
        return WholeLogits(self.logits[:, a:self.logits.shape[1] + b if b <= 0 else b])

    def block(self, a: int, b: int) -> torch.Tensor:
        return self.logits[:, a:b]


# Positions per block: at most this many float64 logits per block (32 MB), whatever the vocabulary.
BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Scores:
    """Per sequence, summed over its scored positions: the token KL(new || old), the
    log-probabilities of the sequence under old and new, and the entropy of new (nats)."""

    kl: np.ndarray
    logp_old: np.ndarray
    logp_new: np.ndarray
    entropy_new: np.ndarray


def score_blocked(new: BlockedLogits | WholeLogits, old: BlockedLogits | WholeLogits | None, targets: torch.Tensor,
                  mask: torch.Tensor, block_elements: int = BLOCK_ELEMENTS) -> Scores:
    """``Scores`` over ``BlockedLogits`` (or ``WholeLogits``), a block of positions at a time:
    peak memory independent of positions x vocabulary beyond one block. ``old`` None: only
    the new policy's log-probabilities and entropy (the KL and old ones are zeros)."""
    n, t, v = new.shape
    step = max(1, block_elements // max(1, n * v))
    kl, lp_old, lp_new, ent = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    for a in range(0, t, step):
        b = min(t, a + step)
        m = mask[:, a:b].double()
        ln = torch.log_softmax(new.block(a, b).double(), -1)
        tgt = targets[:, a:b, None]
        lp_new += (ln.gather(-1, tgt)[..., 0] * m).sum(-1).numpy()
        ent += (-(ln.exp() * ln).sum(-1) * m).sum(-1).numpy()
        if old is not None:
            lo = torch.log_softmax(old.block(a, b).double(), -1)
            kl += (_kl(ln, lo) * m).sum(-1).numpy()
            lp_old += (lo.gather(-1, tgt)[..., 0] * m).sum(-1).numpy()
    return Scores(kl, lp_old, lp_new, ent)


def summed_kl_and_logps_blocked(new: BlockedLogits | WholeLogits, old: BlockedLogits | WholeLogits,
                                targets: torch.Tensor, mask: torch.Tensor,
                                block_elements: int = BLOCK_ELEMENTS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``summed_kl_and_logps`` over ``BlockedLogits`` (or ``WholeLogits``), a block of positions
    at a time: the same sums, with peak memory independent of positions x vocabulary beyond
    one block."""
    s = score_blocked(new, old, targets, mask, block_elements)
    return s.kl, s.logp_old, s.logp_new


@dataclass(frozen=True)
class KlEstimate:
    """D_t in nats per sequence, with its standard error across sequences."""

    mean: float
    se: float
    n: int
    per_sequence: tuple[float, ...]
    estimator: str = "exact_post_samples"

    def __float__(self) -> float:
        return self.mean

    @classmethod
    def of(cls, per_sequence, estimator: str = "exact_post_samples") -> KlEstimate:
        per = np.asarray(per_sequence, dtype=float)
        se = float(per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else float("nan")
        return cls(float(per.mean()), se, len(per), tuple(per.tolist()), estimator)

    @property
    def relative_se(self) -> float:
        return self.se / self.mean if self.mean > 0 else float("inf")


@torch.no_grad()
def sequence_kl(model_new, model_old, seqs: Sequences) -> np.ndarray:
    """Per sequence: the sum over its completion positions of the token-level KL."""
    ids = seqs.ids
    logits_new = model_new(input_ids=ids).logits[:, :-1]  # position j predicts token j + 1
    logits_old = model_old(input_ids=ids).logits[:, :-1]
    return summed_kl_and_logps(logits_new, logits_old, ids[:, 1:], seqs.completion_mask[:, 1:])[0]


def kl_between(pre, post, prompt_ids: list[int], *, n: int = 16, max_new_tokens: int, eos_token_id: int | None,
               pad_token_id: int, seed: int = 0) -> KlEstimate:
    """D_t from two policies (models): sample ``n`` sequences from ``post`` and sum the
    full-vocabulary token KL to ``pre`` along each."""
    if n < 2:
        raise ValueError("D_t needs at least 2 sequences for a standard error")
    check_pair(pre, post)
    seqs = sample(post, prompt_ids, n, max_new_tokens, eos_token_id, pad_token_id, seed)
    return KlEstimate.of(sequence_kl(post, pre, seqs))


def kl_spent_from_checkpoints(run, *, n: int = 16, max_new_tokens: int | None = None,
                              seed: int = 0) -> dict[int, KlEstimate]:
    """D_t for every consecutive pair of checkpoints stored in a record, ``{t: KlEstimate}``
    (pass it as ``cost_series(..., kl_spent=...)``; the estimator is carried along).

    Sequences are sampled from the post-step checkpoint for the prompts of step t, ``n`` in
    all, spread evenly over the distinct prompts; the length cap defaults to the record's
    ``max_completion_length``.
    """
    from reward_lens.measure.whitebox.policy import WhiteboxError, load_policy
    from reward_lens.record.reader import Window

    by_step = {c.step: run.path / c.path for c in run.manifest.checkpoints}
    cap = max_new_tokens or int(run.manifest.trainer_config.get("max_completion_length") or 256)
    out: dict[int, KlEstimate] = {}
    for t in sorted(by_step):
        if t + 1 not in by_step:
            continue
        pre, tok_pre = load_policy(by_step[t])
        post, tok_post = load_policy(by_step[t + 1])
        check_pair(pre, post, tok_pre, tok_post)
        prompts = sorted(set(run.read_rollouts(["prompt"], Window(t, t)).column("prompt").to_pylist()))
        if not prompts:
            raise WhiteboxError(f"{run.path}: step {t} has no rollouts, so no prompts to sample D_t on")
        per: list[float] = []
        for i, prompt in enumerate(prompts):
            k = n // len(prompts) + (1 if i < n % len(prompts) else 0)
            if k == 0:
                continue
            ids = tok_pre(prompt, add_special_tokens=False)["input_ids"]
            seqs = sample(post, ids, k, cap, tok_post.eos_token_id, tok_post.pad_token_id, seed + 1000 * t + i)
            per.extend(sequence_kl(post, pre, seqs).tolist())
        out[t] = KlEstimate.of(per)
    return out
