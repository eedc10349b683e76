"""Secrets kept out of every line printed and every file written.

A password never travels inside a URI here: a tracking URI with user information
(``http://user:secret@host``) is refused in one line that shows it redacted, before anything prints,
logs or stores it (MLflow reads its basic-auth credentials from ``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``; a database driver from its own environment, e.g. ``PGPASSWORD``).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted(uri: str) -> str:
    """``uri`` with any user information replaced by ``***`` (``http://***@host:5000/``)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def credentials_error(uri: str, where: str) -> str | None:
    """The one-line refusal of a URI that carries credentials (``where`` names the setting), or None."""
    if "@" not in urlsplit(uri).netloc:
        return None
    scheme = urlsplit(uri).scheme.lower()
    fix = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (Flyte: a Secret with env_var) instead"
           if scheme in ("http", "https") else
           "give the password to the database driver through its own environment (PostgreSQL: PGPASSWORD or "
           "~/.pgpass) or track through an mlflow server")
    return (f"{where} {redacted(uri)} carries user credentials, which would be printed and stored with it; "
            f"remove them and {fix}")
