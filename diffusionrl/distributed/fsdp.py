"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the peft LoRA policy.

Each transformer block is one FSDP unit (``block_units``: every block of each of the transformer's
block stacks, whatever the family names them), the transformer root (embeddings, final norm and
projection) another. Wan2.2's two experts (``WanExperts``): each expert's blocks are units, the root
holds both experts' embeddings and heads; a forward runs one expert's blocks, so the ranks must run
the same expert at every collective (``worker.aligned_work`` orders their units so). Base weights
are frozen, LoRA tensors train: FSDP2 allows mixed ``requires_grad`` inside a unit and only asks the
trainable ones to share a dtype (fp32 master LoRA). With mixed precision the units all-gather and
compute in fp16/bf16 and reduce gradients in fp32 into the fp32 sharded LoRA (the master weights).
Timesteps and latents are not cast on the way in (``cast_forward_inputs=False``): the sinusoidal
timestep embedding must see the rollout's fp32 timesteps, or recomputed log-probs drift.

Gradients are reduce-scattered as *sums* (divide factor 1 on NCCL; gloo lacks PREMUL_SUM, so there
FSDP's mean is kept and the loss carries a x world_size factor): the trainer divides every unit's
loss once by the step's global count, so N ranks x M micro-batches give one process's gradient.
Works with gloo on CPU (checked with torch 2.13) and NCCL on GPU.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

AMP_DTYPES = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def mesh_for(device: torch.device, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


def shard_policy(
    policy, mixed_precision: str, device: torch.device, world_size: int, reshard_after_forward: bool = True
):
    """Shard the policy's modules in place (``policy.sharded_modules()``: the LoRA-wrapped transformer; with
    full fine-tuning the transformer and its frozen reference copy); refreshes ``policy.params`` (now DTensors).

    Returns the FSDP root of the trained transformer and the loss multiplier of ``set_sum_reduction``."""
    mesh = mesh_for(device, world_size)
    amp = AMP_DTYPES[mixed_precision]
    mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32, cast_forward_inputs=False)
    kw = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
    modules = policy.sharded_modules()
    for transformer in modules:
        for block in block_units(transformer):
            fully_shard(block, **kw)
        fully_shard(transformer, **kw)
    policy.refresh_params()
    return modules[0], set_sum_reduction(modules[0], device)


def block_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks that become FSDP units below the root: every element of each ``nn.ModuleList`` child
    of the transformer (SD3 and Qwen-Image ``transformer_blocks``; FLUX.1/FLUX.2 their double- and
    single-stream stacks; Wan ``blocks``; Z-Image its two refiners and ``layers``), looking into child
    transformers (Wan2.2's two experts) the same way."""
    from diffusers import ModelMixin

    units: list[torch.nn.Module] = []
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            units.extend(child)
        elif isinstance(child, ModelMixin):
            units.extend(block_units(child))
    return units


def set_sum_reduction(root: torch.nn.Module, device: torch.device) -> float:
    """Make the FSDP units reduce gradient sums; returns the factor the loss must be multiplied by.

    NCCL: divide factor 1 (a PREMUL_SUM reduce-scatter), factor 1. gloo has no PREMUL_SUM, so the
    default mean over ranks is kept and the loss is multiplied by the world size instead.
    """
    import torch.distributed as dist

    if device.type == "cuda":
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
        return 1.0
    return float(dist.get_world_size())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank must call it), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(tensors: dict[str, torch.Tensor], to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Gathered copies of (possibly sharded) tensors, in sorted key order on every rank."""
    out = {}
    for name in sorted(tensors):
        t = full_tensor(tensors[name].detach())
        out[name] = t.cpu().clone() if to_cpu else t.clone()
    return out


@torch.no_grad()
def load_full_state(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly sharded) parameters: each rank keeps its own shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in params.items():
        value = state[name].to(p.dtype)
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(value.to(p.device_mesh.device_type), p.device_mesh, p.placements))
        else:
            p.copy_(value.to(p.device))


@torch.no_grad()
def shard_like(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors (keyed like ``params``) cut into this rank's shards the way ``params`` are, in fp32."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for name, value in state.items():
        p = params[name] if name in params else None
        value = value.float()
        out[name] = (distribute_tensor(value.to(p.device_mesh.device_type), p.device_mesh, p.placements)
                     if isinstance(p, DTensor) else value)
    return out


def offload_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> int:
    """Move every optimizer state tensor to ``device`` (CPU while the engine samples). Returns bytes moved."""
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)
                moved += value.numel() * value.element_size()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return moved
