"""The run record: a directory with a manifest, per-step telemetry and per-step rollouts."""

from reward_lens.record.errors import RecordError
from reward_lens.record.reader import Run, open_run
from reward_lens.record.schema import NonFiniteValue, OptimizerTelemetry, Rollout, RunManifest
from reward_lens.record.writer import write_run

__all__ = ["NonFiniteValue", "OptimizerTelemetry", "RecordError", "Rollout", "Run", "RunManifest", "open_run", "write_run"]
