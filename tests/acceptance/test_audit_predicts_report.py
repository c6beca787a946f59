"""The audit predicts the report: each of several small TRL GRPO configurations is audited
before training (``audit CONFIG --with-tap``), trained with the tap, then reported; the
audit's verdict for every book, the ledger it names and the cause of each refusal are the
report's, and so are the findings it says a run this short will not evaluate. The record's own
audit says the same again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reward_lens.audit import audit
from reward_lens.record import open_run

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import make_reference_records as gen  # noqa: E402

sys.path.pop(0)
pytestmark = pytest.mark.slow

BASE = dict(max_steps=4, max_completion_length=8, learning_rate=1e-2, beta=0.0, bf16=False, report_to="none",
            use_cpu=True, seed=5, save_strategy="no", disable_tqdm=True, num_generations=4)

CONFIGS = {
    # 4 completions per generation batch, 4 per prompt: one prompt group a step (the paired
    # ledger cannot form; `--ledger auto` reads the run with the unpaired one)
    "one prompt per step": dict(per_device_train_batch_size=4, logging_steps=1),
    # the trainer's own logs hold one step in 3; the tap records every step
    "logging_steps 3": dict(per_device_train_batch_size=8, logging_steps=3),
    # TRL writes no completions; the tap records them
    "no completions": dict(per_device_train_batch_size=8, logging_steps=1, log_completions=False),
    # one generation feeds two steps: no per-step D_t, the paired ledger prices the windows
    "num_iterations 2": dict(per_device_train_batch_size=8, logging_steps=1, num_iterations=2),
}


def _train(tmp: Path, cfg: dict) -> Path:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.taps.trl import RewardLensTap

    tok = gen.build_tokenizer()
    model = gen.build_model(len(tok), 5, tok)
    model.save_pretrained(tmp / "init")
    tok.save_pretrained(tmp / "init")
    trainer = GRPOTrainer(model=str(tmp / "init"), reward_funcs=[gen.lowercase],
                          args=GRPOConfig(output_dir=str(tmp / "out"), **BASE, **cfg),
                          train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * 4}),
                          processing_class=tok)
    # budget=None: which pairs a budget measures depends on the machine's timing, which no audit
    # of a config can predict (the audit states the budget instead)
    RewardLensTap.attach(trainer, tmp / "rec", flush_every=2, budget=None)
    trainer.train()
    return tmp / "rec"


def _said(res) -> dict[str, tuple[str, str | None, set[str]]]:
    """Per book: the verdict in the report's words, the ledger, the requirements refused."""
    out = {}
    for b in res.books:
        verdict = "computes" if b.verdict == "will compute" else "refuses" if b.verdict == "will refuse" else b.verdict
        out[b.book] = (verdict, b.ledger, {r.requirement for r in b.refusals})
    return out


def _reported(report) -> dict[str, tuple[str, str | None, set[str]]]:
    out = {}
    for b in report.books:
        missing = {r.context.get("requirement") for r in b.refusals if r.code == "RECORD_INCOMPLETE"}
        verdict = "refuses" if b.status == "refused" or missing else "computes"
        ledger = b.data.summary.get("ledger") if b.id == "cost" and b.data is not None else (
            b.data.ledger if b.id == "effect" and b.data is not None else None)
        out[b.id] = (verdict, ledger, missing)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_audit_of_a_config_and_of_its_record_say_what_the_report_does(tmp_path, name):
    from reward_lens.report import build_report

    cfg = {**BASE, **CONFIGS[name]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    predicted = audit(path, framework="trl", with_tap=True)
    before = _said(predicted)
    rec = _train(tmp_path, CONFIGS[name])
    built = build_report(open_run(rec))
    report = _reported(built)
    after = _said(audit(rec))
    # the findings too: what the audit says will not evaluate (here: too few steps for those with
    # a `min_steps`) is not evaluated on the report, and every finding the report leaves
    # unjudged for too few steps, the audit said beforehand
    found = {f.id: f for f in built.findings}
    for f in predicted.findings:
        if f.verdict == "will not evaluate":
            assert found[f.finding].status == "not_evaluated", (name, f.finding, f.missing)
        if found[f.finding].values.get("too_short"):
            assert f.verdict == "will not evaluate", (name, f.finding)
    assert any(f.verdict == "will not evaluate" for f in predicted.findings)  # 4 steps: under every min_steps
    for book, (verdict, ledger, missing) in report.items():
        assert before[book][0] == verdict == after[book][0], (name, book, before[book], report[book], after[book])
        assert before[book][2] == missing == after[book][2], (name, book, before[book], report[book])
        if book in ("cost", "effect") and verdict == "computes":
            assert before[book][1] == ledger == after[book][1], (name, book, before[book], ledger)
    if name == "one prompt per step":
        assert report["cost"][1] == "unpaired"
    if name == "num_iterations 2":
        assert report["price"][0] == "refuses" and report["cost"][0] == "computes"
