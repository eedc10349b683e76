"""The file system refusing a file (no permission, a read-only file system, a full disk) on the prompt file, the
run folder or a checkpoint is one line naming the path and the fix (``errors.FileSystemError``: the CLIs print it
and exit 2, the Flyte tasks raise it without the library's frames), not a traceback; a newest checkpoint this
user may not read is skipped for the previous one, as a damaged one is.

The refusals are injected where the file is opened or created (these tests may run as root, whom no ``chmod``
stops), with the ``OSError`` the kernel gives."""

from __future__ import annotations

import builtins
import errno
import io
import logging
import os

import pytest

from diffusionrl.errors import EXIT_USER_ERROR, FileSystemError, filesystem_error, run_cli

from .test_checkpoint_trust import same, toy, warnings_about, weights

UID = os.getuid()


def refuse(monkeypatch, under, code: int, only: str = "") -> None:
    """Opening, creating or making a folder at any path under ``under`` (only the file ``only`` in the folder
    ``under``, if given) fails with ``code``, as the file system would."""
    under = os.fspath(under)

    def hit(path) -> bool:
        try:
            path = os.fspath(path)
        except TypeError:  # a file descriptor
            return False
        if only:
            return os.path.dirname(path) == under and os.path.basename(path) == only
        return path.startswith(under)

    def guard(real):
        def call(path, *args, **kwargs):
            if hit(path):
                raise OSError(code, os.strerror(code), os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "mkdir")):
        monkeypatch.setattr(module, name, guard(getattr(module, name)))


def cli_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


PERMISSION = (f"Permission denied; this user (uid {UID}) may not use it; change its permissions or owner (chmod, "
              "chown), or use another path")


def test_an_unreadable_prompt_file_and_a_read_only_run_folder_are_one_line_from_the_cli(tmp_path, monkeypatch,
                                                                                       capsys):
    from diffusionrl.train import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\na green car\na white bird\n")
    args = ["--preset", "tiny-cpu", "--set", f"data.source={prompts}", "--steps", "1"]
    with monkeypatch.context() as patch:
        refuse(patch, prompts, errno.EACCES)
        assert main([*args, "--out", str(tmp_path / "run")]) == EXIT_USER_ERROR
    assert cli_line(capsys) == f"file system error: {prompts}: {PERMISSION}"
    with monkeypatch.context() as patch:
        refuse(patch, tmp_path / "ro", errno.EROFS)
        assert main([*args, "--out", str(tmp_path / "ro" / "run")]) == EXIT_USER_ERROR
    assert cli_line(capsys) == (f"file system error: {tmp_path / 'ro' / 'run'}: Read-only file system; the file "
                                "system is read-only; use a folder on a writable one (--out, checkpoint_dir)")


def test_a_full_disk_while_writing_a_checkpoint_or_the_metrics_names_the_file(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    from diffusionrl.run import checkpoint

    def full(tensors, filename, *args, **kwargs):  # what safetensors raises: it names its temporary file
        folder = os.path.dirname(filename)
        raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error 28) at path "
                              f"\"{folder}/.tmpAb12Cd\"")

    fix = ("No space left on device; free some space there (older runs; fewer checkpoints kept: "
           "train.keep_checkpoints) or use a folder on another disk, then run again: a run resumes from its last "
           "complete checkpoint")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_file", full)
        assert run_cli(lambda: toy(tmp_path / "a").run(resume=None) and None) == EXIT_USER_ERROR
    assert cli_line(capsys) == f"file system error: {tmp_path / 'a' / 'checkpoints' / 'step-000001'}: {fix}"

    real_open = builtins.open

    class Full(io.StringIO):
        def write(self, text):  # a write to an open file names no file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_full(path, mode="r", *args, **kwargs):
        return Full() if os.fspath(path).endswith("metrics.jsonl") and "a" in mode else real_open(path, mode, *args,
                                                                                                   **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(io, "open", open_full)  # Path.open
        assert run_cli(lambda: toy(tmp_path / "b").run(resume=None) and None) == EXIT_USER_ERROR
    assert cli_line(capsys) == f"file system error: {tmp_path / 'b' / 'metrics.jsonl'}: {fix}"


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, monkeypatch, caplog):
    full = toy(tmp_path / "full")
    full.run(resume=None)
    run = tmp_path / "part"
    toy(run).run(resume=None)  # checkpoints 1, 2, 3
    caplog.set_level(logging.WARNING)
    with monkeypatch.context() as patch:
        refuse(patch, run / "checkpoints" / "step-000003", errno.EACCES, only="lora.safetensors")
        resumed = toy(run)
        result = resumed.run(resume="auto")  # rewrites step 3 (its files are opened for writing only then)
    [line] = warnings_about(caplog, "skipping")
    assert "step-000003" in line and "lora.safetensors is not readable by this user (permission denied" in line
    assert result.steps_done == 3 and same(weights(resumed), weights(full))  # step 3 re-run from step 2's state


def test_the_flyte_tasks_and_the_conversion_name_the_path_and_leave_other_errors_alone():
    pytest.importorskip("flytekit")
    from tasks.common import user_errors

    @user_errors
    def body():
        open("/no/such/dir/x")  # noqa: SIM115 - not a refusal: stays what it is

    with pytest.raises(FileNotFoundError):
        body()

    @user_errors
    def denied():
        raise PermissionError(errno.EACCES, "Permission denied", "/data/prompts.jsonl")

    with pytest.raises(FileSystemError, match=r"^/data/prompts.jsonl: Permission denied; this user") as err:
        denied()
    import traceback

    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert frames[-1] == "task_body"  # the task's own frame, not the library's
    assert filesystem_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/x")).report().startswith(
        "file system error: /x: Disk quota exceeded; this user's disk quota is used up")
    assert filesystem_error(ConnectionError(errno.ECONNREFUSED, "refused")) is None
    assert filesystem_error(ValueError("nothing about files")) is None
