"""``builtin:tiny-flux``: a small FLUX.1-architecture pipeline built in code, no download.

Real diffusers/transformers classes, FLUX.1-dev's layout at a tiny width: FluxTransformer2DModel
with guidance embedding (guidance-distilled, no CFG), double- and single-stream blocks and 3-axis
RoPE over txt_ids/img_ids; AutoencoderKL with 16 latent channels, 8x spatial compression and
FLUX's scaling/shift factors (latents packed 2x2 into 64-channel tokens); CLIPTextModel (pooled)
and T5EncoderModel; FlowMatchEulerDiscreteScheduler with FLUX.1-dev's resolution-dependent
(dynamic) shift. Tokenizers, text encoders and the VAE come from ``models/tiny.py``; each
constructor runs right after ``torch.manual_seed(TINY_SEED + k)``, so the weights are the same
on every machine with the same torch version.

``models.save_builtin(ref, dir)`` writes a folder that ``FluxPipeline.from_pretrained(dir)`` loads.
``builtin:tiny-flux-kontext`` is the same components behind ``FluxKontextPipeline`` (image editing).
"""

from __future__ import annotations

import torch

from .tiny import TINY_SEED, build_tokenizers, frozen, tiny_clip, tiny_t5, tiny_vae

TINY_FLUX_REF = "builtin:tiny-flux"
TINY_FLUX_KONTEXT_REF = "builtin:tiny-flux-kontext"  # the same components behind FluxKontextPipeline


def build_tiny_flux_components() -> dict:
    """All components of a tiny FLUX.1 pipeline, in eval mode, fp32, CPU."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip_tok, t5_tok = build_tokenizers()
    clip = tiny_clip(TINY_SEED + 11, len(clip_tok), projection=False)
    t5 = tiny_t5(TINY_SEED + 12, len(t5_tok))

    torch.manual_seed(TINY_SEED + 13)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels x a 2x2 patch
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=64,  # T5 d_model
        pooled_projection_dim=32,  # CLIP hidden size
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )

    vae = tiny_vae(TINY_SEED + 14, scaling_factor=0.3611, shift_factor=0.1159)

    # FLUX.1-dev's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )

    return frozen({
        "transformer": transformer,
        "vae": vae,
        "text_encoder": clip,
        "tokenizer": clip_tok,
        "text_encoder_2": t5,
        "tokenizer_2": t5_tok,
        "scheduler": scheduler,
    })


def build_tiny_flux_pipeline():
    from diffusers import FluxPipeline

    return FluxPipeline(**build_tiny_flux_components())


def build_tiny_flux_kontext_pipeline():
    """``builtin:tiny-flux-kontext``: FLUX.1 Kontext's pipeline (image editing) over the tiny FLUX.1
    components; Kontext-dev has FLUX.1-dev's architecture, its input image enters as extra tokens."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**build_tiny_flux_components())
