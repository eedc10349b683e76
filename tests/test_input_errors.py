"""Mistakes in a run's model, LoRA, SFT and run-folder inputs are one line, found before any weights
load: a mistyped folder is "no such folder", never an invalid hub id; a damaged
pipeline folder, a wrong ``sampling.num_frames``, a bad ``init_lora`` or ``sft_source``, a store
without credentials each name the setting and the fix. No model is loaded and nothing reaches a
network here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from diffusionrl.config import ConfigError
from diffusionrl.data import PromptDataError
from diffusionrl.errors import UserError
from diffusionrl.models.families import ModelReferenceError, UnknownModelFamily, check_model, local_folder
from diffusionrl.run import RunFolderError, check_store_access
from diffusionrl.training.preflight import check_early, check_init_lora

from .conftest import tiny_config


def _pipeline_folder(root, cls="StableDiffusion3Pipeline"):
    """A folder shaped like a diffusers pipeline: model_index.json and one component's weights."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": cls, "transformer": ["diffusers", "X"],
                                                       "image_encoder": [None, None]}))
    (root / "transformer").mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    return root


def test_a_mistyped_folder_is_no_such_folder_not_an_invalid_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for ref in (str(tmp_path / "missing"), "./missing", "../missing", "~/no-such-model-here", "models/sd35",
                "a/b/c", "missing/"):
        with pytest.raises(ModelReferenceError, match=r"no such folder; fix the path"):
            local_folder(ref)
    with pytest.raises(ModelReferenceError, match=r"neither a local folder .* nor a hub id"):
        local_folder("bad id!")
    assert local_folder("stabilityai/stable-diffusion-3.5-medium") is None  # a hub id: left to the hub
    from diffusionrl.models.fetch import fetch_model

    with pytest.raises(ModelReferenceError, match="no such folder"):
        fetch_model("./missing", "", tmp_path / "dest")


def test_a_damaged_pipeline_folder_fails_in_one_line_before_loading(tmp_path):
    good = _pipeline_folder(tmp_path / "good")
    assert check_model(str(good)).pipeline_class == "StableDiffusion3Pipeline"
    with pytest.raises(ConfigError, match=r"num_frames=5, but .* image model \(sd3\); set sampling.num_frames=1"):
        check_model(str(good), num_frames=5)
    with pytest.raises(UnknownModelFamily, match="FooPipeline.*supported pipelines"):
        check_model(str(_pipeline_folder(tmp_path / "foo", "FooPipeline")))
    weights = good / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelReferenceError, match=r"transformer/diffusion_pytorch_model.safetensors is damaged "
                                                  r"\(truncated \(5000 bytes of \d+\)\); re-download"):
        check_model(str(good))
    (good / "model_index.json").unlink()
    with pytest.raises(ModelReferenceError, match="not a diffusers pipeline folder: no model_index.json"):
        check_model(str(good))
    nested = tmp_path / "outer"
    _pipeline_folder(nested / "inner")
    with pytest.raises(ModelReferenceError, match="did you mean .*outer/inner"):
        check_model(str(nested))
    gone = _pipeline_folder(tmp_path / "gone")
    (gone / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    (gone / "transformer").rmdir()
    with pytest.raises(ModelReferenceError, match="lists the component 'transformer' but there is no transformer/"):
        check_model(str(gone))


def test_the_train_cli_reports_a_missing_model_folder_in_one_line(tmp_path, capsys):
    from diffusionrl.train import main

    code = main(["--preset", "tiny-cpu", "--out", str(tmp_path / "out"), "--set", f"model.name={tmp_path}/nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no such folder" in err[0] and "hub" in err[0], err


def test_init_lora_must_name_a_lora_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.init_lora=.*missing: no such folder; give a peft LoRA folder"):
        check_init_lora(str(tmp_path / "missing"))
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    save_file({"a": torch.zeros(4, 8)}, str(run / "lora" / "adapter_model.safetensors"))
    (run / "lora" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ConfigError, match=r"is not a LoRA folder: no adapter_model.safetensors there; did you mean "
                                          r".*run/lora"):
        check_init_lora(str(run))
    check_init_lora(str(run / "lora"), lora_rank=4)
    with pytest.raises(ConfigError, match=r"has rank 4, but model.lora_rank=8: set model.lora_rank=4"):
        check_init_lora(str(run / "lora"), lora_rank=8)
    weights = run / "lora" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="adapter_model.safetensors is damaged"):
        check_init_lora(str(run / "lora"))


def test_a_bad_sft_source_is_one_line(tmp_path):
    from diffusionrl.data import check_sft_source, load_image_pairs

    with pytest.raises(PromptDataError, match=r"'abc' is not a number of scenes; write builtin:shapes:N"):
        load_image_pairs("builtin:shapes:abc", 32)
    for source, why in (("builtin:cats", "unknown built-in SFT source"), (str(tmp_path / "nope"), "no such file"),
                        ("s3://bucket/pairs", "not a URI"), (str(tmp_path), "needs a prompts.jsonl")):
        with pytest.raises(PromptDataError, match=why):
            check_sft_source(source)
    check_sft_source("builtin:shapes:8")


class NoCredentialsError(Exception):
    """Named like botocore's: what s3fs raises when no credentials are found."""


def _locked_store(monkeypatch):
    """A fake object store (protocol ``lockedstore://``) that refuses every request for want of credentials."""
    import fsspec
    from fsspec.spec import AbstractFileSystem

    class LockedStore(AbstractFileSystem):
        protocol = "lockedstore"

        def info(self, path, **kwargs):
            raise NoCredentialsError("Unable to locate credentials")

        def exists(self, path, **kwargs):
            raise NoCredentialsError("Unable to locate credentials")

    fsspec.register_implementation("lockedstore", LockedStore, clobber=True)


def test_a_run_folder_without_credentials_fails_the_first_task_in_one_line(monkeypatch, tmp_path):
    _locked_store(monkeypatch)
    with pytest.raises(RunFolderError, match=r"checkpoint_dir lockedstore://bucket/run: the store refused access "
                                             r"\(NoCredentialsError: Unable to locate credentials\); give this task"):
        check_store_access("lockedstore://bucket/run", "checkpoint_dir")
    with pytest.raises(RunFolderError, match=r"nosuchproto://x: fsspec cannot open this store"):
        check_store_access("nosuchproto://x")
    check_store_access(str(tmp_path))  # a local folder: nothing to ask
    from tasks.grpo import resolve_config

    body = resolve_config.task_function  # the task's body, run here without Flyte
    cfg = tiny_config()
    with pytest.raises(RunFolderError, match="lockedstore://bucket/run"):
        body(config=cfg, overrides=[], sft_steps=0, sft_overrides=[], checkpoint_dir="lockedstore://bucket/run")
    with pytest.raises(PromptDataError, match="algorithm.sft_source='builtin:shapes:abc'"):
        body(config=cfg, overrides=[], sft_steps=2, sft_overrides=["algorithm.sft_source=builtin:shapes:abc"])
    with pytest.raises(RunFolderError, match="algorithm.init_lora lockedstore://b/lora: the store refused access"):
        check_early(tiny_config("algorithm.init_lora=lockedstore://b/lora"))
    with pytest.raises(ConfigError, match="sampling.num_frames=5"):  # a builtin image model: no fetch needed
        body(config=cfg, overrides=["sampling.num_frames=5"], sft_steps=0, sft_overrides=[])
    assert body(config=cfg, overrides=[], sft_steps=0, sft_overrides=[], checkpoint_dir=str(tmp_path)) == cfg
    assert issubclass(RunFolderError, UserError)


def test_a_config_folder_is_named_a_folder_not_missing(tmp_path, capsys):
    from diffusionrl.config.tree import read_config_file
    from diffusionrl.train import main

    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a folder; give the YAML \(or .json\) file in "
                                          rf"it, e.g. {tmp_path / 'config.yaml'}$"):
        read_config_file(tmp_path)
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        read_config_file(tmp_path / "nope.yaml")
    assert main(["--config", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert f"config file {tmp_path} is a folder" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_cuda_device_this_torch_cannot_use_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """model.device=cuda on a CPU-only torch ended in a long traceback from the first tensor moved there."""
    import time

    from diffusionrl.train import main
    from diffusionrl.training.preflight import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"^model.device=cuda, but this torch is a CPU-only build; set model.device="
                                          r"auto \(a GPU where there is one, else the CPU\) or model.device=cpu, or "
                                          r"run where a GPU is$"):
        check_device("cuda")
    t0 = time.perf_counter()
    assert main(["--preset", "tiny-cpu", "--set", "model.device=cuda:0", "--steps", "1",
                 "--out", str(tmp_path / "run")]) == 2
    assert "model.device=cuda:0, but this torch is a CPU-only build" in capsys.readouterr().err.strip().splitlines()[-1]
    assert time.perf_counter() - t0 < 30  # refused before the model was built
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(ConfigError, match=r"no CUDA GPU is visible to this process"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^model.device=cuda:2, but this process sees 2 GPU\(s\) \(cuda:0 to "
                                          r"cuda:1\)"):
        check_device("cuda:2")
    for ok in ("cuda", "cuda:1", "auto", "cpu"):
        check_device(ok)
