"""SHA-256 of a file's bytes: the one place the code hashes a file (a leaf module, no project imports)."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike, into=None):
    """The SHA-256 hash object of the bytes of one file, read in chunks.

    Args:
        path (`str` or `os.PathLike`): a local path, or a URI that fsspec opens (``s3://``, ``gs://``,
            ``memory://``...).
        into (`hashlib` hash object, *optional*, defaults to `None`): a running hash to add the bytes to
            (a digest over several files); `None` starts a new SHA-256.

    Returns:
        The hash object (``into`` when given): ``.hexdigest()`` for the hex string, ``.digest()`` for bytes.
    """
    make = (lambda: into) if into is not None else hashlib.sha256
    path = os.fspath(path)
    if "://" in path:
        import fsspec

        with fsspec.open(path, "rb") as fh:
            return hashlib.file_digest(fh, make)
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, make)
