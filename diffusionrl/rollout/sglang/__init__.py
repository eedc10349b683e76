"""The SGLang rollout engine (``sampling.engine=sglang``, docs/sglang.md).

- ``server.py``: the ``sglang serve`` process (interpreter, ports, start/health/stop).
- ``protocol.py``: the ``/rollout/generate`` wire format and answers -> ``Trajectory`` parts.
- ``weight_sync.py``: the weight push (merged LoRA or full weights; by value or CUDA IPC) and its verification.
- ``engine.py``: ``SGLangRolloutEngine``, which ties them together (restarts and retries).
"""

from .engine import SGLangRolloutEngine
from .protocol import decode_tensors, request_body
from .server import (
    PRECISIONS,
    REPO_ROOT,
    SD3_MODEL_ID,
    SGLANG_PYTHON_ENV,
    SGLangServer,
    SGLangServerError,
    free_port,
    model_folder,
    resolve_sglang_python,
    sglang_available,
)
from .weight_sync import (
    MODULE_CHECKSUM_MAX_NUMEL,
    LoraLayer,
    base_transformer_state,
    buckets,
    full_named,
    lora_layers,
    merge_lora,
    tensor_sha256,
    weights_checksum,
)

__all__ = [
    "MODULE_CHECKSUM_MAX_NUMEL",
    "PRECISIONS",
    "REPO_ROOT",
    "SD3_MODEL_ID",
    "SGLANG_PYTHON_ENV",
    "LoraLayer",
    "SGLangRolloutEngine",
    "SGLangServer",
    "SGLangServerError",
    "base_transformer_state",
    "buckets",
    "decode_tensors",
    "free_port",
    "full_named",
    "lora_layers",
    "merge_lora",
    "model_folder",
    "request_body",
    "resolve_sglang_python",
    "sglang_available",
    "tensor_sha256",
    "weights_checksum",
]
