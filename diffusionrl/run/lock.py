"""Who owns a run folder: one run writes a folder at a time, a second one refuses naming the first.

Two runs in one folder (two ``python -m diffusionrl.train --out X``, two executions with the same
``checkpoint_dir``) would both exit 0 with their metrics rows interleaved in one ``metrics.jsonl`` and
each other's checkpoints resumed or pruned. So a run holds its folder for as long as it runs
(``hold_run_folder``), and a second writer gets ``RunFolderBusy``: one line naming the owner
(``pid@host``) and since when.

- A local folder: an ``flock(2)`` on ``<folder>/run.lock``, a file holding the owner's pid, host
  and start time. The kernel drops the lock when the owner ends, however it ends, so a killed run
  never blocks its successor (the file it left is taken over with a warning naming it). A lock
  still held although the pid it names is dead on this host (a forked child inherited the
  descriptor and outlived the run) is replaced too. The holder removes the file when it is done.
  This is not ``filelock.FileLock``, which takes the same ``flock`` but keeps nothing in the file: here
  the file records its owner for the refusal to name, a lock held only by a dead run's forked child is
  replaced, and ``check`` notices the file removed or replaced while the run holds it.
- An object-store folder (an fsspec URI, ``run.folder.is_remote``): a lease ``<uri>/run.lease``
  (owner, since, expiry, a random token), renewed by a background thread every third of its
  lifetime (``LEASE_TTL_S``) and deleted at the end. An expired lease is taken over: a preempted
  pod cannot release its lease, and its successor continues once it expired. Object stores offer
  no lock and not all of them a conditional put, so a lease is taken by write-then-read-back:
  write our record, wait ``settle_s``, read it back; if another writer's record is there, that
  writer came later and won, and this one refuses. That is sound on a store that reads its own
  writes (S3, GCS and Azure Blob are strongly consistent) as long as two writers' read-to-write
  gaps are shorter than ``settle_s`` and the hosts' clocks agree to well within ``ttl_s``; it is
  not a consensus protocol. A lease that cannot be renewed before it expires, or that another
  writer took over meanwhile, is lost: ``RunOwner.check`` (called by the run loop before each step
  and each checkpoint) raises ``RunFolderLost`` so the run stops writing.

Ownership is per thread and re-entrant: the Flyte train task holds the run folder (the store URI,
or the local folder) from before it picks the checkpoint to resume from, and the ``RunLoop`` it
starts in the same thread re-enters that hold for its local folder instead of locking again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from diffusionrl.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"  # a local run folder's lock
LEASE_FILE = "run.lease"  # an object-store run folder's lease
LEASE_TTL_S = 120.0  # a lease lives this long unless renewed (every third of it)
LEASE_SETTLE_S = 2.0  # write-then-read-back: how long a taken lease is left before it is read back


class RunFolderBusy(UserError):
    """Another run owns the run folder (its lock is held, or its lease is alive)."""


class RunFolderLost(UserError):
    """This run lost its lease on an object-store run folder (expired unrenewed, or taken over)."""


def this_host() -> str:
    return socket.gethostname()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _record(**extra) -> dict:
    return {"pid": os.getpid(), "host": this_host(), "since": _now(), **extra}


def owner_text(record: dict | None) -> str:
    """``pid 1234@host since 2026-01-01T10:00:00+0000`` (what a refusal names)."""
    if not record:
        return "an unknown owner"
    return f"pid {record.get('pid', '?')}@{record.get('host', '?')} since {record.get('since', '?')}"


def pid_alive(pid) -> bool:
    """Whether a process ``pid`` runs on this host (a zombie counts as ended)."""
    try:
        pid = int(pid)
        os.kill(pid, 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _dead_here(record: dict | None) -> bool:
    """The record names a process of this host that no longer runs."""
    return bool(record) and record.get("host") == this_host() and not pid_alive(record.get("pid"))


class RunOwner:
    """What ``hold_run_folder`` yields: ``check()`` raises ``RunFolderLost`` when the hold was lost."""

    where: str

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


# -- a local folder: flock ---------------------------------------------------------------------------


def _same_file(path: Path, fd: int) -> bool:
    try:
        st, own = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_fd(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 1 << 16)
        record = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _busy_lock(folder: Path, path: Path, holder: dict | None) -> RunFolderBusy:
    return RunFolderBusy(f"run folder {folder} is in use by another run: {owner_text(holder)} (it holds {path}); "
                         "wait for it to end, or use another output folder (--out, checkpoint_dir)")


def _busy_lease(uri: str, lease_uri: str, ttl_s: float, holder: dict | None) -> RunFolderBusy:
    return RunFolderBusy(f"run folder {uri} is in use by another run: {owner_text(holder)} (its lease {lease_uri} is "
                         f"renewed while it runs and expires {ttl_s:.0f} s after it stops); wait for it to end, or "
                         "use another checkpoint_dir")


class FolderLock(RunOwner):
    """An exclusive ``flock`` on ``<folder>/run.lock``, the file naming its holder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.where = str(self.folder)
        self.fd: int | None = None
        self.record: dict = {}

    def acquire(self) -> FolderLock:
        # the folders this lock creates go again at release if nothing else was written in them (a run
        # refused before it started leaves no trace)
        self.created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # the file may be replaced (released, or stale) between open and lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = _read_fd(fd)
                if _dead_here(holder) and _same_file(self.path, fd):
                    # a forked child of a dead run still holds the descriptor: the run is gone
                    log.warning("%s: its owner %s no longer runs, but a process it left holds the lock; "
                                "replacing the lock file", self.path, owner_text(holder))
                    self.path.unlink(missing_ok=True)
                    os.close(fd)
                    continue
                os.close(fd)
                raise _busy_lock(self.folder, self.path, holder) from None
            if not _same_file(self.path, fd):  # released (and removed) while we waited: open the new one
                os.close(fd)
                continue
            previous = _read_fd(fd)
            if previous:
                log.warning("%s: took over the lock file left by %s, which ended without releasing it",
                            self.path, owner_text(previous))
            self.record = _record()
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.record).encode(), 0)
            os.fsync(fd)
            self.fd = fd
            return self
        raise RunFolderBusy(f"run folder {self.folder}: {self.path} kept being replaced while taking it; "
                            "another run is starting there, use another output folder")

    def check(self) -> None:
        if self.fd is not None and not _same_file(self.path, self.fd):
            raise RunFolderLost(f"run folder {self.folder}: its lock file {self.path} was removed or replaced "
                                "while this run held it; stopping so that two runs do not write one folder")

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _same_file(self.path, fd):  # removed while still locked: a waiter then opens a fresh file
                self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        for folder in getattr(self, "created", []):  # innermost first
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote there
                break


# -- an object-store folder: a lease ------------------------------------------------------------------


class Lease(RunOwner):
    """The lease ``<uri>/run.lease`` of an object-store run folder (see the module docstring).

    ``tags`` are recorded with the owner (e.g. ``{"execution": <Flyte execution id>}``);
    ``acquire(wait_for=...)`` waits for a live lease to expire when its holder's tags match
    ``wait_for`` (a previous, preempted attempt of the same execution) instead of refusing."""

    def __init__(self, uri: str, ttl_s: float = LEASE_TTL_S, settle_s: float = LEASE_SETTLE_S,
                 tags: dict[str, str] | None = None):
        import fsspec

        self.uri = str(uri).rstrip("/")
        self.where = self.uri
        self.fs, root = fsspec.core.url_to_fs(self.uri)
        self.path = f"{root.rstrip('/')}/{LEASE_FILE}"
        self.ttl_s, self.settle_s = float(ttl_s), float(settle_s)
        self.tags = dict(tags or {})
        self.token = uuid.uuid4().hex
        self.record: dict = {}
        self.expires = 0.0  # our lease's expiry as last written (wall clock)
        self.lost: str | None = None  # why the lease was lost, once it was
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def lease_uri(self) -> str:
        return f"{self.uri}/{LEASE_FILE}"

    def read(self) -> dict | None:
        """The lease record on the store (``{}`` for an unreadable one), None when there is none."""
        try:
            record = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def _write(self) -> None:
        self.expires = time.time() + self.ttl_s
        self.record = {**self.record, "expires": self.expires}
        self.fs.pipe_file(self.path, json.dumps(self.record).encode())

    def _free(self, holder: dict | None) -> bool:
        """A lease that is missing, unreadable, expired or left by a process of this host that ended."""
        if not holder:
            return True
        try:
            expired = float(holder.get("expires", 0)) <= time.time()
        except (TypeError, ValueError):
            expired = True
        return expired or _dead_here(holder)

    def acquire(self, wait_for: dict[str, str] | None = None) -> Lease:
        self.record = _record(token=self.token, tags=self.tags)
        deadline = None
        while True:
            holder = self.read()
            if self._free(holder):
                if holder:
                    log.warning("%s: taking over the lease of %s (expired or ended)", self.lease_uri,
                                owner_text(holder))
                self._write()
                self._settle()
                holder = self.read()
                if holder and holder.get("token") == self.token:
                    self._write()  # the settle wait counts against the lease: renew at once
                    self._start_renewing()
                    return self
            if wait_for and holder and all(holder.get("tags", {}).get(k) == v for k, v in wait_for.items()):
                deadline = deadline or time.monotonic() + self.ttl_s + 2 * self.settle_s
                if time.monotonic() < deadline:
                    log.info("%s: held by %s, a previous attempt of this execution; waiting for it to expire",
                             self.lease_uri, owner_text(holder))
                    time.sleep(max(0.05, min(self.ttl_s / 10, deadline - time.monotonic())))
                    continue
            raise _busy_lease(self.uri, self.lease_uri, self.ttl_s, holder)

    def _settle(self) -> None:
        """Between writing our record and reading it back: long enough for a writer that read the
        lease before our write to have written its own (then it won)."""
        time.sleep(self.settle_s)

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                holder = self.read()
                if not holder or holder.get("token") != self.token:
                    self.lost = f"{owner_text(holder)} holds it now" if holder else "it was deleted"
                    log.error("%s: this run lost its lease (%s)", self.lease_uri, self.lost)
                    return
                self._write()
            except Exception as exc:  # a store hiccup: try again at the next beat, until the lease expires
                log.warning("%s: could not renew the lease (%s: %s); retrying", self.lease_uri,
                            type(exc).__name__, exc)

    def check(self) -> None:
        why = self.lost or ("it expired unrenewed" if self.expires and time.time() > self.expires else None)
        if why:
            raise RunFolderLost(f"run folder {self.uri}: this run lost its lease {self.lease_uri} ({why}); "
                                "stopping so that two runs do not write one folder")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=10)
            self._renewer = None
        if not self.expires:
            return
        self.expires = 0.0
        try:
            holder = self.read()
            if holder and holder.get("token") == self.token:
                self.fs.rm(self.path)
        except Exception as exc:  # it expires by itself
            log.warning("%s: could not release the lease (%s: %s); it expires in %.0f s", self.lease_uri,
                        type(exc).__name__, exc, self.ttl_s)


# -- holding a run folder -----------------------------------------------------------------------------

_held: dict[str, tuple[int, RunOwner]] = {}  # key -> (thread id, owner) of the holds of this process
_held_guard = threading.Lock()


def _key(where: str | Path) -> str:
    from .folder import is_remote, local_path

    return str(where).rstrip("/") if is_remote(where) else str(local_path(where).resolve())


@contextlib.contextmanager
def hold_run_folder(uri: str | Path, local: str | Path | None = None, *, ttl_s: float = LEASE_TTL_S,
                    settle_s: float = LEASE_SETTLE_S, tags: dict[str, str] | None = None,
                    wait_for: dict[str, str] | None = None) -> Iterator[RunOwner]:
    """Own the run folder ``uri`` (a local path: ``FolderLock``; an object-store URI: ``Lease``)
    inside the block, or raise ``RunFolderBusy`` naming its owner. ``local``: the staging folder of
    a remote one, covered by the same hold (a ``RunLoop`` writing it re-enters it). Re-entrant in
    one thread: a nested hold of a folder this thread holds yields the outer owner."""
    from .folder import is_remote

    keys = [_key(uri)] + ([_key(local)] if local is not None and is_remote(uri) else [])
    me = threading.get_ident()
    with _held_guard:
        outer = _held.get(keys[0])
    if outer is not None and outer[0] == me:
        yield outer[1]
        return
    if is_remote(uri):
        owner: RunOwner = Lease(str(uri), ttl_s=ttl_s, settle_s=settle_s, tags=tags).acquire(wait_for=wait_for)
    else:
        from .folder import local_path

        owner = FolderLock(local_path(uri)).acquire()
    with _held_guard:
        for key in keys:
            _held[key] = (me, owner)
    try:
        yield owner
    finally:
        with _held_guard:
            for key in keys:
                if _held.get(key, (None, None))[1] is owner:
                    del _held[key]
        owner.release()
