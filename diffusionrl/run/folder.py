"""``RunFolder``: a run's folder as a local path or an object-store URI (``s3://``, ``gs://``, ...).

Training always writes into a local folder (``local``); when the run folder is remote, that folder
is a staging copy and ``RunFolder`` moves what must outlive the process to the store:

- ``pull()`` before a run: the published checkpoint (``checkpoints/LATEST``) and ``metrics.jsonl``
  come down, so a re-launched execution, on another machine, resumes where the last one stopped;
  the checkpoint is verified against its manifest (``diffusionrl.run.manifest``), and when the
  pointer's target is damaged the previous published one is used (one warning line); a pointer
  that does not parse, or lacks a key ``publish_checkpoint`` writes, is reported in one warning line
  and the published checkpoints are tried newest first;
- ``publish_checkpoint(path)``: the checkpoint goes up under a new versioned prefix
  (``checkpoints/step-000012-<random>/``, its ``manifest.json`` last), and only when every file is
  there does the pointer ``checkpoints/LATEST`` (one small object, written in one request, naming
  the previous published prefixes too) move to it: a reader never sees a half-written checkpoint;
  prefixes beyond the newest ``keep`` (at least 2, so a damaged newest one has an intact
  predecessor) are deleted after the pointer moved;
- ``push(relpath)``: a file or folder (``metrics.jsonl``, a trajectory step file, the LoRA) goes up
  under the same relative path; a re-run step overwrites its own files, so an interrupted and
  resumed run ends with one file per step and one metrics row per step.

For a local folder every method is a no-op (checkpoints are already written under a temporary
name and renamed, ``diffusionrl.run.checkpoint``): the loop's own files are the run folder.

A run folder must outlive the process that writes it (the next task reads it, a retried attempt
resumes from it, MLflow records where it is): a store that lives inside the process (fsspec's
``memory://``) is refused in one line (``RunFolderError``, ``check_run_folder``). Tests that
exercise the store logic in one process set ``DIFFUSIONRL_ALLOW_MEMORY_STORE=1`` (test-only).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from diffusionrl.errors import UserError

from .callbacks import Callback
from .manifest import MANIFEST, CheckpointDamaged, verify_checkpoint

log = logging.getLogger(__name__)

POINTER = "LATEST"  # checkpoints/LATEST: {"name": "step-000012-ab12cd34", "step": 12, "previous": [names]}
PUBLISHED = re.compile(r"step-\d+-[0-9a-f]+")  # a published prefix's name
MIN_KEEP = 2  # published checkpoints kept at least (when pruning at all): the pointer's and one before
HISTORY = 8  # previous names a pointer records when nothing is pruned (keep=0)


def is_remote(uri: str | Path) -> bool:
    """An object-store (or any non-local fsspec) URI, as opposed to a plain or ``file://`` path."""
    text = str(uri)
    return "://" in text and not text.startswith("file://")


# fsspec stores that live in the process's memory: nothing there outlives it or is seen by another
PROCESS_LOCAL = ("memory",)
ALLOW_MEMORY_ENV = "DIFFUSIONRL_ALLOW_MEMORY_STORE"  # "1": allow them (tests of the store logic only)


class RunFolderError(UserError):
    """A run folder that cannot keep a run: on a process-local store, or a URI where a local folder is needed."""


def protocols(uri: str | Path) -> list[str]:
    """The fsspec protocols of ``uri``, chained ones included (``simplecache::memory://x`` -> both)."""
    return [part.split("://", 1)[0] for part in str(uri).split("::") if "://" in part]


def check_run_folder(uri: str | Path) -> None:
    """Refuse a run folder on a process-local store (``memory://``) unless ``$DIFFUSIONRL_ALLOW_MEMORY_STORE``
    is 1: its checkpoints, metrics and LoRA would vanish when the process exits, while the run (and
    MLflow's record of its folder) said they were kept."""
    local = [p for p in protocols(uri) if p in PROCESS_LOCAL]
    if local and os.environ.get(ALLOW_MEMORY_ENV) != "1":
        raise RunFolderError(
            f"run folder {uri}: {local[0]}:// is a store inside this process, gone when it exits and invisible to "
            "the next task or attempt; use a local folder or an object store (s3://, gs://, ...)")


def check_local_out(out_dir: str | Path) -> None:
    """Refuse a URI as a training output folder: the loop writes a local folder (a run folder on an
    object store is staged locally and uploaded by ``RunFolder``, the workflows' ``checkpoint_dir``),
    and a URI there would become a local folder named like it (``memory:/x``)."""
    if is_remote(out_dir):
        check_run_folder(out_dir)
        raise RunFolderError(
            f"output folder {out_dir}: training writes a local folder, not a URI; give a local path (a run folder "
            "on an object store is the workflow's checkpoint_dir)")


# Words in the type names of what a store client raises for missing or refused credentials
# (botocore's NoCredentialsError, google.auth's DefaultCredentialsError, azure's ClientAuthenticationError, ...)
_DENIED_NAMES = ("credential", "auth", "accessdenied", "forbidden", "permission", "token", "signature")


def access_denied(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the store refused who we are: no
    credentials, bad or expired ones, or no permission."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PermissionError) or any(w in type(exc).__name__.lower() for w in _DENIED_NAMES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def check_store_access(uri: str | Path, what: str = "run folder") -> None:
    """One cheap request to the store behind ``uri`` (``fs.info`` on its prefix; a prefix with
    nothing under it yet is fine), so that a store without credentials, one that refuses them, or a
    protocol fsspec cannot open fails now, in one line naming ``what`` and the URI, and not as a
    ``NoCredentialsError`` traceback from inside training after the model was fetched. A local path
    is not checked; other errors (a network fault: retryable) propagate."""
    if not is_remote(uri):
        return
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(str(uri))
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its package not installed
        raise RunFolderError(f"{what} {uri}: fsspec cannot open this store ({exc}); fix the URI or install the "
                             "store's fsspec package (s3fs, gcsfs, adlfs)") from None
    try:
        fs.info(root)
    except FileNotFoundError:
        pass  # nothing there yet: a new run folder
    except Exception as exc:
        if not access_denied(exc):
            raise
        raise RunFolderError(
            f"{what} {uri}: the store refused access ({type(exc).__name__}: {exc}); give this task credentials for "
            "it (e.g. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the pod's service account), or use "
            "another folder") from None


def local_path(uri: str | Path) -> Path:
    text = str(uri)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def write_text(uri: str | Path, text: str) -> None:
    """Write ``text`` to a local path or an object-store URI."""
    import fsspec

    with fsspec.open(str(uri), "w", auto_mkdir=True) as fh:
        fh.write(text)


def local_copy(uri: str | Path, dest: str | Path) -> Path:
    """A local folder with the contents of ``uri``: the path itself when it is local, else the
    object-store prefix downloaded into ``dest`` (emptied first). Raises ``FileNotFoundError`` naming
    the URI when there is nothing there."""
    import fsspec

    if not is_remote(uri):
        return local_path(uri)
    fs, root = fsspec.core.url_to_fs(str(uri))
    files = fs.find(root)
    if not files:
        raise FileNotFoundError(f"{uri}: no files there")
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    for remote_file in files:
        target = dest / remote_file[len(root.rstrip("/")) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote_file, str(target))
    return dest


class RunFolder:
    """The run folder at ``uri``; ``local`` is where the loop writes (``uri`` itself when local)."""

    def __init__(self, uri: str | Path, staging: str | Path | None = None):
        check_run_folder(uri)
        self.uri = str(uri).rstrip("/")
        self.remote = is_remote(self.uri)
        if self.remote:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(self.uri)
            self.local = Path(staging) if staging else Path(tempfile.mkdtemp(prefix="run-"))
        else:
            self.fs, self.root = None, ""
            self.local = local_path(self.uri)
        self.local.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"RunFolder({self.uri!r}, local={str(self.local)!r})"

    def uri_of(self, relpath: str) -> str:
        """Where ``relpath`` of the run lives (a URI for a remote folder, a path otherwise)."""
        return f"{self.uri}/{relpath}" if self.remote else str(self.local / relpath)

    def _remote(self, relpath: str) -> str:
        return f"{self.root}/{relpath}"

    # -- files ----------------------------------------------------------------------------------
    def push(self, relpath: str) -> None:
        """Upload the local file or folder ``relpath`` (a folder: every file under it)."""
        if not self.remote:
            return
        src = self.local / relpath
        if src.is_dir():
            for f in sorted(p for p in src.rglob("*") if p.is_file()):
                self.fs.put_file(str(f), self._remote(str(f.relative_to(self.local))))
        elif src.is_file():
            self.fs.put_file(str(src), self._remote(relpath))

    def pull_file(self, relpath: str) -> bool:
        """Download ``relpath`` if the store has it; True if it did."""
        if not self.remote or not self.fs.exists(self._remote(relpath)):
            return False
        dest = self.local / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._remote(relpath), str(dest))
        return True

    def push_changed(self, skip: tuple[str, ...] = ("checkpoints",)) -> int:
        """Upload every local file that is new or changed since the last call (folders in ``skip``,
        ``*.tmp`` files, which a background writer is still writing, and ``*.lock`` files, a local
        folder's lock (``run.lock``), which mean nothing on another machine, excluded); returns how
        many went up."""
        if not self.remote:
            return 0
        seen = getattr(self, "_pushed", {})
        sent = 0
        for f in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = f.relative_to(self.local)
            if rel.parts[0] in skip or f.name.endswith((".tmp", ".lock")):  # .tmp: renamed when complete
                continue
            st = f.stat()
            key = (st.st_size, st.st_mtime_ns)
            if seen.get(str(rel)) != key:
                self.fs.put_file(str(f), self._remote(rel.as_posix()))
                seen[str(rel)] = key
                sent += 1
        self._pushed = seen
        return sent

    # -- checkpoints ----------------------------------------------------------------------------
    def latest_published(self) -> dict | None:
        """The pointer record ``{"name", "step", "previous"}`` of the published checkpoint, if any;
        ``ValueError`` saying what it lacks when it is not such a record."""
        if not self.remote:
            return None
        pointer = self._remote(f"checkpoints/{POINTER}")
        if not self.fs.exists(pointer):
            return None
        record = json.loads(self.fs.cat_file(pointer))
        if not isinstance(record, dict) or not isinstance(record.get("name"), str) \
                or not isinstance(record.get("step"), int) or not isinstance(record.get("previous"), list):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"not a pointer record: it needs name, step and previous, it has {keys}")
        return record

    def pull(self) -> Path | None:
        """Bring the published checkpoint and ``metrics.jsonl`` into the local folder; returns the
        local checkpoint path (``checkpoints/step-XXXXXX``), or None when nothing was published.
        A damaged published checkpoint is reported and the previous one taken; ``CheckpointDamaged``
        when none is intact."""
        if not self.remote:
            return None
        self.pull_file("metrics.jsonl")
        damaged: list[CheckpointDamaged] = []
        try:
            record = self.latest_published()
        except ValueError as exc:  # a pointer is one request: this is not expected, but not fatal either
            log.warning("%s/checkpoints/%s cannot be read (%s): trying the published checkpoints newest first",
                        self.uri, POINTER, exc)
            record = {"name": None, "previous": []}
        if record is None:
            return None
        for name in self._candidates(record):
            dest = self._download(name)
            try:
                verify_checkpoint(dest)
            except CheckpointDamaged as exc:
                log.warning("published checkpoint %s of %s is damaged (%s): trying the previous one",
                            name, self.uri, exc.reason)
                damaged.append(CheckpointDamaged(name, exc.reason))
                shutil.rmtree(dest)
                continue
            self._damaged = {str(e.path) for e in damaged}
            log.info("pulled checkpoint %s (step %s) from %s", name, _step(name), self.uri)
            return dest
        reasons = "; ".join(f"{e.path}: {e.reason}" for e in damaged) or "none found"
        raise CheckpointDamaged(self.uri, reasons, f"no intact published checkpoint in {self.uri}/checkpoints "
                                                   f"({reasons}); restore one, or use another run folder")

    def _published(self) -> list[str]:
        root = self._remote("checkpoints")
        if not self.fs.exists(root):
            return []
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False)}
        return sorted(n for n in names if PUBLISHED.fullmatch(n))

    def _candidates(self, record: dict) -> list[str]:
        """The pointer's target, then the prefixes it names as published before it; with no readable
        pointer (``name`` None) every published prefix, newest first."""
        if record["name"]:
            return [record["name"], *record["previous"]]
        return sorted(self._published(), key=lambda n: (_step(n), n), reverse=True)

    def _download(self, name: str) -> Path:
        dest = self.local / "checkpoints" / f"step-{_step(name):06d}"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        prefix = self._remote(f"checkpoints/{name}")
        for remote_file in self.fs.find(prefix):
            rel = remote_file[len(prefix.rstrip("/")) + 1:]
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote_file, str(target))
        return dest

    def publish_checkpoint(self, path: str | Path, step: int, keep: int = 0) -> str:
        """Upload the checkpoint folder ``path`` under a new prefix (its manifest last), then move the
        pointer to it. Returns the published name (remote) or the local path."""
        path = Path(path)
        if not self.remote:
            return str(path)
        name = f"step-{step:06d}-{uuid.uuid4().hex[:8]}"
        prefix = self._remote(f"checkpoints/{name}")
        for f in sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: (p.name == MANIFEST, str(p))):
            self.fs.put_file(str(f), f"{prefix}/{f.relative_to(path)}")
        try:
            before = self.latest_published()
        except ValueError:
            before = None
        damaged = getattr(self, "_damaged", set())
        previous = [n for n in ([before["name"], *before["previous"]] if before else [])
                    if n and n != name and n not in damaged]
        keep = max(keep, MIN_KEEP) if keep > 0 else 0
        previous = previous[: (keep - 1) if keep else HISTORY]
        record = {"name": name, "step": step, "previous": previous}
        self.fs.pipe_file(self._remote(f"checkpoints/{POINTER}"), json.dumps(record).encode())
        self._prune(keep, {name, *previous})
        return name

    def _prune(self, keep: int, kept: set[str]) -> None:
        """Delete the published prefixes the pointer no longer names (none when ``keep`` is 0)."""
        if keep <= 0:
            return
        root = self._remote("checkpoints")
        for old in self._published():
            if old not in kept:
                self.fs.rm(f"{root}/{old}", recursive=True)


def _step(name: str) -> int:
    """``step-000012-ab12cd34`` -> 12."""
    return int(name.split("-")[1])


class SyncRunFolder(Callback):
    """Loop callback keeping a remote run folder current: after each step the new and changed
    files (``metrics.jsonl``, trajectory step files, sample grids), at each checkpoint those files
    again (a background writer may have finished one since) and then an atomic publish, at the end
    the outputs (the LoRA folders). Add it after the callbacks that write into the run folder."""

    def __init__(self, folder: RunFolder, keep: int = 0):
        self.folder = folder
        self.keep = keep

    def on_step(self, loop, step, batch, metrics) -> None:
        self.folder.push_changed()

    def on_checkpoint(self, loop, path) -> None:
        # what the checkpoint covers first (files a background writer finished after the last step's
        # push, e.g. the step's trajectory file), then the checkpoint itself
        self.folder.push_changed()
        self.folder.publish_checkpoint(path, loop.step, self.keep)

    def on_end(self, loop) -> None:
        self.folder.push_changed()
