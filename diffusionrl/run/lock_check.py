"""Who owns a run folder, asked without taking it (``check_free``): the read-only side of ``run.lock``."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from .folder import is_remote, local_path
from .lock import LOCK_FILE, Lease, _busy_lease, _busy_lock, _dead_here, _read_fd


def check_free(uri: str | Path, tags: dict[str, str] | None = None) -> None:
    """Refuse, with ``hold_run_folder``'s ``RunFolderBusy`` line, a run folder another run owns now, without
    taking it and without writing anything: a workflow's first task calls it so that a second execution on the
    same ``checkpoint_dir`` stops before it prepares prompts or fetches weights (the stage that writes the folder
    still holds it, and still refuses a run that started in between).

    An object-store folder: one read of its lease, which is free when missing, expired, left by a process of
    this host that ended, or held by a previous attempt of this execution (``tags`` match the holder's; that
    stage waits for it). Tasks on a cluster share only the store, and the lease is there. A local folder: a
    non-blocking ``flock`` of its ``run.lock``, released at once (a lock held only by a dead run's forked
    child counts as free, as ``hold_run_folder`` replaces it); no lock file, no check. (The probe holds the lock
    for microseconds: a run taking it in exactly that instant is refused, naming the file's last owner.)"""
    if is_remote(uri):
        lease = Lease(str(uri), tags=tags)
        holder = lease.read()
        if lease._free(holder) or (tags and all((holder or {}).get("tags", {}).get(k) == v for k, v in tags.items())):
            return
        raise _busy_lease(lease.uri, lease.lease_uri, lease.ttl_s, holder)
    folder = local_path(uri)
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (a missing folder, a first run) or none this process may read
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        holder = _read_fd(fd)
        if not _dead_here(holder):
            raise _busy_lock(folder, path, holder) from None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
