"""The record: write, open, and every kind of broken record named by file, field and step."""

from __future__ import annotations

import json
import math
import os
import stat

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reward_lens.record import OptimizerTelemetry, RecordError, Rollout, open_run, write_run
from tests.conftest import LONG, rewrite_parquet


def _write(path, steps=3, per_step=4, **kw):
    tel = kw.pop("telemetry", [OptimizerTelemetry(step=s, learning_rate=0.1, grad_norm_unclipped=1.0 + s)
                               for s in range(steps)])
    rol = kw.pop("rollouts", [Rollout(step=s, group_id=f"{s}:0", prompt="p", completion=f"abc {i}",
                                      reward=float(i), advantage=0.0)
                              for s in range(steps) for i in range(per_step)])
    return write_run(path, framework={"name": "test"}, model={"description": "none"},
                     telemetry=tel, rollouts=rol, **kw)


def test_roundtrip_and_presence(tmp_path):
    m = _write(tmp_path / "r")
    run = open_run(tmp_path / "r", m.run_id)
    assert run.steps.tolist() == [0, 1, 2]
    assert run.n_rollouts == 12
    f = run.fields()
    assert f["learning_rate"].count == 3 and f["learning_rate"].full
    # Absent is absent: not zero, not NaN.
    assert "kl_to_previous" not in f and "update_norm" not in f
    assert run.telemetry_column("kl_to_previous") == {}
    assert run.telemetry.column("kl_to_previous").null_count == 3


def test_run_id_is_a_content_hash_stable_across_rewrites(tmp_path):
    a = _write(tmp_path / "a")
    b = _write(tmp_path / "b")
    c = _write(tmp_path / "c", steps=4)
    assert a.run_id == b.run_id != c.run_id
    assert a.run_id.startswith("run:") and len(a.run_id) == 4 + 64
    open_run(tmp_path / "a", a.run_id[:12])  # a prefix of run: + 8 hex digits is enough
    with pytest.raises(RecordError, match="not run:deadbeef"):
        open_run(tmp_path / "a", "run:deadbeef")


def test_record_directory_is_not_private(tmp_path):
    _write(tmp_path / "r")
    assert os.stat(tmp_path / "r").st_mode & stat.S_IRGRP


def test_writer_is_atomic(tmp_path):
    _write(tmp_path / "r")
    before = (tmp_path / "r" / "manifest.json").read_text()
    bad = [Rollout(step=0, group_id="g", prompt="p", completion="c")]
    with pytest.raises(RecordError, match="already exists"):
        _write(tmp_path / "r", rollouts=bad)
    # A failure part-way (here: an unserialisable trainer config) leaves the old record intact
    # and no temporary directory behind.
    with pytest.raises(ValueError, match="serialize"):
        _write(tmp_path / "r", overwrite=True, trainer_config={"x": object()})
    assert (tmp_path / "r" / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# ---------------------------------------------------------------- broken records, one kind each
def test_missing_directory(tmp_path):
    with pytest.raises(RecordError, match="not a directory"):
        open_run(tmp_path / "nope")


def test_missing_manifest(long_copy):
    (long_copy / "manifest.json").unlink()
    with pytest.raises(RecordError, match=r"manifest\.json: missing"):
        open_run(long_copy)


def test_corrupt_manifest(long_copy):
    p = long_copy / "manifest.json"
    p.write_text(p.read_text()[:100])
    with pytest.raises(RecordError, match=r"manifest\.json: not valid JSON"):
        open_run(long_copy)


def test_manifest_with_wrong_type(long_copy):
    p = long_copy / "manifest.json"
    data = json.loads(p.read_text())
    data["logging_steps"] = "often"
    p.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"manifest\.json: field `logging_steps`"):
        open_run(long_copy)


def test_edited_manifest_changes_the_run_id(long_copy):
    p = long_copy / "manifest.json"
    data = json.loads(p.read_text())
    data["optimizer"] = "sgd"
    p.write_text(json.dumps(data))
    with pytest.raises(RecordError, match="does not match the content hash"):
        open_run(long_copy)


def test_missing_data_file(long_copy):
    (long_copy / "telemetry.parquet").unlink()
    with pytest.raises(RecordError, match=r"telemetry\.parquet: listed in manifest\.json but missing"):
        open_run(long_copy)


def test_truncated_data_file(long_copy):
    p = long_copy / "rollouts.parquet"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordError, match=r"rollouts\.parquet: is \d+ bytes but manifest\.json records \d+: truncated"):
        open_run(long_copy)


def test_corrupt_data_file_of_the_right_size(long_copy):
    p = long_copy / "rollouts.parquet"
    data = bytearray(p.read_bytes())
    data[-8:] = b"\x00" * 8  # destroy the footer length and magic, keep the size
    p.write_bytes(bytes(data))
    # a committed file that no longer parses is named as changed since the commit, then as unreadable
    with pytest.raises(RecordError, match=r"rollouts\.parquet: sha256 differs from manifest\.json: the file was "
                                          r"changed, and it is not a readable Parquet file"):
        open_run(long_copy)


def test_wrong_column_type(long_copy):
    t = pq.read_table(long_copy / "telemetry.parquet")
    i = t.column_names.index("grad_norm")
    t = t.set_column(i, "grad_norm", pa.array([str(v) for v in t.column("grad_norm").to_pylist()]))
    rewrite_parquet(long_copy, "telemetry.parquet", t)
    with pytest.raises(RecordError, match=r"telemetry\.parquet: field `grad_norm`: has type string, expected double"):
        open_run(long_copy)


def test_missing_required_column(long_copy):
    t = pq.read_table(long_copy / "rollouts.parquet").drop(["completion"])
    rewrite_parquet(long_copy, "rollouts.parquet", t)
    with pytest.raises(RecordError, match=r"rollouts\.parquet: field `completion`: required column is missing"):
        open_run(long_copy)


def _set_telemetry(record, column, values):
    t = pq.read_table(record / "telemetry.parquet")
    i = t.column_names.index(column)
    t = t.set_column(i, t.schema.field(column), pa.array(values, type=t.schema.field(column).type))
    rewrite_parquet(record, "telemetry.parquet", t)


def test_duplicate_steps(long_copy):
    steps = list(range(200))
    steps[7] = 6
    _set_telemetry(long_copy, "step", steps)
    with pytest.raises(RecordError, match=r"telemetry\.parquet: field `step` at step 6: duplicate steps"):
        open_run(long_copy)


def test_non_monotone_steps(long_copy):
    steps = list(range(200))
    steps[10], steps[11] = 11, 10
    _set_telemetry(long_copy, "step", steps)
    with pytest.raises(RecordError, match=r"field `step` at step 10: steps are not increasing"):
        open_run(long_copy)


def test_nan_where_absent_belongs(long_copy):
    lr = pq.read_table(long_copy / "telemetry.parquet").column("learning_rate").to_pylist()
    lr[42] = math.nan
    _set_telemetry(long_copy, "learning_rate", lr)
    with pytest.raises(RecordError, match=r"field `learning_rate` at step 42: NaN value \(absent must be stored as null"):
        open_run(long_copy)


def test_infinite_value(long_copy):
    g = pq.read_table(long_copy / "telemetry.parquet").column("grad_norm").to_pylist()
    g[3] = math.inf
    _set_telemetry(long_copy, "grad_norm", g)
    with pytest.raises(RecordError, match=r"field `grad_norm` at step 3: infinite value"):
        open_run(long_copy)


def test_negative_where_the_unit_forbids(long_copy):
    g = pq.read_table(long_copy / "telemetry.parquet").column("grad_norm_unclipped").to_pylist()
    g[5] = -1.0
    g[9] = -2.0
    _set_telemetry(long_copy, "grad_norm_unclipped", g)
    with pytest.raises(RecordError, match=r"field `grad_norm_unclipped` at steps 5, 9: negative value; a l2_norm"):
        open_run(long_copy)


def test_bad_rollout_value_is_named_when_read(long_copy):
    t = pq.read_table(long_copy / "rollouts.parquet")
    adv = t.column("advantage").to_pylist()
    adv[8 * 17 + 3] = math.nan
    t = t.set_column(t.column_names.index("advantage"), "advantage", pa.array(adv))
    rewrite_parquet(long_copy, "rollouts.parquet", t)
    run = open_run(long_copy)  # rollout values are checked lazily, by column
    with pytest.raises(RecordError, match=r"rollouts\.parquet: field `advantage` at step 17: NaN"):
        run.read_rollouts(["advantage"])


def test_unsorted_rollouts(long_copy):
    t = pq.read_table(long_copy / "rollouts.parquet")
    idx = np.r_[np.arange(8, 16), np.arange(0, 8), np.arange(16, t.num_rows)]
    rewrite_parquet(long_copy, "rollouts.parquet", t.take(idx))
    with pytest.raises(RecordError, match=r"field `step` at step 0: rows are not sorted by step"):
        open_run(long_copy)


def test_window_reads_only_overlapping_row_groups(tmp_path):
    from reward_lens.record.reader import Window
    from reward_lens.record import writer

    old = writer.ROLLOUT_ROW_GROUP
    writer.ROLLOUT_ROW_GROUP = 16
    try:
        _write(tmp_path / "r", steps=20, per_step=8)
    finally:
        writer.ROLLOUT_ROW_GROUP = old
    run = open_run(tmp_path / "r")
    assert run._segments[0][1].metadata.num_row_groups == 10
    parts = list(run.iter_rollouts(["completion"], Window(4, 5)))
    assert len(parts) == 1 and parts[0].column("step").to_pylist() == [4] * 8 + [5] * 8


def test_verify_detects_a_changed_file(long_copy):
    run = open_run(long_copy)
    run.verify()
    ck = long_copy / run.manifest.checkpoints[0].path / "config.json"
    ck.write_text(ck.read_text().replace('"hidden_size": 8', '"hidden_size": 9'))
    with pytest.raises(RecordError, match="checkpoint file missing or changed"):
        run.verify()


def test_reference_record_reads_without_loading_everything():
    run = open_run(LONG)
    assert "completion" in run.rollout_columns()
    t = run.read_rollouts(["advantage"])
    assert t.column_names == ["step", "advantage"]


def test_small_row_groups_are_read_together_and_every_row_once(tmp_path, monkeypatch):
    """Consecutive row groups are read in batches of up to ROWS_PER_READ rows; a window still
    skips the groups outside it; every row comes once, in order."""
    from reward_lens.record import reader, writer
    from reward_lens.record.reader import Window

    monkeypatch.setattr(writer, "ROLLOUT_ROW_GROUP", 16)
    _write(tmp_path / "r", steps=20, per_step=8)  # 10 row groups of 2 steps
    run = open_run(tmp_path / "r")
    monkeypatch.setattr(reader, "ROWS_PER_READ", 48)  # three row groups per read
    parts = list(run.iter_rollouts(["completion"]))
    assert [p.num_rows for p in parts] == [48, 48, 48, 16]
    assert [s for p in parts for s in p.column("step").to_pylist()] == [s for s in range(20) for _ in range(8)]
    parts = list(run.iter_rollouts(["completion"], Window(3, 12)))  # row groups 1..6 overlap
    assert [s for p in parts for s in p.column("step").to_pylist()] == [s for s in range(3, 13) for _ in range(8)]


def test_chosen_steps_read_only_the_row_groups_that_hold_them(tmp_path, monkeypatch):
    from reward_lens.record import reader, writer

    monkeypatch.setattr(writer, "ROLLOUT_ROW_GROUP", 16)
    _write(tmp_path / "r", steps=20, per_step=8)  # 10 row groups of 2 steps
    run = open_run(tmp_path / "r")
    read: list[list[int]] = []
    real = run._read

    def spy(pf, name, columns, row_groups=None):
        read.append(list(row_groups))
        return real(pf, name, columns, row_groups)

    monkeypatch.setattr(run, "_read", spy)
    monkeypatch.setattr(reader, "ROWS_PER_READ", 16)  # one row group per read
    parts = list(run.iter_rollouts(["completion"], steps=[17, 3, 4]))
    assert [s for p in parts for s in p.column("step").to_pylist()] == [3] * 8 + [4] * 8 + [17] * 8
    assert read == [[1], [2], [8]]  # steps 2-3, 4-5 and 16-17: nothing else is read


def _three_segments(path):
    from reward_lens.record import OptimizerTelemetry, Rollout
    from reward_lens.record.stream import RecordStream

    s = RecordStream(path, framework={"name": "t", "version": "0"}, model={"description": "x"})
    for step in range(6):
        s.set_telemetry(OptimizerTelemetry(step=step))
        s.add_rollouts([Rollout(step=step, group_id=f"{step}:0", prompt="p", completion=c) for c in ("a", "bb")])
        if step % 2 == 1:
            s.flush()
    return path


def test_an_unsorted_segment_is_the_one_named(tmp_path):
    """The error used to name the first segment whatever segment was out of order (issue 31)."""
    import pyarrow.parquet as pq

    from tests.conftest import refresh_manifest

    rec = _three_segments(tmp_path / "rec")
    seg = rec / "rollouts-00003.parquet"
    t = pq.read_table(seg)
    pq.write_table(t.take([2, 3, 0, 1]), seg)  # steps 5, 5, 4, 4
    refresh_manifest(rec)
    with pytest.raises(RecordError) as e:
        open_run(rec)
    assert "rollouts-00003.parquet" in str(e.value) and "not sorted" in str(e.value)
    # a segment that starts before the one before it ends: named, with what went wrong
    rec2 = _three_segments(tmp_path / "rec2")
    a, b = rec2 / "rollouts-00002.parquet", rec2 / "rollouts-00003.parquet"
    ta, tb = pq.read_table(a), pq.read_table(b)
    pq.write_table(tb, a)
    pq.write_table(ta, b)
    refresh_manifest(rec2)
    with pytest.raises(RecordError) as e:
        open_run(rec2)
    assert "rollouts-00003.parquet" in str(e.value) and "segment" in str(e.value)
