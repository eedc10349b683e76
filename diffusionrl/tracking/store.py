"""Where the MLflow store is, whether it answers, and retries against it.

The store: ``tracking.uri`` if set, else ``$MLFLOW_TRACKING_URI``, else a SQLite store in
``./runs/mlflow`` (the registry needs a database backend; artifacts go next to it).

A mistyped SQLite URI would not fail: MLflow (SQLAlchemy) either raises deep in a traceback or
quietly creates a new, empty database somewhere else, and the run or registry looked for is
"not there". ``check_uri`` refuses them in one line (``TrackingURIError``): a SQLite store is
``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``, in a folder that exists (only the
default local store's folder is created). A CLI that only reads (``python -m diffusionrl.serving
show``) asks once, quickly, whether the store answers (``cli_store``) instead of letting MLflow's
client retry an unreachable server for minutes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from diffusionrl.errors import UserError
from diffusionrl.secrets import credentials_error

log = logging.getLogger(__name__)

ENV_URI = "MLFLOW_TRACKING_URI"
LOCAL_STORE = Path("runs") / "mlflow"
T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be reached (raised before any training work starts)."""


class TrackingURIError(UserError):
    """A tracking URI that cannot name the store meant (a malformed or misplaced SQLite URI), or a
    store a read-only CLI cannot read."""

    kind = "tracking error"


def local_store_uri(root: str | Path | None = None) -> str:
    folder = (Path(root) if root else LOCAL_STORE).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}"


def resolve_uri(configured: str = "") -> str:
    """``tracking.uri`` > ``$MLFLOW_TRACKING_URI`` > the local SQLite store (absolute path); a URI that
    carries credentials is a ``TrackingURIError`` (``diffusionrl.secrets``)."""
    uri = configured or os.environ.get(ENV_URI) or local_store_uri()
    refusal = credentials_error(uri, "tracking URI" if configured else f"${ENV_URI}")
    if refusal:
        raise TrackingURIError(refusal)
    return uri


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


SQLITE_FORMS = "sqlite:///relative/path.db or sqlite:////absolute/path.db"


def check_uri(uri: str, must_exist: bool = False) -> None:
    """Refuse a SQLite URI that does not name the database meant: not of the form ``sqlite:///<path>``
    (``sqlite:/x.db``, ``sqlite//x.db``, ``sqlite:x.db``), or in a folder that does not exist (a typo
    there would create a new empty store; the default local store's folder is created by
    ``preflight``); with ``must_exist`` (a reader), also a database file that is not there. Any URI
    that carries credentials is refused, shown redacted (``diffusionrl.secrets``)."""
    refusal = credentials_error(uri, "tracking URI")
    if refusal:
        raise TrackingURIError(refusal)
    if not uri.lower().startswith("sqlite"):
        return
    db = _sqlite_path(uri)
    if db is None or not uri[len("sqlite:///"):].strip() or uri.endswith("/"):
        raise TrackingURIError(f"tracking URI {uri!r} is not a SQLite URI MLflow reads as meant: write {SQLITE_FORMS}")
    if must_exist and not db.is_file():
        raise TrackingURIError(f"tracking URI {uri}: no database at {db.resolve()}; fix the path (--tracking-uri, "
                               f"tracking.uri or ${ENV_URI}), or run a workflow first to create it")
    if uri != local_store_uri() and not db.resolve().parent.is_dir():
        raise TrackingURIError(f"tracking URI {uri}: the folder {db.resolve().parent} does not exist; fix the path, "
                               "or create the folder for a new store")


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
    """Fail fast, naming the URI, when the tracking store cannot be reached (a malformed SQLite URI:
    ``TrackingURIError``, ``check_uri``)."""
    check_uri(uri)
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


def cli_store(uri: str, timeout_s: float = 5.0) -> str:
    """``uri`` for a CLI that reads the store, checked once: a SQLite database that is there
    (``check_uri``), a store that answers within ``timeout_s`` (``preflight``), else one line
    (``TrackingURIError``) naming the URI; later client calls retry briefly (``configure_http``),
    not MLflow's minutes of default retries."""
    check_uri(uri, must_exist=True)
    try:
        preflight(uri, timeout_s=timeout_s)
    except TrackingUnavailable as exc:
        raise TrackingURIError(str(exc)) from None
    configure_http(timeout_s=max(1, int(timeout_s * 2)), retries=1)
    return uri


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
    """Call ``fn`` until it returns, on any exception (transient store errors have many types), with
    tenacity's exponential backoff.

    Args:
        fn (`Callable[[], T]`): the call to make.
        attempts (`int`): calls at most, the first included; the last one's error is raised as it is.
        what (`str`): what the call does, for the warning logged before each retry.
        base_delay_s (`float`, *optional*, defaults to 0.5): the wait before the first retry, doubled after each.

    Returns:
        `T`: what ``fn`` returned.
    """
    from tenacity import Retrying, stop_after_attempt, wait_exponential

    def warn(state) -> None:
        exc = state.outcome.exception()
        log.warning("%s failed (%s: %s); retry %d/%d in %.1fs", what, type(exc).__name__, exc,
                    state.attempt_number, attempts - 1, state.upcoming_sleep)

    retrying = Retrying(stop=stop_after_attempt(max(1, attempts)), reraise=True, before_sleep=warn,
                        wait=wait_exponential(multiplier=base_delay_s, exp_base=2, min=0))
    return retrying(fn)
