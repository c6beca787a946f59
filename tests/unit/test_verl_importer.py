"""veRL metric logs: mapped by meaning; ppo_kl is never D_t."""

from __future__ import annotations

from pathlib import Path

import pytest

from reward_lens.record import RecordError, open_run
from reward_lens.record.importers.verl import import_verl
from reward_lens.report import build_report

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "verl"


def test_jsonl_metrics_map_by_meaning(tmp_path):
    m = import_verl(FIX / "metrics.jsonl", tmp_path / "rec", framework_version="0.5.0")
    run = open_run(tmp_path / "rec", m.run_id)
    assert run.steps.tolist() == [0, 1, 2]  # veRL's global_steps 1, 2, 3
    assert run.telemetry_column("ppo_kl") == {0: 0.0, 1: 0.00031, 2: -0.00004}
    assert run.telemetry_column("kl_to_previous") == {}  # ppo_kl is not D_t
    assert run.telemetry_column("kl_to_ref") == {0: 0.0012, 1: 0.0019, 2: 0.0023}
    assert run.telemetry_column("grad_norm_unclipped")[2] == 1.31 and run.telemetry_column("grad_norm") == {}
    assert run.telemetry_column("learning_rate") == {0: 1e-06, 1: 1e-06, 2: 1e-06}
    assert run.n_rollouts == 0 and "no rollouts" in m.notes[0]


def test_console_lines_with_their_precision_said(tmp_path):
    m = import_verl(FIX / "console.log", tmp_path / "rec")
    run = open_run(tmp_path / "rec")
    assert run.steps.tolist() == [0, 1, 2] and run.telemetry_column("grad_norm_unclipped")[2] == 1.31
    assert any("three decimals" in n for n in m.notes)


def test_the_report_refuses_for_lack_of_rollouts_and_names_ppo_kl(tmp_path):
    import_verl(FIX / "metrics.jsonl", tmp_path / "rec")
    report = build_report(open_run(tmp_path / "rec"))
    books = {b.id: b for b in report.books}
    assert books["cost"].status == "refused"
    assert [r.context["requirement"] for r in books["cost"].refusals] == ["rollouts"]
    assert all(b.status == "refused" for b in books.values())  # nothing moved, nothing was asked for


def test_bad_lines_are_named(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"step": 1, "actor/ppo_kl": 0.1}\n{"step": 2, "actor/ppo_kl": "lots"}\n')
    with pytest.raises(RecordError, match=r"m\.jsonl:2: field `actor/ppo_kl` at `step` 2: `actor/ppo_kl` is 'lots'"):
        import_verl(bad, tmp_path / "rec")
    bad.write_text('{"step": 1}\n{"step": 1}\n')
    with pytest.raises(RecordError, match=r"m\.jsonl:2 at `step` 1: a second metrics line for this step"):
        import_verl(bad, tmp_path / "rec")
    bad.write_text('{"step": 1,\n')
    with pytest.raises(RecordError, match=r"m\.jsonl:1: not valid JSON"):
        import_verl(bad, tmp_path / "rec")
    bad.write_text("hello\n")
    with pytest.raises(RecordError, match="no veRL metric lines found"):
        import_verl(bad, tmp_path / "rec")
    assert not (tmp_path / "rec").exists()


def _dump_lines(step: int) -> list[dict]:
    import json

    return [json.loads(line) for line in (FIX / "rollouts" / f"{step}.jsonl").read_text().splitlines()]


def test_rollout_dumps_become_rollouts_grouped_by_prompt(tmp_path):
    """veRL's `{step}.jsonl` dumps (`_dump_generations`: input, output, gts, score, step and the
    reward function's per-sample extras), shuffled as `_balance_batch` leaves them."""
    m = import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=FIX / "rollouts")
    run = open_run(tmp_path / "rec")
    assert run.n_rollouts == 24 and sorted(set(run.rollout_steps.tolist())) == [0, 1, 2]
    rows = run.read_rollouts(["step", "group_id", "prompt", "completion", "reward", "rewards"]).to_pylist()
    for t in (0, 1, 2):
        lines = _dump_lines(t + 1)
        mine = [r for r in rows if r["step"] == t]
        # same rollouts in the same order, reward = score, extras = per-function rewards
        assert [r["completion"] for r in mine] == [x["output"] for x in lines]
        assert [r["reward"] for r in mine] == [x["score"] for x in lines]
        assert [dict(r["rewards"]) for r in mine] == [{"acc": float(x["acc"]), "format": x["format"]} for x in lines]
        # a group is every rollout of one prompt in that step, wherever the shuffle put it
        by_group: dict[str, set[str]] = {}
        for r in mine:
            by_group.setdefault(r["group_id"], set()).add(r["prompt"])
        assert all(len(p) == 1 for p in by_group.values()) and len(by_group) == len({x["input"] for x in lines})
    assert any("no advantages and no per-rollout log-probabilities" in n for n in m.notes)
    assert any("['pred']" in n for n in m.notes)
    # the feature movement is computable on it: KL_min is there, efficiency refused for lack of D_t
    report = build_report(run)
    books = {b.id: b for b in report.books}
    assert [r.context["requirement"] for r in books["cost"].refusals] == ["denominator"]
    assert books["effect"].status != "refused"  # what moved needs rollouts only
    # veRL dumps carry no advantages: the cause book says so, and what veRL still lacks
    (ref,) = books["cause"].refusals
    assert ref.context["requirement"] == "advantages" and "veRL's generation dumps" in ref.remedy


def test_bad_rollout_dumps_are_named(tmp_path):
    import json

    d = tmp_path / "dumps"
    d.mkdir()
    (d / "2.jsonl").write_text(json.dumps({"input": "q", "output": "a", "score": 1.0, "step": 3}) + "\n")
    with pytest.raises(RecordError, match=r"2\.jsonl:1: field `step`: `step` is 3 in the dump of step 2"):
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=d)
    (d / "2.jsonl").write_text(json.dumps({"input": "q", "score": 1.0, "step": 2}) + "\n")
    with pytest.raises(RecordError, match=r"2\.jsonl:1: field `output`: .*missing \['output'\]"):
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=d)
    (d / "2.jsonl").write_text(json.dumps({"input": "q", "output": "a", "score": None, "step": 2}) + "\n")
    with pytest.raises(RecordError, match=r"`score` is None, not a number"):
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=d)
    (d / "2.jsonl").unlink()
    (d / "9.jsonl").write_text(json.dumps({"input": "q", "output": "a", "score": 1.0, "step": 9}) + "\n")
    with pytest.raises(RecordError, match="a rollout dump for a step the metrics log does not have"):
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=d)
    with pytest.raises(RecordError, match="no such rollout dump directory"):
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=tmp_path / "nope")
    assert not (tmp_path / "rec").exists()


def _dumps(tmp_path):
    import shutil

    d = tmp_path / "dumps"
    shutil.copytree(FIX / "rollouts", d)
    return d


@pytest.mark.parametrize("name", ["03.jsonl", "\u0663.jsonl", "\u00b2.jsonl"])
def test_a_dump_named_like_a_step_but_not_as_verl_names_it_is_named(tmp_path, name):
    """`03.jsonl` or an Arabic-Indic `٣.jsonl` beside `3.jsonl` used to replace it silently, and
    `².jsonl` failed in int() without the file (issue 31)."""
    d = _dumps(tmp_path)
    (d / name).write_text((d / "3.jsonl").read_text())
    with pytest.raises(RecordError, match=r"named like a step's dump") as e:
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=d)
    assert name in str(e.value)
    assert not (tmp_path / "rec").exists()


def test_a_fifo_named_as_a_dump_is_refused_without_blocking(tmp_path):
    import os

    d = _dumps(tmp_path)
    (d / "2.jsonl").unlink()
    os.mkfifo(d / "2.jsonl")  # opening it would wait for a writer forever
    with pytest.raises(RecordError, match="not a regular file") as e:
        import_verl(FIX / "metrics.jsonl", tmp_path / "rec", rollouts=d)
    assert "2.jsonl" in str(e.value)


@pytest.mark.parametrize("content,words", [
    (b'{"input": "q", "output": "\xff\xfe", "score": 1.0, "step": 2}\n', ["2.jsonl:1", "not UTF-8"]),
    (b'{"input": "q", "output": "a\\ud800b", "score": 1.0, "step": 2}\n', ["2.jsonl:1", "`output`", "lone surrogate"]),
    (b'{"input": "q", "output": "a", "score": "' + b"9" * 200_000 + b'x", "step": 2}\n',
     ["2.jsonl:1", "`score`", "200,003 characters"]),
])
def test_undecodable_or_huge_dump_values_are_named_in_one_short_line(tmp_path, capsys, content, words):
    from reward_lens import cli

    d = _dumps(tmp_path)
    (d / "2.jsonl").write_bytes(content)
    code = cli.main(["import", "verl", str(FIX / "metrics.jsonl"), str(tmp_path / "rec"), "--rollouts", str(d)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and len(err) < 600, err[:300]
    assert all(w in err for w in words), err[:300]
    assert not (tmp_path / "rec").exists()


def test_a_non_utf8_metrics_file_is_named(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_bytes(b'{"step": 1, "actor/pg_loss": 0.1}\n{"step": 2, "x\xff": 1}\n')
    with pytest.raises(RecordError, match=r"m\.jsonl:2: not UTF-8"):
        import_verl(bad, tmp_path / "rec")


def test_import_overwrite_keeps_the_users_files_in_the_record_folder(tmp_path):
    from reward_lens import cli

    rec = tmp_path / "rec"
    assert cli.main(["import", "verl", str(FIX / "metrics.jsonl"), str(rec), "--rollouts", str(FIX / "rollouts")]) == 0
    (rec / "notes.txt").write_text("mine")
    assert cli.main(["import", "verl", str(FIX / "metrics.jsonl"), str(rec), "--rollouts", str(FIX / "rollouts"),
                     "--overwrite"]) == 0
    assert (rec / "notes.txt").read_text() == "mine"
    open_run(rec).verify()
