"""What a run's inputs are checked for before the model loads (``check_inputs``).

Loading a model takes seconds (the tiny ones) to minutes (a hub model), and a mistake found by the
loader or the first step is a 30-80-line traceback from deep inside diffusers, peft or
safetensors. Everything that can be read without the weights is read here first, each mistake
one line (a ``UserError``) naming the setting and the fix: the model reference and its folder
(``models.families.check_model``: a mistyped folder, no ``model_index.json``, an unsupported
pipeline, a truncated weights file, ``sampling.num_frames`` > 1 for an image model, a
``guidance_scale_2`` for a model without two experts: ``check_guidance_2``) and the
warm-start LoRA (``check_init_lora``: a missing folder, one that is not a peft LoRA, a rank that
is not ``model.lora_rank``), and a ``model.device`` naming a CUDA device this machine's torch cannot use
(``check_device``). Both the one-process worker and the rank group call it, so neither
the local nor the distributed layout starts loading on inputs that cannot work.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusionrl.config import ConfigError

LORA_FILE = "adapter_model.safetensors"
LORA_HINT = "give a peft LoRA folder (a run's <out>/lora, with adapter_model.safetensors)"


def check_inputs(cfg, model_path: str | None = None) -> None:
    """Check ``cfg``'s model (or the fetched ``model_path`` standing for it) and its
    ``algorithm.init_lora`` before any weights load."""
    from diffusionrl.models.families import check_guidance_2, check_model

    check_device(cfg.model.device)
    key = "model.name" if not model_path else f"model folder (fetched for model.name={cfg.model.name})"
    check_model(model_path or cfg.model.name, cfg.model.revision, cfg.sampling.num_frames, key=key)
    check_guidance_2(cfg, model_path or cfg.model.name, key)
    if cfg.algorithm.init_lora:
        check_init_lora(str(cfg.algorithm.init_lora), cfg.model.lora_rank)


def check_device(device: str) -> None:
    """``model.device`` (``cuda``, ``cuda:N``) names a GPU this process's torch can use, checked on the machine
    that loads the model (a config is resolved anywhere): a CPU build of torch, no visible GPU or an index past
    the last one is one line, not a traceback from the first tensor moved there. ``auto`` and ``cpu`` pass."""
    if not device.startswith("cuda"):
        return
    import torch

    fix = "set model.device=auto (a GPU where there is one, else the CPU) or model.device=cpu"
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "no CUDA GPU is visible to this process (the driver, CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"model.device={device}, but {why}; {fix}, or run where a GPU is")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={device}, but this process sees {torch.cuda.device_count()} GPU(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); pick one of them, or {fix}")


def check_init_lora(uri: str, lora_rank: int | None = None) -> None:
    """``algorithm.init_lora`` names a peft LoRA: a folder with an intact
    ``adapter_model.safetensors`` (and, when it has an ``adapter_config.json``, the rank
    ``model.lora_rank``); an object-store URI gets one cheap request (``run.folder.check_store_access``,
    then the file's existence), its contents are checked once downloaded
    (``LoraPolicy.load_adapter_folder``)."""
    from diffusionrl.models.families import safetensors_problem
    from diffusionrl.run import check_store_access, is_remote

    label = f"algorithm.init_lora={uri}"
    if is_remote(uri):
        import fsspec

        check_store_access(uri, "algorithm.init_lora")
        fs, root = fsspec.core.url_to_fs(uri)
        if not fs.exists(f"{root.rstrip('/')}/{LORA_FILE}"):
            raise ConfigError(f"{label}: no {LORA_FILE} there; {LORA_HINT}")
        return
    path = Path(uri).expanduser()
    if not path.exists():
        raise ConfigError(f"{label}: no such folder; {LORA_HINT}, or '' for a fresh LoRA")
    if not path.is_dir():
        raise ConfigError(f"{label} is a file; {LORA_HINT}")
    weights = path / LORA_FILE
    if not weights.is_file():
        inner = next((p.parent for p in (path / "lora" / LORA_FILE, *sorted(path.glob(f"*/{LORA_FILE}")))
                      if p.is_file()), None)
        hint = f"did you mean {str(inner)!r}?" if inner is not None else LORA_HINT
        raise ConfigError(f"{label} is not a LoRA folder: no {LORA_FILE} there; {hint}")
    problem = safetensors_problem(weights)
    if problem:
        raise ConfigError(f"{label}: {LORA_FILE} is damaged ({problem}); save the LoRA again")
    config = path / "adapter_config.json"
    if lora_rank is not None and config.is_file():
        try:
            rank = json.loads(config.read_text()).get("r")
        except (json.JSONDecodeError, AttributeError):
            raise ConfigError(f"{label}: adapter_config.json is not peft's JSON; save the LoRA again") from None
        if isinstance(rank, int) and rank != lora_rank:
            raise ConfigError(f"{label} has rank {rank}, but model.lora_rank={lora_rank}: set model.lora_rank={rank}")


def check_early(cfg, run_folder: str = "") -> None:
    """What a workflow's first task checks, needing no model: a builtin or local model reference
    (``check_model``, as the worker will; a hub id is left to ``fetch_base_weights``, which has the
    token), the object store of the run folder ``run_folder`` answers this task's credentials
    (``run.folder.check_store_access``), an SFT run's ``algorithm.sft_source`` exists and parses
    (``data.image_pairs.check_sft_source``), and ``algorithm.init_lora`` names a LoRA. Otherwise each would
    fail only inside training, after the model was fetched, and a store without credentials as a
    ``NoCredentialsError`` not naming the URI."""
    from diffusionrl.data import check_sft_source
    from diffusionrl.models.families import check_guidance_2, check_model, looks_like_path
    from diffusionrl.run import check_run_folder, check_store_access

    ref = cfg.model.name
    if ref.startswith("builtin:") or Path(ref).expanduser().exists() or looks_like_path(ref):  # no hub request
        check_model(ref, cfg.model.revision, cfg.sampling.num_frames)
        check_guidance_2(cfg, ref)
    if run_folder:
        check_run_folder(run_folder)
        check_store_access(run_folder, "checkpoint_dir")
    if cfg.algorithm.name == "sft":
        check_sft_source(cfg.algorithm.sft_source)
    if cfg.algorithm.init_lora:
        check_init_lora(str(cfg.algorithm.init_lora), cfg.model.lora_rank)
