"""Run folders on an object store (fsspec ``memory://`` here, allowed by the test-only
``DIFFUSIONRL_ALLOW_MEMORY_STORE=1``; ``s3://`` in tests/test_cluster.py): atomic checkpoint
publishing, pulling on another machine, and a run interrupted on one machine and resumed on another
that ends where the uninterrupted run ends. Without the switch a ``memory://`` run folder is refused."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from diffusionrl.run import Callback
from diffusionrl.run.folder import ALLOW_MEMORY_ENV, POINTER, RunFolder, RunFolderError, SyncRunFolder, is_remote
from diffusionrl.run.manifest import write_manifest

from .conftest import saved_lora, tiny_config


@pytest.fixture(autouse=True)
def memory_store():
    """These tests play several machines in one process on fsspec's memory store (a patch of its own:
    a test's ``monkeypatch.undo()`` keeps it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ALLOW_MEMORY_ENV, "1")
        yield


def test_a_process_local_store_is_refused_as_a_run_folder(monkeypatch, tmp_path):
    """A memory:// run folder vanished with the process while the run exited 0 and MLflow recorded it."""
    monkeypatch.delenv(ALLOW_MEMORY_ENV)
    for uri in ("memory://runs/x", "simplecache::memory://runs/x"):
        with pytest.raises(RunFolderError, match=r"memory:// is a store inside this process") as err:
            RunFolder(uri, staging=tmp_path / "a")
        assert "\n" not in str(err.value) and uri in str(err.value)
    assert RunFolder(tmp_path / "local").local == tmp_path / "local"  # local folders and object stores are fine


def test_train_refuses_a_uri_as_its_output_folder_in_one_line(monkeypatch, tmp_path, capsys):
    """``train --out memory://x`` wrote a local folder named ``memory:/x`` and exited 0."""
    from diffusionrl.train import main

    monkeypatch.delenv(ALLOW_MEMORY_ENV)
    monkeypatch.chdir(tmp_path)
    for out, why in (("memory://runs/x", "memory:// is a store inside this process"),
                     ("s3://bucket/runs/x", "training writes a local folder, not a URI")):
        assert main(["--out", out, "--set", "train.steps=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    assert list(tmp_path.iterdir()) == []  # no local "memory:" or "s3:" folder


def store_uri() -> str:
    return f"memory://runs/{uuid.uuid4().hex[:8]}"


def fake_checkpoint(folder, step: int):
    ckpt = folder.local / "checkpoints" / f"step-{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    (ckpt / "lora.safetensors").write_bytes(bytes([step]) * 64)
    write_manifest(ckpt)
    return ckpt


def test_is_remote():
    assert is_remote("s3://b/x") and is_remote("memory://x") and is_remote("gs://b")
    assert not is_remote("/tmp/x") and not is_remote("runs/x") and not is_remote("file:///tmp/x")


def test_published_checkpoint_and_metrics_come_down_on_another_machine(tmp_path):
    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    (a.local / "metrics.jsonl").write_text('{"step": 1}\n')
    a.push_changed()
    a.publish_checkpoint(fake_checkpoint(a, 1), step=1)
    b = RunFolder(uri, staging=tmp_path / "b")
    path = b.pull()
    assert path == b.local / "checkpoints" / "step-000001"
    assert (path / "lora.safetensors").read_bytes() == bytes([1]) * 64
    assert (b.local / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_half_written_checkpoint_is_never_read(tmp_path, monkeypatch):
    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    a.publish_checkpoint(fake_checkpoint(a, 1), step=1)
    calls = {"n": 0}
    real = a.fs.put_file

    def dies_after_one_file(src, dst, **kw):
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConnectionError("preempted mid-upload")
        return real(src, dst, **kw)

    monkeypatch.setattr(a.fs, "put_file", dies_after_one_file)
    with pytest.raises(ConnectionError):
        a.publish_checkpoint(fake_checkpoint(a, 2), step=2)
    monkeypatch.undo()
    assert a.latest_published()["step"] == 1  # the pointer never moved to the torn prefix
    path = RunFolder(uri, staging=tmp_path / "b").pull()
    assert path.name == "step-000001" and (path / "lora.safetensors").read_bytes() == bytes([1]) * 64


def test_old_checkpoints_pruned_but_never_the_pointers(tmp_path):
    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    for step in (1, 2, 3):
        a.publish_checkpoint(fake_checkpoint(a, step), step=step, keep=2)
    names = sorted(p.rsplit("/", 1)[-1] for p in a.fs.ls(f"{a.root}/checkpoints", detail=False))
    assert [n.split("-")[1] for n in names if n != POINTER] == ["000002", "000003"]
    assert a.latest_published()["step"] == 3


def test_push_changed_sends_only_new_or_changed_files(tmp_path):
    a = RunFolder(store_uri(), staging=tmp_path / "a")
    (a.local / "metrics.jsonl").write_text("1\n")
    (a.local / "trajectories").mkdir()
    (a.local / "trajectories" / "step-000001.parquet").write_bytes(b"x")
    fake_checkpoint(a, 1)
    assert a.push_changed() == 2  # checkpoints/ travel only through publish_checkpoint
    assert a.push_changed() == 0
    with (a.local / "metrics.jsonl").open("a") as fh:
        fh.write("2\n")
    assert a.push_changed() == 1
    assert a.fs.cat_file(f"{a.root}/metrics.jsonl") == b"1\n2\n"


class WriteTrajectories(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_step(self, loop, step, batch, metrics):
        from diffusionrl.trajectory import write_step

        write_step(self.folder.local / "trajectories", batch, run_id="t", step=step, images=False)


def test_run_resumed_on_another_machine_equals_uninterrupted(tmp_path):
    """Two steps, then the machine is gone (its local folder deleted); a new machine pulls the
    published checkpoint and finishes: same LoRA, one metrics row and one trajectory per step."""
    import shutil

    from diffusionrl.train import train

    cfg = tiny_config("train.steps=3")
    train(cfg, tmp_path / "full", resume=None, progress=False)

    uri = store_uri()
    first = RunFolder(uri, staging=tmp_path / "m1")
    train(cfg, first.local, resume=None, stop_after=2, progress=False,
          callbacks=[WriteTrajectories(first), SyncRunFolder(first, keep=1)])
    shutil.rmtree(first.local)
    second = RunFolder(uri, staging=tmp_path / "m2")
    resume = second.pull()
    assert resume is not None and resume.name == "step-000002"
    result = train(cfg, second.local, resume=resume, progress=False,
                   callbacks=[WriteTrajectories(second), SyncRunFolder(second, keep=1)])
    assert result.steps_done == 3
    a, b = saved_lora(tmp_path / "full"), saved_lora(second.local)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in second.fs.cat_file(f"{second.root}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    files = sorted(p.rsplit("/", 1)[-1] for p in second.fs.ls(f"{second.root}/trajectories", detail=False))
    assert files == ["step-000001.parquet", "step-000002.parquet", "step-000003.parquet"]
    assert second.fs.exists(f"{second.root}/lora/adapter_model.safetensors")


# -- damaged published checkpoints ----------------------------------------------------------------


def published(folder):
    return sorted(n for n in (p.rsplit("/", 1)[-1] for p in folder.fs.ls(f"{folder.root}/checkpoints",
                                                                          detail=False)) if n != POINTER)


def damage(folder, name, file="lora.safetensors"):
    path = f"{folder.root}/checkpoints/{name}/{file}"
    folder.fs.pipe_file(path, bytes(len(folder.fs.cat_file(path))))  # same size, zeroed


def test_a_damaged_published_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    for step in (1, 2, 3):
        a.publish_checkpoint(fake_checkpoint(a, step), step=step, keep=1)
    names = published(a)
    assert [n.split("-")[1] for n in names] == ["000002", "000003"]  # keep=1 still keeps 2
    damage(a, names[1])
    b = RunFolder(uri, staging=tmp_path / "b")
    caplog.set_level("WARNING")
    path = b.pull()
    assert path.name == "step-000002" and (path / "lora.safetensors").read_bytes() == bytes([2]) * 64
    assert sorted(p.name for p in (b.local / "checkpoints").iterdir()) == ["step-000002"]
    [line] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert names[1] in line and "lora.safetensors does not match its SHA-256" in line
    # the next publish from b does not keep the damaged prefix as its predecessor
    new = b.publish_checkpoint(fake_checkpoint(b, 3), step=3, keep=1)
    assert published(b) == sorted([names[0], new])
    assert b.latest_published()["previous"] == [names[0]]


def test_no_intact_published_checkpoint_fails_in_one_line(tmp_path):
    from diffusionrl.run import CheckpointDamaged

    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    for step in (1, 2):
        name = a.publish_checkpoint(fake_checkpoint(a, step), step=step, keep=2)
        damage(a, name, "state.json")
    with pytest.raises(CheckpointDamaged, match="no intact published checkpoint") as err:
        RunFolder(uri, staging=tmp_path / "b").pull()
    assert "\n" not in str(err.value) and "state.json" in str(err.value)


@pytest.mark.parametrize("pointer", [b"{", b"{}", b"x"], ids=["torn", "empty", "not-json"])
def test_a_pointer_that_cannot_be_read_falls_back_to_the_published_checkpoints_newest_first(tmp_path, caplog,
                                                                                            pointer):
    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    one = a.publish_checkpoint(fake_checkpoint(a, 1), step=1)
    two = a.publish_checkpoint(fake_checkpoint(a, 2), step=2)
    a.fs.put_file(str(fake_checkpoint(a, 3) / "lora.safetensors"),  # a torn upload, never pointed to
                  f"{a.root}/checkpoints/step-000003-0000abcd/lora.safetensors")
    a.fs.pipe_file(f"{a.root}/checkpoints/{POINTER}", pointer)
    damage(a, two)
    caplog.set_level("WARNING")
    path = RunFolder(uri, staging=tmp_path / "b").pull()
    assert path.name == "step-000001" and one in published(a)
    [line] = [r.getMessage() for r in caplog.records if POINTER in r.getMessage()]
    assert line.startswith(f"{uri}/checkpoints/{POINTER} cannot be read (") and "newest first" in line


def test_a_pointer_without_its_predecessors_is_not_a_pointer_record(tmp_path, caplog):
    uri = store_uri()
    a = RunFolder(uri, staging=tmp_path / "a")
    two = a.publish_checkpoint(fake_checkpoint(a, 2), step=2)
    a.fs.pipe_file(f"{a.root}/checkpoints/{POINTER}", json.dumps({"name": two, "step": 2}).encode())
    with pytest.raises(ValueError, match=r"needs name, step and previous, it has \['name', 'step'\]"):
        a.latest_published()
    caplog.set_level("WARNING")
    assert RunFolder(uri, staging=tmp_path / "b").pull().name == "step-000002"
    assert any("cannot be read" in r.getMessage() for r in caplog.records)

