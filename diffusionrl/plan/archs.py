"""The real sizes the planner measures: each family's transformer config (as in the hub model's
``transformer/config.json``), its other GPU-resident modules (text encoders, VAE), the reward models
that run on a GPU, and how a config's resolution, frames and prompt length become tokens.

Nothing is downloaded: every module is built from its config on the ``meta`` device (shapes only)
to count parameters, or at one or two blocks on the CPU (``measure.py``) to count the bytes saved for
backward. A ``builtin:tiny-*`` model is read from its own builder (its config is the built one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# transformer/config.json of each hub model (keyword form of the diffusers class).
SD35_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
FLUX1_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
WAN21_T2V_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)

# The frozen modules each pipeline keeps beside the transformer (``FlowAdapter`` moves the whole
# pipeline to the device): (name, builder key) pairs, built on meta by ``module_params``.
CLIP_L = dict(kind="clip_text", hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, vocab_size=49408, max_position_embeddings=77)
CLIP_G = dict(kind="clip_text", hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, projection_dim=1280, vocab_size=49408, max_position_embeddings=77)
T5_XXL = dict(kind="t5", vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu")
UMT5_XXL = dict(kind="umt5", vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu")
QWEN25_VL_7B = dict(kind="qwen2_5_vl", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584))
SD3_VAE = dict(kind="vae_kl", block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16)
QWEN_VAE = dict(kind="vae_qwen")
WAN_VAE = dict(kind="vae_wan")
# PickScore_v1: CLIP ViT-H/14 (laion2B), kept on the GPU in fp16 by rewards/pickscore.py.
PICKSCORE = dict(kind="clip", text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                        num_attention_heads=16, vocab_size=49408),
                 vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                             patch_size=14, image_size=224), projection_dim=1024)
GPU_REWARDS = {"pickscore": PICKSCORE}  # the rest score on CPUs (OCR: onnxruntime; jpeg, geneval_mini: numpy)


@dataclass(frozen=True)
class FamilySpec:
    """One family's shapes: the diffusers transformer class, its real config, the block lists the
    activations scale with, and the frozen modules beside it."""

    family: str
    transformer_class: str
    config: dict
    blocks: tuple[str, ...]  # ModuleList attributes holding the repeated blocks
    layer_keys: tuple[str, ...]  # config keys giving each list's length
    others: dict = field(default_factory=dict)  # frozen module name -> meta-build spec

    def with_layers(self, counts: tuple[int, ...], base: dict | None = None) -> dict:
        """The config (``base`` or the real one) with each block list cut to ``counts``."""
        cfg = dict(base if base is not None else self.config)
        for key, n in zip(self.layer_keys, counts):
            cfg[key] = n
        if "dual_attention_layers" in cfg:
            cfg["dual_attention_layers"] = tuple(i for i in cfg["dual_attention_layers"] if i < cfg["num_layers"])
        return cfg

    def layers(self, config: dict | None = None) -> tuple[int, ...]:
        cfg = config if config is not None else self.config
        return tuple(int(cfg[k]) for k in self.layer_keys)

    def build(self, config: dict, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        import diffusers

        cls = getattr(diffusers, self.transformer_class)
        with torch.device(device):
            model = cls(**config)
        return model.to(dtype).eval().requires_grad_(False)


FAMILIES: dict[str, FamilySpec] = {
    "sd3": FamilySpec("sd3", "SD3Transformer2DModel", SD35_MEDIUM, ("transformer_blocks",), ("num_layers",),
                      {"text_encoder": CLIP_L, "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL, "vae": SD3_VAE}),
    "flux": FamilySpec("flux", "FluxTransformer2DModel", FLUX1_DEV, ("transformer_blocks", "single_transformer_blocks"),
                       ("num_layers", "num_single_layers"), {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL,
                                                             "vae": SD3_VAE}),
    "qwen-image": FamilySpec("qwen-image", "QwenImageTransformer2DModel", QWEN_IMAGE, ("transformer_blocks",),
                             ("num_layers",), {"text_encoder": QWEN25_VL_7B, "vae": QWEN_VAE}),
    "wan": FamilySpec("wan", "WanTransformer3DModel", WAN21_T2V_1_3B, ("blocks",), ("num_layers",),
                      {"text_encoder": UMT5_XXL, "vae": WAN_VAE}),
}
# Hub references whose sizes are these (model.name -> family); a builtin is read from its builder.
HUB_MODELS = {
    "stabilityai/stable-diffusion-3.5-medium": "sd3",
    "black-forest-labs/FLUX.1-dev": "flux",
    "Qwen/Qwen-Image": "qwen-image",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan",
}


def module_params(spec: dict) -> int:
    """Parameters of a frozen module built from ``spec`` on the meta device (no memory, no download)."""
    import transformers

    kind = spec["kind"]
    kw = {k: v for k, v in spec.items() if k != "kind"}
    with torch.device("meta"):
        if kind == "clip_text":
            model = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**kw))
        elif kind in ("t5", "umt5"):
            cls, conf = ((transformers.T5EncoderModel, transformers.T5Config) if kind == "t5"
                         else (transformers.UMT5EncoderModel, transformers.UMT5Config))
            model = cls(conf(**kw))
        elif kind == "qwen2_5_vl":
            vision = kw.pop("vision")
            conf = transformers.Qwen2_5_VLConfig(text_config=kw, vision_config=vision)
            model = transformers.Qwen2_5_VLForConditionalGeneration(conf)
        elif kind == "clip":
            conf = transformers.CLIPConfig(text_config=kw["text"], vision_config=kw["vision"],
                                           projection_dim=kw["projection_dim"])
            model = transformers.CLIPModel(conf)
        elif kind == "vae_kl":
            import diffusers

            n = len(kw["block_out_channels"])
            model = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * n,
                                            up_block_types=("UpDecoderBlock2D",) * n, **kw)
        elif kind in ("vae_qwen", "vae_wan"):
            import diffusers

            model = (diffusers.AutoencoderKLQwenImage() if kind == "vae_qwen" else diffusers.AutoencoderKLWan())
        else:
            raise ValueError(f"unknown module kind {kind!r}")
    return sum(p.numel() for p in model.parameters())


def tokens(family: str, config: dict, resolution: int, num_frames: int, max_sequence_length: int,
           vae_scale: int = 8, temporal_scale: int = 4) -> tuple[int, int]:
    """(image tokens, text tokens) of one sample's transformer forward."""
    latent = resolution // vae_scale
    if family == "sd3":
        p = config["patch_size"]
        return (latent // p) ** 2, 77 + max_sequence_length  # CLIP's 77 (padded) then T5's tokens
    if family in ("flux", "qwen-image"):
        return (latent // 2) ** 2, max_sequence_length  # 2x2 packing
    if family == "wan":
        _, ph, pw = config["patch_size"]
        frames = (num_frames - 1) // temporal_scale + 1
        return frames * (latent // ph) * (latent // pw), max_sequence_length
    raise ValueError(f"unknown family {family!r}")
