"""A tiny policy and a plain GRPO-shaped loop for driving the tap core call by call (tests of
issue 61: what an adapter hands over is checked at the call; what it leaves is readable)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

VOCAB, PAD, EOS = 12, 0, 1


class TinyPolicy(torch.nn.Module):
    """An embedding and a linear output layer: enough of a causal LM for the tap's scoring."""

    def __init__(self, vocab: int = VOCAB, width: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.config = SimpleNamespace(vocab_size=vocab, _name_or_path="tiny-policy")

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.mix(torch.cumsum(self.emb(input_ids), dim=1)))
        return SimpleNamespace(logits=self.head(h))


def decode(rows):
    return ["".join(chr(97 + (t % 26)) for t in r if t not in (PAD, EOS)) for r in rows]


def core_for(record_dir, model, **settings):
    from reward_lens.taps.core import TapCore
    from reward_lens.taps.settings import tap_settings

    settings = {"budget": None, "overwrite": True, "check_every": 0, **settings}
    return TapCore(record_dir, model, tap_settings(**settings), pad_id=PAD, eos_id=EOS, decode=decode,
                   framework={"name": "plain-torch"}, optimizer="sgd",
                   trainer_config={"num_generations": 4, "learning_rate": 0.05, "max_completion_length": 6})


def sample(rng: np.random.Generator, n: int, length: int = 5) -> list[list[int]]:
    return [[int(x) for x in rng.integers(2, VOCAB, size=int(rng.integers(1, length + 1)))] + [EOS] for _ in range(n)]


def generation(step: int, rng: np.random.Generator, groups: int = 2, size: int = 4, **override):
    """Step ``step``'s batch as a plain loop hands it over: rewards the share of even tokens,
    group-normalised advantages. ``override``: fields replaced (a NaN advantage, ...)."""
    from reward_lens.taps.core import Generation

    prompts = [[2 + g, 3 + g] for g in range(groups) for _ in range(size)]
    comps = sample(rng, len(prompts))
    rewards = np.array([np.mean([t % 2 == 0 for t in c]) for c in comps])
    by = rewards.reshape(groups, size)
    adv = ((by - by.mean(1, keepdims=True)) / (by.std(1, keepdims=True) + 1e-4)).ravel().tolist()
    fields = dict(step=step, prompts=decode(prompts), completions=decode(comps),
                  prompt_ids=[torch.tensor(p) for p in prompts], completion_ids=[torch.tensor(c) for c in comps],
                  rewards=rewards[:, None], all_rewards=rewards[:, None], reward_names=["even"],
                  reward_weights=np.ones(1), advantages=adv, group_size=size)
    fields.update(override)
    return Generation(**fields)


def optimizer_step(core, model, opt, step: int, batch, **override):
    """A policy-gradient step on ``batch``: the tap's calls around it."""
    loss = 0.0
    for p, c, a in zip(batch.prompt_ids, batch.completion_ids, batch.advantages):
        a = 0.0 if a is None or not np.isfinite(a) else float(a)
        ids = torch.cat([torch.as_tensor(p), torch.as_tensor(c)])[None]
        logits = model(ids).logits[0, len(p) - 1:-1]
        loss = loss - a * torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(c)[:, None]).sum()
    opt.zero_grad()
    (loss / max(1, len(batch.prompt_ids))).backward()
    kw = dict(learning_rate=0.05, grad_norm_unclipped=None, max_grad_norm=None)
    kw.update(override)
    core.before_optimizer_step(step, **kw)
    opt.step()
    core.after_optimizer_step(step)
    core.end_step(step)


def run_loop(record_dir, steps: int = 3, seed: int = 0, generations: dict | None = None, **settings):
    """A whole loop of ``steps`` steps; ``generations``: step -> Generation overrides."""
    model = TinyPolicy(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    core = core_for(record_dir, model, **settings)
    rng = np.random.default_rng(seed)
    core.begin()
    for t in range(steps):
        batch = generation(t, rng, **(generations or {}).get(t, {}))
        extra = core.extra_requests(t, [p.tolist() for p in batch.prompt_ids], batch.prompts, group_size=batch.group_size)
        core.extras_generated(sample(rng, len(extra)))
        core.on_generation(batch)
        optimizer_step(core, model, opt, t, batch)
    core.end(steps)
    return core
