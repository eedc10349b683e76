"""Policy-update maths: advantages and the per-pair losses of each algorithm."""

from .advantages import Advantages, group_advantages
from .flow_grpo import FlowGRPOTerms, flow_grpo_terms, ratio_stats

__all__ = ["Advantages", "FlowGRPOTerms", "flow_grpo_terms", "group_advantages", "ratio_stats"]
