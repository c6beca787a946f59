"""Truth first: does the paired ledger's interval cover the efficiency a step really had?

    python tools/paired_truth.py            # ~5 min on 2 cores; prints one line per step pair

A tiny Qwen3 (built in code, as in ``make_reference_records.py``) is trained with TRL's
``GRPOTrainer`` (8 prompts x 8 generations, AdamW at a constant 1e-2) with the reward-lens tap
attached, and the policy's parameters are kept at every step. For each step pair (t, t+1):

* **paired** -- the cost book on the record alone: step t+1's 64 rollouts, scored under pi_t
  and pi_{t+1} by the tap, give eta (debiased) with its 95 % interval;
* **oracle** -- ``N_ORACLE`` fresh completions of pi_{t+1} for the same 8 prompts (512 each),
  scored under both policies in float64: eta from the same I-projection on that large sample
  (its null k / (n - G) is ~0.002), and D_t as the full-vocabulary token KL along them;
* **in-sample** -- the same estimator fed the rollouts step t trained on (sampled from pi_t,
  scored before and after the step: the record's ``logp_pre`` / ``logp_post``), which is
  what a ledger built on those rollouts would report.

The acceptance test (``tests/acceptance/test_paired_truth.py``, slow) asserts that the paired
interval covers the oracle on at least 80 % of the step pairs it priced, that every checked pair
it did not price was refused for its heavy-tailed weights, and that the in-sample estimator's
interval does not cover it as often.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

N_ORACLE_PER_PROMPT = 512  # x 8 prompts = 4096 samples of pi_{t+1} per step
# Train 50 steps; check the step pairs from steps 1-11, where the features explain almost
# none of a step (eta near 0), and 38-48, where they explain most of it (eta near 0.8).
STEPS = 50
CHECKED = (*range(1, 12), *range(38, 49))


@dataclass
class Truth:
    step_pair: tuple[int, int]
    oracle: float  # debiased eta from 4096 samples
    oracle_d_t: float  # token-level KL, nats per sequence
    paired: float
    paired_ci: tuple[float, float]
    in_sample: float
    in_sample_ci: tuple[float, float]

    @property
    def paired_covers(self) -> bool:
        return self.paired_ci[0] <= self.oracle <= self.paired_ci[1]

    @property
    def in_sample_covers(self) -> bool:
        return self.in_sample_ci[0] <= self.oracle <= self.in_sample_ci[1]


@dataclass
class TruthRun:
    rows: list[Truth]  # the checked step pairs the cost book priced
    refused: dict[tuple[int, int], str]  # the checked step pairs it refused: code and premise


def run(seed: int = 31, steps: int = STEPS, checked=CHECKED, n_oracle: int = N_ORACLE_PER_PROMPT) -> TruthRun:
    import numpy as np
    import pyarrow as pa
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from make_reference_records import REWARDS, build_model, build_tokenizer
    from reward_lens.measure.efficiency import cost_series
    from reward_lens.measure.efficiency.eta import paired_estimate
    from reward_lens.measure.efficiency.metric import within_group_metric
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.paired import paired_ledger
    from reward_lens.measure.ledger.price import StepSample, steps_from_run
    from reward_lens.measure.whitebox.kl import summed_kl_and_logps
    from reward_lens.measure.whitebox.policy import sample
    from reward_lens.record.reader import open_run
    from reward_lens.taps.trl import RewardLensTap

    torch.manual_seed(seed)
    feats = SurfaceFeatures()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = build_tokenizer()
        model = build_model(len(tok), seed, tok)
        model.save_pretrained(tmp / "initial")
        tok.save_pretrained(tmp / "initial")
        args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=steps, per_device_train_batch_size=64,
                          num_generations=8, max_completion_length=32, learning_rate=1e-2, beta=0.0,
                          logging_steps=1, bf16=False, report_to="none", use_cpu=True, seed=seed,
                          save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0)
        prompts = [f"{w} {i}" for i in range(16) for w in ("Note", "Item", "Line", "Word")]
        trainer = GRPOTrainer(model=str(tmp / "initial"), reward_funcs=[REWARDS["lowercase"]], args=args,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
        RewardLensTap.attach(trainer, tmp / "rec", flush_every=100)
        params: dict[int, dict[str, torch.Tensor]] = {}
        prompt_ids: dict[int, list[list[int]]] = {}
        gen = trainer._generate_and_score_completions

        def capture(inputs, *a, **kw):  # the exact prompt ids of each step (one per group)
            out = gen(inputs, *a, **kw)
            t = trainer.state.global_step
            ids = [out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist() for i in range(0, len(out["prompt_ids"]), 8)]
            prompt_ids[t] = ids
            return out

        trainer._generate_and_score_completions = capture

        class Keep(TrainerCallback):
            def on_step_begin(self, args_, state, control, **kw):
                params[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

            def on_train_end(self, args_, state, control, **kw):
                params[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

        trainer.add_callback(Keep())
        trainer.train()
        rec = open_run(tmp / "rec")
        samples = {s.step: s for s in steps_from_run(rec, feats)}
        tab = rec.read_rollouts(["logp_post"])
        post_by_step = {t: tab.column("logp_post").to_numpy()[tab.column("step").to_numpy() == t] for t in samples}

        pre_m, post_m = build_model(len(tok), seed, tok), build_model(len(tok), seed, tok)
        pre_m.eval()
        post_m.eval()
        ledgers = [paired_ledger(samples[t]) for t in range(1, steps)]
        book = cost_series(ledgers, within_group_metric(ledgers))
        by_pair = {r.step_pair: r for r in book.rows}
        refused = {tuple(p): f"{r.code} {r.context.get('premise', '')}".strip()
                   for r in book.refusals for p in r.subject.step_pairs if p[0] in checked}
        out: list[Truth] = []
        for t in checked:
            pair = (t, t + 1)
            if pair not in by_pair:
                continue
            pre_m.load_state_dict(params[t])
            post_m.load_state_dict(params[t + 1])
            zs, rs, kls, groups = [], [], [], []
            for g, pids in enumerate(prompt_ids[t + 1]):
                seqs = sample(post_m, pids, n_oracle, 32, tok.eos_token_id, tok.pad_token_id, 1000 * t + g)
                ids, mask = seqs.ids, seqs.completion_mask
                att = torch.ones_like(ids)
                with torch.no_grad():
                    new = post_m(input_ids=ids, attention_mask=att).logits[:, :-1].float()
                    old = pre_m(input_ids=ids, attention_mask=att).logits[:, :-1].float()
                kl, lp_old, lp_new = summed_kl_and_logps(new, old, ids[:, 1:], mask[:, 1:])
                texts = [tok.decode(ids[i, len(pids):][mask[i, len(pids):]].tolist(), skip_special_tokens=True)
                         for i in range(len(ids))]
                zs.append(feats.compute(pa.table({"completion": texts})))
                rs.append(lp_new - lp_old)
                kls.append(kl)
                groups += [g] * len(ids)
            z, r = np.vstack(zs), np.concatenate(rs)
            big = paired_ledger(StepSample(t + 1, feats.names, z, groups=np.array(groups), logp=r,
                                           logp_prev=np.zeros(len(r))))
            oracle = paired_estimate(big, within_group_metric([big]).for_step(t).active_index)
            row = by_pair[pair]
            a = samples[t]  # in-sample: the rollouts step t trained on, pi_t -> pi_{t+1}
            ins = paired_ledger(StepSample(t + 1, feats.names, a.z, groups=a.groups, logp=post_by_step[t],
                                           logp_prev=a.logp))
            ins_est = paired_estimate(ins, within_group_metric([ins]).for_step(t).active_index)
            out.append(Truth(pair, oracle.eta_debiased, float(np.concatenate(kls).mean()), row.efficiency_debiased,
                             row.interval, ins_est.eta_debiased, ins_est.interval()))
    return TruthRun(out, refused)


def main() -> None:
    result = run()
    rows = result.rows
    print("step pair   oracle eta   D_t (nats)   paired [95 %]          in-sample [95 %]")
    for r in rows:
        print(f"{r.step_pair[0]:>3}->{r.step_pair[1]:<4}  {r.oracle:10.3f}  {r.oracle_d_t:11.4f}   "
              f"{r.paired:6.3f} [{r.paired_ci[0]:6.3f}, {r.paired_ci[1]:6.3f}] {'covers' if r.paired_covers else 'MISSES'}   "
              f"{r.in_sample:6.3f} [{r.in_sample_ci[0]:6.3f}, {r.in_sample_ci[1]:6.3f}] "
              f"{'covers' if r.in_sample_covers else 'MISSES'}")
    n = len(rows)
    print(f"paired covers {sum(r.paired_covers for r in rows)} of {n}; in-sample covers "
          f"{sum(r.in_sample_covers for r in rows)} of {n}")
    for pair, why in sorted(result.refused.items()):
        print(f"{pair[0]:>3}->{pair[1]:<4}  refused: {why}")


if __name__ == "__main__":
    main()
