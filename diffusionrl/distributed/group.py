"""torch.distributed inside Ray actors: rank 0 publishes its address, every rank joins."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def node_address_and_port() -> tuple[str, int]:
    """This host's routable address (Ray's node IP when in a Ray worker) and a free TCP port."""
    try:
        import ray

        addr = ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        addr = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return addr, int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
               timeout_s: float = 600.0) -> None:
    """Join the trainer group (NCCL on GPU, gloo on CPU). Idempotent within a process."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def all_reduce_scalar(value: float, op=dist.ReduceOp.SUM, device: torch.device | str = "cpu") -> float:
    """All-reduce a float (float64 so sums of counts stay exact)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return float(t.item())


def all_reduce_sums(values: dict[str, float], device: torch.device | str = "cpu") -> dict[str, float]:
    """Key-wise sum over ranks of ``values`` (every rank passes the same keys, sorted here)."""
    keys = sorted(values)
    if not keys:
        return {}
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_gather_keys(keys: list[str]) -> list[str]:
    """The union of every rank's keys (stat names can differ when a rank had no units)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return sorted(set(keys))
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, sorted(set(keys)))
    return sorted({k for ks in out for k in ks})
