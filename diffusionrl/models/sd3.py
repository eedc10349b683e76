"""Model-family adapter for Stable Diffusion 3 / 3.5 (diffusers ``StableDiffusion3Pipeline``).

The trainer and the rollout engines talk to the model only through this interface: encode
prompts, predict a CFG velocity with a given transformer (the LoRA policy, the reference, or an
engine's copy), name the LoRA targets, decode latents to uint8 images, and give the sigma schedule.
A new family (Flux, ...) is one new file with the same methods.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from diffusionrl.trajectory import Conditioning

from .tiny import TINY_REF, build_tiny_sd3_pipeline
from .tiny_shapes import SHAPES_REF, build_shapes_pipeline

# The models built in code (no download): reference -> pipeline builder.
BUILTIN_PIPELINES = {TINY_REF: build_tiny_sd3_pipeline, SHAPES_REF: build_shapes_pipeline}

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# diffusers warns on every encode_prompt call that truncates a prompt, quoting the whole cut-off text
# (and transformers once per tokenizer); the adapter drops those records while it encodes and says it
# once itself (``warn_truncated``).
_TRUNCATION_LOGS = {  # logger -> how its truncation message starts
    "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3": "The following part of your input",
    "transformers.tokenization_utils_base": "Token indices sequence length is longer",
}


class _DropTruncationWarnings(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix, self.dropped = prefix, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(self.prefix):
            self.dropped += 1
            return False
        return True


@contextlib.contextmanager
def _truncation_warnings_dropped():
    filters = {name: _DropTruncationWarnings(prefix) for name, prefix in _TRUNCATION_LOGS.items()}
    for name, quiet in filters.items():
        logging.getLogger(name).addFilter(quiet)
    try:
        yield filters
    finally:
        for name, quiet in filters.items():
            logging.getLogger(name).removeFilter(quiet)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def hf_token() -> str | None:
    """The Hugging Face token from the environment (never logged; see tracking for redaction)."""
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def load_sd3_pipeline(reference: str, revision: str = "", dtype: str = "float32"):
    """A ``StableDiffusion3Pipeline`` from a built-in model (``builtin:tiny-sd3``,
    ``builtin:tiny-sd3-shapes``), a local folder or a hub id.

    Hub ids are loaded with ``revision`` and ``HF_TOKEN`` (SD3.5 is gated). Under
    ``HF_HUB_OFFLINE=1`` only the local cache is consulted.
    """
    from diffusers import StableDiffusion3Pipeline

    torch_dtype = DTYPES[dtype]
    if reference in BUILTIN_PIPELINES:
        pipe = BUILTIN_PIPELINES[reference]()
        return pipe.to(dtype=torch_dtype) if torch_dtype != torch.float32 else pipe
    if reference.startswith("builtin:"):
        raise ValueError(f"unknown builtin model {reference!r}; the built-in image models are "
                         f"{', '.join(BUILTIN_PIPELINES)}")
    path = Path(reference).expanduser()
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise ValueError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
        return StableDiffusion3Pipeline.from_pretrained(str(path), torch_dtype=torch_dtype)
    return StableDiffusion3Pipeline.from_pretrained(
        reference, revision=revision or None, token=hf_token(), torch_dtype=torch_dtype
    )


def module_digest(modules: dict[str, torch.nn.Module]) -> str:
    """sha256 over every named tensor (name, dtype, shape, bytes) of the given modules."""
    h = hashlib.sha256()
    for prefix in sorted(modules):
        for name, tensor in sorted(modules[prefix].state_dict().items()):
            t = tensor.detach().cpu().contiguous()
            h.update(f"{prefix}.{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class SD3Adapter:
    """Stable Diffusion 3 behind the small interface the engines and the trainer use."""

    family = "sd3"

    def __init__(self, pipe, device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None):
        self.pipe = pipe.to(device)
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.eval().requires_grad_(False)
        self._digest: str | None = None
        self._truncation_warned = False

    @classmethod
    def from_config(cls, model_cfg, mixed_precision: str = "no") -> SD3Adapter:
        device = resolve_device(model_cfg.device)
        pipe = load_sd3_pipeline(model_cfg.name, model_cfg.revision, model_cfg.dtype)
        autocast = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]
        return cls(pipe, device=device, autocast_dtype=autocast)

    # -- components ---------------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def scheduler(self):
        return self.pipe.scheduler

    def digest(self) -> str:
        """Content digest of the base weights (all components), cached."""
        if self._digest is None:
            mods = {
                n: getattr(self.pipe, n)
                for n in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
                if getattr(self.pipe, n, None) is not None
            }
            self._digest = module_digest(mods)
        return self._digest

    def lora_targets(self, suffixes: list[str]) -> list[str]:
        """Full module names of the transformer's linear layers that end with one of ``suffixes``."""
        # In SD3's last block (context_pre_only) the text tokens' outputs are discarded, so the
        # text-query projection there cannot change the prediction: its gradient is exactly 0.
        # An adapter on it would be dead weight (it never trains), so it is left out.
        dead = {
            f"transformer_blocks.{i}.attn.add_q_proj"
            for i, block in enumerate(self.transformer.transformer_blocks)
            if getattr(block, "context_pre_only", False)
        }
        names = [
            name
            for name, module in self.transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and any(name.endswith(s) for s in suffixes) and name not in dead
        ]
        if not names:
            raise ValueError(f"no transformer module matches the LoRA targets {suffixes}")
        return names

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        factor = 2 ** (len(self.pipe.vae.config.block_out_channels) - 1)
        return (self.transformer.config.in_channels, resolution // factor, resolution // factor)

    def schedule(self, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's own shifted ``sigmas [T+1]`` and ``timesteps [T]``, float32, CPU."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = scheduler.sigmas.detach().to(torch.float32).clone()
        timesteps = scheduler.timesteps.detach().to(torch.float32).clone()
        if sigmas.shape[0] != num_steps + 1 or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"scheduler gave {sigmas.shape[0]} sigmas ending in {float(sigmas[-1])}; expected T+1 ending in 0"
            )
        return sigmas, timesteps

    # -- text -----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], negative_prompt: str | None, max_sequence_length: int
    ) -> Conditioning:
        """Embeddings for each prompt (each distinct prompt encoded once) and, if
        ``negative_prompt`` is not None, the negative prompt's, expanded to the batch."""
        position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        unique = list(position)
        index = torch.tensor([position[p] for p in prompts], device=self.device)
        embeds, pooled = self._encode(unique, max_sequence_length)
        cond = Conditioning(embeds.index_select(0, index), pooled.index_select(0, index))
        if negative_prompt is not None:
            neg, neg_pooled = self._encode([negative_prompt], max_sequence_length)
            b = len(prompts)
            cond.negative_prompt_embeds = neg.expand(b, *neg.shape[1:]).contiguous()
            cond.negative_pooled_embeds = neg_pooled.expand(b, *neg_pooled.shape[1:]).contiguous()
        return cond

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's (no-CFG) prompt and pooled embeddings of ``texts``; diffusers' per-call
        truncation warnings are replaced by ``warn_truncated``'s single one."""
        with _truncation_warnings_dropped() as dropped:
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=texts,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=False,
                max_sequence_length=max_sequence_length,
            )
        if any(quiet.dropped for quiet in dropped.values()):
            self.warn_truncated(texts, max_sequence_length)
        return embeds, pooled

    def warn_truncated(self, prompts: list[str], max_sequence_length: int) -> int:
        """Warn once (per adapter) about the prompts the text encoders cut short: CLIP takes its
        ``tokenizer_max_length`` tokens, T5 ``max_sequence_length``. The training loop calls it on
        all prompts once the model is loaded; ``encode_prompts`` calls it if diffusers reports a
        truncation first. Returns how many of ``prompts`` are truncated."""
        if self._truncation_warned:
            return 0
        unique = list(dict.fromkeys(prompts))
        clip_limit = self.pipe.tokenizer_max_length
        limits = [(self.pipe.tokenizer, clip_limit, f"CLIP takes {clip_limit} tokens")]
        if getattr(self.pipe, "tokenizer_3", None) is not None:
            limits.append((self.pipe.tokenizer_3, max_sequence_length,
                           f"T5 model.max_sequence_length={max_sequence_length}"))
        long: dict[str, None] = {}
        hit = []
        for tokenizer, limit, what in limits:
            if tokenizer is None:
                continue
            ids = tokenizer(unique, verbose=False).input_ids  # verbose=False: no "longer than maximum" warning
            over = [p for p, i in zip(unique, ids) if len(i) > limit]
            if over:
                hit.append(what)
                long.update(dict.fromkeys(over))
        if long:
            self._truncation_warned = True
            longest = max(long, key=len)
            log.warning("%d of %d prompts are longer than the text encoders take and are truncated (%s), e.g. a "
                        "prompt of %d characters starting %r; this is reported once", len(long), len(unique),
                        "; ".join(hit), len(longest), longest[:60])
        return len(long)

    # -- velocity -------------------------------------------------------------------------------
    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float,
    ) -> torch.Tensor:
        """CFG velocity in float32: one forward on ``[x; x]`` with ``[negative; positive]``."""
        cfg = guidance_scale != 1.0
        if cfg and cond.negative_prompt_embeds is None:
            raise ValueError(f"guidance_scale={guidance_scale} needs negative embeddings in the conditioning")
        x = latents
        embeds, pooled = cond.prompt_embeds, cond.pooled_embeds
        if cfg:
            x = torch.cat([latents, latents])  # [2B, C, H, W]
            embeds = torch.cat([cond.negative_prompt_embeds, embeds])
            pooled = torch.cat([cond.negative_pooled_embeds, pooled])
        dtype = transformer.dtype if self.autocast_dtype is None else self.autocast_dtype
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1)
        t = t.expand(x.shape[0]) if t.numel() == 1 else (torch.cat([t, t]) if cfg else t)
        with self.autocast():
            out = transformer(
                hidden_states=x.to(self.device, dtype),
                timestep=t,
                encoder_hidden_states=embeds.to(dtype),
                pooled_projections=pooled.to(dtype),
                return_dict=False,
            )[0]
        out = out.float()
        if not cfg:
            return out
        v_neg, v_pos = out.chunk(2)
        return v_neg + guidance_scale * (v_pos - v_neg)

    # -- images ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, images: np.ndarray) -> torch.Tensor:
        """uint8 images ``[B, H, W, 3]`` -> clean latents ``[B, C, H/f, W/f]`` float32 (the VAE posterior's
        mode, shifted and scaled as ``decode`` undoes)."""
        vae = self.pipe.vae
        x = torch.as_tensor(np.asarray(images), device=self.device).permute(0, 3, 1, 2).to(vae.dtype) / 127.5 - 1
        z = vae.encode(x).latent_dist.mode()
        return ((z.float() - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Clean latents ``[B, C, H, W]`` -> uint8 images ``[B, H*f, W*f, 3]``."""
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z, return_dict=False)[0].float()
        image = (image / 2 + 0.5).clamp(0, 1)
        return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()
