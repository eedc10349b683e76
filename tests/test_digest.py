"""``digest.file_sha256`` is the one file hash: local paths and fsspec URIs, alone or into a running hash,
and the digests built on it (model folders, checkpoint manifests, the initial LoRA) are plain SHA-256."""

from __future__ import annotations

import hashlib

import fsspec

from diffusionrl.digest import file_sha256
from diffusionrl.models.fetch import folder_digest
from diffusionrl.run.manifest import sha256_file
from diffusionrl.train import file_digest

DATA = bytes(range(256)) * 5000  # 1.28 MB: several read chunks


def test_local_path_and_uri_match_hashlib(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(DATA)
    expected = hashlib.sha256(DATA).hexdigest()
    assert file_sha256(path).hexdigest() == expected
    assert file_sha256(str(path)).hexdigest() == expected
    assert sha256_file(path) == expected
    assert file_digest(str(path)) == expected[:16]
    with fsspec.open("memory://digest-test/w.bin", "wb") as fh:
        fh.write(DATA)
    assert file_sha256("memory://digest-test/w.bin").hexdigest() == expected
    assert file_digest("memory://digest-test/w.bin") == expected[:16]


def test_into_a_running_hash_and_folder_digest(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "b" / "w.bin").write_bytes(DATA)
    h = hashlib.sha256(b"prefix")
    assert file_sha256(tmp_path / "a.json", into=h) is h
    assert h.hexdigest() == hashlib.sha256(b"prefix{}").hexdigest()
    expected = hashlib.sha256(b"a.json\x00{}b/w.bin\x00" + DATA).hexdigest()
    assert folder_digest(tmp_path) == expected
