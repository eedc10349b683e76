"""Policy-update maths: advantages, the per-pair losses of each algorithm, and the SDE steps with their
log-probs that rollouts and recomputation share (``sde``)."""

from .advantages import Advantages, group_advantages
from .flow_grpo import FlowGRPOTerms, flow_grpo_terms, ratio_stats
from .nft import NFTTerms, adaptive_weight, nft_optimality, nft_terms, noisy_latents, old_policy_eta

__all__ = [
    "Advantages",
    "FlowGRPOTerms",
    "NFTTerms",
    "adaptive_weight",
    "flow_grpo_terms",
    "group_advantages",
    "nft_optimality",
    "nft_terms",
    "noisy_latents",
    "old_policy_eta",
    "ratio_stats",
]
