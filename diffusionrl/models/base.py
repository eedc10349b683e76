"""What every model-family adapter shares (``FlowAdapter``): the seam between a diffusers
flow-matching pipeline and the engines, objectives, evaluation and registry.

The rest of the library talks to a model only through an adapter's methods: encode prompts
(``encode_prompts`` -> ``Conditioning``), predict a velocity with a given transformer
(``velocity``: the LoRA policy, the reference, or an engine's copy), name the LoRA targets, decode
latents to uint8 images (and encode images for SFT), give the sigma schedule of a resolution, the
latent shape of a resolution, whether a guidance scale needs negative-prompt embeddings
(``needs_negative``), and a digest of the base weights. Latents are always the VAE's spatial
latents ``[B, C, H/f, W/f]`` in float32 (a family that packs them, as FLUX does, packs inside
``velocity``), or for a video family (``video = True``, e.g. Wan) its ``[B, C, F', H/f, W/f]``
(``sample_shape``), so trajectories, the SDE step and the Parquet schema are family-independent
(they reduce over all non-batch dims).

A family subclasses ``FlowAdapter`` in ``models/<family>.py`` (class attributes ``family``,
``pipeline_class``, ``builtin``, ``components``, how its CFG pass runs: ``cfg_mode``,
``cfg_negative_first``, ``cfg_norm_rescale``; methods ``_encode`` and ``_forward``, the one
transformer call under ``velocity``'s template, and where it differs ``_unpack`` / ``latent_shape``
/ ``_timestep_kwargs`` / ``needs_negative``) and is listed in ``models/families.py``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging

import numpy as np
import torch

from diffusionrl.hub import hf_token  # noqa: F401  (models.sd3 and serving.video_model import it from here)
from diffusionrl.trajectory import Conditioning

from .lora import LoraTargets
from .textside import TextSide
from .truncation import truncation_warnings_dropped

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def dtype_kwargs(dtype: torch.dtype) -> dict:
    """A pipeline ``from_pretrained``'s dtype argument under the name this diffusers reads:
    ``dtype`` where diffusers has renamed it (0.42 turns ``torch_dtype`` into a FutureWarning on every
    load; ``deprecation_utils._resolve_dtype`` is what maps the old name), else ``torch_dtype``."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def module_digest(modules: dict[str, torch.nn.Module]) -> str:
    """sha256 over every named tensor (name, dtype, shape, bytes) of the given modules."""
    h = hashlib.sha256()
    for prefix in sorted(modules):
        for name, tensor in sorted(modules[prefix].state_dict().items()):
            t = tensor.detach().cpu().contiguous()
            h.update(f"{prefix}.{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            # reshape(-1): the same bytes, and 0-d tensors too (a BatchNorm's num_batches_tracked)
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class FlowAdapter(LoraTargets):
    """A diffusers flow-matching pipeline behind the library's interface; ``models.load_adapter`` picks the family.

    Args:
        pipe (`diffusers.DiffusionPipeline`): the family's pipeline; its ``components`` are frozen.
        device (`torch.device` or `str`, *optional*, defaults to ``"cpu"``): where the pipeline runs.
        autocast_dtype (`torch.dtype`, *optional*, defaults to `None`): the forward's autocast dtype (`None`: none).
    """

    family = ""  # short name (logs, bench/families.py)
    pipeline_class = ""  # diffusers pipeline class name, as in model_index.json's _class_name
    builtin = ""  # the builtin:tiny-<family> reference
    components: tuple[str, ...] = ()  # the pipeline's modules (frozen, eval mode, digested)
    pipeline_logger = ""  # the diffusers pipeline module whose truncation warnings are replaced
    video = False  # True: samples are videos (latents [C, F', H, W], decoded frames [F, H, W, 3])
    editing = False  # True: samples edit the prompt row's input image (``references.EditingReferences``)

    def __init__(self, pipe, device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None):
        self.pipe = pipe.to(device)
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        for name in self.components:
            module = getattr(pipe, name, None)
            if module is not None:
                module.eval().requires_grad_(False)
        self._digest: str | None = None
        self._truncation_warned = False
        self.log = logging.getLogger(type(self).__module__)

    @staticmethod
    def build_tiny():
        """The family's ``builtin`` pipeline, built in code (fp32, CPU)."""
        raise NotImplementedError

    @classmethod
    def builtins(cls) -> dict:
        """The family's built-in models: reference -> builder of its pipeline (fp32, CPU). One by
        default (``builtin``); a family with pretrained tiny models adds theirs."""
        return {cls.builtin: cls.build_tiny}

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
            mods = {n: getattr(self.pipe, n) for n in self.components if getattr(self.pipe, n, None) is not None}
            self._digest = module_digest(mods)
        return self._digest

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.pipe.vae.config.block_out_channels) - 1)

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        """``(C, H, W)`` of one sample's spatial latent at ``resolution`` pixels."""
        f = self.vae_scale_factor
        return (self.transformer.config.in_channels, resolution // f, resolution // f)

    def sample_shape(self, resolution: int, num_frames: int = 1) -> tuple[int, ...]:
        """The latent shape of one sample: ``latent_shape`` for an image family (``num_frames`` must
        be 1); a video family (``video = True``) overrides it with ``(C, F', H, W)``."""
        if num_frames != 1:
            from diffusionrl.config import ConfigError

            raise ConfigError(f"sampling.num_frames={num_frames}, but {self.family} makes images: set "
                              "sampling.num_frames=1")
        return self.latent_shape(resolution)

    def _timestep_kwargs(self, num_steps: int, resolution: int | None) -> dict:
        """What the stock pipeline passes to ``scheduler.set_timesteps`` (besides the device)."""
        return {"num_inference_steps": num_steps}

    def schedule(self, num_steps: int, resolution: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's own shifted ``sigmas [T+1]`` and ``timesteps [T]``, float32, CPU, as the
        stock pipeline sets them for ``resolution`` (which only resolution-dependent shifts read)."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(device="cpu", **self._timestep_kwargs(num_steps, resolution))
        sigmas = scheduler.sigmas.detach().to(torch.float32).clone()
        timesteps = scheduler.timesteps.detach().to(torch.float32).clone()
        if sigmas.shape[0] != num_steps + 1 or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"scheduler gave {sigmas.shape[0]} sigmas ending in {float(sigmas[-1])}; expected T+1 ending in 0"
            )
        return sigmas, timesteps

    def needs_negative(self, guidance_scale: float) -> bool:
        """Whether sampling at ``guidance_scale`` runs a CFG pass on negative-prompt embeddings
        (never where the guidance is embedded, ``cfg_mode = "embedded"``)."""
        return self.cfg_mode != "embedded" and guidance_scale != 1.0

    # -- the stock pipeline's forms (parity tests and bench/families.py call the pipeline itself) --
    def to_pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Spatial latents ``[B, C, H, W]`` -> what the stock pipeline's ``latents=`` argument takes."""
        return latents

    def from_pipeline_latents(self, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        """The stock pipeline's ``output_type="latent"`` output -> spatial latents ``[B, C, H, W]``."""
        return latents

    def from_tokens(self, tokens: torch.Tensor, resolution: int) -> torch.Tensor:
        """The transformer's latent token sequence ``[B, seq, C']`` (what SGLang's rollout answers carry for a
        family whose DiT takes tokens) -> spatial latents ``[B, C, H, W]``. For most such families the stock
        pipeline's latent output is that sequence (``from_pipeline_latents``)."""
        return self.from_pipeline_latents(tokens, resolution)

    @staticmethod
    def served_guidance(guidance_scale: float) -> float:
        """The stock pipeline's ``guidance_scale`` argument that samples as our ``guidance_scale`` does
        (what the registered model's ``guidance_scale`` param defaults to)."""
        return guidance_scale

    def pipeline_kwargs(self, guidance_scale: float, negative_prompt: str | list[str]) -> dict:
        """The guidance arguments of the stock pipeline's ``__call__`` that sample as ``velocity`` does
        (``negative_prompt``: one per prompt gives the pipeline our batch layout)."""
        kwargs: dict = {"guidance_scale": guidance_scale}
        if self.needs_negative(guidance_scale):
            kwargs["negative_prompt"] = negative_prompt
        return kwargs

    def true_cfg_kwargs(self, guidance_scale: float, negative_prompt: str | list[str]) -> dict:
        """``pipeline_kwargs`` of a pipeline whose guidance is ``true_cfg_scale`` (Qwen-Image's; FLUX.1's without a
        guidance embedding): the scale, and where ``needs_negative`` the negative prompt, without which the
        pipeline would not guide."""
        if self.needs_negative(guidance_scale):
            return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt}
        return {"true_cfg_scale": 1.0}

    # -- text -----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], negative_prompt: str | None, max_sequence_length: int
    ) -> Conditioning:
        """Embeddings for each prompt (each distinct prompt encoded once) and, if
        ``negative_prompt`` is not None, the negative prompt's, expanded to the batch.

        Args:
            prompts (`list[str]`): one prompt per sample.
            negative_prompt (`str` or `None`): the negative prompt for CFG; `None` encodes none.
            max_sequence_length (`int`): the text encoder's token limit (``model.max_sequence_length``).
        Returns:
            `Conditioning`: ``[B, ...]`` embeddings on the adapter's device."""
        position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        unique = list(position)
        index = torch.tensor([position[p] for p in prompts], device=self.device)
        embeds, pooled, mask = self._encode_quietly(unique, max_sequence_length)
        cond = Conditioning(embeds.index_select(0, index), pooled.index_select(0, index),
                            prompt_embeds_mask=None if mask is None else mask.index_select(0, index))
        if negative_prompt is not None:
            neg, neg_pooled, neg_mask = self._encode_quietly([negative_prompt], max_sequence_length)
            b = len(prompts)
            cond.negative_prompt_embeds = neg.expand(b, *neg.shape[1:]).contiguous()
            cond.negative_pooled_embeds = neg_pooled.expand(b, *neg_pooled.shape[1:]).contiguous()
            if neg_mask is not None:
                cond.negative_prompt_embeds_mask = neg_mask.expand(b, *neg_mask.shape[1:]).contiguous()
        return cond

    def encode_conditioning(self, prompts: list[str], negative_prompt: str | None, max_sequence_length: int,
                            references: list[np.ndarray] | None = None, resolution: int | None = None) -> Conditioning:
        """A rollout's conditioning: ``encode_prompts``, and where the rows carry input images (``references``,
        uint8 RGB; an editing family) their latents (``encode_references`` at ``resolution``). A family whose
        text encoding also sees the input image (Qwen-Image-Edit) overrides it."""
        cond = self.encode_prompts(prompts, negative_prompt, max_sequence_length)
        if references is not None:
            cond.image_latents = self.encode_references(references, resolution)
        return cond

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        """The pipeline's own (no-CFG) embeddings of ``texts``: ``(prompt [N, S, D], pooled [N, P],
        token mask [N, S] or None)``."""
        raise NotImplementedError

    def _encode_quietly(self, texts: list[str], max_sequence_length: int) -> tuple:
        """``_encode`` with diffusers' per-call truncation warnings replaced by ``warn_truncated``'s one."""
        with truncation_warnings_dropped(self.pipeline_logger) as dropped:
            out = self._encode(texts, max_sequence_length)
        if any(quiet.dropped for quiet in dropped.values()):
            self.warn_truncated(texts, max_sequence_length)
        return out

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        """(tokenizer, token limit, how to say it) for each text encoder."""
        clip_limit = self.pipe.tokenizer_max_length
        return [(self.pipe.tokenizer, clip_limit, f"CLIP takes {clip_limit} tokens")]

    def warn_truncated(self, prompts: list[str], max_sequence_length: int) -> int:
        """Warn once (per adapter) about the prompts the text encoders cut short. The training loop
        calls it on all prompts once the model is loaded; ``encode_prompts`` calls it if diffusers
        reports a truncation first. Returns how many of ``prompts`` are truncated."""
        if self._truncation_warned:
            return 0
        unique = list(dict.fromkeys(prompts))
        long: dict[str, None] = {}
        hit = []
        for tokenizer, limit, what in self._token_limits(max_sequence_length):
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
            self.log.warning("%d of %d prompts are longer than the text encoders take and are truncated (%s), e.g. "
                             "a prompt of %d characters starting %r; this is reported once", len(long), len(unique),
                             "; ".join(hit), len(longest), longest[:60])
        return len(long)

    # -- velocity -------------------------------------------------------------------------------
    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_dtype(self, transformer: torch.nn.Module) -> torch.dtype:
        return transformer.dtype if self.autocast_dtype is None else self.autocast_dtype

    # How a CFG pass runs (``velocity``; a class-level fact of each family):
    # "batched": one forward on ``[x; x]`` with both sides' text in one batch (``TextSide.cat``;
    #   ``cfg_negative_first``: the negative side first, as the stock pipeline lays the batch out);
    # "separate": one forward per side (the texts' lengths or masks differ, or the pipeline does so);
    # "embedded": none: the scale is an input of the transformer (``guidance_input``), one forward.
    cfg_mode = "batched"
    cfg_negative_first = True
    cfg_norm_rescale = False  # the mix rescaled per token to the positive prediction's norm (Qwen-Image)

    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float,
        guidance_scale_2: float | None = None,
    ) -> torch.Tensor:
        """The velocity of ``latents`` at ``timestep``, computed with ``transformer``. The one template of every
        family: the latents in the forward dtype, the timestep as float32 ``[B]``, the family's ``_forward`` under
        autocast, and where ``needs_negative`` a CFG pass as ``cfg_mode`` says, mixed ``v_neg + g (v_pos - v_neg)``
        in the forward's output layout (then rescaled where ``cfg_norm_rescale``), and ``_unpack`` to the latents'
        layout. ``g`` is the scale of this call's timestep (``step_guidance``: a two-expert model's low-noise steps
        take ``guidance_scale_2``); whether there is a CFG pass is ``guidance_scale``'s, as in ``WanPipeline``.

        Args:
            transformer (`torch.nn.Module`): the LoRA policy, the reference or an engine's copy.
            latents (`torch.Tensor`): spatial latents ``[B, C, H, W]`` (video ``[B, C, F', H, W]``).
            timestep (`torch.Tensor`): ``sigma * num_train_timesteps``, a scalar or ``[B]``.
            cond (`Conditioning`): from ``encode_prompts`` (with negative embeddings where CFG runs).
            guidance_scale (`float`): the CFG scale (no CFG pass where ``needs_negative`` is false).
            guidance_scale_2 (`float`, *optional*): a two-expert model's low-noise scale (`None`: the same).
        Returns:
            `torch.Tensor`: float32 velocities shaped like ``latents``."""
        cfg = self.needs_negative(guidance_scale)
        if cfg and cond.negative_prompt_embeds is None:
            raise ValueError(f"guidance_scale={guidance_scale} needs negative embeddings in the conditioning")
        dtype = self.forward_dtype(transformer)
        x = latents.to(self.device, dtype)
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1)
        t = t.expand(x.shape[0]) if t.numel() == 1 else t
        guidance_scale = self.step_guidance(t, guidance_scale, guidance_scale_2)
        pos = TextSide(cond.prompt_embeds, cond.pooled_embeds, cond.prompt_embeds_mask, cond.image_latents)

        def forward(x: torch.Tensor, t: torch.Tensor, side: TextSide) -> torch.Tensor:
            with self.autocast():
                return self._forward(transformer, x, t, side, guidance_scale, dtype).float()

        if not cfg:
            return self._unpack(forward(x, t, pos), latents)
        neg = TextSide(cond.negative_prompt_embeds, cond.negative_pooled_embeds, cond.negative_prompt_embeds_mask,
                       cond.image_latents)
        if self.cfg_mode == "batched":
            first, second = (neg, pos) if self.cfg_negative_first else (pos, neg)
            v_first, v_second = forward(torch.cat([x, x]), torch.cat([t, t]), TextSide.cat(first, second)).chunk(2)
            v, v_neg = (v_second, v_first) if self.cfg_negative_first else (v_first, v_second)
        else:
            v, v_neg = forward(x, t, pos), forward(x, t, neg)
        mixed = v_neg + guidance_scale * (v - v_neg)
        if self.cfg_norm_rescale:
            mixed = mixed * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(mixed, dim=-1, keepdim=True))
        return self._unpack(mixed, latents)

    def step_guidance(self, t: torch.Tensor, guidance_scale: float, guidance_scale_2: float | None = None) -> float:
        """The CFG scale of a forward at timesteps ``t``: ``guidance_scale``. Only a model with two experts
        takes a ``guidance_scale_2`` (``WanAdapter``: its low-noise expert's steps); here it is refused."""
        if guidance_scale_2 is not None:
            from diffusionrl.config import ConfigError

            raise ConfigError(f"guidance_scale_2={guidance_scale_2:g}: {self.family} has one transformer, not two "
                              "experts (Wan2.2 A14B); set sampling.guidance_scale_2=0 and eval.guidance_scale_2=0")
        return guidance_scale

    def _forward(self, transformer: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, side: TextSide,
                 guidance_scale: float, dtype: torch.dtype) -> torch.Tensor:
        """The family's one transformer call (``velocity`` runs it under autocast): latents ``x``
        (``[N, ...]`` in ``dtype`` on the device, N = B or 2B), scheduler timesteps ``t`` (float32
        ``[N]``; the family maps them to what its transformer takes, e.g. ``t / 1000``), one text
        ``side`` of N rows (cast it to ``dtype``), ``guidance_scale`` for a guidance embedding
        (``guidance_input``). Returns the prediction in the transformer's output layout (e.g.
        packed tokens; ``_unpack`` maps it back), the per-token dim last where ``cfg_norm_rescale``."""
        raise NotImplementedError

    def _unpack(self, v: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """``_forward``'s output layout -> the layout of ``latents`` (identity: already spatial)."""
        return v

    def guidance_input(self, batch: int, guidance_scale: float) -> torch.Tensor | None:
        """The transformer's ``guidance`` input, ``[batch]`` float32 of the scale, where it has a
        guidance embedding (guidance-distilled: FLUX.1 / FLUX.2 [dev]); None where it has none."""
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.full([1], guidance_scale, device=self.device, dtype=torch.float32).expand(batch)

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
        """Clean latents ``[B, C, H, W]`` (``latents``, `torch.Tensor`) -> uint8 RGB images
        ``[B, H*f, W*f, 3]`` (`np.ndarray`; ``f`` the VAE's scale factor)."""
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z, return_dict=False)[0].float()
        image = (image / 2 + 0.5).clamp(0, 1)
        return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()
