"""Rollout engines by name: ``sampling.engine`` -> an engine over a policy's weights.

An engine has ``generate(...) -> Trajectory``, ``update_weights(state, version)`` (a LoRA's or a full
fine-tune's tensors), ``release_memory()`` / ``resume_memory()`` and ``close()``
(``rollout.base.RolloutEngine``). A new
engine is one module in ``rollout/`` plus one branch here.
"""

from __future__ import annotations


def make_engine(cfg, adapter, policy, progress: bool = False):
    """The engine of ``cfg.sampling.engine`` serving ``adapter``'s model with ``policy``'s weights."""
    name = cfg.sampling.engine
    if name == "local":
        from diffusionrl.rollout.local import LocalRolloutEngine

        return LocalRolloutEngine(adapter, policy.engine_copy(), cfg.train.micro_batch_size, progress=progress)
    if name == "sglang":
        from diffusionrl.rollout.sglang import SGLangRolloutEngine

        return SGLangRolloutEngine.from_config(cfg, adapter, policy)
    raise ValueError(f"unknown rollout engine {name!r}")
