"""The ``sampling`` section of the image config tree (``SamplingConfig``: rollouts, the SDE, the step
strategy, the rollout engine) and ``check_guidance_2``, which the ``eval`` section shares. Re-exported by
``diffusionrl.config.sections``; ``diffusionrl.config.Config`` assembles the sections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from .tree import ConfigError, check_constraints, option


def check_guidance_2(section, name: str) -> None:
    """``guidance_scale_2`` needs the CFG pass, which ``WanPipeline`` runs at ``guidance_scale > 1`` only."""
    if section.guidance_scale_2 and section.guidance_scale <= 1:
        raise ConfigError(f"{name}.guidance_scale_2={section.guidance_scale_2:g} needs {name}.guidance_scale > 1 (the "
                          f"pipeline runs no CFG pass at guidance_scale={section.guidance_scale:g}); raise "
                          f"{name}.guidance_scale or set {name}.guidance_scale_2=0")


@dataclass
class SamplingConfig:
    resolution: int = option(64, "Image height and width in pixels (a multiple of 16)")
    num_frames: PositiveInt = option(
        1, "Frames per sample: 1 for image models; video models (Wan) take 1 + 4k (5, 33, 81)"
    )
    eval_resolution: int = option(0, "Evaluation and registered-model image size (0 = resolution): train lower")
    num_steps: int = option(10, "Denoising steps T of a rollout")
    guidance_scale: PositiveFloat = option(
        4.5, "Guidance scale g: SD3's classifier-free guidance (1.0 = no CFG pass); FLUX.1's distilled-guidance "
        "input (3.5 for FLUX.1-dev; never a CFG pass)"
    )
    guidance_scale_2: NonNegativeFloat = option(
        0.0, "A model with two experts (Wan2.2 A14B): the CFG scale of the low-noise expert's steps (transformer_2, "
        "t < boundary_ratio * 1000; WanPipeline's guidance_scale_2); 0 = guidance_scale. Other models: 0"
    )
    negative_prompt: str = option("", "Negative prompt used for CFG (families with a CFG pass: SD3)")
    sde_type: Literal["sde", "cps", "ode", "dance"] = option(
        "sde", "Stochastic step: sde (Flow-GRPO) | cps (coefficients-preserving) | ode | dance (DanceGRPO: constant "
        "noise g = noise_level)"
    )
    noise_level: NonNegativeFloat = option(
        0.7, "SDE noise level a (0.7 for sde, 0.8 recommended for cps, eta = 0.3 for dance)"
    )
    step_strategy: Literal["all", "sde_window", "epoch_random_choice", "mix_window"] = option(
        "all", "Which steps are stochastic: all | sde_window | epoch_random_choice | mix_window (MixGRPO: one window "
        "for all groups, sliding with training)"
    )
    num_sde_steps: int = option(2, "Number of SDE steps for sde_window / epoch_random_choice / mix_window")
    window_range: list[int] = option([0, 5], "[lo, hi): the SDE window lies inside these step indices")
    window_shift_interval: PositiveInt = option(
        25, "mix_window: RL steps between two moves of the window (MixGRPO's tau)"
    )
    window_stride: PositiveInt = option(
        1, "mix_window: steps the window moves by (MixGRPO's s); it restarts at lo once it would leave window_range"
    )
    candidate_steps: list[int] = option([0, 1, 2, 3, 4, 5, 6, 7, 8], "Steps epoch_random_choice draws from")
    ode_solver: Literal["euler", "heun", "dpm2m"] = option(
        "euler", "Deterministic solver for NFT rollouts, eval and the ODE steps outside an SDE window: euler | heun | "
        "dpm2m (DPM-Solver++(2M); with mix_window: MixGRPO-Flash)"
    )
    post_window_ode_steps: NonNegativeInt = option(
        0, "mix_window: MixGRPO-Flash's time-step compression: training rollouts take this many ODE steps after the "
        "SDE window instead of all the schedule's remaining ones (a subset of its sigmas, evenly spaced by index, "
        "ending at 0; no gradient flows through them); 0 = off; evaluation samples the full schedule"
    )
    same_latent: bool = option(False, "Training rollouts: a group's samples start from one initial latent (the "
                               "group's first seed; flow_grpo's sample.same_latent, DanceGRPO's init_same_noise), so "
                               "their reward spread comes from the trained SDE steps alone")
    engine: Literal["local", "sglang"] = option(
        "local", "Rollout engine: local (in-process diffusers) | sglang (SGLang diffusion server)"
    )
    sglang_python: str = option(
        "", "sglang engine: Python interpreter of the SGLang venv ('' = $DIFFUSIONRL_SGLANG_PYTHON, else "
        "the repo's .venv-sglang/bin/python, else the current interpreter if it imports sglang)"
    )
    sglang_port: int = option(0, "sglang engine: HTTP port of the server it launches on 127.0.0.1 (0 = a free port)")
    sglang_verify_weights: bool = option(
        False, "sglang engine: after each weight push, check the server's /get_weights_checksum against ours"
    )
    sglang_ipc_bucket_mb: PositiveInt = option(
        512, "sglang engine: CUDA IPC weight-push bucket size in MiB (colocated GPU only)"
    )
    sglang_start_timeout_s: PositiveFloat = option(
        300.0, "sglang engine: seconds to wait for the server to become healthy"
    )
    sglang_max_restarts: NonNegativeInt = option(
        3, "sglang engine: server restarts (then a batch retry) allowed per run"
    )
    sglang_outputs_per_request: PositiveInt = option(
        16, "sglang engine: most samples of one group (a prompt and its SDE step set) sent in one /rollout/generate "
        "request, which the server samples as one batched forward (1 = one request per sample)"
    )

    def __post_init__(self) -> None:
        check_constraints(self, "sampling")
        check_guidance_2(self, "sampling")
        if not 0 <= self.sglang_port <= 65535:
            raise ConfigError(f"sampling.sglang_port={self.sglang_port} must be in [0, 65535] (0 picks a free port)")
        if self.resolution <= 0 or self.resolution % 16:
            raise ConfigError(f"sampling.resolution={self.resolution} must be a positive multiple of 16")
        if self.eval_resolution < 0 or self.eval_resolution % 16:
            raise ConfigError(f"sampling.eval_resolution={self.eval_resolution} must be 0 or a multiple of 16")
        if self.num_steps < 2:
            raise ConfigError(f"sampling.num_steps={self.num_steps} must be >= 2")
        if self.step_strategy != "all" and self.num_sde_steps <= 0:
            raise ConfigError(f"sampling.num_sde_steps={self.num_sde_steps} must be > 0")
        if self.step_strategy in ("sde_window", "mix_window"):
            if len(self.window_range) != 2:
                raise ConfigError(f"sampling.window_range={self.window_range} must be [lo, hi)")
            lo, hi = self.window_range
            if not 0 <= lo < hi <= self.num_steps - 1:
                raise ConfigError(
                    f"sampling.window_range={self.window_range} must satisfy 0 <= lo < hi <= num_steps - 1 "
                    f"= {self.num_steps - 1} (the last step is never stochastic)"
                )
            if hi - lo < self.num_sde_steps:
                raise ConfigError(
                    f"sampling.window_range={self.window_range} is narrower than num_sde_steps="
                    f"{self.num_sde_steps}; widen it to at least [{lo}, {lo + self.num_sde_steps}]"
                )
        if self.step_strategy == "epoch_random_choice":
            bad = [s for s in self.candidate_steps if not 0 <= s < self.num_steps - 1]
            if bad:
                raise ConfigError(
                    f"sampling.candidate_steps has {bad} outside [0, {self.num_steps - 2}] "
                    "(the last step is never stochastic)"
                )
            if len(set(self.candidate_steps)) < self.num_sde_steps:
                raise ConfigError(
                    f"sampling.candidate_steps has {len(set(self.candidate_steps))} distinct steps, fewer "
                    f"than num_sde_steps={self.num_sde_steps}"
                )
        if self.post_window_ode_steps:
            self._check_compression()
        if self.engine == "sglang":
            self._check_sglang()

    def _check_compression(self) -> None:
        k = self.post_window_ode_steps
        if self.step_strategy != "mix_window" or self.sde_type == "ode":
            raise ConfigError(f"sampling.post_window_ode_steps={k} compresses the ODE steps after MixGRPO's SDE "
                              "window: it needs sampling.step_strategy=mix_window and a stochastic sde_type, not "
                              f"step_strategy={self.step_strategy}, sde_type={self.sde_type}; use 0 (off)")
        most = self.num_steps - self.window_range[0] - self.num_sde_steps
        if k >= most:
            raise ConfigError(f"sampling.post_window_ode_steps={k} never compresses: at most {most} ODE steps follow "
                              "the window (num_steps - window_range[0] - num_sde_steps); use fewer, or 0 (off)")

    def _check_sglang(self) -> None:
        if self.same_latent:
            raise ConfigError("sampling.same_latent is not available with sampling.engine=sglang (the server draws "
                              "each output's initial latent from its own seed); use sampling.engine=local")
        if self.step_strategy == "mix_window":
            raise ConfigError("sampling.step_strategy=mix_window is not available with sampling.engine=sglang "
                              "(MixGRPO's sliding window is not verified against SGLang's diffusion runtime); use "
                              "sampling.engine=local")
        if self.ode_solver != "euler":
            raise ConfigError(f"sampling.ode_solver={self.ode_solver} is not available with sampling.engine=sglang "
                              "(its server takes Euler ODE steps only); use sampling.engine=local")
