"""Group-relative advantages (docs/algorithms.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] float32, clamped
    active: torch.Tensor  # [B] bool: False for samples of zero-std groups (no signal)
    zero_std_groups: int  # groups whose rewards are all equal


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    global_std: bool = True,
    clip_max: float = 5.0,
    eps: float = 1e-4,
) -> Advantages:
    """``A = (r - mean_group(r)) / (std + eps)``, clamped to ``[-clip_max, clip_max]``.

    ``std`` is the group's std, or the whole batch's with ``global_std``. Groups whose rewards
    are all equal carry no signal: they are counted and marked inactive (dropped from the loss).
    Groups are given by explicit ``group_ids``, never by prompt text. With one sample per group
    the whole batch is z-scored instead.
    """
    r = rewards.detach().to(torch.float32).reshape(-1)
    g = group_ids.reshape(-1)
    if r.shape != g.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and group_ids {tuple(g.shape)} differ")
    unique, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
    if int(counts.max()) == 1:  # k = 1: batch z-score, nothing is "zero std" per group
        adv = (r - r.mean()) / (r.std(unbiased=False) + eps)
        active = torch.ones_like(r, dtype=torch.bool)
        return Advantages(adv.clamp(-clip_max, clip_max), active, 0)
    n = unique.shape[0]
    sums = torch.zeros(n).index_add_(0, inverse, r)
    means = sums / counts
    centred = r - means[inverse]
    sq = torch.zeros(n).index_add_(0, inverse, centred**2)
    group_std = torch.sqrt(sq / counts)
    std = r.std(unbiased=False) if global_std else group_std[inverse]
    adv = (centred / (std + eps)).clamp(-clip_max, clip_max)
    # "All equal" is exact equality: a group with any spread carries signal.
    gmax = torch.full((n,), -torch.inf).scatter_reduce_(0, inverse, r, "amax")
    gmin = torch.full((n,), torch.inf).scatter_reduce_(0, inverse, r, "amin")
    zero = gmax == gmin
    active = ~zero[inverse]
    adv = torch.where(active, adv, torch.zeros_like(adv))
    return Advantages(adv, active, int(zero.sum()))
