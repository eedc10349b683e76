"""The wire format of SGLang's ``POST /rollout/generate``: request bodies, the msgpack answers,
and a batch of answers as the parts of our ``Trajectory``.

One request per group: the samples that share a prompt and an SDE step set (a GRPO group) go in one
request of up to ``sampling.sglang_outputs_per_request`` outputs (``num_outputs_per_prompt``), one
seed per output, which the server samples as one batched forward with the prompt encoded once
(and the requests of a batch run concurrently). The server computes the per-step log-probs itself;
the answer's DiT trajectory (latents ``[T+1, C, h, w]``, the scheduler's ``sigmas`` snapshot
``[T+1]``, ``timesteps``) and denoising env (the DiT's text conditioning) become our
``Trajectory``, so the trainer recomputes exactly what the server sampled.

Mapping of our contract to SGLang's (sglang 0.5.23, SD3):
- seeds: one per output (``extra_sampling_params.seed``, a list; the request's ``seed`` field is its
  first) with ``generator_device="cpu"``; each output has its own generator, so a sample depends on
  its seed only, not on the other outputs of its request (to fp32 rounding of the batched forward).
  SGLang's noise stream differs from the local engine's, so the two engines give different
  samples for one seed (each is reproducible).
- step strategies: our per-sample ``sde_mask`` row -> ``rollout_sde_step_indices`` (steps not
  listed are ODE steps whose log-prob the server reports as 0, as ours). An ODE spec (NFT
  rollouts) is ``sde`` with no SDE step, so no log-prob assertion trips on the server.
- ``sde`` log-probs are full Gaussian log-densities averaged over elements (ours); ``cps`` asks for
  ``rollout_log_prob_no_const`` (ours drops the constants there too).
- sigmas/timesteps: the server's own post-shift ``sigmas`` snapshot is kept as is (recomputing it
  from timesteps drifts ~3e-5 in log-prob); its timesteps carry a terminal 0, dropped (``[:T]``).
- conditioning: ``pos_cond_kwargs`` / ``neg_cond_kwargs`` (``encoder_hidden_states``,
  ``pooled_projections``; FLUX.2 has none: ``[B, 0]`` as its adapter's) -> ``Conditioning``. The server
  encodes T5 (FLUX.2's Mistral) at ``model.max_sequence_length`` tokens, as the local engine does
  (``server.text_encoder_args``: SD3 then conditions on ``77 + max_sequence_length`` tokens, not SGLang's
  fixed 77 + 256; FLUX.1 and FLUX.2 on ``max_sequence_length``, not 512). A request's ``max_sequence_length``
  is not sent: in 0.5.23 it would cut SD3's CLIP encoders too and is not applied to the negative prompt.
- a guidance-distilled family's embedded scale comes back in ``denoising_env.guidance``, in the unit
  its SGLang pipeline feeds the DiT (``GUIDANCE_UNIT``: FLUX.1's scale x 1000, FLUX.2's as is), and is
  checked against the spec's.
- images: ``generated_output`` (float ``[3, H, W]`` in [0, 1]) -> uint8 ``[H, W, 3]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from diffusionrl.trajectory import Conditioning

from ..base import SamplingSpec
from .server import SGLangServerError

# denoising_env.guidance per guidance-distilled family: the spec's scale times this (SGLang 0.5.23's FLUX.1
# pipeline hands its DiT guidance x 1000, its FLUX.2 pipeline the scale itself)
GUIDANCE_UNIT = {"flux": 1000.0, "flux2": 1.0}


def json_or_text(r):
    """A response's JSON body, else (not JSON) the start of its text, for error messages."""
    try:
        return r.json()
    except ValueError:
        return r.text[:2000]


def decode_tensors(obj):
    """A msgpack response tree with ``{"__tensor__": True, "data": <safetensors bytes>}`` leaves
    -> the same tree with torch tensors."""
    from safetensors.torch import load

    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            return load(obj["data"])["t"]
        return {k: decode_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tensors(v) for v in obj]
    return obj


# -- requests -------------------------------------------------------------------------------------


def request_body(prompt: str, seeds: list[int], sde_steps: list[int], spec: SamplingSpec,
                 cfg_pass: bool = True) -> dict:
    """The ``/rollout/generate`` body of ``len(seeds)`` samples of one prompt that share the SDE
    steps ``sde_steps`` (ODE at the others): one output per seed, in seed order. The server draws
    each output's initial and SDE noise from its own ``torch.Generator`` seeded with that seed, and
    runs the outputs as one batched forward (the prompt encoded once). ``RolloutRequest.seed`` is an
    int, so the per-output seed list travels in ``extra_sampling_params`` (laid over the request's
    sampling parameters by the server). ``cfg_pass``: the family samples with a negative (CFG) pass
    (SD3); a guidance-distilled one (FLUX) asks for no CFG (``guidance_scale`` 1, SGLang's true-CFG
    weight) and its server embeds the guidance itself."""
    cfg = cfg_pass and spec.guidance_scale != 1.0
    seeds = [int(s) for s in seeds]
    body = {
        "prompt": prompt,
        "negative_prompt": spec.negative_prompt if cfg else None,
        "seed": seeds[0],
        "generator_device": "cpu",
        "width": spec.resolution,
        "height": spec.resolution,
        "num_inference_steps": spec.num_steps,
        "num_outputs_per_prompt": len(seeds),
        "guidance_scale": float(spec.guidance_scale) if cfg_pass else 1.0,
        "rollout": True,
        "rollout_sde_type": "sde" if spec.sde_type == "ode" else spec.sde_type,
        "rollout_noise_level": float(spec.noise_level),
        "rollout_log_prob_no_const": spec.sde_type == "cps",
        "rollout_debug_mode": False,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
        "rollout_sde_step_indices": sde_steps,
        "suppress_logs": True,
    }
    if len(seeds) > 1:
        body["extra_sampling_params"] = {"seed": seeds}
    return body


def plan_requests(prompts: list[str], seeds: torch.Tensor, sde_mask: torch.Tensor, spec: SamplingSpec,
                  per_request: int, cfg_pass: bool = True) -> list[tuple[list[int], dict]]:
    """The requests of one batch: samples that share a prompt and an SDE step set (a GRPO group)
    go together, at most ``per_request`` to a request. Returns ``(sample indices, body)`` pairs;
    the answers' outputs map back to those indices in order."""
    t = spec.num_steps
    runs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, prompt in enumerate(prompts):
        steps = tuple(j for j in range(t) if bool(sde_mask[i, j]))
        runs.setdefault((prompt, steps), []).append(i)
    plan = []
    seed_list = seeds.tolist()
    for (prompt, steps), idx in runs.items():
        for k in range(0, len(idx), max(1, per_request)):
            chunk = idx[k:k + max(1, per_request)]
            plan.append((chunk, request_body(prompt, [seed_list[i] for i in chunk], list(steps), spec,
                                                      cfg_pass)))
    return plan


def request_seeds(body: dict) -> list[int]:
    """The per-output seeds a body asks for, in output order."""
    extra = body.get("extra_sampling_params") or {}
    return [int(s) for s in extra.get("seed", [body["seed"]])]


def parse_generate_response(r, body: dict) -> list[dict]:
    """The outputs of a ``/rollout/generate`` answer to ``body``, tensors decoded: exactly one per
    requested seed, each answering the request's first seed (the server echoes the request's
    ``seed`` field) and each with its own log-probs and trajectory."""
    import msgpack

    if r.status_code != 200:
        raise SGLangServerError(f"/rollout/generate failed (HTTP {r.status_code}): {json_or_text(r)}")
    items = decode_tensors(msgpack.unpackb(r.content, raw=False))
    n = len(request_seeds(body))
    if len(items) != n:
        raise SGLangServerError(f"/rollout/generate returned {len(items)} outputs for {n} requested")
    for item in items:
        if int(item["seed"]) != int(body["seed"]):
            raise SGLangServerError(f"/rollout/generate answered seed {item['seed']} for seed {body['seed']}")
    return items


# -- answers -> trajectory --------------------------------------------------------------------------


def trajectory_fields(items: list[dict], spec: SamplingSpec, adapter) -> dict[str, Any]:
    """The answers of one batch (in sample order) -> ``sigmas``, ``timesteps``, ``latents``,
    ``log_probs``, ``conditioning`` and ``images`` of its ``Trajectory``. Packed latent tokens
    (FLUX.1: ``[T+1, seq, 4C]``; FLUX.2: ``[T+1, seq, 128]``) are laid out by the adapter (``from_tokens``) as
    spatial latents."""
    t = spec.num_steps
    cfg = adapter.needs_negative(spec.guidance_scale)
    traj0 = items[0]["dit_trajectory"]
    sigmas = traj0["sigmas"].to(torch.float32)  # [T+1], the server's post-shift snapshot
    timesteps = traj0["timesteps"].to(torch.float32)[:t]  # [T] (the server appends a terminal 0)
    latents, log_probs, images, pos, neg = [], [], [], [], []
    for item in items:
        traj = item["dit_trajectory"]
        if not (torch.equal(traj["sigmas"].float(), sigmas) and torch.equal(traj["timesteps"].float()[:t], timesteps)):
            raise SGLangServerError("samples of one batch came back with different schedules")
        lat = traj["latents"].to(torch.float32)  # [T+1, C, h, w], or packed tokens [T+1, seq, 4C]
        latents.append(adapter.from_tokens(lat, spec.resolution) if lat.ndim == 3 else lat)
        log_probs.append(item["rollout_log_probs"].to(torch.float32).reshape(t))  # [T]
        env = item["denoising_env"]
        if not cfg and env.get("guidance") is not None:  # a guidance-distilled family: the server's embedded scale
            served = float(env["guidance"].reshape(-1)[0]) / GUIDANCE_UNIT[adapter.family]
            if abs(served - spec.guidance_scale) > 1e-6:
                raise SGLangServerError(f"the server samples with embedded guidance {served:g}, the request asks for "
                                        f"{spec.guidance_scale:g} (SGLang takes it per server: --embedded-cfg-scale)")
        pos.append(env["pos_cond_kwargs"])
        neg.append(env.get("neg_cond_kwargs"))
        if spec.keep_images:
            img = item["generated_output"].float()  # [3, H, W] in [0, 1]
            images.append((img.clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
    return {
        "sigmas": sigmas,
        "timesteps": timesteps,
        "latents": torch.stack(latents),  # [B, T+1, C, h, w]
        "log_probs": torch.stack(log_probs),  # [B, T]
        "conditioning": _conditioning(pos, neg if cfg else None),
        "images": np.stack(images) if images else None,  # [B, H, W, 3] uint8
    }


def _conditioning(pos: list[dict], neg: list[dict | None] | None) -> Conditioning:
    """The DiT's conditioning kwargs of each sample -> one batched ``Conditioning``."""

    def stack(kwargs: list[dict], key: str, ndim: int) -> torch.Tensor:
        # one sample's tensor comes as [S, D] / [D] (or with a leading 1); a family without it (FLUX.2's
        # pooled embedding) gets [B, 0], as its adapter's
        if key not in kwargs[0]:
            return torch.zeros(len(kwargs), 0)
        return torch.stack([kw[key].reshape(kw[key].shape[-ndim:]).to(torch.float32) for kw in kwargs])

    cond = Conditioning(stack(pos, "encoder_hidden_states", 2), stack(pos, "pooled_projections", 1))
    if neg is not None:
        if any(n is None for n in neg):
            raise SGLangServerError("the server returned no negative conditioning for a CFG request")
        cond.negative_prompt_embeds = stack(neg, "encoder_hidden_states", 2)
        cond.negative_pooled_embeds = stack(neg, "pooled_projections", 1)
    return cond
