"""Where the MLflow store is, whether it answers, and retries against it.

The store: ``tracking.uri`` if set, else ``$MLFLOW_TRACKING_URI``, else a SQLite store in
``./runs/mlflow`` (the registry needs a database backend; artifacts go next to it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

log = logging.getLogger(__name__)

ENV_URI = "MLFLOW_TRACKING_URI"
LOCAL_STORE = Path("runs") / "mlflow"
T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be reached (raised before any training work starts)."""




def local_store_uri(root: str | Path | None = None) -> str:
    folder = (Path(root) if root else LOCAL_STORE).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}"


def resolve_uri(configured: str = "") -> str:
    """``tracking.uri`` > ``$MLFLOW_TRACKING_URI`` > the local SQLite store (absolute path)."""
    return configured or os.environ.get(ENV_URI) or local_store_uri()


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go: next to a local SQLite file; the server decides otherwise."""
    db = _sqlite_path(uri)
    if db is None:
        return None
    return (db.parent / "artifacts" / experiment).as_uri()


def configure_http(timeout_s: int = 30, retries: int = 2) -> None:
    """Short client-side HTTP retries: our own buffer/backoff decides what a failure costs."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(retries))


def preflight(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, naming the URI, when the tracking store cannot be reached."""
    scheme = urlparse(uri).scheme
    try:
        if scheme in ("http", "https"):
            import requests

            resp = requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
            if resp.status_code != 200:
                raise TrackingUnavailable(f"GET /health answered HTTP {resp.status_code}")
        elif scheme == "sqlite":
            _sqlite_path(uri).parent.mkdir(parents=True, exist_ok=True)
            client(uri).search_experiments(max_results=1)
        else:
            client(uri).search_experiments(max_results=1)
    except Exception as exc:  # any failure here means "cannot track"
        raise TrackingUnavailable(
            f"MLflow tracking store {uri} is unreachable ({type(exc).__name__}: {exc}). Start the server, fix "
            f"tracking.uri / ${ENV_URI}, or unset both to use the local store {local_store_uri()}"
        ) from exc


def client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(uri: str, name: str) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=artifact_location(uri, name))
    except Exception:  # created concurrently by another execution
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def with_retries(fn: Callable[[], T], attempts: int, what: str, base_delay_s: float = 0.5) -> T:
    """Call ``fn`` up to ``attempts`` times with exponential backoff; re-raise the last error."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # transient store errors have many types
            if i == attempts - 1:
                raise
            delay = base_delay_s * 2**i
            log.warning("%s failed (%s: %s); retry %d/%d in %.1fs", what, type(exc).__name__, exc, i + 1,
                        attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
