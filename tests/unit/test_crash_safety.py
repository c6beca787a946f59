"""Nothing lost, nothing half-written: output folders reward-lens does not own are refused,
a report or site changes as a whole, a streamed record survives SIGKILL, a swap is never
caught with nothing in place, and an internal error exits 3."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reward_lens import cli
from reward_lens.record.reader import open_run
from reward_lens.record.writer import recover_swap, swap_into_place
from reward_lens.report.output import MARKER, _locked, replace_dir_atomically
from tests.conftest import tiny_record

REPO = Path(__file__).resolve().parents[2]


def _record(tmp_path: Path, name: str = "rec") -> Path:
    return tiny_record(tmp_path / name, {0: ["ab", "abc", "a b"], 1: ["abcd", "ab c", "x"]})


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- ownership
@pytest.mark.parametrize("command", ["publish", "report"])
def test_a_folder_with_foreign_files_is_refused_and_untouched(tmp_path, capsys, command):
    rec = _record(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "notes.txt").write_text("mine")
    before = _tree(site)
    argv = ["publish", str(rec), "--site", str(site)] if command == "publish" else \
        ["report", str(rec), "--out", str(site), "--quiet"]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "notes.txt" in err[0] and "did not write" in err[0]
    assert _tree(site) == before


def test_publish_into_the_folder_of_its_records_or_the_current_directory_is_refused(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    rec = _record(runs, "a")
    before = _tree(runs)
    assert cli.main(["publish", str(rec), "--site", str(runs)]) == cli.EXIT_BAD_INPUT
    monkeypatch.chdir(runs)
    assert cli.main(["publish", "a", "--site", "."]) == cli.EXIT_BAD_INPUT
    assert _tree(runs) == before


def test_a_folder_reward_lens_wrote_is_replaced_whole(tmp_path):
    rec = _record(tmp_path)
    site = tmp_path / "site"
    assert cli.main(["publish", str(rec), "--site", str(site), "--quiet"]) == 0
    marker = json.loads((site / MARKER).read_text())
    assert sorted(marker["files"]) == sorted(n for n in _tree(site) if n != MARKER)
    (site / "runs" / "stale.html").write_text("old")  # not in the marker: a user's file now
    assert cli.main(["publish", str(rec), "--site", str(site), "--quiet"]) == cli.EXIT_BAD_INPUT
    (site / "runs" / "stale.html").unlink()
    assert cli.main(["publish", str(rec), "--site", str(site), "--quiet"]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["report", str(rec), "--out", str(empty), "--quiet", "--fail-on", "never"]) == 0


def test_import_overwrite_replaces_only_a_record(tmp_path):
    from reward_lens.record.errors import RecordError

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    from reward_lens.record import OptimizerTelemetry, Rollout, write_run

    with pytest.raises(RecordError, match="not a record reward-lens wrote"):
        write_run(folder, framework={"name": "t", "version": "0"}, model={"description": "x"},
                  telemetry=[OptimizerTelemetry(step=0)], rollouts=[Rollout(step=0, group_id="0:0", prompt="p", completion="a")],
                  overwrite=True)
    assert (folder / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- swap
def test_swap_exchanges_in_one_step_and_the_fallback_recovers(tmp_path, monkeypatch):
    import reward_lens.record.writer as writer

    dest, new = tmp_path / "d", tmp_path / "n"
    dest.mkdir()
    (dest / "f").write_text("old")
    new.mkdir()
    (new / "f").write_text("new")
    swap_into_place(new, dest)
    assert (dest / "f").read_text() == "new" and not new.exists()
    # The fallback (no renameat2) killed between its two renames: recover_swap puts the old back.
    new.mkdir()
    (new / "f").write_text("newer")
    monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    real = os.rename
    calls = []

    def dies(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process "dies" here
        return real(a, b)

    monkeypatch.setattr(writer.os, "rename", dies)
    with pytest.raises(KeyboardInterrupt):
        swap_into_place(new, dest)
    monkeypatch.setattr(writer.os, "rename", real)
    assert not dest.exists()
    recover_swap(dest)
    assert (dest / "f").read_text() == "new"


# ---------------------------------------------------------------- kills
WRITER = textwrap.dedent("""
    import sys, itertools
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from reward_lens.report.output import replace_dir_atomically
    out = Path(sys.argv[1])
    big = "x" * 400_000
    kind = sys.argv[4] if len(sys.argv) > 4 else "report"
    for i in itertools.count():
        tag = f"{sys.argv[3]}{i}"
        replace_dir_atomically(out, {f"report.{e}": tag + big for e in ("md", "html", "json")}, kind=kind)
        print(tag, flush=True)
""")


def _consistent(out: Path) -> set[str]:
    tags = {(out / f"report.{e}").read_text()[:12].rstrip("x") for e in ("md", "html", "json")}
    assert len(tags) == 1, f"a mixed set: {tags}"
    return tags


def _lines(proc: subprocess.Popen, n: int, timeout: float = 120.0) -> list[str]:
    """The next ``n`` lines ``proc`` prints (each after a write it committed): the test moves on
    the writer's own word, not on a sleep. Fails naming what it got if the writer ends or stalls."""
    import selectors

    got: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n:
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(left), f"no line from the writer in {timeout} s after {got}"
            line = proc.stdout.readline()
            assert line, f"the writer ended after {got}: {proc.stderr.read() if proc.stderr else ''}"
            got.append(line.strip())
    finally:
        sel.close()
    return got


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["report", "site"])  # report --out and publish --site share the writer
def test_output_folder_survives_sigkill_at_random_points(tmp_path, kind):
    """Each writer is killed after it has said it committed a random number of sets (1 to 4), at a
    random moment after: the folder then holds one whole set, this writer's, no older than the last
    it said it committed -- never an earlier writer's (a kill before any write would test nothing)."""
    rng = random.Random(0)
    out = tmp_path / "out"
    replace_dir_atomically(out, {f"report.{e}": "seed" for e in ("md", "html", "json")}, kind=kind)
    for k in range(24):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(REPO), f"k{k}-", kind],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            done = _lines(proc, rng.randint(1, 4))
            time.sleep(rng.random() * 0.02)  # somewhere in the next write: where does not decide the outcome
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        (tag,) = _consistent(out)
        # this writer's, and no earlier than the last set it said it committed (it may have gone on
        # past the lines read before the kill)
        assert tag.startswith(f"k{k}-") and int(tag[len(f"k{k}-"):]) >= int(done[-1][len(f"k{k}-"):]), (done, tag)
    # The next writer removes what killed writers left beside the folder.
    replace_dir_atomically(out, {f"report.{e}": "last" for e in ("md", "html", "json")}, kind=kind)
    assert _consistent(out) == {"last"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.slow
def test_two_writers_never_interleave(tmp_path):
    """Two writers replace one folder at once; a reader under the writers' lock checks the set
    until each writer has said it committed 15 sets and it has read a set of each. Which writer's
    set a reader finds is up to the scheduler (on a loaded two-core machine one writer may take the
    lock back straight after the other's commit for many rounds), so the reader goes on past the
    15 sets until it has read both; a writer that stalls or ends still fails the test at the
    deadline."""
    import threading

    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(REPO), tag], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tag in ("A", "B")]
    said: dict[str, list[str]] = {"A": [], "B": []}

    def listen(tag, proc):
        for line in proc.stdout:
            said[tag].append(line.strip())

    threads = [threading.Thread(target=listen, args=(t, p), daemon=True) for t, p in zip("AB", procs)]
    for t in threads:
        t.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 120  # a stalled writer fails the test, it does not end the loop early
    try:
        while min(len(v) for v in said.values()) < 15 or {t[0] for t in seen} != {"A", "B"}:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (said, seen)
            if (out / "report.md").exists():
                # A reader takes the writers' lock to read the set at one instant (without it a
                # reader that opens three files one by one can straddle an exchange).
                with _locked(tmp_path):
                    seen |= _consistent(out)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait()
    for p in procs:
        assert "Traceback" not in p.stderr.read() or p.returncode == -signal.SIGTERM
    assert {t[0] for t in seen} == {"A", "B"}, seen  # the reader saw both writers' sets
    _consistent(out)


STREAMER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from reward_lens.record.schema import OptimizerTelemetry, Rollout
    from reward_lens.record.stream import RecordStream
    s = RecordStream(sys.argv[1], framework={"name": "t", "version": "0"}, model={"description": "x"},
                     overwrite=True)
    for t in range(100000):
        s.set_telemetry(OptimizerTelemetry(step=t, learning_rate=1e-3))
        s.add_rollouts([Rollout(step=t, group_id=f"{t}:0", prompt="p", completion="c" * (t % 7), reward=float(i))
                       for i in range(4)])
        s.flush()
        print(t, flush=True)
""")


@pytest.mark.slow
def test_streamed_record_survives_sigkill_at_random_points(tmp_path):
    """Each streamer is killed after it has said it flushed a random number of steps (1 to 10), at
    a random moment after: the record opens, verifies, and holds at least every step the streamer
    said it flushed -- after every kill, not most of them."""
    rng = random.Random(1)
    rec = tmp_path / "rec"
    for k in range(24):
        proc = subprocess.Popen([sys.executable, "-c", STREAMER, str(rec), str(REPO)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            flushed = int(_lines(proc, rng.randint(1, 10))[-1])
            time.sleep(rng.random() * 0.02)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        run = open_run(rec)  # raises if the manifest and the files disagree
        steps = run.steps.tolist()
        assert steps == list(range(len(steps)))
        assert len(steps) >= flushed + 1, (k, flushed, len(steps))  # it may have flushed more than was read
        run.read_rollouts(["completion"])
        run.verify()


# ---------------------------------------------------------------- exit codes
def test_internal_error_exits_3_in_one_line(tmp_path, monkeypatch, capsys):
    import reward_lens.report as report

    rec = _record(tmp_path)

    def boom(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(report, "build_report", boom)
    assert cli.main(["report", str(rec), "--out", str(tmp_path / "o"), "--quiet"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error" in err[0] and "ZeroDivisionError" in err[0]
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- wrong answers and leaks
def test_identical_completions_get_a_report_that_prices_nothing(tmp_path):
    rec = tiny_record(tmp_path / "same", {s: ["same text"] * 6 for s in range(4)}, kl_to_previous={s: 1.0 for s in
                                                                                                    range(4)})
    out = tmp_path / "o"
    assert cli.main(["report", str(rec), "--out", str(out), "--quiet", "--fail-on", "refused"]) == cli.EXIT_REFUSED
    data = json.loads((out / "report.json").read_text())
    book = next(b for b in data["books"] if b["id"] == "cost")
    assert book["status"] == "unresolved" and book["data"]["summary"]["rows_nothing_priced"] == 3
    eff = book["data"]["efficiency"]  # columns: one list per quantity
    assert len(eff["step_pair"]) == 3 and set(eff["efficiency"]) == {None} and set(eff["status"]) == {"nothing_priced"}
    assert (out / "report.html").stat().st_size > 0


def test_a_step_with_one_rollout_refuses_only_the_pairs_that_touch_it(tmp_path):
    from tests.conftest import varied_completions

    steps = {s: varied_completions(s, n=12) for s in range(6)}
    steps[3] = steps[3][:1]
    rec = tiny_record(tmp_path / "one", steps, kl_to_previous={s: 50.0 for s in range(6)})
    out = tmp_path / "o"
    assert cli.main(["report", str(rec), "--out", str(out), "--quiet", "--fail-on", "never"]) == 0
    book = next(b for b in json.loads((out / "report.json").read_text())["books"] if b["id"] == "cost")
    priced = {tuple(p) for p in book["data"]["efficiency"]["step_pair"]}
    assert priced == {(0, 1), (1, 2), (4, 5)}
    (ref,) = [r for r in book["refusals"] if r["context"].get("requirement") == "ledger"]
    assert sorted(map(tuple, ref["step_pairs"])) == [(2, 3), (3, 4)] and "step 3 has 1 rollout" in ref["detail"]


def test_a_same_size_edit_of_a_data_file_is_refused_naming_it(tmp_path, capsys):
    rec = _record(tmp_path)
    name = next(n for n in json.loads((rec / "manifest.json").read_text())["files"] if n.startswith("rollouts"))
    data = bytearray((rec / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (rec / name).write_bytes(bytes(data))
    assert cli.main(["report", str(rec), "--out", str(tmp_path / "o"), "--quiet"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert name in err and "sha256" in err and not (tmp_path / "o").exists()


def test_manifest_names_rows_segments_and_paths_are_checked(tmp_path):
    from reward_lens.record.errors import RecordError

    rec = _record(tmp_path)
    m = json.loads((rec / "manifest.json").read_text())
    tel = next(n for n in m["files"] if n.startswith("telemetry"))

    def edited(change):
        from reward_lens.record.schema import RunManifest, content_run_id

        d = json.loads(json.dumps(m))
        change(d)

        d["run_id"] = content_run_id(RunManifest.model_validate(d))
        (rec / "manifest.json").write_text(json.dumps(d))

    edited(lambda d: d["files"][tel].update(rows=99))
    with pytest.raises(RecordError, match="rows but manifest.json records 99"):
        open_run(rec)
    edited(lambda d: d["files"].update({"/etc/passwd": d["files"][tel]}))
    with pytest.raises(RecordError, match="plain names inside its own directory"):
        open_run(rec)


def test_window_mean_telemetry_gives_no_per_step_d_t(tmp_path):
    from reward_lens.measure.efficiency import cost_series, metric_g
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import ledger_series, steps_from_run
    from reward_lens.record import OptimizerTelemetry, Rollout, write_run
    from tests.conftest import varied_completions

    rol = [Rollout(step=s, group_id=f"{s}:0", prompt="p", completion=c) for s in range(3)
           for c in varied_completions(s, n=10)]
    write_run(tmp_path / "w", framework={"name": "t", "version": "0"}, model={"description": "x"},
              telemetry=[OptimizerTelemetry(step=s, kl_to_previous=1.0) for s in range(3)], rollouts=rol,
              telemetry_per_step=False, logging_steps=10)
    run = open_run(tmp_path / "w")
    samples = steps_from_run(run, SurfaceFeatures())
    book = cost_series(ledger_series(samples), metric_g(samples), run_=run)
    assert book.rows == () and [r.code for r in book.refusals] == ["RECORD_INCOMPLETE"]


def test_sample_text_is_capped_with_a_visible_mark(tmp_path):
    rec = tiny_record(tmp_path / "big", {0: ["x" * 50_000, "ab"], 1: ["cd", "ef"]})
    from reward_lens.report import build_report

    report = build_report(open_run(rec))
    big = next(s for s in report.samples if s.completion.startswith("xxx"))
    assert len(big.completion) < 2100 and "[truncated: 48000 more characters]" in big.completion


# ---------------------------------------------------------------- reading a record while it is written (issue 31)
LIVE_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from reward_lens.record import OptimizerTelemetry, Rollout
    from reward_lens.record.stream import RecordStream
    s = RecordStream(sys.argv[1], framework={"name": "t", "version": "0"}, model={"description": "x"})
    for step in range(10_000):
        s.set_telemetry(OptimizerTelemetry(step=step, learning_rate=1e-3))
        s.add_rollouts([Rollout(step=step, group_id=f"{step}:0", prompt="p", completion=c, reward=float(i))
                        for i, c in enumerate(["ab", "abc ", "x y z", "AB1"])])
        s.flush()
        time.sleep(float(sys.argv[3]))
""")


@pytest.mark.parametrize("every", [0.0, 0.05])
def test_a_record_is_read_while_the_tap_flushes(tmp_path, every):
    """Each flush used to remove the telemetry file the previous manifest listed, so a reader
    between reading the manifest and opening its files failed (4 of 4 times at a 50 ms flush).
    A reader now always gets one committed manifest's snapshot."""
    rec = tmp_path / "rec"
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(rec), str(REPO), str(every)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while not (rec / "manifest.json").exists():
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "no flush"
            time.sleep(0.01)
        reads, steps_seen = 0, []
        while reads < 40:
            run = open_run(rec)
            steps = run.steps.tolist()
            assert steps == list(range(len(steps)))
            assert set(run.read_rollouts(["step"]).column("step").to_pylist()) <= set(steps)
            steps_seen.append(len(steps))
            reads += 1
        assert proc.poll() is None  # the writer was flushing throughout
        assert steps_seen[-1] > steps_seen[0]  # and the reads saw it grow
        code = cli.main(["report", str(rec), "--out", str(tmp_path / "out"), "--format", "json", "--quiet",
                         "--fail-on", "never"])
        assert code == 0
    finally:
        proc.kill()
        proc.wait()


def test_overwriting_a_record_keeps_the_users_own_files(tmp_path):
    """`import ... --overwrite` (write_run) and the tap's overwrite=True (RecordStream) replace
    the record's own files, never a user's notes beside them (issue 31)."""
    from reward_lens.record import OptimizerTelemetry, Rollout, write_run
    from reward_lens.record.stream import RecordStream

    rec = _record(tmp_path)
    (rec / "notes.txt").write_text("mine")
    (rec / "data.parquet").write_bytes(b"not ours")
    (rec / "analysis").mkdir()
    (rec / "analysis" / "a.py").write_text("print(1)")
    write_run(rec, framework={"name": "t", "version": "0"}, model={"description": "again"},
              telemetry=[OptimizerTelemetry(step=0)], rollouts=[Rollout(step=0, group_id="0:0", prompt="p", completion="a")],
              overwrite=True)
    assert open_run(rec).manifest.model.description == "again"
    assert (rec / "notes.txt").read_text() == "mine" and (rec / "data.parquet").read_bytes() == b"not ours"
    assert (rec / "analysis" / "a.py").read_text() == "print(1)"
    s = RecordStream(rec, framework={"name": "t", "version": "0"}, model={"description": "streamed"}, overwrite=True)
    s.set_telemetry(OptimizerTelemetry(step=0))
    s.add_rollouts([Rollout(step=0, group_id="0:0", prompt="p", completion="a")])
    s.flush()
    assert open_run(rec).manifest.model.description == "streamed"
    assert (rec / "notes.txt").read_text() == "mine" and (rec / "data.parquet").read_bytes() == b"not ours"
