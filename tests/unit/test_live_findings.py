"""The live findings (``reward_lens.findings.LiveFindings``) against ``reward-lens check``: fed a
record's steps one at a time, as the tap feeds them, the book-grounded findings say at every
prefix what ``check`` says on that prefix of the record -- status, onset and evidence -- on a
hand-made run in which each of them comes to hold; where the basis declares no target, the
findings that need one are not evaluated and name the field, live and after."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

BOOK_GROUNDED = ("moving_against_reward", "proxy_gaming", "paid_for_drift", "collateral_behaviour", "length_drift")

BASIS = """
name: hacked
features:
  - name: correct
    kind: reward
    reward: correctness
    unit: "indicator (0/1)"
    target: higher
  - name: len_chars
    kind: length
    of: characters
  - name: exclaims
    kind: regex
    pattern: "!"
"""


def hacked_record(path: Path, steps: int = 16, groups: int = 8, per: int = 8, onset: int = 6, seed: int = 0) -> Path:
    """A run whose reward pays 0.05 per character besides correctness: from ``onset`` the policy
    pads its answers (the reward rises), gets fewer right (the target falls, against its selection)
    and starts to exclaim (selected by nothing: collateral)."""
    from reward_lens.record import OptimizerTelemetry, Rollout, write_run

    rng = np.random.default_rng(seed)
    rows, tel = [], []
    for t in range(steps):
        late = max(0, t - onset + 1)
        p = np.clip(rng.beta(4, 3, size=groups) - 0.12 * late, 0.0, 1.0)
        for g in range(groups):
            a, b = int(rng.integers(50)), int(rng.integers(50))
            right = rng.random(per) < p[g]
            pad = rng.poisson(2 + 6 * late, size=per)
            bang = rng.random(per) < min(0.9, 0.05 + 0.15 * late)
            texts = [f"<answer>{a + b if r else a + b + 1}</answer>" + "x" * int(k) + ("!" if e else "")
                     for r, k, e in zip(right, pad, bang)]
            reward = right.astype(float) + 0.05 * np.array([len(s.rstrip("!")) for s in texts])  # "!" is not paid
            adv = (reward - reward.mean()) / (reward.std() + 1e-4)
            rows += [Rollout(step=t, group_id=f"{t}:{g}", prompt=f"Q: {a}+{b}=", completion=s, reward=float(r),
                             rewards={"correctness": float(c), "length": float(r - c)}, advantage=float(v))
                     for s, r, c, v in zip(texts, reward, right, adv)]
        tel.append(OptimizerTelemetry(step=t, learning_rate=1e-3, grad_norm_unclipped=0.5, beta=0.0))
    write_run(path, framework={"name": "test", "version": "0"}, model={"description": "hand-made"}, telemetry=tel,
              rollouts=rows)
    return path


@pytest.fixture(scope="module")
def hacked(tmp_path_factory):
    d = tmp_path_factory.mktemp("hacked")
    (d / "basis.yaml").write_text(BASIS)
    return hacked_record(d / "record"), d / "basis.yaml"


def _check_prefix(run, k, work, basis):
    from labelled_runs import prefix_record

    from reward_lens.record import open_run
    from reward_lens.report import build_report

    return {f.id: f for f in build_report(open_run(prefix_record(run, k, work / "prefix")), features=basis).findings}


def test_live_says_what_check_says_on_every_prefix(hacked, tmp_path):
    from reward_lens.findings import LiveFindings
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run

    record, basis_file = hacked
    basis = load_basis(basis_file)
    run = open_run(record)
    live = LiveFindings(basis)
    table = run.read_rollouts(run.rollout_columns())
    telemetry = {r["step"]: r for r in run.telemetry.to_pylist()}
    seen = {fid: [] for fid in BOOK_GROUNDED}
    for k in sorted(telemetry):
        step_rows = table.filter(np.asarray(table.column("step")) == k)  # the tap hands over each step once
        now = {f.id: f for f in live.observe(k, step_rows, None, {k: telemetry[k]})}
        after = _check_prefix(run, k, tmp_path, basis)
        for fid in BOOK_GROUNDED:
            a, b = now[fid], after[fid]
            assert (a.status, a.onset, a.evidence) == (b.status, b.onset, b.evidence), (k, fid)
            seen[fid].append(a.status)
    for fid in BOOK_GROUNDED[:4]:  # each comes to hold on this run, after being clear: the equality is not empty
        assert "holds" in seen[fid] and seen[fid][2] == "clear", (fid, seen[fid])


def test_the_live_onset_is_where_the_movement_began(hacked):
    from reward_lens.findings import LiveFindings
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run

    record, basis_file = hacked
    run = open_run(record)
    live = LiveFindings(load_basis(basis_file))
    table = run.read_rollouts(run.rollout_columns())
    first = {}
    for k in range(16):
        for f in live.observe(k, table.filter(np.asarray(table.column("step")) == k)):
            if f.status == "holds" and f.id not in first:
                first[f.id] = (k, f.onset)
    # the hack begins at step 6 (hacked_record's onset): each finding holds a few steps later, and
    # names a step near 6 as where it began, not the step at which it crossed
    for fid in ("proxy_gaming", "paid_for_drift", "moving_against_reward"):
        at, onset = first[fid]
        assert 6 <= at <= 10 and 5 <= onset <= 7 and onset < at, (fid, at, onset)


def test_a_step_handed_over_twice_is_read_once(hacked):
    from reward_lens.findings import LiveFindings
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run

    record, basis_file = hacked
    run = open_run(record)
    table = run.read_rollouts(run.rollout_columns())
    once, twice = LiveFindings(load_basis(basis_file)), LiveFindings(load_basis(basis_file))
    for k in range(10):
        rows = table.filter(np.asarray(table.column("step")) == k)
        a = once.observe(k, rows)
        twice.observe(k, rows)
        b = twice.observe(k, rows)
    assert [(f.id, f.status, f.onset, f.evidence) for f in a] == [(f.id, f.status, f.onset, f.evidence) for f in b]


def test_without_a_target_the_findings_that_need_one_are_not_evaluated(hacked, tmp_path):
    from reward_lens.findings import TARGET, LiveFindings
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    record, basis_file = hacked
    plain = tmp_path / "plain.yaml"
    plain.write_text(BASIS.replace("    target: higher\n", ""))
    basis = load_basis(plain)
    assert basis.targets == {} and load_basis(basis_file).targets == {"correct": "higher"}
    assert basis.basis_id == load_basis(basis_file).basis_id  # a target says what a number is for, not what it is
    run = open_run(record)
    after = {f.id: f for f in build_report(run, features=basis).findings}
    live = LiveFindings(basis)
    table = run.read_rollouts(run.rollout_columns())
    now = {f.id: f for f in live.observe(15, table)}
    for fid in ("proxy_gaming", "paid_for_drift"):
        for f in (after[fid], now[fid]):
            assert f.status == "not_evaluated" and f.missing == [TARGET] and "`target:`" in f.evidence
    assert after["moving_against_reward"].status == "holds"  # it needs no target


def test_the_audit_says_a_finding_that_reads_a_target_needs_one(tmp_path):
    from reward_lens.audit import audit
    from reward_lens.findings import TARGET
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.features import SurfaceFeatures

    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_generations: 8\nper_device_train_batch_size: 16\nlogging_steps: 1\nmax_steps: 50\n"
                   "log_completions: true\n")
    task = {f.finding: f for f in audit(cfg, with_tap=True, features=load_basis(REPO / "examples" / "features"
                                                                               / "task.yaml")).findings}
    surface = {f.finding: f for f in audit(cfg, with_tap=True, features=SurfaceFeatures()).findings}
    for fid in ("proxy_gaming", "paid_for_drift"):
        assert task[fid].verdict == "will evaluate"
        assert surface[fid].verdict == "will not evaluate" and surface[fid].missing == [TARGET]
    assert surface["moving_against_reward"].verdict == "will evaluate"
