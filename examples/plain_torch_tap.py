"""A second tap adapter: a hand-written GRPO loop in plain torch (no TRL) driving reward-lens's
trainer-neutral tap core (``reward_lens.taps.core.TapCore``) through its documented interface
(docs/recording.md, "Write an adapter"). Run it to record a run the books read:

    python examples/plain_torch_tap.py runs/plain --steps 6
    reward-lens report runs/plain

The loop: a tiny Qwen3 built in code (seeded, nothing downloaded) answers ``GROUPS`` prompts with
``GENERATIONS`` completions each per step, sampled by ``model.generate``; the reward is the share
of lowercase letters; advantages are the group-normalised rewards; the loss is the
policy-gradient surrogate -mean(A * log pi(y)); AdamW takes the step. Every line that talks to
the tap is marked ``# tap``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent

GROUPS, GENERATIONS, MAX_NEW = 4, 8, 16
PROMPTS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


def lowercase(texts: list[str]) -> list[float]:
    return [sum(c.islower() for c in t) / max(len(t), 1) for t in texts]


def build(seed: int = 3):
    sys.path.insert(0, str(REPO / "tools"))
    import make_reference_records as gen  # the reference records' byte tokenizer and tiny Qwen3

    sys.path.pop(0)
    tok = gen.build_tokenizer()
    return gen.build_model(len(tok), seed, tok), tok


def generate(model, tok, rows: list[list[int]], temperature: float) -> list[list[int]]:
    """Completions of the prompt ``rows`` (token ids), left-padded into one batch; each cut after
    its first EOS (kept)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    att = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, max_new_tokens=MAX_NEW, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)[:, width:].tolist()
    cut = []
    for c in out:
        cut.append(c[:c.index(tok.eos_token_id) + 1] if tok.eos_token_id in c else c)
    return cut


def train(record_dir: str | Path, steps: int = 6, seed: int = 3, lr: float = 1e-2, budget: float | None = None,
          **settings):
    from reward_lens.taps.core import Generation, TapCore  # tap
    from reward_lens.taps.settings import tap_settings  # tap

    torch.manual_seed(seed)
    model, tok = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    temperature = 1.0

    def reward_rows(rows):  # tap: the reward function on the tap's extra completions
        for r, v in zip(rows, lowercase([r.completion for r in rows])):
            r.rewards, r.reward = {"lowercase": v}, v

    core = TapCore(record_dir, model, tap_settings(budget=budget, overwrite=True, **settings),  # tap
                   pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                   decode=lambda ids: tok.batch_decode(ids, skip_special_tokens=True), temperature=temperature,
                   framework={"name": "plain-torch"}, optimizer="adamw", reward=reward_rows,
                   trainer_config={"num_generations": GENERATIONS, "learning_rate": lr, "max_completion_length": MAX_NEW,
                                   "temperature": temperature},
                   notes=["recorded by examples/plain_torch_tap.py: a hand-written GRPO loop, no TRL"])
    core.begin()  # tap
    for step in range(steps):
        texts = [PROMPTS[(step * GROUPS + g) % len(PROMPTS)] for g in range(GROUPS)]
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in texts for _ in range(GENERATIONS)]
        prompts = [p for p in texts for _ in range(GENERATIONS)]
        model.eval()
        extra = core.extra_requests(step, prompt_ids, prompts, group_size=GENERATIONS)  # tap
        with core.capture(len(extra), len(prompt_ids) + len(extra)):  # tap
            completions = generate(model, tok, prompt_ids + extra, temperature)
        core.extras_generated(completions[len(prompt_ids):])  # tap
        completions = completions[:len(prompt_ids)]  # the extras leave the batch: never trained on
        texts_out = tok.batch_decode(completions, skip_special_tokens=True)
        rewards = np.array(lowercase(texts_out))
        by_group = rewards.reshape(GROUPS, GENERATIONS)
        adv = ((by_group - by_group.mean(1, keepdims=True)) / (by_group.std(1, keepdims=True) + 1e-4)).ravel()
        core.on_generation(Generation(  # tap
            step=step, prompts=prompts, completions=texts_out,
            prompt_ids=[torch.tensor(p) for p in prompt_ids], completion_ids=[torch.tensor(c) for c in completions],
            rewards=rewards[:, None], all_rewards=rewards[:, None], reward_names=["lowercase"],
            reward_weights=np.ones(1), advantages=adv.tolist(), group_size=GENERATIONS))
        model.train()
        loss = 0.0
        for p, c, a in zip(prompt_ids, completions, adv):
            ids = torch.tensor([p + c])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1] / temperature
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).sum()
            loss = loss - float(a) * logp / len(prompt_ids)
        opt.zero_grad()
        loss.backward()
        unclipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        core.before_optimizer_step(step, learning_rate=lr, grad_norm_unclipped=unclipped, max_grad_norm=1.0)  # tap
        opt.step()
        core.after_optimizer_step(step)  # tap
        if core.end_step(step):  # tap: a live finding at stop_on or above
            break
    core.end(steps)  # tap
    return core


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    train(a.record, a.steps)
    print(f"recorded {a.steps} steps in {a.record}: reward-lens report {a.record}")
