"""A peft LoRA folder as a diffusers LoRA folder: what the registered model's adapter is.

``pytorch_lora_weights.safetensors`` (written by the base model's pipeline class, whose LoRA loader's
key layout it then has, with the adapter metadata so rank and alpha survive) beside our own peft
folder under ``peft/`` (for re-evaluation and warm starts).

A LoRA on Wan2.2's two experts (``WanExperts``: peft names its layers ``high.*`` and ``low.*``) is one
file per expert it trained, as Wan2.2 LoRAs are shipped: ``high_noise_lora_weights.safetensors`` for the
pipeline's ``transformer`` (``pipe.load_lora_weights(folder, weight_name=...)``) and
``low_noise_lora_weights.safetensors`` for ``transformer_2`` (the same with ``load_into_transformer_2=True``),
each in ``WanPipeline``'s key layout with its expert's own targets in the metadata (``EXPERT_FILES``);
``adapter_files`` says which file goes on which component.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' load_lora_weights() reads
PEFT_SUBDIR = "peft"  # our own format, for re-evaluation and warm starts
# a two-expert LoRA (Wan2.2 A14B): expert (WanExperts' name) -> (pipeline component, diffusers LoRA file)
EXPERT_FILES = {"high": ("transformer", "high_noise_lora_weights.safetensors"),
                "low": ("transformer_2", "low_noise_lora_weights.safetensors")}
METADATA_KEYS = ("r", "lora_alpha", "target_modules", "init_lora_weights", "lora_dropout", "bias", "use_dora",
                 "use_rslora", "rank_pattern", "alpha_pattern")


def _expert_metadata(metadata: dict, expert: str, layers: dict) -> dict:
    """The adapter metadata of one expert's file: its own layers as the targets (peft records
    suffixes, some of them prefixed by an expert), rank and alpha patterns without the other expert's."""
    others = tuple(f"{e}." for e in EXPERT_FILES if e != expert)
    out = {k: ({p.removeprefix(f"{expert}."): v for p, v in value.items() if not p.startswith(others)}
               if isinstance(value, dict) else value) for k, value in metadata.items()}
    out["target_modules"] = sorted({k.split(".lora_")[0] for k in layers})
    return out


def diffusers_adapter_dir(peft_dir: str | Path, out: str | Path, pipeline_class: str = "StableDiffusion3Pipeline"
                          ) -> Path:
    """A LoRA folder both diffusers (``pytorch_lora_weights.safetensors`` with its adapter metadata,
    so rank and alpha survive, written by the base model's pipeline class: its LoRA loader's key
    layout; a two-expert LoRA: one file per expert, ``EXPERT_FILES``) and we (``peft/``) can load."""
    import diffusers
    from safetensors.torch import load_file

    peft_dir, out = Path(peft_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(peft_dir / "adapter_model.safetensors"))
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    metadata = {k: config[k] for k in METADATA_KEYS if k in config}
    parts = {ADAPTER_FILE: (state, metadata)}
    experts = [e for e in EXPERT_FILES if any(k.startswith(f"{e}.") for k in state)]
    if experts:  # WanExperts' layers: each expert's own file, names and targets without the expert's prefix
        layers = {e: {k.removeprefix(f"{e}."): v for k, v in state.items() if k.startswith(f"{e}.")} for e in experts}
        parts = {EXPERT_FILES[e][1]: (layers[e], _expert_metadata(metadata, e, layers[e])) for e in experts}
    for name, (layers, meta) in parts.items():
        getattr(diffusers, pipeline_class).save_lora_weights(str(out), transformer_lora_layers=layers,
                                                             weight_name=name, transformer_lora_adapter_metadata=meta)
    shutil.copytree(peft_dir, out / PEFT_SUBDIR, dirs_exist_ok=True)
    return out


def adapter_files(folder: str | Path) -> dict[str, str]:
    """The diffusers LoRA files of a folder ``diffusers_adapter_dir`` wrote: pipeline component -> file
    name (``{"transformer": ADAPTER_FILE}``, or a two-expert LoRA's ``transformer`` and/or ``transformer_2``)."""
    folder = Path(folder)
    experts = {component: name for component, name in EXPERT_FILES.values() if (folder / name).is_file()}
    return experts or {"transformer": ADAPTER_FILE}


def lora_experts(peft_dir: str | Path) -> list[str]:
    """The experts a peft LoRA's layers sit on (``high``, ``low``: a LoRA of Wan2.2's ``WanExperts``);
    [] for a LoRA of one transformer. Reads the tensor names only."""
    from safetensors import safe_open

    with safe_open(str(Path(peft_dir) / "adapter_model.safetensors"), framework="pt") as f:
        names = [k.removeprefix("base_model.model.") for k in f.keys()]
    return [e for e in EXPERT_FILES if any(n.startswith(f"{e}.") for n in names)]
