"""A peft LoRA folder as a diffusers LoRA folder: what the registered model's adapter is.

``pytorch_lora_weights.safetensors`` (written by the base model's pipeline class, whose LoRA loader's
key layout it then has, with the adapter metadata so rank and alpha survive) beside our own peft
folder under ``peft/`` (for re-evaluation and warm starts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' load_lora_weights() reads
PEFT_SUBDIR = "peft"  # our own format, for re-evaluation and warm starts


def diffusers_adapter_dir(peft_dir: str | Path, out: str | Path, pipeline_class: str = "StableDiffusion3Pipeline"
                          ) -> Path:
    """A LoRA folder both diffusers (``pytorch_lora_weights.safetensors`` with its adapter metadata,
    so rank and alpha survive, written by the base model's pipeline class: its LoRA loader's key
    layout) and we (``peft/``) can load."""
    import diffusers
    from safetensors.torch import load_file

    peft_dir, out = Path(peft_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(peft_dir / "adapter_model.safetensors"))
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    if any(k.startswith(("high.", "low.")) for k in state):
        from diffusionrl.errors import UserError

        raise UserError(f"{peft_dir}: a LoRA on Wan2.2's two experts (high./low. layers) has no diffusers LoRA file "
                        "yet (WanPipeline's holds one transformer's layers), so it cannot be registered; use the peft "
                        "folder (PeftModel on WanAdapter's WanExperts)")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    metadata = {k: config[k] for k in ("r", "lora_alpha", "target_modules", "init_lora_weights", "lora_dropout",
                                        "bias", "use_dora", "use_rslora", "rank_pattern", "alpha_pattern")
                if k in config}
    getattr(diffusers, pipeline_class).save_lora_weights(str(out), transformer_lora_layers=state,
                                                         weight_name=ADAPTER_FILE,
                                                         transformer_lora_adapter_metadata=metadata)
    shutil.copytree(peft_dir, out / PEFT_SUBDIR, dirs_exist_ok=True)
    return out
