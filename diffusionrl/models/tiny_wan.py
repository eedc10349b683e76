"""``builtin:tiny-wan``: a small Wan2.1 text-to-video pipeline built in code, no download.

Real diffusers/transformers classes, Wan2.1-T2V's layout at a tiny width: WanTransformer3DModel
(patch ``(1, 2, 2)``, self-attention with RMS q/k norm across heads and 3-axis RoPE over frames,
rows and columns, cross-attention to the text, time-conditioned modulation), AutoencoderKLWan
(causal 3-D VAE: 4x temporal, 8x spatial compression, 16 latent channels, per-channel
``latents_mean``/``latents_std`` -- Wan2.1's own), UMT5EncoderModel, and
FlowMatchEulerDiscreteScheduler with Wan2.1's ``shift=3.0`` (the hub model ships a
``UniPCMultistepScheduler`` with ``flow_shift=3.0`` and flow sigmas; our engine only reads the
scheduler's sigmas and takes its own Euler/SDE steps, docs/architecture.md "Model families").
The tokenizer is the tiny T5 (sentencepiece-style) tokenizer of ``models/tiny.py``; each module is
constructed right after ``torch.manual_seed(TINY_SEED + k)``, so every machine with the same torch
version builds the same weights. 32 px x 5 frames -> latents ``[16, 2, 4, 4]``.

``builtin:tiny-wan22`` is Wan2.2 A14B's layout on the same components: a second transformer of the
same architecture with its own weights (``transformer_2``, the low-noise expert) and
``boundary_ratio`` 0.875 (Wan2.2-T2V-A14B's): ``transformer`` denoises at ``t >= 875``, ``transformer_2``
below.

``models.save_builtin(ref, dir)`` writes a folder that ``WanPipeline.from_pretrained(dir)`` loads.
"""

from __future__ import annotations

import torch

from .tiny import TINY_SEED, build_tokenizers, frozen, tiny_t5

TINY_WAN_REF = "builtin:tiny-wan"
TINY_WAN22_REF = "builtin:tiny-wan22"
WAN22_BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B's model_index.json


def build_tiny_wan_transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=24,  # RoPE axes: 8 (frames) + 8 (rows) + 8 (columns)
        in_channels=16,
        out_channels=16,
        text_dim=64,  # UMT5 d_model
        freq_dim=32,
        ffn_dim=96,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    )


def build_tiny_wan_components() -> dict:
    """All components of a tiny Wan2.1 T2V pipeline, in eval mode, fp32, CPU."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    _, t5_tok = build_tokenizers()
    umt5 = tiny_t5(TINY_SEED + 21, len(t5_tok), umt5=True)

    torch.manual_seed(TINY_SEED + 22)
    transformer = build_tiny_wan_transformer()

    torch.manual_seed(TINY_SEED + 23)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)

    return frozen({
        "transformer": transformer,
        "vae": vae,
        "text_encoder": umt5,
        "tokenizer": t5_tok,
        "scheduler": scheduler,
    })


def build_tiny_wan_pipeline():
    from diffusers import WanPipeline

    return WanPipeline(**build_tiny_wan_components())


def build_tiny_wan22_pipeline():
    from diffusers import WanPipeline

    torch.manual_seed(TINY_SEED + 24)
    transformer_2 = build_tiny_wan_transformer().eval().requires_grad_(False)
    return WanPipeline(**build_tiny_wan_components(), transformer_2=transformer_2,
                       boundary_ratio=WAN22_BOUNDARY_RATIO)
