"""Write tests/fixtures/verl/{legacy_grpo,v1_resumed,diverged,engine_mismatch,engine_clean}/ with veRL's own code.

Run it in a throwaway venv outside the repository, never in the project's:

    python3 -m venv /tmp/verlvenv
    /tmp/verlvenv/bin/pip install --no-deps verl==0.9.1
    /tmp/verlvenv/bin/pip install orjson packaging numpy omegaconf pyyaml tqdm pydantic cachetools torch==2.13.0
    /tmp/verlvenv/bin/python tools/make_verl_fixtures.py tests/fixtures/verl

and for veRL 0.4.1 (its console logger rounds every value to three decimals; it has no file
logger, and its ``_dump_generations`` writes no ``gts``), in a second venv:

    python3 -m venv /tmp/verl04
    /tmp/verl04/bin/pip install --no-deps verl==0.4.1
    /tmp/verl04/bin/pip install packaging numpy torch==2.13.0 omegaconf orjson tqdm pyyaml
    /tmp/verl04/bin/python tools/make_verl_fixtures.py tests/fixtures/verl

(torch 2.13.0 installs the CPU wheel; veRL's console logger, ``verl.utils.logger.LocalLogger``,
imports it.) What runs is veRL 0.9.1's code: ``verl.utils.tracking.Tracking`` with its ``console``
and ``file`` backends writes the metric logs, the legacy trainer's static
``RayPPOTrainer._write_generations`` (trainer/ppo/ray_trainer.py) and the v1 trainer's
``PPOTrainer._write_generations`` (trainer/ppo/v1/trainer_base.py) write the dumps, and
``OmegaConf.save`` writes veRL's own trainer config (trainer/config/_generated_ppo_trainer.yaml,
with the run's overrides) as Hydra saves ``.hydra/config.yaml``.

Importing veRL's modules needs packages the CPU index lacks or that only matter on a cluster
(ray, tensordict, codetiming, hydra, transformers, datasets, torchdata, peft, wandb, vllm, ...):
they are stood in *at import only* by ``_StandIns`` below, a module whose every attribute is a
placeholder class. None of them is called by the code that writes the files: Tracking's console
and file backends use pprint, orjson and print; ``_write_generations`` uses os, json and numpy.

Under Ray the trainer runs in the ``TaskRunner`` actor, and the driver prints its stdout with
Ray's worker prefix: ``"{}({}{}){} {}".format(color, "TaskRunner pid=", pid, RESET_ALL, line)``
(ray/_private/worker.py, ``print_worker_logs``; cyan by default). ``_ray_prefixed`` applies that
format to what veRL printed; the console logs are otherwise veRL's output byte for byte.

The training numbers are a simulation (a 4-prompt arithmetic task, 4 rollouts each, a policy that
learns the format): the *format* is veRL's, the values are made to be plausible, as no GPU run is
possible here.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import os
import shutil
import sys
import types
import uuid
from pathlib import Path

_STANDIN = ("ray", "tensordict", "codetiming", "hydra", "transformers", "datasets", "torchdata", "peft", "wandb",
            "torchvision", "flash_attn", "liger_kernel", "vllm", "sglang", "accelerate", "safetensors", "tensorboard",
            "pylatexenc", "math_verify", "mathruler", "qwen_vl_utils", "transfer_queue", "pyarrow", "pandas", "PIL",
            "fastapi", "uvicorn", "regex", "aiohttp", "psutil",
            # verl 0.4.1's __init__ imports pkg_resources (used only on Ascend NPUs), which the setuptools
            # torch 2.13.0 needs no longer has
            "pkg_resources")


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # used as a decorator (@ray.remote): the decorated thing unchanged
        return _Placeholder("instance", (), {})

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


class _StandInModule(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _STANDIN:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StandInModule(spec.name)
        m.__spec__ = spec
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StandIns())

import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import verl  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
if not verl.__version__.startswith("0.4"):  # the v1 trainer exists from 0.9
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer as V1Trainer  # noqa: E402
from verl.utils.tracking import Tracking  # noqa: E402

CYAN, RESET = "\x1b[36m", "\x1b[0m"  # colorama.Fore.CYAN, colorama.Style.RESET_ALL
PROMPTS = [("Q: 2+3=?", "5"), ("Q: 7+5=?", "12"), ("Q: 9-4=?", "5"), ("Q: 3*3=?", "9")]
N = 4


def _ray_prefixed(text: str, pid: int = 48213) -> str:
    return "".join(f"{CYAN}(TaskRunner pid={pid}){RESET} {line}\n" for line in text.splitlines())


def _config(path: Path, **overrides) -> None:
    """veRL's own trainer config with the run's overrides, saved as Hydra saves it."""
    base = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    if not base.exists():  # veRL 0.4: one flat file
        base = base.with_name("ppo_trainer.yaml")
    cfg = OmegaConf.load(base)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path)


def _generations(rng: np.random.Generator, step: int, steps: int):
    """One step's rollouts: each prompt N times, the format learned as training goes on."""
    p_format = min(0.9, 0.15 + 0.7 * step / steps)
    p_right = 0.4 + 0.3 * step / steps
    inputs, outputs, gts, scores, fmt, acc, pred = [], [], [], [], [], [], []
    for q, a in PROMPTS:
        for _ in range(N):
            right = rng.random() < p_right
            answer = a if right else str(int(a) + int(rng.integers(1, 3)))
            formatted = rng.random() < p_format
            inputs.append(q)
            outputs.append(f"<answer>{answer}</answer>" if formatted else f"the answer is {answer}" + " ok" * int(
                rng.integers(0, 4)))
            gts.append(a)
            scores.append(float(right) + 0.1 * float(formatted))
            fmt.append(np.float32(formatted))  # a numpy scalar: the legacy dump writes it with default=str
            acc.append(np.bool_(right))
            pred.append(answer)
    order = rng.permutation(len(inputs))  # _balance_batch reorders the batch
    pick = lambda xs: [xs[i] for i in order]  # noqa: E731
    return pick(inputs), pick(outputs), pick(gts), pick(scores), {"format": pick(fmt), "acc": pick(acc),
                                                                   "pred": pick(pred)}


def _metrics(rng: np.random.Generator, step: int, steps: int, scores: list[float], lengths: list[int],
             diverged_from: int | None = None) -> dict:
    """A step's metrics with veRL's keys and value types (np.float64 from reduce_metrics' np.mean)."""
    f = np.float64
    bad = diverged_from is not None and step >= diverged_from
    nan = float("nan")
    m = {
        "training/global_step": step,
        "training/epoch": 0,
        "actor/entropy": f(nan) if bad else f(1.2 - 0.07 * step + 0.01 * rng.standard_normal()),
        "actor/pg_loss": f(nan) if bad else f(0.02 * rng.standard_normal()),
        "actor/pg_clipfrac": f(0.0) if bad else f(abs(0.004 * rng.standard_normal())),
        "actor/ppo_kl": f(nan) if bad else f(0.0005 * rng.standard_normal()),
        "actor/pg_clipfrac_lower": f(0.0),
        "actor/kl_loss": f(nan) if bad else f(0.001 * step + 0.0002 * rng.random()),
        "actor/kl_coef": 0.001,
        "actor/grad_norm": f(nan) if bad else f(0.6 + 0.9 * rng.random() + (1.5 if step > steps - 4 else 0.0)),
        "actor/lr": f(1e-6),
        "training/rollout_probs_diff_valid": 0,  # no rollout log-probabilities: the diff is NaN, not measured
        "training/rollout_probs_diff_max": nan,
        "training/rollout_probs_diff_mean": nan,
        "training/rollout_probs_diff_std": nan,
        "critic/score/mean": f(np.mean(scores)),
        "critic/score/max": f(np.max(scores)),
        "critic/score/min": f(np.min(scores)),
        "critic/rewards/mean": f(np.mean(scores)),
        "critic/advantages/mean": f(0.0),
        "response_length/mean": f(np.mean(lengths)),
        "response_length/max": f(np.max(lengths)),
        "response_length/min": f(np.min(lengths)),
        "response_length/clip_ratio": f(0.0),
        "prompt_length/mean": f(9.0),
        "timing_s/gen": 3.1 + rng.random(),
        "timing_s/update_actor": 1.9 + rng.random(),
        "perf/throughput": f(812.5 + 10 * rng.standard_normal()),
    }
    return m


def _validation(rng: np.random.Generator, step: int, steps: int, dump: Path | None):
    inputs, outputs, gts, scores, extra = _generations(rng, step, steps)
    inputs, outputs, gts, scores = inputs[:8], outputs[:8], gts[:8], scores[:8]
    extra = {k: v[:8] for k, v in extra.items()}
    if dump is not None:
        RayPPOTrainer._write_generations(inputs, outputs, gts, scores, extra, str(dump), step)
    return {"val-core/openai/gsm8k/reward/mean@1": np.float64(np.mean(scores))}


def _log(tracking: Tracking, data: dict, step: int, console: io.StringIO) -> None:
    with contextlib.redirect_stdout(console):
        tracking.log(data=data, step=step)


def legacy_grpo(out: Path, steps: int = 12, diverged_from: int | None = None, seed: int = 0) -> None:
    """The legacy ray_trainer: file and console loggers, val_before_train, validation dumps,
    rollout dumps whose numpy reward extras are JSON strings."""
    rng = np.random.default_rng(seed)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _config(out / ".hydra" / "config.yaml", **{
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": N, "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_coef": 0.001, "actor_rollout_ref.actor.optim.lr": 1e-6,
        "actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct", "trainer.logger": ["console", "file"],
        "trainer.project_name": "verl_grpo", "trainer.experiment_name": "arith",
        "trainer.rollout_data_dir": "rollouts", "trainer.validation_data_dir": "validation",
        "trainer.total_training_steps": steps, "trainer.test_freq": 6})
    os.environ["VERL_FILE_LOGGER_ROOT"] = str(out)
    console = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):  # FileLogger prints where it writes (an absolute path)
        tracking = Tracking("verl_grpo", "arith", default_backend=["console", "file"])
    console.write(f"Training Progress:   0%|          | 0/{steps} [00:00<?, ?it/s]\n")
    _log(tracking, _validation(rng, 0, steps, out / "validation"), 0, console)
    for step in range(1, steps + 1):
        inputs, outputs, gts, scores, extra = _generations(rng, step, steps)
        with contextlib.redirect_stdout(io.StringIO()):
            RayPPOTrainer._write_generations(inputs, outputs, gts, scores, extra, str(out / "rollouts"), step)
        data = _metrics(rng, step, steps, scores, [len(o.split()) * 3 for o in outputs], diverged_from)
        if step % 6 == 0:
            data.update(_validation(rng, step, steps, out / "validation"))
        _log(tracking, data, step, console)
    tracking.finish()
    (out / "console.log").write_text(_ray_prefixed(console.getvalue()))


def v1_resumed(out: Path, steps: int = 8, crash_after: int = 5, resume_from: int = 4, seed: int = 1) -> None:
    """The v1 trainer (default since 0.9): console logger only, dumps keyed by `uid`, a multi-turn
    session in one step, and a run that crashed after step 5 and resumed from its step-4 checkpoint
    (val_before_train logs the resumed step's validation, then steps 5.. are logged again)."""
    rng = np.random.default_rng(seed)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _config(out / ".hydra" / "config.yaml", **{
        "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False,
        "actor_rollout_ref.rollout.n": N, "trainer.logger": ["console"], "trainer.rollout_data_dir": "rollout_dump",
        "trainer.total_training_steps": steps})
    console = io.StringIO()
    tracking = Tracking("verl_v1", "arith", default_backend=["console"])
    prompt_uid = {q: str(uuid.UUID(int=int(rng.integers(0, 2**63)))) for q, _ in PROMPTS}

    def run(step_from: int, step_to: int) -> None:
        for step in range(step_from, step_to + 1):
            inputs, outputs, gts, scores, _ = _generations(rng, step, steps)
            session: dict[str, int] = {}
            keys = []
            for q in inputs:
                session[q] = session.get(q, -1) + 1
                keys.append(f"{prompt_uid[q]}_{session[q]}_0")
            if step == 2:  # one two-turn session: its first turn is dumped too, under index 0
                i = 0
                inputs.append(inputs[i])
                outputs.append("let me think")
                gts.append(gts[i])
                scores.append(scores[i])
                keys[i] = keys[i][:-2] + "_1"
                keys.append(keys[i][:-2] + "_0")
            with contextlib.redirect_stdout(io.StringIO()):
                V1Trainer._write_generations(inputs, outputs, gts, scores, {"uid": keys}, str(out / "rollout_dump"),
                                             step)
            data = _metrics(rng, step, steps, scores, [len(o.split()) * 3 for o in outputs])
            _log(tracking, data, step, console)

    _log(tracking, _validation(rng, 0, steps, None), 0, console)
    run(1, crash_after)
    console.write("Error executing job with overrides: []\n")
    _log(tracking, _validation(rng, resume_from, steps, None), resume_from, console)
    run(resume_from + 1, steps)
    (out / "console.log").write_text(_ray_prefixed(console.getvalue(), pid=7711))


def v04_console(out: Path, steps: int = 6, diverged_from: int = 5, seed: int = 3) -> None:
    """veRL 0.4.1: the console logger only (``f"{k}:{v:.3f}"``: three decimals, ``nan``), the
    dumps of ``RayPPOTrainer._dump_generations`` (an instance method then, reading
    ``self.global_steps``; no ``gts``), and a run whose update turns NaN at step ``diverged_from``."""
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _config(out / ".hydra" / "config.yaml", **{
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": N, "trainer.logger": ["console"],
        "trainer.rollout_data_dir": "dumps", "trainer.total_training_steps": steps})
    console = io.StringIO()
    tracking = Tracking("verl_04", "arith", default_backend="console")
    _log(tracking, {"val-core/openai/gsm8k/reward/mean@1": 0.5}, 0, console)
    for step in range(1, steps + 1):
        inputs, outputs, _, scores, extra = _generations(rng, step, steps)
        trainer = SimpleNamespace(global_steps=step)
        with contextlib.redirect_stdout(io.StringIO()):
            RayPPOTrainer._dump_generations(trainer, inputs, outputs, scores,
                                            {"acc": [bool(a) for a in extra["acc"]]}, str(out / "dumps"))
        data = _metrics(rng, step, steps, scores, [len(o.split()) * 3 for o in outputs], diverged_from)
        _log(tracking, data, step, console)
    (out / "console.log").write_text(_ray_prefixed(console.getvalue(), pid=30211))


# The engine-trainer mismatch of a run (issue 59): the engine samples each position from its own
# distribution, the actor recomputes pi_t's log-probability of what was sampled, and veRL's own
# metric functions compare the two as the trainer does each step.
MISMATCH_VOCAB, MISMATCH_SEQS, MISMATCH_LEN = 32, 16, 24


def _engine_batch(rng: np.random.Generator, temperature: float):
    """One step's response tokens, as veRL's batch holds them: ``old_log_probs`` (pi_t's, which the
    actor recomputes), ``rollout_log_probs`` (the engine's, ``calculate_log_probs: true``),
    ``response_mask`` (completions of different lengths, right-padded) and ``responses``; and the
    exact KL(pi_engine || pi_t) per token over the whole vocabulary, averaged over the response
    tokens, the truth these metrics estimate. pi_t is softmax of the position's logits in float32;
    the engine computes them in bfloat16 (a precision gap, always there) and divides them by
    ``temperature`` (1: none; above 1, a temperature the engine applies and the scorer does not)."""
    import torch

    logits = torch.from_numpy(rng.normal(0.0, 2.0, (MISMATCH_SEQS, MISMATCH_LEN, MISMATCH_VOCAB))).float()
    lp_t = torch.log_softmax(logits, -1)
    lp_s = torch.log_softmax(logits.to(torch.bfloat16).float() / temperature, -1)
    u = torch.from_numpy(rng.random((MISMATCH_SEQS, MISMATCH_LEN, 1))).float()
    tokens = (lp_s.exp().cumsum(-1) < u).sum(-1).clamp(max=MISMATCH_VOCAB - 1)  # inverse-CDF draw from the engine
    lengths = torch.from_numpy(rng.integers(MISMATCH_LEN // 3, MISMATCH_LEN + 1, MISMATCH_SEQS))
    mask = (torch.arange(MISMATCH_LEN)[None, :] < lengths[:, None]).float()
    old = lp_t.gather(-1, tokens[..., None])[..., 0] * mask
    rollout = lp_s.gather(-1, tokens[..., None])[..., 0] * mask
    kl = (lp_s.exp() * (lp_s - lp_t)).sum(-1)
    truth = float((kl * mask).sum() / mask.sum())
    return old, rollout, mask, tokens, truth


def _mismatch_metrics(rng: np.random.Generator, temperature: float) -> tuple[dict, float]:
    """The mismatch metrics one veRL step logs, from veRL's own functions on the batch:
    ``calculate_debug_metrics`` (utils/debug/metrics.py, called at ray_trainer.py:1613-1615 when the
    batch holds rollout_log_probs) and ``compute_rollout_correction_and_rejection_mask`` with the
    default ``algorithm.rollout_correction`` (rollout_is and rollout_rs null: metrics only), the
    arguments ``compute_rollout_correction_and_add_to_batch`` hands it (rollout_corr_helper.py:1049-1058;
    that wrapper itself builds a DataProto, whose tensordict is stood in here, so it is not called)."""
    from types import SimpleNamespace

    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.utils.debug.metrics import calculate_debug_metrics

    old, rollout, mask, tokens, truth = _engine_batch(rng, temperature)
    out = dict(calculate_debug_metrics(SimpleNamespace(batch={
        "rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask, "responses": tokens})))
    _, _, corr = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, rollout_is=None, rollout_is_threshold=2.0,
        rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None)
    out.update(corr)
    return out, truth


def engine_mismatch(out: Path, steps: int = 10, onset: int | None = 5, temperature: float = 1.25,
                    seed: int = 4) -> None:
    """The legacy trainer's file and console logs of a run whose engine starts applying a
    ``temperature`` the trainer does not at step ``onset`` (None: never; the bfloat16 gap only),
    with veRL 0.9.1's defaults for the mismatch (``rollout.calculate_log_probs: true``,
    ``algorithm.rollout_correction`` metrics only), and ``truth.json``: the exact per-token KL of
    each step's batch (the simulation's, not veRL's). No dumps: the finding reads the logged metrics."""
    import json

    rng = np.random.default_rng(seed)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _config(out / ".hydra" / "config.yaml", **{
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": N,
        "actor_rollout_ref.rollout.calculate_log_probs": True, "trainer.logger": ["console", "file"],
        "trainer.project_name": "verl_grpo", "trainer.experiment_name": "mismatch",
        "trainer.total_training_steps": steps})
    os.environ["VERL_FILE_LOGGER_ROOT"] = str(out)
    console = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        tracking = Tracking("verl_grpo", "mismatch", default_backend=["console", "file"])
    truth = {}
    for step in range(1, steps + 1):
        _, outputs, _, scores, _ = _generations(rng, step, steps)
        data = _metrics(rng, step, steps, scores, [len(o.split()) * 3 for o in outputs])
        temp = temperature if onset is not None and step >= onset else 1.0
        corr, truth[step] = _mismatch_metrics(rng, temp)
        data.update(corr)
        _log(tracking, data, step, console)
    tracking.finish()
    (out / "console.log").write_text(_ray_prefixed(console.getvalue(), pid=51020))
    (out / "truth.json").write_text(json.dumps({
        "what": "exact KL(pi_engine || pi_t) per token of each logged step's batch (veRL's global_steps), over the "
                "whole vocabulary: the simulation's truth, computed by tools/make_verl_fixtures.py, not by veRL",
        "onset": onset, "temperature": temperature, "kl_token": truth}, indent=1) + "\n")


def main(dest: str) -> None:
    root = Path(dest)
    if verl.__version__.startswith("0.4"):
        v04_console(root / "v04_console")
        print(f"wrote v04_console under {root} with veRL {verl.__version__}")
        return
    legacy_grpo(root / "legacy_grpo")
    v1_resumed(root / "v1_resumed")
    legacy_grpo(root / "diverged", steps=8, diverged_from=5, seed=2)
    engine_mismatch(root / "engine_mismatch")
    engine_mismatch(root / "engine_clean", onset=None, seed=5)
    # the diverged run keeps its file log and dumps; its validation dumps add nothing here
    shutil.rmtree(root / "diverged" / "validation")
    print(f"wrote {', '.join(p.name for p in sorted(root.iterdir()) if p.is_dir())} under {root}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/verl")
