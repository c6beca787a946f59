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
TAPPED = FIXTURES / "tapped"
PAIRED = FIXTURES / "paired"


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


def tiny_record(path: Path, completions_by_step: dict[int, list[str]], *, kl_to_previous: dict[int, float] | None = None,
                optimizer: str = "adamw_torch_fused", reward_slope: float = 0.0) -> Path:
    """A small hand-made record (for escaping, exit-code and browser tests); the mean reward
    rises by ``reward_slope`` a step."""
    from reward_lens.record import OptimizerTelemetry, Rollout, write_run

    steps = sorted(completions_by_step)
    tel = [OptimizerTelemetry(step=s, learning_rate=1e-3, grad_norm_unclipped=1.0, beta=0.0,
                              kl_to_previous=(kl_to_previous or {}).get(s),
                              kl_to_previous_estimator="test" if kl_to_previous and s in kl_to_previous else None)
           for s in steps]
    rol = [Rollout(step=s, group_id=f"{s}:0", prompt=f"prompt <{s}> | x", completion=c, reward=float(i % 3) + reward_slope * s,
                   advantage=float(i % 3) - 1.0)
           for s in steps for i, c in enumerate(completions_by_step[s])]
    write_run(path, framework={"name": "test", "version": "0"}, model={"description": "hand-made"},
              telemetry=tel, rollouts=rol, optimizer=optimizer)
    return path


def varied_completions(step: int, n: int = 12, seed: int = 0) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed * 1000 + step)
    alphabet = list("abcdefghijKLMNOP0123 .,!\n")
    out = []
    for _ in range(n):
        k = int(rng.integers(5, 30))
        out.append("".join(rng.choice(alphabet, size=k)))
    return out
