"""Datasets, folders and images of a run: prompt splits as MLflow datasets with digests, a folder
copied into the run's artifacts or linked when it is too large."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .runs import TrackingRun
from .store import client


def frame_digest(df: pd.DataFrame) -> str:
    blob = json.dumps(df.to_dict(orient="list"), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _artifact_source(uri: str):
    """An MLflow dataset source naming a run artifact (``mlflow-artifacts:/...`` has no built-in one)."""
    from mlflow.data.dataset_source import DatasetSource

    class RunArtifactSource(DatasetSource):
        def __init__(self, uri: str):
            self.uri = uri

        @staticmethod
        def _get_source_type() -> str:
            return "mlflow_artifact"

        def load(self, dst_path: str | None = None) -> str:
            from mlflow.artifacts import download_artifacts

            return download_artifacts(artifact_uri=self.uri, dst_path=dst_path)

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any) -> RunArtifactSource:
            return cls(str(raw_source))

        def to_dict(self) -> dict[str, Any]:
            return {"uri": self.uri}

        @classmethod
        def from_dict(cls, source_dict: dict[Any, Any]) -> RunArtifactSource:
            return cls(source_dict["uri"])

    return RunArtifactSource(uri)


def log_prompt_datasets(
    run: TrackingRun, stage_id: str, splits: dict[str, pd.DataFrame], source: str
) -> dict[str, str]:
    """Each split as Parquet artifacts of the stage run and as an MLflow dataset (with its digest)
    on the stage run; returns split -> digest. Contexts: train -> training, test -> evaluation."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    c = client(run.uri)
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for split, df in splits.items():
            df.to_parquet(Path(tmp) / f"prompts-{split}.parquet", index=False)
        c.log_artifacts(stage_id, tmp, "data")
    artifact_uri = c.get_run(stage_id).info.artifact_uri
    inputs = []
    for split, df in splits.items():
        digest = frame_digest(df)
        digests[split] = digest
        ds = mlflow.data.from_pandas(df, source=_artifact_source(f"{artifact_uri}/data/prompts-{split}.parquet"),
                                     name=f"prompts-{split}", digest=digest)
        context = "training" if split == "train" else "evaluation"
        inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context),
                                                                  InputTag("source_data", source)]))
    c.log_inputs(stage_id, datasets=inputs)
    return digests


def folder_size_mb(uri: str | Path) -> float:
    """Total size of a local folder or an object-store prefix (fsspec), without downloading it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(str(uri))
    return fs.du(path, total=True) / 2**20


def log_folder_or_link(run: TrackingRun, run_id: str, uri: str, fetch: Callable[[], str], artifact_path: str,
                       max_mb: float) -> str:
    """Copy the folder at ``uri`` into the run's artifacts when it is small enough (``fetch()``
    gives a local copy), else record ``uri`` as a tag. Returns where it can be found."""
    size = folder_size_mb(uri)
    c = client(run.uri)
    if size <= max_mb:
        c.log_artifacts(run_id, fetch(), artifact_path)
        c.set_tag(run_id, f"artifact.{artifact_path}", f"artifacts/{artifact_path} ({size:.1f} MB)")
        return f"{c.get_run(run_id).info.artifact_uri}/{artifact_path}"
    c.set_tag(run_id, f"artifact.{artifact_path}", f"{uri} ({size:.1f} MB, over tracking.max_artifact_mb={max_mb})")
    return str(uri)


def image_row(images: np.ndarray, max_images: int = 8) -> np.ndarray:
    """uint8 ``[N, (F,) H, W, 3]`` -> the first ``max_images`` side by side (videos: one row per frame)."""
    return np.concatenate(list(images[:max_images]), axis=-2)

