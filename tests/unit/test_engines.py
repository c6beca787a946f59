"""A record's Parquet reads as one dataset with the engines users already have (DuckDB,
pyarrow.dataset), without reward-lens, and agrees with what reward-lens reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.dataset as ds

from reward_lens.record import open_run

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "grpo_run"


def test_duckdb_reads_segmented_rollouts_and_telemetry_as_one_table():
    import duckdb

    rec = FIX / "task"  # ten rollout segments written by the tap while training
    con = duckdb.connect()
    rows = con.execute(
        f"SELECT r.step, avg(r.reward) AS reward, any_value(t.kl_to_previous) AS d_t "
        f"FROM read_parquet('{rec}/rollouts-*.parquet') r "
        f"JOIN read_parquet('{rec}/telemetry-*.parquet') t USING (step) GROUP BY r.step ORDER BY r.step").fetchall()
    run = open_run(rec)
    table = run.read_rollouts(["reward"])
    steps = table.column("step").to_numpy()
    reward = table.column("reward").to_numpy()
    mine = {int(s): float(reward[steps == s].mean()) for s in np.unique(steps)}
    d_t = run.telemetry_column("kl_to_previous")
    assert len(rows) == len(mine)
    for step, r, d in rows:  # the last step has no next generation, so no D_t
        assert r == mine[step] and d == d_t.get(step)
    assert sum(d is None for _, _, d in rows) == 1
    # the per-function rewards are a MAP column DuckDB indexes by name
    (n,) = con.execute(f"SELECT count(*) FROM read_parquet('{rec}/rollouts-*.parquet') "
                       f"WHERE rewards['correctness'] = 1.0").fetchone()
    assert 0 < n < run.n_rollouts


def test_pyarrow_dataset_reads_the_same_rows():
    rec = FIX / "paired"
    files = sorted(str(p) for p in rec.glob("rollouts-*.parquet"))
    table = ds.dataset(files, format="parquet").to_table(columns=["step", "completion"])
    assert table.num_rows == open_run(rec).n_rollouts
