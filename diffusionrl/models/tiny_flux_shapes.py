"""``builtin:tiny-flux-kontext-shapes``: a small FLUX.1 Kontext pipeline that edits shapes-world scenes.

The real diffusers/transformers classes behind ``FluxKontextPipeline``, sized for the shapes world at
64 px and built around the parts ``builtin:tiny-sd3-shapes`` (``models/tiny_shapes.py``) already
learned, which are loaded from its shipped file and stay frozen:
- its VAE (4x compression, 4 latent channels, its latent shift and scale): 16x16 latents, packed 2x2
  into 16-feature tokens, so 64 noisy tokens plus 64 reference (input image) tokens;
- its first CLIP encoder's text model as FLUX's ``CLIPTextModel`` (the pooled embedding: the EOS token's
  hidden state, 32 features) and its T5 encoder (the sequence, 64 features), with their tokenizers of
  the world's words. The edit verbs ("make", "turn", "remove", "add", "move", "the") are not among
  them and tokenize into characters: the longest instruction is 17 T5 and 30 CLIP tokens, so the CLIP
  tokenizer takes ``CLIP_MAX_LENGTH`` = 32 and a run ``model.max_sequence_length`` = ``MAX_SEQUENCE_LENGTH``.
The transformer is its own: a ``FluxTransformer2DModel`` of 2 double- and 4 single-stream blocks of width
128 (2.3 M parameters), without a guidance embedding (it is not guidance-distilled and samples CFG-free:
the guidance scale is not an input), trained by ``python -m diffusionrl.models.pretrain_edit`` on
training-split edits and shipped as ``KONTEXT_SHAPES_WEIGHTS`` (loaded when present; the scheduler's
shift is in its metadata). The scheduler is FLUX's flow-matching Euler with a static shift (3.0, the
shapes model's), not the resolution-dependent one tuned for 256-4096 image tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .tiny import build_tokenizers
from .tiny_shapes import SCHEDULER_SHIFT, SHAPES_SEED, SHAPES_WEIGHTS, WORDS, build_shapes_components

KONTEXT_SHAPES_REF = "builtin:tiny-flux-kontext-shapes"
KONTEXT_SHAPES_WEIGHTS = Path(__file__).with_name("tiny_flux_kontext_shapes.safetensors")
CLIP_MAX_LENGTH = 32
MAX_SEQUENCE_LENGTH = 20
TRANSFORMER = {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 32,
               "num_attention_heads": 4, "joint_attention_dim": 64, "pooled_projection_dim": 32,
               "guidance_embeds": False, "axes_dims_rope": (8, 12, 12)}


def build_transformer(**overrides):
    """The seeded, untrained transformer (``overrides``: smaller ones for tests)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(SHAPES_SEED + 30)
    return FluxTransformer2DModel(**{**TRANSFORMER, **overrides})


def build_kontext_shapes_components(weights: str | Path | None = KONTEXT_SHAPES_WEIGHTS,
                                    shapes_weights: str | Path = SHAPES_WEIGHTS, **overrides) -> dict:
    """All components, eval mode, fp32, CPU: the shapes model's frozen VAE and text encoders, and the
    transformer (``weights=None``, or a missing default file: its seeded initialisation)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from safetensors import safe_open
    from transformers import CLIPTextModel

    shapes = build_shapes_components(shapes_weights)
    clip = CLIPTextModel(shapes["text_encoder"].config)
    clip.load_state_dict({k.removeprefix("text_model."): v for k, v in shapes["text_encoder"].state_dict().items()
                          if k.startswith("text_model.")}, strict=True)  # all but the projection SD3 pools with
    clip_tok, t5_tok = build_tokenizers(WORDS, clip_max_length=CLIP_MAX_LENGTH)
    meta: dict = {}
    if weights is not None and (Path(weights).is_file() or Path(weights) != KONTEXT_SHAPES_WEIGHTS):
        with safe_open(str(weights), framework="pt") as fh:
            meta = json.loads(fh.metadata().get("diffusionrl", "{}"))
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        transformer = build_transformer(**{**meta.get("transformer", {}), **overrides})  # its size is in the file
        transformer.load_state_dict(tensors, strict=True)
    else:
        transformer = build_transformer(**overrides)
    components = {
        "transformer": transformer, "vae": shapes["vae"], "text_encoder": clip, "tokenizer": clip_tok,
        "text_encoder_2": shapes["text_encoder_3"], "tokenizer_2": t5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=float(meta.get("scheduler_shift", SCHEDULER_SHIFT))),
    }
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return components


def build_kontext_shapes_pipeline(weights: str | Path | None = KONTEXT_SHAPES_WEIGHTS, **overrides):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**build_kontext_shapes_components(weights, **overrides))
