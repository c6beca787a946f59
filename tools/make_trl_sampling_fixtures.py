"""Write tests/fixtures/trl_sampling/{engine_mismatch,engine_clean}/: a TRL output folder whose
log holds the ``sampling/*`` metrics, written by TRL's own code (issue 59).

    PYTHONPATH=$PWD .venv/bin/python tools/make_trl_sampling_fixtures.py tests/fixtures/trl_sampling

What runs is TRL's (the installed version, 1.16.0): a tiny ``GRPOTrainer`` run on CPU (the
reference records' tokenizer and model, tools/make_reference_records.py) with ``use_vllm`` set
and ``vllm_importance_sampling_correction`` at its default (true), so that
``GRPOTrainer._generate_and_score_completions`` computes ``old_per_token_logps`` and logs
``sampling/sampling_logp_difference/{mean,max}`` and ``sampling/importance_sampling_ratio/{min,mean,max}``
(grpo_trainer.py:2639-2707 and 2860-2896) from the per-token log-probabilities the engine handed
back; ``trainer.save_state()`` writes ``trainer_state.json`` (transformers' ``TrainerState.save_to_json``,
what every checkpoint holds) and ``trainer.args.to_dict()`` the config, as docs/recording.md says.

vLLM cannot run here: the engine is stood in at its boundary (``VLLMGeneration.sync_weights`` and
``generate``), as tests/acceptance/test_trl_tap.py's ``_StandInEngine`` does: a copy of the policy,
loaded when TRL syncs the weights, sampling each token from its own distribution and handing back
that distribution's log-probability of it. From step ``onset`` the mismatched run's engine samples
from the nucleus ``ENGINE_TOP_P`` of the policy's distribution (a top-p the engine applies and the
scorer does not, one of the issue's real causes); the clean run's engine samples the policy's own
distribution, in float64 where the trainer scores in float32 (a gap of about 1e-7 per token). Every
number in the log is TRL's own arithmetic on those log-probabilities.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import make_reference_records as gen  # noqa: E402

ENGINE_TOP_P = 0.7  # the nucleus the mismatched engine samples from, which the scorer does not apply


class StandInEngine:
    """TRL's ``VLLMGeneration`` at its boundary: weights synced by TRL before each generation, each
    token sampled from the engine's own distribution, its log-probability handed back per token."""

    def __init__(self, trainer, onset: int | None):
        self.trainer, self.model, self.onset = trainer, copy.deepcopy(trainer.model).eval(), onset

    def sync_weights(self):
        self.model.load_state_dict(self.trainer.model.state_dict())

    def generate(self, prompts, images, num_generations, profiler=None):
        tr = self.trainer
        step = tr.state.global_step + 1  # the update these rollouts feed (TRL's logged step)
        top_p = ENGINE_TOP_P if self.onset is not None and step >= self.onset else 1.0
        eos = tr.processing_class.eos_token_id
        completions, logprobs = [], []
        for p in prompts:
            ids, out, lps = list(p), [], []
            for _ in range(tr.max_completion_length):
                with torch.no_grad():
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].double() / tr.temperature
                probs = torch.softmax(logits, -1)
                if top_p < 1.0:  # vLLM's nucleus: the smallest set of likeliest tokens holding top_p, renormalised
                    p_sorted, order = probs.sort(descending=True)
                    keep = (p_sorted.cumsum(0) - p_sorted) < top_p
                    probs = torch.zeros_like(probs).scatter(0, order[keep], p_sorted[keep])
                    probs = probs / probs.sum()
                y = int(torch.multinomial(probs, 1))
                out.append(y)
                lps.append([float(torch.log(probs[y]))])
                ids.append(y)
                if y == eos:
                    break
            completions.append(out)
            logprobs.append(lps)
        return prompts, completions, logprobs, None


def run(dest: Path, onset: int | None, steps: int = 8, seed: int = 11) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = gen.build_tokenizer()
        model = gen.build_model(len(tok), seed, tok)
        model.save_pretrained(tmp / "init")
        tok.save_pretrained(tmp / "init")
        args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=steps, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=12, learning_rate=1e-2, beta=0.0, logging_steps=1,
                          bf16=False, report_to="none", use_cpu=True, seed=seed, save_strategy="no",
                          disable_tqdm=True)
        trainer = GRPOTrainer(model=str(tmp / "init"), reward_funcs=[gen.lowercase], args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]}),
                              processing_class=tok)
        # TRL's vLLM path, with the engine stood in (grpo_trainer.py reads these three attributes)
        trainer.vllm_generation = StandInEngine(trainer, onset)
        trainer.use_vllm, trainer.vllm_mode, trainer._last_loaded_step = True, "colocate", -1
        assert trainer.vllm_importance_sampling_correction  # TRL's default: the sampling/* metrics are logged
        trainer.train()
        trainer.save_state()
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        shutil.copy(tmp / "out" / "trainer_state.json", dest / "trainer_state.json")
    cfg = {k: v for k, v in trainer.args.to_dict().items() if isinstance(v, (str, int, float, bool, type(None)))}
    cfg.pop("output_dir", None)  # a temporary folder's path
    (dest / "grpo_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    (dest / "README.md").write_text(
        "Written by tools/make_trl_sampling_fixtures.py: a tiny GRPOTrainer run (TRL "
        f"{__import__('trl').__version__}) on TRL's vLLM code path with the engine stood in at its boundary. "
        + (f"From step {onset} the engine samples from the top-p {ENGINE_TOP_P} nucleus, which the trainer does not apply."
           if onset is not None else "The engine samples at the trainer's temperature (float64 against float32).")
        + " trainer_state.json is what trainer.save_state() wrote; grpo_config.json is trainer.args.to_dict() "
          "(scalars only, output_dir left out).\n")


def main(dest: str) -> None:
    root = Path(dest)
    run(root / "engine_mismatch", onset=4)
    run(root / "engine_clean", onset=None)
    print(f"wrote engine_mismatch, engine_clean under {root}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/trl_sampling")
