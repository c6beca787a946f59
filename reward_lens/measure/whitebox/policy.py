"""Loading policies without pickle, checking two checkpoints belong together, and sampling
from a policy exactly (no top-k, top-p, temperature or repetition processors)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


class WhiteboxError(ValueError):
    """Bad whitebox input: checkpoints that do not belong together, NaN scores, n = 1, ..."""


def load_policy(path: str | Path):
    """Model and tokenizer from a safetensors checkpoint directory (never a pickle)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not list(path.glob("*.safetensors")):
        raise WhiteboxError(f"{path}: no .safetensors weights; reward-lens loads checkpoints without pickle")
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()
    return model, tokenizer


def check_pair(pre, post, tokenizer_pre=None, tokenizer_post=None) -> None:
    """Refuse two policies that are not consecutive checkpoints of one run: different
    architecture or config, different parameter names or shapes, different vocabularies."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "head_dim")
    a, b = pre.config.to_dict(), post.config.to_dict()
    diff = [k for k in keys if a.get(k) != b.get(k)]
    if diff:
        raise WhiteboxError("the two checkpoints have different configs (" + ", ".join(
            f"{k}: {a.get(k)} vs {b.get(k)}" for k in diff) + "): they are not consecutive steps of one run")
    pa, pb = dict(pre.named_parameters()), dict(post.named_parameters())
    if pa.keys() != pb.keys():
        only = sorted(set(pa) ^ set(pb))[:5]
        raise WhiteboxError(f"the two checkpoints have different parameters (e.g. {only})")
    shapes = [n for n in pa if pa[n].shape != pb[n].shape]
    if shapes:
        raise WhiteboxError(f"parameter {shapes[0]} has shape {tuple(pa[shapes[0]].shape)} in one checkpoint "
                            f"and {tuple(pb[shapes[0]].shape)} in the other")
    if tokenizer_pre is not None and tokenizer_post is not None:
        if tokenizer_pre.get_vocab() != tokenizer_post.get_vocab():
            raise WhiteboxError("the two checkpoints' tokenizers have different vocabularies")


@dataclass(frozen=True)
class Sequences:
    """Sampled (or given) token sequences: ``ids`` (n, T) with the prompt first, and a mask
    of the completion positions whose tokens the policy produced (EOS included, padding not)."""

    ids: torch.Tensor  # (n, T) long
    completion_mask: torch.Tensor  # (n, T) bool: True where ids[:, j] is a completion token
    prompt_len: int

    @property
    def n(self) -> int:
        return self.ids.shape[0]


def _cache_kw(model) -> str:
    """transformers 5 names the KV cache ``cache``; 4.x named it ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample(model, prompt_ids: list[int], n: int, max_new_tokens: int, eos_token_id: int | None,
           pad_token_id: int, seed: int, temperature: float = 1.0) -> Sequences:
    """n completions of one prompt from the policy itself: softmax(logits / temperature)
    sampling in float64, with a seeded generator. Generation stops at EOS (kept) or the
    length cap."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids] * n, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    mask = torch.zeros((n, len(prompt_ids)), dtype=torch.bool)
    kw = _cache_kw(model)
    out = model(input_ids=ids, use_cache=True)
    past = getattr(out, kw)
    logits = out.logits[:, -1, :]
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, (~done)[:, None]], dim=1)
        if eos_token_id is not None:
            done = done | (nxt == eos_token_id)
        if bool(done.all()) and not synced:
            break
        out = model(input_ids=nxt[:, None], use_cache=True, **{kw: past})
        past = getattr(out, kw)
        logits = out.logits[:, -1, :]
    return Sequences(ids, mask, len(prompt_ids))


@torch.no_grad()
def sample_prompts(model, prompts: list[list[int]], n: int, max_new_tokens: int, eos_token_id: int | None,
                   pad_token_id: int, generator: torch.Generator, temperature: float = 1.0,
                   synced: bool = False) -> list[list[int]]:
    """``n`` completions of each prompt from the policy, all prompts in one batch (left-padded,
    with an attention mask): softmax(logits / temperature) sampling in float64, stopping at EOS
    (kept) or the length cap. Returns the completions' token ids, prompt by prompt, n each.
    Attention to padding is masked and rotary positions are relative, so each row samples from
    the same distribution as its prompt alone (``sample``). ``synced``: run to the length cap
    even when every row has ended, so that processes sharing collective forward passes (FSDP2)
    make the same number of them."""
    if not prompts or n < 1:
        return []
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        att[i, width - len(p):] = 1
    ids, att = ids.to(dev), att.to(dev)
    kw = _cache_kw(model)
    out = model(input_ids=ids, attention_mask=att, use_cache=True)
    past = getattr(out, kw)
    logits = out.logits[:, -1, :]
    done = torch.zeros(len(rows), dtype=torch.bool, device=dev)
    new: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.double() / temperature, dim=-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(dev)
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        new.append(torch.where(done, torch.full_like(nxt, -1), nxt))
        if eos_token_id is not None:
            done = done | (nxt == eos_token_id)
        if bool(done.all()) and not synced:
            break
        att = torch.cat([att, torch.ones((len(rows), 1), dtype=att.dtype, device=dev)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=att, use_cache=True, **{kw: past})
        past = getattr(out, kw)
        logits = out.logits[:, -1, :]
    tokens = torch.stack(new, dim=1).cpu() if new else torch.zeros((len(rows), 0), dtype=torch.long)
    return [[int(t) for t in row if t >= 0] for row in tokens.tolist()]
