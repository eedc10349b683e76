"""Trajectories: the batch contract between rollout engines and the trainer, and its Parquet files.

- ``batch``: ``Trajectory`` (B samples x T steps) and ``Conditioning``, validated at construction;
- ``store``: Trajectory Parquet, one file per RL step and one row per sample (schema v2, v1 read;
  docs/trajectories.md), page checksums written and verified;
- ``writer``: ``TrajectoryWriter``, the loop callback that writes each step's file from a
  background thread and verifies it before a checkpoint covers the step.

The names other modules import are re-exported here.
"""

from .batch import Conditioning, Trajectory, TrajectoryError
from .store import (
    SCHEMA_VERSION,
    CorruptParquetFile,
    list_step_files,
    read_parquet,
    read_trajectories,
    read_trajectory,
    write_parquet,
    write_step,
)
from .writer import TrajectoryWriteError, TrajectoryWriter, verify_step_file

__all__ = [
    "SCHEMA_VERSION", "Conditioning", "CorruptParquetFile", "Trajectory", "TrajectoryError", "TrajectoryWriteError",
    "TrajectoryWriter", "list_step_files", "read_parquet", "read_trajectories", "read_trajectory", "verify_step_file",
    "write_parquet", "write_step",
]
