"""The trajectory batch contract between rollout engines and the trainer (docs/architecture.md "Contracts").

A ``Trajectory`` holds B samples of T denoising steps. Shapes and dtypes are checked when it is
built, so a malformed batch fails at the engine that made it, not deep inside the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch


class TrajectoryError(ValueError):
    """A trajectory field has the wrong shape, dtype or value."""


@dataclass
class Conditioning:
    """Conditioning of B samples (what the transformer attends to): the text's, and an editing family's
    input image (``image_latents``: its VAE latents, which the transformer sees beside the noisy ones)."""

    prompt_embeds: torch.Tensor  # [B, S, D]
    pooled_embeds: torch.Tensor  # [B, P] (P = 0: a family without a pooled embedding, e.g. Qwen-Image)
    negative_prompt_embeds: torch.Tensor | None = None  # [B, S, D]; None when no CFG pass
    negative_pooled_embeds: torch.Tensor | None = None  # [B, P]
    # [B, S] int64 (1 = real token) where the family pads text to the batch's longest prompt
    # (Qwen-Image); None where every token counts (SD3, FLUX) or, as diffusers does, none is padding
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None  # [B, S']
    # [B, C, h, w] float32: the input image's spatial VAE latents (editing families: Kontext, Qwen-Image-Edit); None for
    # text-to-image. Same layout as the trajectory's latents, so rollouts, recompute and the trainer select it alike.
    image_latents: torch.Tensor | None = None

    FIELDS = ("prompt_embeds", "pooled_embeds", "negative_prompt_embeds", "negative_pooled_embeds",
              "prompt_embeds_mask", "negative_prompt_embeds_mask", "image_latents")

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def select(self, idx: slice | torch.Tensor) -> Conditioning:
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]

        return Conditioning(*(pick(getattr(self, name)) for name in self.FIELDS))

    def to(self, device: torch.device | str) -> Conditioning:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Conditioning(*(move(getattr(self, name)) for name in self.FIELDS))

    @staticmethod
    def cat(parts: list[Conditioning]) -> Conditioning:
        def join(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            if values[0] is None:
                if any(v is not None for v in values):
                    raise TrajectoryError(f"cannot join conditionings: {name} is set in some parts only")
                return None
            if len({tuple(v.shape[1:]) for v in values}) > 1:  # e.g. Qwen-Image text padded per encoding
                raise TrajectoryError(f"cannot join conditionings whose {name} differ in shape "
                                      f"{sorted({tuple(v.shape[1:]) for v in values})}")
            return torch.cat(values)

        return Conditioning(*(join(name) for name in Conditioning.FIELDS))

    def validate(self, batch: int) -> None:
        _check(self.prompt_embeds, "prompt_embeds", ndim=3, first=batch, floating=True)
        _check(self.pooled_embeds, "pooled_embeds", ndim=2, first=batch, floating=True)
        if (self.negative_prompt_embeds is None) != (self.negative_pooled_embeds is None):
            raise TrajectoryError("negative_prompt_embeds and negative_pooled_embeds must both be set or both be None")
        if self.negative_prompt_embeds is not None:
            # the negative prompt may be encoded to another length (Qwen-Image pads per encoding)
            _check(self.negative_prompt_embeds, "negative_prompt_embeds", ndim=3, first=batch, floating=True)
            if self.negative_prompt_embeds.shape[2] != self.prompt_embeds.shape[2]:
                raise TrajectoryError(f"negative_prompt_embeds has width {self.negative_prompt_embeds.shape[2]}, "
                                      f"prompt_embeds {self.prompt_embeds.shape[2]}")
            _check(self.negative_pooled_embeds, "negative_pooled_embeds", shape=tuple(self.pooled_embeds.shape))
        for mask, embeds in ((self.prompt_embeds_mask, self.prompt_embeds),
                             (self.negative_prompt_embeds_mask, self.negative_prompt_embeds)):
            if mask is not None:
                if embeds is None:
                    raise TrajectoryError("a prompt_embeds mask without its embeddings")
                _check(mask, "prompt_embeds_mask", shape=tuple(embeds.shape[:2]))
        if self.image_latents is not None:
            _check(self.image_latents, "image_latents", ndim=4, first=batch, floating=True)


def _check(
    t: torch.Tensor | None,
    name: str,
    *,
    ndim: int | None = None,
    first: int | None = None,
    shape: tuple | None = None,
    dtype: torch.dtype | None = None,
    floating: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TrajectoryError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise TrajectoryError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if first is not None and t.shape[0] != first:
        raise TrajectoryError(f"{name} has {t.shape[0]} rows, expected {first} (one per sample)")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise TrajectoryError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TrajectoryError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if floating and not t.is_floating_point():
        raise TrajectoryError(f"{name} must be a floating tensor, got {t.dtype}")


@dataclass
class Trajectory:
    """B samples x T steps of one rollout.

    ``micro_batch_size`` records the batch composition the engine sampled with: samples
    ``[k*m, (k+1)*m)`` went through the transformer together. The trainer recomputes with the
    same composition, which is what makes recomputed log-probs bitwise equal to these.
    """

    prompts: list[str]  # [B]
    group_ids: torch.Tensor  # [B] int64: samples of one prompt group share an id
    seeds: torch.Tensor  # [B] int64: per-sample noise seed
    sigmas: torch.Tensor  # [T+1] float32: the exact schedule used, sigmas[0] = 1 ... sigmas[T] = 0
    timesteps: torch.Tensor  # [T] float32: the transformer's timestep input at each step
    sde_mask: torch.Tensor  # [B, T] bool: stochastic (trained) steps
    latents: torch.Tensor  # [B, T+1, C, H, W] (video: [B, T+1, C, F', H, W]) float32: x_0 (noise) ... x_T (clean)
    log_probs: torch.Tensor  # [B, T] float32: 0 at deterministic steps
    conditioning: Conditioning
    guidance_scale: float
    sde_type: str
    noise_level: float
    micro_batch_size: int
    policy_version: int = 0
    guidance_scale_2: float | None = None  # two experts (Wan2.2): the low-noise expert's scale; None: guidance_scale
    images: np.ndarray | None = None  # [B, H, W, 3] uint8 (video: frames [B, F, H, W, 3])
    rewards: torch.Tensor | None = None  # [B] float32
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B]
    advantages: torch.Tensor | None = None  # [B] float32
    metadata: list[dict] | None = None  # [B] per-prompt metadata from the dataset

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def guidance(self) -> tuple[float, float | None]:
        """``FlowAdapter.velocity``'s guidance arguments as the rollout sampled: ``guidance_scale, guidance_scale_2``
        (a two-expert model's low-noise steps take the second)."""
        return self.guidance_scale, self.guidance_scale_2

    @property
    def is_video(self) -> bool:
        """Samples are videos: 6-D latents ``[B, T+1, C, F', H, W]``."""
        return self.latents.ndim == 6

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def validate(self) -> None:
        b = len(self.prompts)
        if b == 0:
            raise TrajectoryError("a trajectory needs at least one sample")
        if not all(isinstance(p, str) for p in self.prompts):
            raise TrajectoryError("prompts must be a list of str")
        _check(self.group_ids, "group_ids", shape=(b,), dtype=torch.int64)
        _check(self.seeds, "seeds", shape=(b,), dtype=torch.int64)
        _check(self.timesteps, "timesteps", ndim=1, dtype=torch.float32)
        t = self.timesteps.shape[0]
        _check(self.sigmas, "sigmas", shape=(t + 1,), dtype=torch.float32)
        _check(self.sde_mask, "sde_mask", shape=(b, t), dtype=torch.bool)
        _check(self.latents, "latents", first=b, dtype=torch.float32)
        if self.latents.ndim not in (5, 6):
            raise TrajectoryError(f"latents must be [B, T+1, C, H, W] or, for video, [B, T+1, C, F, H, W]; got shape "
                                  f"{tuple(self.latents.shape)}")
        if self.latents.shape[1] != t + 1:
            raise TrajectoryError(f"latents has {self.latents.shape[1]} states per sample, expected T+1 = {t + 1}")
        _check(self.log_probs, "log_probs", shape=(b, t), dtype=torch.float32)
        self.conditioning.validate(b)
        if self.sde_type not in ("sde", "cps", "ode", "dance"):
            raise TrajectoryError(f"sde_type {self.sde_type!r} is not sde | cps | ode | dance")
        if self.micro_batch_size <= 0 or b % self.micro_batch_size:
            raise TrajectoryError(f"micro_batch_size {self.micro_batch_size} does not divide the batch of {b}")
        if self.images is not None:
            ok = isinstance(self.images, np.ndarray) and self.images.dtype == np.uint8 and self.images.ndim in (4, 5)
            if not ok:
                raise TrajectoryError("images must be a uint8 numpy array [B, H, W, 3] (video: [B, F, H, W, 3])")
            if self.images.shape[0] != b or self.images.shape[-1] != 3:
                raise TrajectoryError(f"images has shape {self.images.shape}, expected [{b}, (F,) H, W, 3]")
        for name in ("rewards", "advantages"):
            value = getattr(self, name)
            if value is not None:
                _check(value, name, shape=(b,), dtype=torch.float32)
        for name, value in self.reward_components.items():
            _check(value, f"reward_components[{name!r}]", shape=(b,), dtype=torch.float32)
        if self.metadata is not None and len(self.metadata) != b:
            raise TrajectoryError(f"metadata has {len(self.metadata)} entries, expected {b}")
        if self.sde_type != "ode" and not torch.isfinite(self.log_probs[self.sde_mask]).all():
            raise TrajectoryError("log_probs has non-finite values at stochastic steps")

    def with_rewards(
        self, rewards: torch.Tensor, components: dict[str, torch.Tensor], advantages: torch.Tensor | None = None
    ) -> Trajectory:
        return replace(self, rewards=rewards, reward_components=dict(components), advantages=advantages)

    def micro_batches(self) -> list[slice]:
        m = self.micro_batch_size
        return [slice(i, i + m) for i in range(0, self.batch_size, m)]
