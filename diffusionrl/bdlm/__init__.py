"""Block-diffusion language models: GRPO with exact full-trace replay (docs/bdlm.md).

Stages (what a workflow calls)::

    cfg = load_bdlm_config("tiny-bdlm", overrides=["grpo.steps=40"])
    init_dir = warm_start(cfg, "runs/bdlm/warm")                  # -> model folder
    result = train_grpo(cfg, "runs/bdlm/grpo", init_dir)          # resumable; result.model_dir
    metrics = evaluate(cfg, result.model_dir)                     # {"eval/exact_match": ...}

Components: ``decode`` (sampler with trace), ``TraceBatch`` + Parquet (``trace``),
``replay_log_probs`` (exact replay), ``TraceGRPO`` (grpo / dapo / dr_grpo / opd), model adapters
(``load_bdlm``: the built-in tiny model, Hugging Face masked LMs, DiffusionGemma through the stock
``DiffusionGemmaPipeline`` with a recorded ``gemma_rollout.CanvasTrace``, imported on use: it
needs diffusers).
"""

from .backend import BDLMBackend, train_grpo
from .config import BDLMConfig, load_bdlm_config
from .evaluation import compare, decode_examples, eval_key, evaluate, evaluate_adapter
from .gemma import DiffusionGemmaAdapter
from .grpo import OBJECTIVE, OldPolicy, TraceGRPO, categorical_kl, grpo_token_terms
from .loading import load_bdlm
from .model import (
    VOCAB,
    HFMaskedLMAdapter,
    TinyBDLMAdapter,
    Vocab,
    frozen_copy,
    weights_digest,
)
from .replay import replay_canvas, replay_log_probs
from .sampler import Decoded, decode
from .task import make_splits
from .trace import TraceBatch, TraceError, read_trace, read_traces, write_step
from .warmstart import warm_start

__all__ = [
    "OBJECTIVE",
    "VOCAB",
    "BDLMConfig",
    "BDLMBackend",
    "DiffusionGemmaAdapter",
    "Decoded",
    "HFMaskedLMAdapter",
    "OldPolicy",
    "TinyBDLMAdapter",
    "TraceBatch",
    "TraceError",
    "TraceGRPO",
    "Vocab",
    "categorical_kl",
    "compare",
    "decode_examples",
    "decode",
    "eval_key",
    "evaluate",
    "evaluate_adapter",
    "frozen_copy",
    "grpo_token_terms",
    "load_bdlm",
    "load_bdlm_config",
    "make_splits",
    "read_trace",
    "read_traces",
    "replay_canvas",
    "replay_log_probs",
    "train_grpo",
    "warm_start",
    "weights_digest",
    "write_step",
]
