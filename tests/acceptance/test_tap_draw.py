"""The tap's extra completions against the exact distribution they are meant to come from.

The TRL adapter appends the core's extra prompts to TRL's own generation batch
(``_generate_single_turn``: left-padded beside prompts of other lengths, TRL's generation config)
and takes the extra completions back out. Here a tiny Qwen3 whose output layer puts most of its
mass on a few tokens answers two prompts of different lengths with completions of up to two
tokens; thousands of extra completions drawn through that path at a fixed seed are set against
the exact sequence distribution (every first token's continuation scored in one batched forward
pass) by a chi-square test, at temperature 1 and 0.7 -- and the same test run against the other
temperature's distribution rejects, so it has the power to see a wrong sampler. The drawing
policy's log-probabilities of the drawn tokens, taken from the hidden states captured during the
generation, equal a forward pass's to float32 tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import make_reference_records as gen  # noqa: E402

sys.path.pop(0)

PROMPTS = ("ab", "cdef")
DRAWS_PER_CALL = 4  # extra completions per prompt group and call (heldout)


def _peaked_model(tok, seed: int = 7):
    """The reference tiny Qwen3 with an output layer that favours six tokens (the rest share a
    small remainder), so that two-token sequences have cells a few thousand draws can fill."""
    model = gen.build_model(len(tok), seed, tok)
    g = torch.Generator().manual_seed(seed)
    favoured = [5, 40, 77, 101, 150, 200]
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w.mul_(0.05)
        w[favoured] = torch.randn(len(favoured), w.shape[1], generator=g) * 1.6
    return model, favoured


def _trainer(tmp: Path, temperature: float):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = gen.build_tokenizer()
    model, _ = _peaked_model(tok)
    model.save_pretrained(tmp / "init")
    tok.save_pretrained(tmp / "init")
    args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=2, temperature=temperature, learning_rate=1e-3, logging_steps=1,
                      bf16=False, report_to="none", use_cpu=True, seed=11, save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=str(tmp / "init"), reward_funcs=[gen.lowercase], args=args,
                          train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}), processing_class=tok)
    return trainer, tok


def _exact(model, prompt: list[int], temperature: float, eos: int | None) -> dict[tuple[int, ...], float]:
    """Every completion of up to two tokens and its probability under the model at the temperature."""
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        v = p1.shape[0]
        both = torch.tensor([prompt + [y] for y in range(v)])
        p2 = torch.softmax(model(input_ids=both).logits[:, -1].double() / temperature, -1)
    out = {}
    for y1 in range(v):
        if y1 == eos:
            out[(y1,)] = float(p1[y1])
            continue
        for y2 in range(v):
            out[(y1, y2)] = float(p1[y1] * p2[y1, y2])
    return out


def _chi2(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], n: int) -> float:
    """The chi-square test's p-value: cells of expected count >= 5, the rest pooled into one."""
    big = [c for c, p in exact.items() if p * n >= 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [exact[c] * n for c in big]
    rest_p = 1.0 - sum(exact[c] for c in big)
    observed.append(n - sum(observed))
    expected.append(rest_p * n)
    expected = np.array(expected) * n / sum(expected)  # float rounding of the exact sum
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("temperature,other", [(1.0, 0.7), (0.7, 1.0)])
def test_extra_completions_are_exact_samples_of_the_policy(tmp_path, temperature, other):
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model of hidden size 8: threads only contend
    try:
        _draw_and_test(tmp_path, temperature, other)
    finally:
        torch.set_num_threads(threads)


def _draw_and_test(tmp_path, temperature, other):
    from reward_lens.measure.whitebox.kl import score_blocked
    from reward_lens.taps.trl import RewardLensTap

    trainer, tok = _trainer(tmp_path, temperature)
    single = trainer._generate_single_turn  # TRL's own, before the tap wraps it
    tap = RewardLensTap.attach(trainer, tmp_path / "rec", budget=None, heldout=DRAWS_PER_CALL)
    core = tap.core
    model = trainer.model
    model.eval()
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS for _ in range(2)]
    calls = 200
    for _ in range(calls):
        tap._generate_with_extras(single, prompt_ids, None, {}, 2)
    rows = core._planned.side_a
    assert len(rows) == calls * len(PROMPTS) * DRAWS_PER_CALL
    eos = tok.eos_token_id
    for g, prompt in enumerate(PROMPTS):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        drawn = [tuple(r.completion_ids.tolist()) for r in rows if r.group == f"h{g}"]
        n = len(drawn)
        counts: dict[tuple[int, ...], int] = {}
        for d in drawn:
            counts[d] = counts.get(d, 0) + 1
        assert _chi2(counts, _exact(model, ids, temperature, eos), n) > 1e-3, (prompt, temperature)
        # the test can see a wrong sampler: the same draws against the other temperature's distribution
        assert _chi2(counts, _exact(model, ids, other, eos), n) < 1e-6, (prompt, other)
    # the drawing policy's log-probabilities from the generation's hidden states = a forward pass
    some = rows[:32]
    items = [(r.prompt_ids, r.completion_ids) for r in some]
    ids, att, comp, pw = core._batch(items)
    captured = core._from_hidden(some, comp, None)
    forward = core._forward(None, ids, att).positions(pw - 1, -1)
    a = score_blocked(captured, None, ids[:, pw:], comp).logp_new
    b = score_blocked(forward, None, ids[:, pw:], comp).logp_new
    assert np.allclose(a, b, rtol=1e-5, atol=1e-4), np.abs(a - b).max()
