"""``builtin:tiny-zimage``: a small Z-Image pipeline built in code, no download.

Real diffusers/transformers classes at a tiny width: ZImageTransformer2DModel (single-stream DiT:
noise and caption refiner blocks, then joint blocks over the unified image + caption sequence,
3-axis RoPE, 2x2 patches of the 16-channel latent, AdaLN on the timestep ``1 - sigma``),
AutoencoderKL with 16 latent channels, 8x spatial compression and Z-Image's (FLUX's) scaling and
shift factors, Qwen3Model as the text encoder (the pipeline takes its second-to-last hidden state
over a chat template, padding dropped), the byte-level BPE Qwen2Tokenizer of
``models/tiny_qwen_image.py`` with a Qwen3-style chat template, and Z-Image-Turbo's
FlowMatchEulerDiscreteScheduler (static shift 3). Each constructor runs right after
``torch.manual_seed(TINY_SEED + k)``.

``models.save_builtin(ref, dir)`` writes a folder that ``ZImagePipeline.from_pretrained(dir)`` loads.
"""

from __future__ import annotations

import torch

from .tiny import TINY_SEED, decoder_text_config, frozen, tiny_vae
from .tiny_qwen_image import build_qwen_tokenizer

TINY_ZIMAGE_REF = "builtin:tiny-zimage"
# Qwen3's chat template, reduced to what ZImagePipeline renders (one user turn, generation prompt;
# with enable_thinking=True Qwen3 adds nothing after "assistant\n").
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_zimage_tokenizer():
    tok = build_qwen_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_zimage_components() -> dict:
    """All components of a tiny Z-Image pipeline, in eval mode, fp32, CPU."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tok = build_zimage_tokenizer()
    torch.manual_seed(TINY_SEED + 31)
    text_encoder = Qwen3Model(Qwen3Config(**decoder_text_config(len(tok), 32, 3, head_dim=16)))

    torch.manual_seed(TINY_SEED + 32)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
    )

    vae = tiny_vae(TINY_SEED + 33, scaling_factor=0.3611, shift_factor=0.1159)

    # Z-Image-Turbo's scheduler_config.json: a static shift, no resolution-dependent one
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return frozen({"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tok,
                   "scheduler": scheduler})


def build_tiny_zimage_pipeline():
    from diffusers import ZImagePipeline

    return ZImagePipeline(**build_tiny_zimage_components())
