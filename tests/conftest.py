from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reward_lens.record.schema import content_run_id, RunManifest
from reward_lens.record.writer import sha256_file

FIXTURES = Path(__file__).parent / "fixtures" / "grpo_run"
LONG = FIXTURES / "long"
SHORT = FIXTURES / "short"


@pytest.fixture
def long_copy(tmp_path) -> Path:
    dest = tmp_path / "long"
    shutil.copytree(LONG, dest)
    return dest


def rewrite_parquet(record: Path, name: str, table: pa.Table) -> None:
    """Replace a data file *and* fix the manifest's checksum and run_id, so that a test
    reaches the validation it means to exercise rather than the checksum check."""
    pq.write_table(table, record / name)
    refresh_manifest(record)


def refresh_manifest(record: Path) -> None:
    data = json.loads((record / "manifest.json").read_text())
    for name, entry in data["files"].items():
        entry["sha256"] = sha256_file(record / name)
        entry["bytes"] = (record / name).stat().st_size
    m = RunManifest.model_validate(data)
    data["run_id"] = content_run_id(m)
    (record / "manifest.json").write_text(json.dumps(data, indent=2))
