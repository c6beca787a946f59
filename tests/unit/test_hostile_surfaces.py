"""The hostile corpus of issue 42, one test per finding, in the style of test_bad_input.py: the
exit code, one line on stderr naming the file (and the field, and the user's own step), never a
traceback, never exit 3, never a hang, never a file read or written outside what it should be.

Every command that could block on a FIFO runs under ``no_hang``: a SIGALRM that fails the test
instead of hanging the suite."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reward_lens import cli
from tests.conftest import SHORT, refresh_manifest
from tests.unit.test_importer import _trl_output


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    def boom(*_):
        raise TimeoutError(f"the command blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _one_line(capsys, code, argv, words, exit_code=cli.EXIT_BAD_INPUT):
    with no_hang():
        got = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert got == exit_code, err
    if exit_code == cli.EXIT_BAD_INPUT:
        assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
        for w in words:
            assert w in lines[0], (w, lines[0])
    return err


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes, links as links (never followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


def _short(tmp_path) -> Path:
    rec = tmp_path / "short"
    shutil.copytree(SHORT, rec)
    return rec


# ---------------------------------------------------------------- security: the site
def test_publish_never_copies_a_linked_file_from_outside_the_site(tmp_path, capsys):
    site, secret = tmp_path / "site", tmp_path / "secret.txt"
    secret.write_text("the user's secret")
    assert cli.main(["publish", str(SHORT), "--site", str(site), "--quiet"]) == 0
    (kept,) = site.glob("runs/short-*/report.md")
    kept.unlink()
    kept.symlink_to(secret)
    before = _tree(site)
    tapped = SHORT.parent / "tapped"
    _one_line(capsys, 2, ["publish", str(tapped), "--site", str(site), "--quiet"],
              [str(kept), "symbolic link", "nothing was changed"])
    assert _tree(site) == before  # nothing changed
    assert not any("secret" in p.read_text(errors="replace") for p in site.rglob("*")
                   if p.is_file() and not p.is_symlink())


@pytest.mark.parametrize("what", ["fifo", "runs-link", "run-folder-link"])
def test_publish_refuses_a_site_path_that_is_not_what_it_wrote(tmp_path, capsys, what):
    site, outside = tmp_path / "site", tmp_path / "outside"
    outside.mkdir()
    assert cli.main(["publish", str(SHORT), "--site", str(site), "--quiet"]) == 0
    (run,) = site.glob("runs/short-*")
    if what == "fifo":
        (run / "report.md").unlink()
        os.mkfifo(run / "report.md")
        words = [f"{run.name}/report.md", "FIFO"]
    elif what == "runs-link":
        shutil.move(str(site / "runs"), str(outside / "runs"))
        (site / "runs").symlink_to(outside / "runs")
        words = ["runs", "symbolic link"]
    else:
        shutil.move(str(run), str(outside / run.name))
        run.symlink_to(outside / run.name)
        words = [run.name, "symbolic link"]
    before = _tree(site)
    _one_line(capsys, 2, ["publish", str(SHORT.parent / "tapped"), "--site", str(site), "--quiet"], words)
    assert _tree(site) == before


def test_a_site_marker_that_is_a_fifo_does_not_hang(tmp_path, capsys):
    site = tmp_path / "site"
    assert cli.main(["publish", str(SHORT), "--site", str(site), "--quiet"]) == 0
    (site / ".reward-lens").unlink()
    os.mkfifo(site / ".reward-lens")
    _one_line(capsys, 2, ["publish", str(SHORT), "--site", str(site), "--quiet"], [str(site), "marker"])


def test_out_that_is_a_link_is_refused_saying_it_is_a_link(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "empty")
    _one_line(capsys, 2, ["report", "--example", "short", "--out", str(tmp_path / "out"), "--quiet"],
              ["out", "is a symbolic link", "empty"])
    assert not any((tmp_path / "empty").iterdir())


# ---------------------------------------------------------------- security: manifest paths
def _checkpoint_path(change):
    def setup(rec: Path):
        m = json.loads((rec / "manifest.json").read_text())
        change(rec, m["checkpoints"][0])
        (rec / "manifest.json").write_text(json.dumps(m))
        refresh_manifest(rec)  # the run id recomputed: the attack the issue describes
    return setup


def _rename_file(rec, ck):
    ck["files"]["../../x"] = ck["files"].pop("config.json")


def _link_out(rec, ck):
    (rec.parent / "elsewhere").mkdir()
    shutil.move(str(rec / ck["path"]), str(rec.parent / "elsewhere" / "step-0"))
    (rec / ck["path"]).symlink_to(rec.parent / "elsewhere" / "step-0")


def _link_file_out(rec, ck):
    (rec.parent / "config.json").write_text("{}")
    (rec / ck["path"] / "extra.json").symlink_to(rec.parent / "config.json")


def _data_link_out(rec, ck):
    shutil.move(str(rec / "rollouts.parquet"), str(rec.parent / "rollouts.parquet"))
    (rec / "rollouts.parquet").symlink_to(rec.parent / "rollouts.parquet")


MANIFEST_PATHS = [
    ("data-file-link-out", _checkpoint_path(_data_link_out), ["`files['rollouts.parquet']`", "symbolic link"]),
    ("parent", _checkpoint_path(lambda rec, ck: ck.update(path="../outside")), ["`checkpoints[0].path`", "'../outside'"]),
    ("absolute", _checkpoint_path(lambda rec, ck: ck.update(path="/etc")), ["`checkpoints[0].path`", "absolute"]),
    ("file-name", _checkpoint_path(_rename_file), ["`checkpoints[0].files['../../x']`"]),
    ("link-out", _checkpoint_path(_link_out), ["`checkpoints[0].path`", "symbolic link"]),
    ("file-link-out", _checkpoint_path(_link_file_out), ["`checkpoints[0].path`", "extra.json", "symbolic link"]),
]


@pytest.mark.parametrize("case,setup,words", MANIFEST_PATHS, ids=[c[0] for c in MANIFEST_PATHS])
def test_every_path_a_manifest_names_stays_inside_the_record(tmp_path, capsys, case, setup, words):
    rec = _short(tmp_path)
    setup(rec)
    _one_line(capsys, 2, ["check", str(rec), "--quiet"], ["manifest.json", *words])


# ---------------------------------------------------------------- never hang
def _fifo_in_record(name, link=False):
    def setup(tmp_path):
        rec = _short(tmp_path)
        (rec / name).unlink()
        if link:  # a link inside the record (one out of it is refused for that already)
            os.mkfifo(rec / "pipe")
            (rec / name).symlink_to(rec / "pipe")
        else:
            os.mkfifo(rec / name)
        return ["check", str(rec), "--quiet"], [name, "FIFO"]
    return setup


def _fifo_in_trl(name):
    def setup(tmp_path):
        out = _trl_output(tmp_path / "trl")
        (out / name).unlink()
        os.mkfifo(out / name)
        return ["check", str(out), "--quiet"], [Path(name).name, "FIFO"]
    return setup


def _fifo_report_json(tmp_path):
    a = tmp_path / "a"
    assert cli.main(["report", "--example", "short", "--out", str(a), "--quiet", "--format", "json"]) == 1
    (tmp_path / "b").mkdir()
    os.mkfifo(tmp_path / "b" / "report.json")
    return ["diff", str(a), str(tmp_path / "b"), "--out", str(tmp_path / "d"), "--quiet"], ["report.json", "FIFO"]


def _fifo_config(tmp_path):
    os.mkfifo(tmp_path / "c.yaml")
    return ["audit", str(tmp_path / "c.yaml")], ["c.yaml", "FIFO"]


def _fifo_basis(tmp_path):
    os.mkfifo(tmp_path / "basis.yaml")
    return ["report", "--example", "short", "--features", str(tmp_path / "basis.yaml"), "--out",
            str(tmp_path / "o"), "--quiet"], ["basis.yaml", "FIFO"]


def _fifo_in_checkpoint(tmp_path):
    out = _trl_output(tmp_path / "trl")
    ck = tmp_path / "ck"
    shutil.copytree(SHORT / "checkpoints" / "step-0", ck)
    os.mkfifo(ck / "tokenizer.model")
    return ["import", "trl", str(out), str(tmp_path / "rec"), "--checkpoint", str(ck)], ["tokenizer.model", "FIFO"]


def _fifo_in_record_checkpoint(tmp_path):
    rec = _short(tmp_path)
    os.mkfifo(rec / "checkpoints" / "step-0" / "tokenizer.model")  # a policy loader would open it
    return ["check", str(rec), "--quiet"], ["tokenizer.model", "FIFO", "checkpoint"]


FIFOS = [
    ("manifest", _fifo_in_record("manifest.json")),
    ("record-checkpoint", _fifo_in_record_checkpoint),
    ("telemetry", _fifo_in_record("telemetry.parquet")),
    ("rollouts", _fifo_in_record("rollouts.parquet")),
    ("rollouts-link-to-fifo", _fifo_in_record("rollouts.parquet", link=True)),
    ("trainer-state", _fifo_in_trl("trainer_state.json")),
    ("grpo-config", _fifo_in_trl("grpo_config.json")),
    ("completions", _fifo_in_trl("completions/completions_00002.parquet")),
    ("diff-report-json", _fifo_report_json),
    ("audit-config", _fifo_config),
    ("basis-file", _fifo_basis),
    ("checkpoint-file", _fifo_in_checkpoint),
]


@pytest.mark.parametrize("case,setup", FIFOS, ids=[c[0] for c in FIFOS])
def test_a_fifo_anywhere_is_named_never_waited_on(tmp_path, capsys, case, setup):
    argv, words = setup(tmp_path)
    capsys.readouterr()
    _one_line(capsys, 2, argv, words)
    assert not (tmp_path / "rec").exists()


# ---------------------------------------------------------------- grpo_config.json typed
CONFIGS = [
    ("max-grad-norm-number-string", {"max_grad_norm": "1.0"}, 0, []),  # TRL's parser reads "1.0" as 1.0
    ("num-generations-zero", {"num_generations": 0}, 2, ["grpo_config.json", "`num_generations`", "0"]),
    ("beta-word", {"beta": "x"}, 2, ["grpo_config.json", "`beta`", "'x'", "finite number"]),
    ("logging-steps-word", {"logging_steps": "ten"}, 2, ["grpo_config.json", "`logging_steps`", "'ten'"]),
    ("max-grad-norm-list", {"max_grad_norm": [1]}, 2, ["grpo_config.json", "`max_grad_norm`"]),
    ("reward-weights-text", {"reward_weights": ["a"]}, 2, ["grpo_config.json", "`reward_weights`"]),
    ("beta-nan", {"beta": float("nan")}, 2, ["grpo_config.json", "`beta`", "nan"]),
    ("group-size-true", {"num_generations": True}, 2, ["grpo_config.json", "`num_generations`", "True"]),
]


@pytest.mark.parametrize("case,change,code,words", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_grpo_config_is_read_through_one_typed_model(tmp_path, capsys, case, change, code, words):
    out = _trl_output(tmp_path / "trl")
    cfg = json.loads((out / "grpo_config.json").read_text())
    cfg.update(change)
    (out / "grpo_config.json").write_text(json.dumps(cfg, allow_nan=True))
    _one_line(capsys, code, ["import", "trl", str(out), str(tmp_path / "rec"), "--quiet"], words, code)
    if code == 0:
        from reward_lens.record import open_run

        run = open_run(tmp_path / "rec")
        assert run.manifest.trainer_config["max_grad_norm"] == 1.0  # a number, as TRL read it
        assert run.telemetry_column("grad_norm")[1] == pytest.approx(2.0 / (2.0 + 1e-6))  # clipped at 1.0


def test_the_audit_reads_the_same_model(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("num_generations: 8\nbeta: .nan\n")
    _one_line(capsys, 2, ["audit", str(tmp_path / "c.yaml")], ["c.yaml", "`beta`", "nan"])
    (tmp_path / "c.yaml").write_text("num_generations: 8\nlearning_rate: 1e-5\nmax_steps: 10\n")  # a string in YAML
    assert cli.main(["audit", str(tmp_path / "c.yaml")]) in (0, 1)


# ---------------------------------------------------------------- steps beyond int64, values near float max
def test_a_trl_step_beyond_int64_is_named(tmp_path, capsys):
    out = _trl_output(tmp_path / "trl")
    state = json.loads((out / "trainer_state.json").read_text())
    state["log_history"][2]["step"] = 2 ** 63
    (out / "trainer_state.json").write_text(json.dumps(state))
    _one_line(capsys, 2, ["import", "trl", str(out), str(tmp_path / "rec")],
              ["trainer_state.json", "`step`", "9223372036854775808"])


def test_a_record_step_of_int64_max_is_named(tmp_path, capsys):
    rec = _short(tmp_path)
    t = pq.read_table(rec / "telemetry.parquet")
    steps = t.column("step").to_pylist()
    steps[-1] = 2 ** 63 - 1
    t = t.set_column(t.schema.get_field_index("step"), "step", pa.array(steps, pa.int64()))
    pq.write_table(t, rec / "telemetry.parquet")
    refresh_manifest(rec)
    _one_line(capsys, 2, ["check", str(rec), "--quiet"], ["telemetry.parquet", "`step`", "9223372036854775807", "2^53"])


@pytest.mark.parametrize("value", [1.7e308, -1.7e308, 1e101])
def test_a_value_near_the_float_maximum_is_bad_input_not_clear(tmp_path, capsys, value):
    out = _trl_output(tmp_path / "trl", steps=3)
    state = json.loads((out / "trainer_state.json").read_text())
    for e in state["log_history"][:3]:
        e["entropy"] = value
    (out / "trainer_state.json").write_text(json.dumps(state))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning on the way either
        err = _one_line(capsys, 2, ["check", str(out), "--quiet"], ["trainer_state.json", "`entropy`", "at `step` 1"])
    assert "clear" not in err and "nan" not in err


def test_a_record_value_near_the_float_maximum_is_named(tmp_path, capsys):
    rec = _short(tmp_path)
    t = pq.read_table(rec / "telemetry.parquet")
    t = t.append_column("entropy", pa.array([1e300] * t.num_rows, pa.float64())) if "entropy" not in t.column_names \
        else t.set_column(t.schema.get_field_index("entropy"), "entropy", pa.array([1e300] * t.num_rows))
    pq.write_table(t, rec / "telemetry.parquet")
    refresh_manifest(rec)
    _one_line(capsys, 2, ["check", str(rec), "--quiet"], ["telemetry.parquet", "`entropy`", "1e+300"])


# ---------------------------------------------------------------- import trl --checkpoint
def _checkpoint(tmp_path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(SHORT / "checkpoints" / "step-0", ck)
    return ck


def test_a_huge_safetensors_header_is_named(tmp_path, capsys):
    out, ck = _trl_output(tmp_path / "trl"), _checkpoint(tmp_path)
    (ck / "model.safetensors").write_bytes((2 ** 64 - 1).to_bytes(8, "little") + b"{}")
    _one_line(capsys, 2, ["import", "trl", str(out), str(tmp_path / "rec"), "--checkpoint", str(ck)],
              ["model.safetensors", "header length"])
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("content,words", [("{not json", ["config.json", "not valid JSON"]),
                                           (b"\xff\xfe", ["config.json", "not UTF-8"]),
                                           ("[1]", ["config.json", "not the object"])])
def test_a_checkpoint_config_that_is_not_json_is_named(tmp_path, capsys, content, words):
    out, ck = _trl_output(tmp_path / "trl"), _checkpoint(tmp_path)
    (ck / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    _one_line(capsys, 2, ["import", "trl", str(out), str(tmp_path / "rec"), "--checkpoint", str(ck)], words)


# ---------------------------------------------------------------- the user's own numbering
def test_trl_errors_quote_the_files_step_not_the_records(tmp_path, capsys):
    out = _trl_output(tmp_path / "trl")
    state = json.loads((out / "trainer_state.json").read_text())
    state["log_history"][1]["learning_rate"] = "fast"  # the entry with "step": 2
    (out / "trainer_state.json").write_text(json.dumps(state))
    err = _one_line(capsys, 2, ["check", str(out), "--quiet"],
                    ["trainer_state.json", "`learning_rate`", "at `step` 2", "'fast'"])
    assert "step 1" not in err


# ---------------------------------------------------------------- check on the usual TRL layout
def test_check_reads_the_newest_checkpoints_state_and_says_which(tmp_path, capsys):
    out = _trl_output(tmp_path / "trl", steps=12)
    state = json.loads((out / "trainer_state.json").read_text())
    (out / "trainer_state.json").unlink()
    for n in (4, 8, 12):  # checkpoint-12 sorts after checkpoint-8 as a number, not as text
        (out / f"checkpoint-{n}").mkdir()
        cut = dict(state, log_history=[e for e in state["log_history"] if e["step"] <= n and "train_runtime" not in e],
                   global_step=n)
        (out / f"checkpoint-{n}" / "trainer_state.json").write_text(json.dumps(cut))
    with no_hang():
        assert cli.main(["check", str(out), "--format", "json", "--fail-on", "never"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["source"].endswith("its log from checkpoint-12/trainer_state.json)")
    from reward_lens.record.importers.trl_output import import_trl

    m = import_trl(out, tmp_path / "rec")
    assert any("checkpoint-12/trainer_state.json" in n for n in m.notes)
    from reward_lens.record import open_run

    assert open_run(tmp_path / "rec").steps.tolist() == list(range(12))


def test_without_any_state_the_message_says_where_trl_keeps_it(tmp_path, capsys):
    out = _trl_output(tmp_path / "trl")
    (out / "trainer_state.json").unlink()
    (out / "checkpoint-x").mkdir()
    _one_line(capsys, 2, ["import", "trl", str(out), str(tmp_path / "rec")],
              ["trainer_state.json", "checkpoint-<step>/trainer_state.json"])


# ---------------------------------------------------------------- versions and schemas
def _report_dir(tmp_path, name="a") -> Path:
    d = tmp_path / name
    assert cli.main(["report", "--example", "short", "--out", str(d), "--quiet", "--format", "json"]) == 1
    return d


@pytest.mark.parametrize("version,words", [(None, ["report.json", "no `schema_version`"]),
                                           ("5.0", ["report.json", "schema_version '5.0'"]),
                                           (7, ["report.json", "schema_version 7"])])
def test_diff_refuses_a_report_of_another_schema_version_naming_it(tmp_path, capsys, version, words):
    a, b = _report_dir(tmp_path, "a"), _report_dir(tmp_path, "b")
    data = json.loads((b / "report.json").read_text())
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    (b / "report.json").write_text(json.dumps(data))
    capsys.readouterr()
    _one_line(capsys, 2, ["diff", str(a), str(b), "--out", str(tmp_path / "d"), "--quiet"], words)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("version,code,words", [(None, 2, ["report.json", "None", "not a reward-lens report version"]),
                                                ("banana", 2, ["report.json", "'banana'"]),
                                                ("99.0", 2, ["report.json", "99.0", "newer"]),
                                                ("5.0", 0, [])])
def test_publish_names_a_kept_report_of_another_schema_version(tmp_path, capsys, version, code, words):
    site = tmp_path / "site"
    assert cli.main(["publish", str(SHORT), "--site", str(site), "--quiet"]) == 0
    (kept,) = site.glob("runs/short-*/report.json")
    data = json.loads(kept.read_text())
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    kept.write_text(json.dumps(data))
    before = _tree(site)
    capsys.readouterr()
    _one_line(capsys, code, ["publish", str(SHORT.parent / "tapped"), "--site", str(site)], words, code)
    if code:
        assert _tree(site) == before
    else:  # an earlier version: listed without numbers, and said so
        index = (site / "index.md").read_text()
        assert "report schema 5.0" in index and "publish it again" in index


def test_publish_says_on_stdout_which_kept_runs_are_of_an_earlier_schema(tmp_path, capsys):
    site = tmp_path / "site"
    assert cli.main(["publish", str(SHORT), "--site", str(site), "--quiet"]) == 0
    (kept,) = site.glob("runs/short-*/report.json")
    kept.write_text(json.dumps(dict(json.loads(kept.read_text()), schema_version="5.0")))
    capsys.readouterr()
    assert cli.main(["publish", str(SHORT.parent / "tapped"), "--site", str(site)]) == 0
    assert "a report of schema 5.0" in capsys.readouterr().out


def test_a_kept_report_md_that_is_not_utf8_is_named(tmp_path, capsys):
    site = tmp_path / "site"
    assert cli.main(["publish", str(SHORT), "--site", str(site), "--quiet"]) == 0
    (kept,) = site.glob("runs/short-*/report.md")
    kept.write_bytes(b"# report \xff\xfe")
    _one_line(capsys, 2, ["publish", str(SHORT.parent / "tapped"), "--site", str(site), "--quiet"],
              ["report.md", "not UTF-8"])


@pytest.mark.parametrize("key,value", [("eta_median", "not a number"), ("rows_resolved", "<b>3</b>"),
                                       ("rows_total", -1), ("eta_run_interval", [0.1])])
def test_the_cost_summary_is_typed(tmp_path, capsys, key, value):
    a, b = _report_dir(tmp_path, "a"), _report_dir(tmp_path, "b")
    data = json.loads((b / "report.json").read_text())
    (cost,) = [x for x in data["books"] if x["id"] == "cost"]
    cost["data"]["summary"][key] = value
    (b / "report.json").write_text(json.dumps(data))
    capsys.readouterr()
    _one_line(capsys, 2, ["diff", str(a), str(b), "--out", str(tmp_path / "d"), "--quiet"],
              ["report.json", "summary", key])


def test_a_non_utf8_basis_file_is_named(tmp_path, capsys):
    (tmp_path / "b.yaml").write_bytes(b"name: x\nfeatures:\n  - name: a\xff\n")
    _one_line(capsys, 2, ["report", "--example", "short", "--features", str(tmp_path / "b.yaml"),
                          "--out", str(tmp_path / "o"), "--quiet"], ["b.yaml", "not UTF-8"])
