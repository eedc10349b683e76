"""Deterministic mode for a trainer process (``train.deterministic``).

``torch.use_deterministic_algorithms(True)`` makes non-deterministic kernels raise instead of
silently varying; cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first handle; cuDNN
autotuning is off; scaled-dot-product attention is limited to the math and memory-efficient
backends (flash attention's backward uses atomics). Call it before the model is built.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def enable_deterministic(seed: int | None = None) -> dict[str, object]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)
    if seed is not None:
        torch.manual_seed(seed)
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
    }
