"""How a step's batch is cut across rollout engines: whole blocks.

A block is ``lcm(group_size, micro_batch_size)`` consecutive samples: whole groups (so group
statistics stay on one engine) and whole micro-batches (so training recomputes with the
composition the engine sampled with; SD3 outputs depend on the batch). Share ``r`` of ``n`` is the
contiguous run of blocks ``[r * B / n, (r + 1) * B / n)``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from diffusionrl.trajectory import Conditioning, Trajectory


def assign_blocks(batch: int, group_size: int, micro_batch_size: int, shares: int) -> list[slice]:
    """Sample ranges of ``shares`` equal shares of whole blocks."""
    block = math.lcm(group_size, micro_batch_size)
    if batch % (block * shares):
        raise ValueError(f"{batch} samples do not split into {shares} shares of whole blocks of {block}")
    per = batch // shares
    return [slice(r * per, (r + 1) * per) for r in range(shares)]


def cat_trajectories(parts: list[Trajectory]) -> Trajectory:
    """Concatenate the engines' shares of one step (same schedule, same settings)."""
    first = parts[0]
    for p in parts[1:]:
        if not torch.equal(p.sigmas, first.sigmas) or p.micro_batch_size != first.micro_batch_size:
            raise ValueError("trajectory shares disagree on sigmas or micro_batch_size")

    def cat(name):
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)

    images = [p.images for p in parts]
    metadata = [p.metadata for p in parts]
    return replace(
        first,
        prompts=[x for p in parts for x in p.prompts],
        group_ids=cat("group_ids"),
        seeds=cat("seeds"),
        sde_mask=cat("sde_mask"),
        latents=cat("latents"),
        log_probs=cat("log_probs"),
        conditioning=Conditioning.cat([p.conditioning for p in parts]),
        images=None if any(i is None for i in images) else np.concatenate(images),
        rewards=cat("rewards"),
        reward_components={},
        advantages=cat("advantages"),
        metadata=None if any(m is None for m in metadata) else [x for m in metadata for x in m],
    )
