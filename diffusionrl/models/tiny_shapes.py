"""``builtin:tiny-sd3-shapes``: a small SD3-architecture pipeline pretrained on the shapes world.

The same real diffusers/transformers classes as ``builtin:tiny-sd3`` (SD3Transformer2DModel,
AutoencoderKL, two CLIPTextModelWithProjection, T5EncoderModel, FlowMatchEulerDiscreteScheduler), with
a vocabulary of the world's words (``diffusionrl.data.shapes``), sized for the world at 64 px: a VAE
with 4x spatial compression and 4 latent channels (16x16 latents: a world object spans 4-5 latent
cells, so its outline survives), a transformer of 6 joint blocks of width 128 (3.5 M parameters) on
64 image tokens (patch 2), and text encoders trained with it. ``build_shapes_components(weights=None)``
builds the modules from their seeded initialisation; with weights (the default: the file shipped in
this package, ``SHAPES_WEIGHTS``) it loads them. The weights are written by
``python -m diffusionrl.models.pretrain`` (VAE, then transformer and text encoders by flow matching,
exported as their EMA). The VAE's latent shift and scale and the scheduler's shift are stored in the
file's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .tiny import build_tokenizers, tiny_clip, tiny_t5

SHAPES_REF = "builtin:tiny-sd3-shapes"
SHAPES_SEED = 20260601
SHAPES_WEIGHTS = Path(__file__).with_name("tiny_sd3_shapes.safetensors")
SHAPES_RESOLUTION = 64
VAE_FACTOR = 4  # spatial compression: 64 px -> 16x16 latents
LATENT_CHANNELS = 4
SCHEDULER_SHIFT = 3.0  # the sigma shift when the weights' metadata names none
# Text tokens: T5 (model.max_sequence_length) and CLIP (its tokenizer's length, to which the pipeline
# pads). The longest world prompt is 10 T5 and 17 CLIP tokens (the in-code BPE splits some words into
# pieces); 24 + 16 text tokens beside 64 image tokens.
MAX_SEQUENCE_LENGTH = 16
CLIP_MAX_LENGTH = 24
WORDS = tuple("a of and left right above below one two three four circle circles square squares triangle "
              "triangles red green blue yellow".split())
TRAINED = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def _modules(clip_vocab: int, t5_vocab: int) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    modules: dict[str, torch.nn.Module] = {"text_encoder": tiny_clip(SHAPES_SEED + 1, clip_vocab),
                                           "text_encoder_2": tiny_clip(SHAPES_SEED + 2, clip_vocab),
                                           "text_encoder_3": tiny_t5(SHAPES_SEED + 3, t5_vocab)}
    torch.manual_seed(SHAPES_SEED + 4)
    modules["transformer"] = SD3Transformer2DModel(
        sample_size=SHAPES_RESOLUTION // VAE_FACTOR, patch_size=2, in_channels=LATENT_CHANNELS, num_layers=6,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
        pooled_projection_dim=64, out_channels=LATENT_CHANNELS, pos_embed_max_size=16)
    torch.manual_seed(SHAPES_SEED + 5)
    modules["vae"] = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 64), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=SHAPES_RESOLUTION, scaling_factor=1.0,
        shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False)
    return modules


def load_weights(modules: dict[str, torch.nn.Module], path: str | Path) -> dict:
    """Load a pretrain-written safetensors file into ``modules`` (strict), with the VAE's latent
    stats; returns the file's metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata().get("diffusionrl", "{}"))
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    for name in TRAINED:
        prefix = name + "."
        modules[name].load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                                      strict=True)
    modules["vae"].register_to_config(scaling_factor=float(meta["scaling_factor"]),
                                      shift_factor=float(meta["shift_factor"]))
    return meta


def build_shapes_components(weights: str | Path | None = SHAPES_WEIGHTS) -> dict:
    """All components of the shapes pipeline, eval mode, fp32, CPU; ``weights=None``: untrained."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    clip_tok, t5_tok = build_tokenizers(WORDS, clip_max_length=CLIP_MAX_LENGTH)
    modules = _modules(len(clip_tok), len(t5_tok))
    meta: dict = {}
    if weights is not None:
        if not Path(weights).is_file():
            raise FileNotFoundError(f"{weights}: the {SHAPES_REF} weights are missing; write them with "
                                    "`python -m diffusionrl.models.pretrain`")
        meta = load_weights(modules, weights)
    for module in modules.values():
        module.eval().requires_grad_(False)
    return {**modules, "tokenizer": clip_tok, "tokenizer_2": clip_tok, "tokenizer_3": t5_tok,
            "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                         shift=float(meta.get("scheduler_shift", SCHEDULER_SHIFT)))}


def build_shapes_pipeline(weights: str | Path | None = SHAPES_WEIGHTS):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(**build_shapes_components(weights))
