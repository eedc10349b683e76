"""``load_bdlm``: a block-diffusion LM adapter from a builtin name, a saved folder or a hub id.

Above the model kinds (``model`` for the tiny BDLM and Hugging Face masked LMs, ``gemma`` for
DiffusionGemma, ``llada2`` for LLaDA2-style models), so that none of them imports another's loader.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from . import gemma
from .model import (
    MODEL_FILE,
    BDLMAdapter,
    HFMaskedLMAdapter,
    TinyBDLM,
    TinyBDLMAdapter,
    TinySpec,
    Vocab,
    build_tiny_bdlm,
)


def load_bdlm(name_or_dir: str | Path, model_cfg=None) -> BDLMAdapter:
    """``builtin:tiny-bdlm`` / ``builtin:tiny-diffusiongemma`` (need ``model_cfg``), a folder written
    by ``adapter.save``, or a DiffusionGemma hub id (at ``model_cfg.revision``, with ``$HF_TOKEN``)."""
    builders = {"builtin:tiny-bdlm": build_tiny_bdlm, gemma.BUILTIN: gemma.build_tiny_diffusiongemma,
                "builtin:tiny-llada2": lambda c: _llada2().build_tiny_llada2(c)}
    if str(name_or_dir) in builders:
        if model_cfg is None:
            raise ValueError(f"{name_or_dir} needs the model config (dimensions, init_seed)")
        return builders[str(name_or_dir)](model_cfg)
    directory = Path(name_or_dir)
    if not directory.exists() and "/" in str(name_or_dir) and not str(name_or_dir).startswith((".", "/")):
        revision = getattr(model_cfg, "revision", "")
        if getattr(model_cfg, "hub_family", "diffusiongemma") == "llada2":
            return _llada2().load_llada2(str(name_or_dir), revision)
        return gemma.load_diffusiongemma(str(name_or_dir), revision)
    if not (directory / MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"{directory} is not a bdlm model folder (no {MODEL_FILE}); use builtin:tiny-bdlm or a folder "
            "written by warm_start/train_grpo"
        )
    info = json.loads((directory / MODEL_FILE).read_text())
    vocab = Vocab(**info["vocab"])
    if info["kind"] == TinyBDLMAdapter.kind:
        module = TinyBDLM(TinySpec(**info["spec"]))
        module.load_state_dict(load_file(str(directory / "model.safetensors")))
        return TinyBDLMAdapter(module, vocab)
    if info["kind"] == gemma.KIND:
        return gemma.load_diffusiongemma(directory)
    if info["kind"] == "llada2":
        return _llada2().load_llada2(directory)
    if info["kind"] == HFMaskedLMAdapter.kind:
        from transformers import AutoModelForMaskedLM

        return HFMaskedLMAdapter(AutoModelForMaskedLM.from_pretrained(str(directory)), info["token_ids"], vocab)
    raise ValueError(f"{directory}: unknown bdlm model kind {info['kind']!r}")


def _llada2():
    from . import llada2  # imports diffusers: only when a LLaDA2 model is asked for

    return llada2
