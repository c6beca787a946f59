"""The TRL tap under torch.distributed: a real 2-process TRL GRPO run (torchrun, gloo on CPUs,
DDP), checked against what each process generated and against D_t recomputed from the
checkpoints TRL saved after every step."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from reward_lens.record import open_run

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("ddp_worker.py")
STEPS = 3


def _torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(WORKER), str(tmp), *args],
                          capture_output=True, text=True, timeout=600, env=env)


def _launch(tmp: Path, *args: str):
    proc = _torchrun(tmp, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, open_run(tmp / "rec")


@pytest.mark.parametrize("version", ["none", "1", "2"])
def test_what_trl_does_with_fsdp_and_use_cpu_is_what_the_audit_says(tmp_path, version):
    """A TRL config with `fsdp: full_shard` and `use_cpu`, launched on two processes without the
    tap. Without `fsdp_config`, and with `fsdp_version: 2`, accelerate ignores `fsdp` and TRL
    trains the model data-parallel (DDP): the audit says so, and the tap records it as
    data-parallel. With `fsdp_version: 1` accelerate's FSDP plugin raises when the trainer is made
    (it initialises parameters on an accelerator), so the audit refuses that config as TRL's
    (specs/frameworks/trl.yaml). Checked in TRL 1.16.0, transformers 5.24.0, accelerate 1.15.0 and
    1.16.0; this test says when any of it stops being true."""
    proc = _torchrun(tmp_path, "fsdp-on-cpu", version)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        outcome = (tmp_path / f"fsdp-cpu-{rank}.txt").read_text()
        if version == "1":  # accelerate 1.15 and 1.16 word it differently: both find no accelerator
            assert outcome.startswith("RuntimeError"), outcome
            assert "no available devices" in outcome or "not supported on cpu" in outcome, outcome
        else:
            assert outcome == "trained", outcome


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("ddp"), str(STEPS))


def _seen(tmp: Path) -> list[Counter]:
    """Per generation call (= per step here), the (prompt, completion) pairs every rank's reward
    function saw: the global batch."""
    calls = [[json.loads(line) for line in (tmp / f"seen-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(calls[0]) == len(calls[1]) == STEPS
    return [Counter(p for r in (0, 1) for p in zip(calls[r][s]["prompts"], calls[r][s]["completions"]))
            for s in range(STEPS)]


def test_every_rollout_of_the_global_batch_is_recorded_once(ddp):
    tmp, run = ddp
    rows = run.read_rollouts(["prompt", "completion", "group_id", "completion_ids", "logp_pre", "logp_prev"]).to_pylist()
    assert len(rows) == STEPS * 16  # 2 processes x 8 per device, every step
    seen = _seen(tmp)
    for s in range(STEPS):
        recorded = Counter((x["prompt"], x["completion"]) for x in rows if x["step"] == s)
        assert recorded == seen[s], f"step {s}"
        # both ranks contributed (a rank-0-only record would hold 8)
        assert sum(seen[s].values()) == 16
    groups: dict[str, list] = {}
    for x in rows:
        groups.setdefault(x["group_id"], []).append(x["prompt"])
    # groups are whole (8 generations of one prompt), numbered over the global batch
    assert all(len(v) == 8 and len(set(v)) == 1 for v in groups.values()) and len(groups) == STEPS * 2
    assert all(x["logp_pre"] is not None for x in rows)
    # two-sided: the pairs are measured on the tap's extra completions, not on the rollouts
    assert all(x["logp_prev"] is None for x in rows)


def _checkpoint(tmp: Path, s: int):
    """pi_s from TRL's own checkpoint (DDP runs save one after every step)."""
    from transformers import AutoModelForCausalLM

    path = tmp / "init" if s == 0 else tmp / "out" / f"checkpoint-{s}"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _gathered(tmp: Path, s: int):
    """pi_s from the full weights the FSDP2 worker gathered from the shards at step s."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp / "init", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(torch.load(tmp / f"full-{s}.pt"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding, which was loaded
    return model.eval()


def _recomputed_d_t(tmp: Path, run, t: int, load=_checkpoint) -> tuple[float, float, int]:
    """D_t of the step pair (t, t+1) recomputed from the weights alone (pi_t, pi_{t+1}): the
    token KL and the log-ratio of every extra completion filed under step t+1 (pi_t's and
    pi_{t+1}'s, both ranks'), combined by the balance heuristic (written out here)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp / "init")
    load = functools.partial(load, tmp)

    pre, post = load(t), load(t + 1)
    rows = [(x, x["drawn_by_step"] == t) for x in run.heldout().read_rollouts(
        ["prompt", "completion_ids", "group_id", "drawn_by_step"]).to_pylist() if x["step"] == t + 1]
    by_group: dict[str, list] = {}
    for x, held in rows:
        prompt = tok(x["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + x["completion_ids"]])
        with torch.no_grad():
            lp_new = torch.log_softmax(post(input_ids=ids).logits[0, :-1].double(), -1)[len(prompt) - 1:]
            lp_old = torch.log_softmax(pre(input_ids=ids).logits[0, :-1].double(), -1)[len(prompt) - 1:]
        tgt = ids[0, len(prompt):, None]
        r = float(lp_new.gather(-1, tgt).sum() - lp_old.gather(-1, tgt).sum())
        kl = float((lp_new.exp() * (lp_new - lp_old)).sum())
        by_group.setdefault(x["group_id"], []).append((held, r, kl))
    def estimate(items, c):  # the group's D with row multiplicities c (the mixture the design's)
        n_a = sum(h for h, _, _ in items)
        n_b = len(items) - n_a
        q = np.array([ci / (n_a * np.exp(-r) + n_b) for (_, r, _), ci in zip(items, c)])
        return float((q / q.sum()) @ np.array([k for _, _, k in items]))

    # its SE conditional on the prompts: each row deleted from its side of its group (the side's
    # other rows weighing n_s / (n_s - 1)), the stratified jackknife's spread, summed, over G^2
    per_group, var = [], 0.0
    for items in by_group.values():
        per_group.append(estimate(items, np.ones(len(items))))
        for side in (True, False):
            idx = [i for i, (h, _, _) in enumerate(items) if h == side]
            if len(idx) < 2:
                continue
            dels = []
            for i in idx:
                c = np.ones(len(items))
                c[idx] = len(idx) / (len(idx) - 1)
                c[i] = 0.0
                dels.append(estimate(items, c))
            var += (len(idx) - 1) / len(idx) * float(((np.array(dels) - np.mean(dels)) ** 2).sum())
    return float(np.mean(per_group)), float(np.sqrt(var) / len(per_group)), len(rows)


def test_d_t_is_the_global_estimate(ddp):
    """D_t recomputed from TRL's own checkpoints over every extra completion of both policies
    (both ranks') equals the record's, and both ranks hold the same gathered estimate."""
    tmp, run = ddp
    d_t = run.telemetry_column("kl_to_previous")
    est = [json.loads((tmp / f"estimates-{r}.json").read_text()) for r in (0, 1)]
    assert est[0] == est[1]
    assert sorted(d_t) == list(range(STEPS - 1))  # the last step has no next generation
    for t in range(STEPS - 1):
        mean, se, n = _recomputed_d_t(tmp, run, t)
        # 2 groups x 4 completions x 2 policies
        assert n == 2 * 4 * 2 and est[0][str(t)]["independent_two_sided"]["n"] == n
        assert d_t[t] == pytest.approx(mean, rel=1e-4)
        assert run.telemetry_column("kl_to_previous_se")[t] == pytest.approx(se, rel=1e-3)


def test_held_out_completions_come_from_both_ranks_and_are_never_trained_on(ddp):
    """Each prompt group's 4 extra completions of each policy are drawn once (in the generation of
    the rank where the group starts), scored by the trainer's reward function, and never reach
    the loss: the trainer's own reward calls (what it trains on) hold rollouts only."""
    tmp, run = ddp
    held = run.heldout().read_rollouts(["group_id", "prompt", "completion", "reward", "advantage",
                                        "logp_prev_step"]).to_pylist()
    assert len(held) == (STEPS - 1) * 2 * 4 * 2 and {x["step"] for x in held} == set(range(1, STEPS))
    assert all(x["advantage"] is None and x["logp_prev_step"] == x["step"] - 1 for x in held)
    assert all(x["reward"] == pytest.approx(gen_lowercase(x["completion"])) for x in held)
    calls = [[json.loads(line) for line in (tmp / f"heldout-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert all(len(c) == STEPS for c in calls)  # both ranks drew in every generation (the last's side a unused)
    trained = {p for s in _seen(tmp) for p in s}
    assert not {(x["prompt"], x["completion"]) for x in held} & trained


def gen_lowercase(text: str) -> float:
    return sum(c.isascii() and c.islower() for c in text) / max(len(text), 1)


def test_the_record_reads_and_reports_like_a_single_process_one(ddp, tmp_path):
    tmp, run = ddp
    assert sorted(run.telemetry_column("update_norm")) == list(range(STEPS))
    assert any("2 data-parallel processes" in n for n in run.manifest.notes)
    out = tmp_path / "rep"
    proc = subprocess.run([str(Path(sys.executable).with_name("reward-lens")), "report", str(tmp / "rec"), "--out",
                           str(out), "--format", "json", "--quiet", "--ledger", "paired"],
                          capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr  # computed, or refused for a stated reason
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["rollouts"] == STEPS * 16 and report["run"]["rollouts_per_step"] == 16
    cost = next(b for b in report["books"] if b["id"] == "cost")
    assert cost["status"] in ("computed", "unresolved") and not cost["refusals"]  # nothing missing from the record
    # every step pair priced on the paired ledger: D_t and both policies' extra completions all there
    assert cost["data"]["kl_min"]["step_pair"] == [[t, t + 1] for t in range(STEPS - 1)]
    assert cost["data"]["summary"]["ledger"] == "paired" and cost["data"]["summary"]["two_sided"] == STEPS - 1


def test_exact_estimator_and_gradient_accumulation_across_processes(tmp_path):
    """estimator="exact" and 2 micro-batches per step on 2 processes: the whole global
    generation batch (8 per device x 2 micro-batches x 2 processes) is recorded once per step,
    the exact estimate samples n_exact = 16 sequences over both ranks together, and the
    independent estimate (paired scoring stays on) covers every rollout of the next step."""
    tmp, run = _launch(tmp_path, "2", "exact", "2")
    steps, counts = np.unique(run.rollout_steps, return_counts=True)
    assert steps.tolist() == [0, 1] and set(counts) == {32}
    est = [json.loads((tmp / f"estimates-{r}.json").read_text()) for r in (0, 1)]
    assert est[0] == est[1]
    for t in ("0", "1"):
        assert est[0][t]["exact"]["n"] == 16
    assert est[0]["0"]["independent_two_sided"]["n"] == 4 * 4 * 2  # 4 groups x 4 completions x 2 policies
    d_t = run.telemetry_column("kl_to_previous")
    assert [d_t[t] for t in (0, 1)] == [pytest.approx(est[0][t]["exact"]["mean"]) for t in ("0", "1")]
    assert set(run.telemetry_column("kl_to_previous_estimator").values()) == {"exact_post_samples"}


# ---------------------------------------------------------------------------- FSDP2
@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("fsdp2"), str(STEPS), "independent", "1", "fsdp2")


def test_fsdp2_parameters_are_sharded_through_every_recorded_step(fsdp2):
    """The run really is sharded: at the start of every step and at the end, every parameter on
    each rank is a DTensor holding part of it, the two ranks' parts summing to the whole."""
    tmp, run = fsdp2
    layout = [json.loads((tmp / f"layout-{r}.json").read_text()) for r in (0, 1)]
    assert sorted(layout[0], key=int) == [str(s) for s in range(STEPS + 1)] and layout[0].keys() == layout[1].keys()
    for step, params in layout[0].items():
        for name, (kind, local, whole) in params.items():
            other_kind, other_local, other_whole = layout[1][step][name]
            assert kind == other_kind == "DTensor", (step, name)
            assert whole == other_whole and local + other_local == whole and max(local, other_local) < whole


def test_fsdp2_snapshot_holds_each_ranks_shards(fsdp2):
    """pi_t is kept as each rank's local shards: 4 bytes (float32) per local element, the two
    ranks together |theta| x 4, each about half."""
    tmp, run = fsdp2
    layout = [json.loads((tmp / f"layout-{r}.json").read_text())["0"] for r in (0, 1)]
    snap = [json.loads((tmp / f"snapshot-{r}.json").read_text())["bytes"] for r in (0, 1)]
    whole = sum(w for _, _, w in layout[0].values())
    assert [4 * sum(local for _, local, _ in lay.values()) for lay in layout] == snap
    assert sum(snap) == 4 * whole and max(snap) <= 0.55 * 4 * whole
    assert any("under FSDP2" in n and "1/2 on each" in n for n in run.manifest.notes)


def test_fsdp2_records_every_rollout_once_and_d_t_from_the_full_weights(fsdp2):
    """What the DDP run checks, under FSDP2: the whole global batch recorded once per step, D_t
    (and its SE) equal to the value recomputed from the full weights gathered at each step,
    the update norm equal to ||theta_{t+1} - theta_t|| of those weights, and the held-out
    completions drawn once per group, never trained on."""
    tmp, run = fsdp2
    rows = run.read_rollouts(["prompt", "completion", "logp_pre", "logp_prev"]).to_pylist()
    assert len(rows) == STEPS * 16
    seen = _seen(tmp)
    for s in range(STEPS):
        assert Counter((x["prompt"], x["completion"]) for x in rows if x["step"] == s) == seen[s]
    d_t = run.telemetry_column("kl_to_previous")
    assert sorted(d_t) == list(range(STEPS - 1))
    for t in range(STEPS - 1):
        mean, se, n = _recomputed_d_t(tmp, run, t, load=_gathered)
        assert n == 2 * 4 * 2
        assert d_t[t] == pytest.approx(mean, rel=1e-4)
        assert run.telemetry_column("kl_to_previous_se")[t] == pytest.approx(se, rel=1e-3)
    upd = run.telemetry_column("update_norm")
    for t in range(STEPS):
        a, b = torch.load(tmp / f"full-{t}.pt"), torch.load(tmp / f"full-{t + 1}.pt")
        assert upd[t] == pytest.approx(float(torch.sqrt(sum(((b[k] - a[k]).double() ** 2).sum() for k in a))),
                                       rel=1e-5)
    held = run.heldout().read_rollouts(["prompt", "completion"]).to_pylist()
    assert len(held) == (STEPS - 1) * 2 * 4 * 2
    assert not {(x["prompt"], x["completion"]) for x in held} & {p for s in seen for p in s}


def test_fsdp2_record_reports_like_a_single_process_one(fsdp2, tmp_path):
    tmp, run = fsdp2
    out = tmp_path / "rep"
    proc = subprocess.run([str(Path(sys.executable).with_name("reward-lens")), "report", str(tmp / "rec"), "--out",
                           str(out), "--format", "json", "--quiet", "--ledger", "paired"],
                          capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads((out / "report.json").read_text())
    cost = next(b for b in report["books"] if b["id"] == "cost")
    assert cost["status"] in ("computed", "unresolved") and not cost["refusals"]
    assert cost["data"]["kl_min"]["step_pair"] == [[t, t + 1] for t in range(STEPS - 1)]
