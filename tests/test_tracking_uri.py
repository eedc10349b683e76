"""A tracking URI that cannot work fails in one line, at once: an unreachable server is
asked once, for a few seconds, not retried for minutes; a mistyped SQLite URI never creates an
empty store somewhere else."""

from __future__ import annotations

import socket
import time

import pytest

from diffusionrl import serving
from diffusionrl.tracking.store import TrackingURIError, check_uri, preflight


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_registry_show_on_an_unreachable_server_is_one_line_in_seconds(capsys):
    uri = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    code = serving.main(["show", "--tracking-uri", uri])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and time.monotonic() - start < 15
    assert len(err) == 1 and uri in err[0] and "unreachable" in err[0], err


@pytest.mark.parametrize("uri", ["sqlite:/x.db", "sqlite//x.db", "sqlite:x.db", "sqlite:///"])
def test_a_malformed_sqlite_uri_is_refused_and_creates_nothing(uri, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrackingURIError, match=r"sqlite:///relative/path.db or sqlite:////absolute/path.db"):
        preflight(uri)
    assert serving.main(["show", "--tracking-uri", uri]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no database (or folder) was made


def test_a_sqlite_store_in_a_missing_folder_or_a_missing_file_for_a_reader(tmp_path, capsys):
    with pytest.raises(TrackingURIError, match=r"the folder .*nofolder does not exist"):
        preflight(f"sqlite:///{tmp_path}/nofolder/mlflow.db")
    assert not (tmp_path / "nofolder").exists()
    check_uri(f"sqlite:///{tmp_path}/new.db")  # a new store in an existing folder: fine for a writer
    assert serving.main(["show", "--tracking-uri", f"sqlite:///{tmp_path}/new.db"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no database at" in err and "\n" not in err and not (tmp_path / "new.db").exists()


@pytest.mark.parametrize("uri", ["http://user:s3cr3t-pw@127.0.0.1:5000", "https://s3cr3t-pw@mlflow.example:443/x",
                                 "postgresql://mlflow:s3cr3t-pw@db:5432/mlflow"])
def test_a_password_in_the_tracking_uri_is_refused_and_never_printed(uri, monkeypatch, capsys):
    """Credentials inside a tracking URI would reach every printed link, report and artifact: the URI is
    refused in one line that shows it redacted and names the variables to use instead."""
    from diffusionrl.config import ConfigError, load_config
    from diffusionrl.tracking import resolve_uri

    with pytest.raises(TrackingURIError) as info:
        resolve_uri(uri)
    assert "s3cr3t" not in str(info.value) and "***@" in str(info.value)
    assert ("MLFLOW_TRACKING_PASSWORD" if uri.startswith("http") else "PGPASSWORD") in str(info.value)
    with pytest.raises(TrackingURIError, match=r"\$MLFLOW_TRACKING_URI .*\*\*\*@"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        resolve_uri()
    with pytest.raises(ConfigError) as info:
        load_config(preset="tiny-cpu", overrides=[f"tracking.uri={uri}"])
    assert "s3cr3t" not in str(info.value) and "tracking.uri" in str(info.value)
    with pytest.raises(TrackingURIError):
        check_uri(uri)
    assert serving.main(["show"]) == 2  # from the environment
    err = capsys.readouterr().err
    assert "s3cr3t" not in err and len(err.strip().splitlines()) == 1, err


def test_redacted_keeps_the_rest_of_the_uri():
    from diffusionrl.secrets import redacted

    assert redacted("http://u:p@h:5/a?b=1") == "http://***@h:5/a?b=1"
    assert redacted("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db" and redacted("http://h:5") == "http://h:5"
