"""A grad scaler whose skip decision is the same on every rank.

Each rank only sees its shard of the gradients, so a local inf/NaN check could let one rank step
while another skips, and the replicas would drift apart. ``SyncedGradScaler`` is torch's
``GradScaler`` with one change: after the local unscale/inf check, the found-inf flags are
all-reduced with MAX over the group, so ``step`` (skip or not) and ``update`` (halve the scale or
grow it) see the same value everywhere. (torch's FSDP1 ``ShardedGradScaler`` does the same with a
SUM; this one works for FSDP2's DTensor gradients and for plain ones, on CPU and GPU.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SyncedGradScaler(torch.amp.GradScaler):
    def __init__(self, device: str = "cuda", *, enabled: bool = True, group=None, **kw):
        super().__init__(device, enabled=enabled, **kw)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.is_enabled():
            return
        state = self._per_optimizer_states[id(optimizer)]
        already = state["stage"] is not torch.amp.grad_scaler.OptState.READY
        super().unscale_(optimizer)
        if already:
            return
        found = state["found_inf_per_device"]
        if not found:  # no gradients on this rank: still join the reduction
            found[torch.device(self._device)] = torch.zeros(1, dtype=torch.float32, device=self._device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            # One flag per rank (sum of this rank's devices), MAX over ranks, written back everywhere.
            flag = torch.stack([v.reshape(()).float() for v in found.values()]).amax().reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            for v in found.values():
                v.copy_(flag.to(v.device).reshape(v.shape))

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """After ``unscale_``: did any rank see inf/NaN (the step will be skipped)?"""
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return any(float(v.item()) > 0 for v in found.values())
