"""``builtin:tiny-qwen-image``: a small Qwen-Image pipeline built in code, no download.

Real diffusers/transformers classes at a tiny width: QwenImageTransformer2DModel (double-stream
MMDiT on 2x2-packed tokens, 3-axis RoPE from ``img_shapes`` and text lengths, no guidance
embedding: true CFG), AutoencoderKLQwenImage (the causal video VAE, 16 latent channels, 8x
spatial compression, per-channel latents mean/std), Qwen2_5_VLForConditionalGeneration as the text
encoder (its last hidden state over the prompt template, the template's 34 leading tokens
dropped; a one-block vision tower it never uses), a byte-level BPE Qwen2Tokenizer built from
``models/tiny.py``'s word list, and FlowMatchEulerDiscreteScheduler with Qwen-Image's dynamic
shift (base 0.5, max 0.9 over 256..8192 tokens, terminal 0.02). Each constructor runs right after
``torch.manual_seed(TINY_SEED + k)``.

``models.save_builtin(ref, dir)`` writes a folder that ``QwenImagePipeline.from_pretrained(dir)`` loads.
"""

from __future__ import annotations

import torch

from .tiny import TINY_SEED, WORDS, decoder_text_config, frozen

TINY_QWEN_IMAGE_REF = "builtin:tiny-qwen-image"
SPECIAL = ["<|im_start|>", "<|im_end|>"]  # the prompt template's markers: one token each
# The words of QwenImagePipeline's prompt template as whole tokens (added tokens, matched before BPE):
# the template's prefix is then 34 tokens, as with the real tokenizer (the pipeline drops exactly 34
# leading positions; ``check_template_prefix``).
TEMPLATE_WORDS = ["system", "user", "assistant", "Describe"] + [" " + w for w in (
    "the image by detailing color shape size texture quantity text spatial relationships of objects and "
    "background").split()]


def build_qwen_tokenizer(template_words: list[str] = TEMPLATE_WORDS, special: list[str] = SPECIAL):
    """Byte-level BPE over the 256 byte symbols, with merges along the tiny vocabulary's words (with
    and without a leading space, ``Ġ``; where merges of several words compete a word may take a few
    tokens), the template's markers (``special``) as special tokens and its words as added tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab: dict[str, int] = {"<|endoftext|>": 0}
    for c in sorted(set(bytes_to_unicode().values())):
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        for symbols in (word, "\u0120" + word):  # left to right: each merge joins the piece so far and a symbol
            piece = symbols[0]
            for ch in symbols[1:]:
                merged = piece + ch
                if merged not in vocab:
                    merges.append((piece, ch))
                    vocab[merged] = len(vocab)
                piece = merged
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.add_tokens(template_words)
    return tok


def check_template_prefix(pipe) -> None:
    """The pipeline drops ``prompt_template_encode_start_idx`` leading positions: they must be exactly
    the template's prefix, else prompts would be cut or the system text kept. The prefix ends where the prompt
    or the picture's vision tokens begin (``QwenImageEditPipeline``'s template puts them before the prompt)."""
    prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
    n = len(pipe.tokenizer(prefix).input_ids)
    if n != pipe.prompt_template_encode_start_idx:
        raise ValueError(f"the tiny Qwen tokenizer makes the prompt template's prefix {n} tokens; the pipeline drops "
                         f"{pipe.prompt_template_encode_start_idx}")


def build_tiny_qwen_image_components() -> dict:
    """All components of a tiny Qwen-Image pipeline, in eval mode, fp32, CPU."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = build_qwen_tokenizer()
    torch.manual_seed(TINY_SEED + 21)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=decoder_text_config(len(tok), 32, 2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
    ))

    torch.manual_seed(TINY_SEED + 22)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )

    torch.manual_seed(TINY_SEED + 23)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)

    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return frozen({"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tok,
                   "scheduler": scheduler})


def build_tiny_qwen_image_pipeline():
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(**build_tiny_qwen_image_components())
    check_template_prefix(pipe)
    return pipe
