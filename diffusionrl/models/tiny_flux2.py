"""``builtin:tiny-flux2``: a small FLUX.2 [dev] pipeline built in code, no download.

Real diffusers/transformers classes at a tiny width: Flux2Transformer2DModel (double- and
single-stream blocks, 4-axis RoPE over (t, h, w, l) ids, guidance embedding: guidance-distilled,
no CFG pass), AutoencoderKLFlux2 (32 latent channels, 8x compression, 2x2 patchified to 128
channels and batch-norm normalised by the pipeline), Mistral3ForConditionalGeneration as the text
encoder with 30 text layers, so the pipeline's default ``text_encoder_out_layers`` (10, 20, 30)
exist (a one-layer Pixtral vision tower it never uses), the byte-level BPE tokenizer of
``models/tiny_qwen_image.py`` with a Mistral-style chat template (the system message's words and
the template's markers as whole tokens, so the system prompt takes ~40 tokens, not hundreds of
bytes), and FLUX.2's FlowMatchEulerDiscreteScheduler (dynamic shift: the pipeline's empirical
``mu`` of the image token count and the step count). Each constructor runs right after
``torch.manual_seed(TINY_SEED + k)``.

``builtin:tiny-flux2-klein`` is FLUX.2 [klein] base's layout on the same transformer, VAE and scheduler:
Qwen3ForCausalLM (27 layers, for the pipeline's layers 9, 18, 27) with ``models/tiny_zimage.py``'s
tokenizer and Qwen3 chat template, no guidance embedding, ``is_distilled`` false (a CFG pass).

``models.save_builtin(ref, dir)`` writes a folder that ``Flux2Pipeline.from_pretrained(dir)`` (or
``Flux2KleinPipeline``) loads.
"""

from __future__ import annotations

import re

import torch

from .tiny import TINY_SEED, decoder_text_config, frozen, tiny_vae
from .tiny_qwen_image import build_qwen_tokenizer

TINY_FLUX2_REF = "builtin:tiny-flux2"
TINY_FLUX2_KLEIN_REF = "builtin:tiny-flux2-klein"
MARKERS = ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
# Mistral Small 3.1's layout of a system and a user turn; message contents are lists of text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% set text = message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)


def build_flux2_tokenizer():
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok = build_qwen_tokenizer()
    tok.add_tokens(MARKERS, special_tokens=True)
    tok.add_tokens(sorted(set(re.findall(r"\s?\S+", SYSTEM_MESSAGE))))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_flux2_components(klein: bool = False) -> dict:
    """All components of a tiny FLUX.2 [dev] pipeline (``klein``: FLUX.2 [klein] base: a Qwen3 text
    encoder of 27 layers for its layers 9, 18, 27, no guidance embedding), in eval mode, fp32, CPU."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    from .tiny_zimage import build_zimage_tokenizer

    tok = build_zimage_tokenizer() if klein else build_flux2_tokenizer()
    torch.manual_seed(TINY_SEED + (44 if klein else 41))
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        **decoder_text_config(len(tok), 16, 27, head_dim=8),
    )) if klein else Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", **decoder_text_config(len(tok), 16, 30, head_dim=8)),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=16),
        spatial_merge_size=1, image_token_index=len(tok) - 1,
    ))

    torch.manual_seed(TINY_SEED + 42)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=48,  # 3 text layers x hidden 16
        timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=not klein,
    )

    vae = tiny_vae(TINY_SEED + 43, AutoencoderKLFlux2, latent_channels=32)

    # FLUX.2 [dev]'s scheduler_config.json (the pipeline passes its empirical mu)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return frozen({"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tok,
                   "scheduler": scheduler})


def build_tiny_flux2_pipeline():
    from diffusers import Flux2Pipeline

    return Flux2Pipeline(**build_tiny_flux2_components())


def build_tiny_flux2_klein_pipeline():
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline(**build_tiny_flux2_components(klein=True), is_distilled=False)
