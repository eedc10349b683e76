"""Retries go through tenacity: the MLflow calls' exponential backoff (``tracking.store.with_retries``) and the
SGLang server's start on a port taken meanwhile (``SGLangServer.start``)."""

from __future__ import annotations

import logging

import pytest

from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError
from diffusionrl.tracking.store import with_retries


def flaky(failures: int, exc: Exception | None = None):
    exc = exc or ConnectionError("store down")
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise exc
        return "done"

    return fn, calls


def test_with_retries_backs_off_then_returns(caplog):
    fn, calls = flaky(2)
    with caplog.at_level(logging.WARNING, logger="diffusionrl.tracking.store"):
        assert with_retries(fn, 3, "log_batch", base_delay_s=0.01) == "done"
    assert len(calls) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "log_batch failed (ConnectionError: store down); retry 1/2 in 0.0s",
        "log_batch failed (ConnectionError: store down); retry 2/2 in 0.0s"]


def test_with_retries_raises_the_last_error_itself():
    fn, calls = flaky(5, ValueError("bad"))
    with pytest.raises(ValueError, match="^bad$"):
        with_retries(fn, 2, "x", base_delay_s=0.0)
    assert len(calls) == 2
    fn, calls = flaky(5)
    with pytest.raises(ConnectionError):
        with_retries(fn, 1, "x")
    assert len(calls) == 1


@pytest.mark.parametrize(("port", "error", "starts"), [
    (0, "Address already in use", 3),  # a port picked here: retried on another, 3 starts at most
    (8123, "Address already in use", 1),  # the port asked for: no other to try
    (0, "CUDA out of memory", 1),  # another failure: not retried
])
def test_server_start_retries_only_a_taken_port(monkeypatch, tmp_path, port, error, starts):
    server = SGLangServer("python", str(tmp_path), "float32", port=port, workdir=tmp_path)
    tried = []

    def start_once():
        tried.append(1)
        raise SGLangServerError(f"sglang server exited: {error}")

    monkeypatch.setattr(server, "_start_once", start_once)
    with pytest.raises(SGLangServerError, match=error):
        server.start(attempts=3)
    assert len(tried) == starts


def test_server_start_goes_on_after_a_taken_port(monkeypatch, tmp_path):
    server = SGLangServer("python", str(tmp_path), "float32", workdir=tmp_path)
    tried = []

    def start_once():
        tried.append(1)
        if len(tried) == 1:
            raise SGLangServerError("sglang server exited: [Errno 98] Address already in use")

    monkeypatch.setattr(server, "_start_once", start_once)
    server.start(attempts=3)
    assert len(tried) == 2
