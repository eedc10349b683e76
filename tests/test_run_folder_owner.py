"""One run per run folder (``diffusionrl.run.lock``): a second run in a folder another one holds
refuses in one line naming the owner (pid@host, since when), for a local folder (flock) and an
object-store one (a lease, ``memory://`` here); the folder is free once the owner ends, a lock or
lease its owner could not release (killed, preempted) is taken over. The holders here are real
processes where it matters (pids, flock); the loop is the toy one of tests/test_checkpoint_trust.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from diffusionrl.run import Callback, lock
from diffusionrl.run.lock import LEASE_FILE, LOCK_FILE, Lease, RunFolderBusy, RunFolderLost, hold_run_folder

from .test_checkpoint_trust import toy

HOLDER = """
import sys
from diffusionrl.run import hold_run_folder
with hold_run_folder(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""
# A forked child of a killed run that inherited its locked descriptor: the lock is held, the file
# names the run, which is gone.
ORPHAN = """
import fcntl, json, os, sys
path = os.path.join(sys.argv[1], "run.lock")
os.makedirs(sys.argv[1], exist_ok=True)
fd = os.open(path, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": int(sys.argv[2]), "host": sys.argv[3], "since": "then"}).encode())
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds a folder until its stdin closes; yields ``start(folder) -> Popen``."""
    procs = []

    def start(folder, code=HOLDER, *args):
        proc = subprocess.Popen([sys.executable, "-c", code, str(folder), *map(str, args)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- a local folder ------------------------------------------------------------------------------------


def test_a_second_run_in_a_held_folder_refuses_naming_the_owner_and_runs_once_it_ended(tmp_path, holder):
    run = tmp_path / "run"
    owner = holder(run)
    with pytest.raises(RunFolderBusy) as err:
        toy(run).run(resume="auto")
    message = str(err.value)
    assert "\n" not in message
    assert f"run folder {run} is in use by another run: pid {owner.pid}@{lock.this_host()} since 20" in message
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()  # touched nothing
    owner.stdin.close()
    assert owner.wait(timeout=30) == 0
    assert not (run / LOCK_FILE).exists()  # released and removed at exit
    assert toy(run).run(resume="auto").steps_done == 3
    assert not (run / LOCK_FILE).exists()


class Peek(Callback):
    """Calls ``look()`` after every step of the run it is attached to and keeps what it returned."""

    def __init__(self, look):
        self.look, self.seen = look, []

    def on_step(self, loop, step, batch, metrics):
        self.seen.append(self.look())


def test_the_lock_names_this_run_while_it_runs(tmp_path):
    loop = toy(tmp_path, steps=1)
    peek = Peek(lambda: json.loads((tmp_path / LOCK_FILE).read_text()))
    loop.callbacks.append(peek)
    loop.run(resume=None)
    assert peek.seen[0]["pid"] == os.getpid() and peek.seen[0]["host"] == lock.this_host()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, holder, caplog):
    owner = holder(tmp_path)
    owner.send_signal(signal.SIGKILL)  # no release: the file stays, the kernel dropped the flock
    owner.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == owner.pid
    caplog.set_level(logging.WARNING)
    assert toy(tmp_path).run(resume=None).steps_done == 3
    assert any(f"left by pid {owner.pid}@" in r.getMessage() for r in caplog.records)


def test_a_lock_still_held_for_a_dead_pid_of_this_host_is_replaced(tmp_path, holder, caplog):
    """A forked child of a killed run inherited the locked descriptor: the run named in the file is gone."""
    dead = ended_pid()
    holder(tmp_path, ORPHAN, dead, lock.this_host())
    caplog.set_level(logging.WARNING)
    assert toy(tmp_path).run(resume=None).steps_done == 3
    assert any(f"pid {dead}@" in r.getMessage() and "replacing" in r.getMessage() for r in caplog.records)


def test_the_cli_refuses_before_loading_the_model(tmp_path, holder, capsys):
    from diffusionrl.train import main

    owner = holder(tmp_path)
    t0 = time.perf_counter()
    assert main(["--preset", "tiny-cpu", "--out", str(tmp_path), "--steps", "1"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith(f"error: run folder {tmp_path} is in use by another run: pid {owner.pid}@")
    assert time.perf_counter() - t0 < 20  # no model was built


def test_a_hold_is_reentrant_in_its_thread_only(tmp_path):
    errors = []

    def another_thread():
        try:
            toy(tmp_path).run(resume=None)
        except RunFolderBusy as exc:
            errors.append(str(exc))

    with hold_run_folder(tmp_path) as outer:
        with hold_run_folder(tmp_path) as inner:
            assert inner is outer
        assert (tmp_path / LOCK_FILE).exists()  # the inner hold's end did not release it
        thread = threading.Thread(target=another_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1 and f"pid {os.getpid()}@" in errors[0]
    assert not (tmp_path / LOCK_FILE).exists()


# -- an object-store folder: the lease -------------------------------------------------------------------


def store_uri() -> str:
    return f"memory://leases/{uuid.uuid4().hex[:8]}"


def lease(uri, **kw):
    return Lease(uri, **{"ttl_s": 30.0, "settle_s": 0.01, **kw})


def preempt(owner: Lease) -> None:
    """The pod is gone: no more renewals, no release."""
    owner._stop.set()
    owner._renewer.join()


def test_a_second_writer_refuses_a_live_lease_naming_the_owner(tmp_path):
    uri = store_uri()
    first = lease(uri).acquire()
    with pytest.raises(RunFolderBusy) as err:
        lease(uri).acquire()
    message = str(err.value)
    assert "\n" not in message and f"run folder {uri} is in use by another run: pid {os.getpid()}@" in message
    assert f"{uri}/{LEASE_FILE}" in message
    first.release()
    assert not first.fs.exists(first.path)
    second = lease(uri).acquire()
    second.check()
    second.release()


def test_a_lease_is_renewed_while_the_run_lives_and_taken_over_when_it_expired(caplog):
    uri = store_uri()
    first = lease(uri, ttl_s=0.6).acquire()
    time.sleep(1.0)  # longer than the ttl: renewed meanwhile
    with pytest.raises(RunFolderBusy):
        lease(uri, ttl_s=0.6).acquire()
    first.check()
    preempt(first)
    time.sleep(0.8)
    caplog.set_level(logging.WARNING)
    successor = lease(uri, ttl_s=0.6).acquire()
    assert any("taking over the lease" in r.getMessage() for r in caplog.records)
    with pytest.raises(RunFolderLost, match="lost its lease"):
        first.check()
    first.release()  # does not delete the successor's lease
    assert json.loads(successor.fs.cat_file(successor.path))["token"] == successor.token
    successor.release()


def test_a_previous_attempt_of_the_same_execution_is_waited_for():
    uri = store_uri()
    first = lease(uri, ttl_s=0.5, tags={"execution": "e1"}).acquire()
    preempt(first)
    with pytest.raises(RunFolderBusy):  # another execution: refused at once
        lease(uri, ttl_s=0.5, tags={"execution": "e2"}).acquire(wait_for={"execution": "e2"})
    retry = lease(uri, ttl_s=0.5, tags={"execution": "e1"}).acquire(wait_for={"execution": "e1"})
    retry.release()


def test_two_writers_at_once_one_wins_by_read_back():
    """The second writer's record replaced ours while we settled: it won, we refuse naming it."""
    uri = store_uri()

    class Raced(Lease):
        def _settle(self):
            self.fs.pipe_file(self.path, json.dumps({"pid": 4242, "host": "elsewhere", "since": "now", "token": "x",
                                                     "expires": time.time() + 30}).encode())

    with pytest.raises(RunFolderBusy, match="pid 4242@elsewhere since now"):
        Raced(uri, ttl_s=30, settle_s=0).acquire()


def test_a_remote_run_folder_is_held_by_the_train_stage_and_its_staging_folder_reentered(tmp_path, monkeypatch):
    """``tasks.common.open_run_folder``: the lease is taken before the resume point is read; the
    loop on the staging folder re-enters it (no run.lock there to be synced to the store)."""
    pytest.importorskip("flytekit")
    from tasks.common import open_run_folder

    monkeypatch.setenv("DIFFUSIONRL_ALLOW_MEMORY_STORE", "1")  # memory:// stands in for s3:// (one process)

    uri = store_uri()
    with open_run_folder(uri) as (folder, resume):
        assert resume is None and folder.fs.exists(f"{folder.root}/{LEASE_FILE}")
        with pytest.raises(RunFolderBusy, match=f"run folder {uri} is in use"):
            lease(uri).acquire()
        loop = toy(folder.local, steps=1)
        peek = Peek(lambda: (folder.local / LOCK_FILE).exists())
        loop.callbacks.append(peek)
        loop.run(resume=None)
        assert peek.seen == [False]
    assert not folder.fs.exists(f"{folder.root}/{LEASE_FILE}")


def test_a_local_checkpoint_dir_is_locked_by_the_train_stage(tmp_path, holder):
    pytest.importorskip("flytekit")
    from tasks.common import open_run_folder

    owner = holder(tmp_path)
    with pytest.raises(RunFolderBusy, match=f"pid {owner.pid}@"):
        with open_run_folder(str(tmp_path)):
            pass


def test_check_free_reads_the_owner_without_taking_or_writing_the_folder(tmp_path, holder):
    """``lock_check.check_free``, what a workflow's first task asks: the refusal ``hold_run_folder`` would give, from
    one read of a lease or a probe of a local lock; nothing is created, taken or changed."""
    from diffusionrl.run import check_free

    check_free(tmp_path / "missing")  # no folder, no lock file: free, and nothing is created
    assert not (tmp_path / "missing").exists()
    owner = holder(tmp_path / "held")
    record = (tmp_path / "held" / LOCK_FILE).read_text()
    with pytest.raises(RunFolderBusy, match=rf"run folder {tmp_path / 'held'} is in use by another run: "
                                            rf"pid {owner.pid}@") as err:
        check_free(tmp_path / "held")
    assert "\n" not in str(err.value) and (tmp_path / "held" / LOCK_FILE).read_text() == record
    owner.stdin.close()
    owner.wait(timeout=30)
    check_free(tmp_path / "held")  # released
    holder(tmp_path / "orphan", ORPHAN, ended_pid(), lock.this_host())
    check_free(tmp_path / "orphan")  # held only by a dead run's forked child: hold_run_folder replaces it
    with hold_run_folder(tmp_path / "mine"):  # another descriptor in this very process is another run
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}@"):
            check_free(tmp_path / "mine")

    uri = store_uri()
    check_free(uri)
    first = lease(uri, tags={"execution": "e1"}).acquire()
    with pytest.raises(RunFolderBusy, match=rf"run folder {uri} is in use by another run: pid {os.getpid()}@"):
        check_free(uri, tags={"execution": "e2"})
    check_free(uri, tags={"execution": "e1"})  # a previous attempt of this execution: its stage waits for it
    assert json.loads(first.fs.cat_file(first.path))["token"] == first.token
    first.release()
    check_free(uri, tags={"execution": "e2"})
