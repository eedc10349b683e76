"""``builtin:tiny-sd3``: a small SD3-architecture pipeline built in code, no download.

Real diffusers/transformers classes (SD3Transformer2DModel, AutoencoderKL with SD3's 16 latent
channels and 8x spatial compression, two CLIPTextModelWithProjection, T5EncoderModel,
FlowMatchEulerDiscreteScheduler with shift 3.0), tokenizers built from an in-code vocabulary.
Each constructor runs right after ``torch.manual_seed(TINY_SEED + k)``, so every machine with the
same torch version builds the same weights. About 0.6 M parameters.

The parts the tiny builtins share are built here, once: the tokenizers (``build_tokenizers``), the
CLIP and T5 text encoders (``tiny_clip``, ``tiny_t5``), the config of a decoder-LM text encoder
(``decoder_text_config``: Qwen2.5-VL, Qwen3, Mistral), the 8x VAE with its faithful decoder
(``tiny_vae``) and the frozen components (``frozen``); each family's ``tiny_<family>.py`` adds its
transformer, scheduler and seeds.

``save_tiny_sd3(dir)`` writes a normal diffusers folder that
``StableDiffusion3Pipeline.from_pretrained(dir)`` (and SGLang's SD3 runtime) loads.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SEED = 20241129
TINY_REF = "builtin:tiny-sd3"

# Words that get a single token in the tiny T5 vocabulary (the built-in prompt generators use them);
# anything else falls back to characters.
WORDS: tuple[str, ...] = tuple(
    "a an the of on in with and at by to from for is photo picture painting drawing sign poster label "
    "red green blue yellow orange purple pink black white brown gray golden silver small large tiny big "
    "old new bright dark shiny wooden metal glass paper stone cat dog bird fish horse car bus bike boat "
    "tree flower house city street beach forest mountain river lake sky cloud sun moon star apple banana "
    "cake cup bottle book chair table lamp clock door window shirt hat shoe bag box ball robot castle "
    "bridge garden field desert snow rain night morning evening text word says saying written that reads "
    "neon store shop cafe menu board screen wall t-shirt mug card banner"
    .split()
)


def _clip_vocab(words: tuple[str, ...] = WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = sorted(set(bytes_to_unicode().values()))
    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for c in chars:
        vocab.setdefault(c + "</w>", len(vocab))
    # A few merges so common words are short; the rest tokenizes per character.
    merges: list[tuple[str, str]] = []
    for word in words:
        if not word.isalpha():
            continue
        piece = word[0]
        for i, ch in enumerate(word[1:], start=1):
            last = i == len(word) - 1
            right = ch + "</w>" if last else ch
            merged = piece + right
            if merged not in vocab:
                merges.append((piece, right))
                vocab[merged] = len(vocab)
            piece = merged
    return vocab, merges


def _t5_vocab(words: tuple[str, ...] = WORDS) -> list[tuple[str, float]]:
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    seen = {v for v, _ in vocab}
    for word in words:
        piece = "\u2581" + word
        if piece not in seen:
            vocab.append((piece, -3.0))
            seen.add(piece)
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-:;()&":
        for piece in (ch, "\u2581" + ch):
            if piece not in seen:
                vocab.append((piece, -8.0))
                seen.add(piece)
    return vocab


def build_tokenizers(words: tuple[str, ...] = WORDS, clip_max_length: int = 77):
    """CLIP and T5 tokenizers in which each of ``words`` is one token (others: characters); the
    pipeline pads CLIP embeddings to ``clip_max_length`` tokens."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab, merges = _clip_vocab(tuple(words))
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=clip_max_length)
    t5 = T5Tokenizer(vocab=_t5_vocab(tuple(words)), extra_ids=0, model_max_length=512)
    return clip, t5


@torch.no_grad()
def make_decoder_faithful(vae) -> None:
    """Make the randomly initialised decoder show its latent instead of its own texture.

    A freshly initialised 4-stage decoder paints nearly the same high-frequency texture over any
    latent (its biases and random upsampling convolutions dominate), so image rewards could
    barely be moved by the transformer. Deterministic edits after the seeded init: residual
    branches damped to 0.1 (resnets close to identity), upsampling convolutions set to the
    identity kernel, decoder biases zeroed. The decoder then behaves like a smooth, nonlinear
    "latent -> RGB" upsampler: smooth latents give flat images, noisy latents busy ones.
    """
    for name, module in vae.decoder.named_modules():
        if not isinstance(module, torch.nn.Conv2d):
            continue
        if "resnets" in name and name.rsplit(".", 1)[-1] in ("conv1", "conv2"):
            module.weight.mul_(0.1)
        if "upsamplers" in name:
            kernel = torch.zeros_like(module.weight)
            channels = kernel.shape[0]
            kernel[range(channels), range(channels), 1, 1] = 1.0
            module.weight.copy_(kernel)
        if module.bias is not None:
            module.bias.zero_()


# -- the tiny builtins' shared parts (each family's tiny_<family>.py takes them from here) ---------
def tiny_clip(seed: int, vocab_size: int, projection: bool = True):
    """A 2-layer, 32-wide CLIP text encoder (``CLIPTextModelWithProjection``, or ``CLIPTextModel``
    without ``projection``), built right after ``torch.manual_seed(seed)``."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        hidden_act="gelu",
    ))


def tiny_t5(seed: int, vocab_size: int, umt5: bool = False):
    """A 2-layer, 64-wide T5 encoder (``T5EncoderModel``, or Wan's ``UMT5EncoderModel``), built right
    after ``torch.manual_seed(seed)``."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    torch.manual_seed(seed)
    return model_class(config_class(
        vocab_size=vocab_size, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    ))


def decoder_text_config(vocab_size: int, hidden_size: int, num_hidden_layers: int, **extra) -> dict:
    """The text config of a tiny decoder-only LM text encoder (Qwen2.5-VL, Qwen3, Mistral): 2 heads,
    1 key-value head, MLP twice the width, token 0 as bos/eos/pad; ``extra`` adds to it."""
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1, **extra,
                max_position_embeddings=2048, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tiny_vae(seed: int, vae_class=None, **config):
    """A 4-stage, 8x VAE (``vae_class``: diffusers' ``AutoencoderKL`` unless given, e.g.
    ``AutoencoderKLFlux2``) with 16 latent channels unless ``config`` says otherwise, built right after
    ``torch.manual_seed(seed)``, its decoder made faithful (``make_decoder_faithful``)."""
    if vae_class is None:
        from diffusers import AutoencoderKL as vae_class
    torch.manual_seed(seed)
    vae = vae_class(**{
        "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (16, 16, 32, 32), "layers_per_block": 1,
        "latent_channels": 16, "norm_num_groups": 8, "sample_size": 64, "use_quant_conv": False,
        "use_post_quant_conv": False, "mid_block_add_attention": False, **config,
    })
    make_decoder_faithful(vae)
    return vae


def frozen(components: dict) -> dict:
    """``components`` with every module in eval mode and without gradients (a pipeline's components)."""
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return components


def build_tiny_sd3_components() -> dict:
    """All components of a tiny SD3 pipeline, in eval mode, fp32, CPU."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    clip_tok, t5_tok = build_tokenizers()
    text_encoder = tiny_clip(TINY_SEED + 1, len(clip_tok))
    text_encoder_2 = tiny_clip(TINY_SEED + 2, len(clip_tok))
    t5 = tiny_t5(TINY_SEED + 3, len(t5_tok))

    torch.manual_seed(TINY_SEED + 4)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=64,
        pooled_projection_dim=64,
        out_channels=16,
        pos_embed_max_size=32,
    )

    vae = tiny_vae(TINY_SEED + 5, scaling_factor=1.5305, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return frozen({
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": clip_tok,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": clip_tok,
        "text_encoder_3": t5,
        "tokenizer_3": t5_tok,
        "scheduler": scheduler,
    })


def build_tiny_sd3_pipeline():
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(**build_tiny_sd3_components())


def save_tiny_sd3(directory: str | Path) -> Path:
    """Write ``builtin:tiny-sd3`` as a diffusers folder (safetensors weights, JSON configs)."""
    directory = Path(directory)
    from .truncation import no_progress_bars

    with no_progress_bars():
        build_tiny_sd3_pipeline().save_pretrained(directory, safe_serialization=True)
    return directory
