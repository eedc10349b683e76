"""The local rollout engine: in-process diffusers modules, CPU or one GPU.

It owns its own copy of the LoRA-wrapped transformer; ``update_weights`` copies the trainer's
LoRA tensors into it (the in-process form of the weight push that the SGLang engine does over
HTTP or CUDA IPC). Sampling runs in micro-batches of ``micro_batch_size`` samples and records
that composition in the trajectory, so the trainer can recompute bitwise-equal log-probs. Rows that
carry an input image (an editing dataset) have it encoded into the conditioning (``image_latents``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusionrl.algorithms.sde import dpm_solver_2m_step, step_with_logprob
from diffusionrl.config import ConfigError
from diffusionrl.data.images import row_images
from diffusionrl.models.base import FlowAdapter
from diffusionrl.trajectory import Conditioning, Trajectory

from .base import SamplingSpec
from .batch import RolloutBatch

log = logging.getLogger(__name__)


class LocalRolloutEngine:
    """Samples with an in-process transformer (a LoRA-wrapped copy of the policy)."""

    name = "local"

    def __init__(self, adapter: FlowAdapter, transformer: torch.nn.Module, micro_batch_size: int,
                 progress: bool = False):
        self.adapter = adapter
        self.transformer = transformer.eval()
        self.transformer.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.version = 0
        self.progress = progress
        self._params = dict(self.transformer.named_parameters())

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy the trained tensors (a LoRA's or every parameter; names as in the policy's ``named_parameters``)
        into the engine."""
        unknown = [k for k in state if k not in self._params]
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} unknown parameter names, e.g. {unknown[:3]}")
        for name, value in state.items():
            self._params[name].copy_(value.to(self._params[name].device, self._params[name].dtype))
        self.version = int(version)

    # -- memory: the engine shares this process's allocator with the trainer, nothing to hand off
    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass

    def close(self) -> None:
        pass

    # -- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        group_ids,
        seeds,
        spec: SamplingSpec,
        sde_mask: np.ndarray | torch.Tensor | None = None,
        metadata: list[dict] | None = None,
    ) -> Trajectory:
        batch = RolloutBatch.prepare(prompts, group_ids, seeds, spec, sde_mask, self.micro_batch_size, metadata)
        sigmas, timesteps = batch.schedule(*self.adapter.schedule(spec.num_steps, spec.resolution))
        negative = spec.negative_prompt if self.adapter.needs_negative(spec.guidance_scale) else None
        references = row_images(metadata)  # the rows' input images (an editing dataset), else None
        if references is not None and not self.adapter.editing:
            raise ConfigError(f"the prompt rows carry an input image ('image'), but {self.adapter.family} "
                              "is a text-to-image model; use an editing model (e.g. builtin:tiny-flux-kontext) "
                              "or prompts without images")
        cond = self.adapter.encode_conditioning(prompts, negative, spec.max_sequence_length, references,
                                                spec.resolution)

        latents, log_probs, images = [], [], []
        micro = batch.micro_batch_size
        chunks = range(0, batch.size, micro)
        latent_seeds = batch.latent_seeds
        for start in tqdm(chunks, desc="rollout", disable=not self.progress, leave=False):
            sl = slice(start, start + micro)
            mask = batch.sde_mask[sl]
            lat, chunk_log_probs = self._sample_chunk(cond.select(sl), batch.seeds[sl], mask, sigmas, timesteps,
                                                      spec, latent_seeds[sl])
            latents.append(lat)
            log_probs.append(chunk_log_probs)
            if spec.keep_images:
                images.append(self.adapter.decode(lat[:, -1]))
        return batch.trajectory(
            sigmas=sigmas,
            timesteps=timesteps,
            latents=torch.cat(latents),
            log_probs=torch.cat(log_probs),
            conditioning=cond.to("cpu"),
            images=np.concatenate(images) if images else None,
            policy_version=self.version,
        )

    def _sample_chunk(
        self,
        cond: Conditioning,
        seeds: torch.Tensor,
        mask: torch.Tensor,
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        spec: SamplingSpec,
        latent_seeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one micro-batch on ``sigmas`` (``T`` steps: ``spec.num_steps``, fewer when compressed);
        returns latents ``[m, T+1, *sample_shape]`` (``[C, H, W]``, or ``[C, F', H, W]`` for video) and
        log-probs ``[m, T]``."""
        device = self.adapter.device
        shape = self.adapter.sample_shape(spec.resolution, spec.num_frames)
        # One generator per sample, all its noise drawn at once: the initial latent and one draw
        # per step (also at ODE steps, so a sample's noise ignores the step set). A sample's
        # noise depends on its seed only, not on the batch it is sampled in (nor on a compressed schedule, whose
        # steps up to the SDE window's end are the schedule's first ones). With ``latent_seeds`` (a group
        # sharing one initial latent) the initial latent is that of the latent seed's own draw.
        def draw(s) -> torch.Tensor:
            return torch.randn((spec.num_steps + 1, *shape), generator=torch.Generator("cpu").manual_seed(int(s)))

        noise = torch.stack([draw(s) for s in seeds]).to(device)  # [m, T+1, *sample_shape]
        x = noise[:, 0]  # [m, *sample_shape] float32
        if latent_seeds is not None and not torch.equal(latent_seeds, seeds):
            x = torch.stack([draw(s)[0] for s in latent_seeds]).to(device)
        states, step_log_probs = [x.cpu()], []
        mask_dev = mask.to(device)
        hist: tuple = (None, None, None)  # dpm2m: the previous step's x0, sigma, and [m] "it was an ODE step"
        for i in range(len(timesteps)):
            v = self.adapter.velocity(self.transformer, x, timesteps[i], cond, *spec.guidance)
            eps = noise[:, i + 1]
            stochastic = spec.sde_type != "ode" and bool(mask[:, i].any())
            m = mask_dev[:, i] if stochastic else torch.zeros(x.shape[0], dtype=torch.bool, device=device)
            if spec.ode_solver == "dpm2m":  # per sample: its own history, whatever its micro-batch
                ode, x0 = dpm_solver_2m_step(x, v, sigmas[i], sigmas[i + 1], *hist)
                hist = (x0, sigmas[i], ~m)
            elif not stochastic:
                ode = self._ode_step(x, v, sigmas, timesteps, i, cond, spec)
            else:  # per-sample step sets: Euler where this step is not stochastic
                ode = x + v * (sigmas[i + 1] - sigmas[i])
            if not stochastic:
                x_next, step_log_prob = ode, torch.zeros(x.shape[0], device=device)
            else:
                out = step_with_logprob(
                    v, x, sigmas[i], sigmas[i + 1], sde_type=spec.sde_type, noise_level=spec.noise_level,
                    sigma_max=sigmas[1], noise=eps,
                )
                if bool(mask[:, i].all()):
                    x_next, step_log_prob = out.x_next, out.log_prob
                else:
                    x_next = torch.where(m.view(-1, *[1] * (x.ndim - 1)), out.x_next, ode)
                    step_log_prob = torch.where(m, out.log_prob, torch.zeros_like(out.log_prob))
            x = x_next
            states.append(x.cpu())
            step_log_probs.append(step_log_prob.cpu())
        return torch.stack(states, dim=1), torch.stack(step_log_probs, dim=1)

    def _ode_step(self, x, v, sigmas, timesteps, i, cond, spec) -> torch.Tensor:
        dt = sigmas[i + 1] - sigmas[i]
        x_euler = x + v * dt
        if spec.ode_solver != "heun" or float(sigmas[i + 1]) == 0.0:
            return x_euler
        # Heun (second order): average the slopes at both ends of the step.
        t_next = sigmas[i + 1] * (timesteps[i] / sigmas[i])
        v_next = self.adapter.velocity(self.transformer, x_euler, t_next, cond, *spec.guidance)
        return x + 0.5 * (v + v_next) * dt
