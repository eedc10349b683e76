"""The GRPO-Guard objective (docs/algorithms.md section 14.2): Flow-GRPO's units and recompute with
RatioNorm and per-step gradient reweighting (``algorithms.grpo_guard``).

Its bias term compares the live step mean with the rollout policy's, so it ``needs_old``: while the
live policy is the rollout policy (the first optimizer step of an RL step) that is the live mean
detached, after it a forward with the step's starting LoRA (``FlowGRPOObjective.evaluate``).
"""

from __future__ import annotations

import torch

from diffusionrl.algorithms.grpo_guard import grpo_guard_terms

from .flow_grpo import FlowGRPOObjective, PairTerms, StepEval


class GRPOGuardObjective(FlowGRPOObjective):
    name = "grpo_guard"
    needs_old = True

    def pair_terms(self, step_eval: StepEval, log_prob_old: torch.Tensor, advantages: torch.Tensor) -> PairTerms:
        algo_cfg = self.cfg.algorithm
        terms = grpo_guard_terms(
            step_eval.out.log_prob, log_prob_old, advantages, mean_new=step_eval.out.mean, mean_old=step_eval.mean_old,
            step_std=step_eval.out.step_std, dt=step_eval.dt, clip_range=algo_cfg.clip_range,
            ratio_norm=algo_cfg.guard_ratio_norm, reweight=algo_cfg.guard_reweight, kl_beta=algo_cfg.kl_beta,
            kl=self.reference_kl(step_eval),
        )
        ratio = terms.ratio.detach()
        extra = {
            "clipfrac": ((ratio - 1.0).abs() > algo_cfg.clip_range).float(),  # of the ratio that is clipped
            "ratio_abs_minus_1": (ratio - 1.0).abs(),
            "guard_ratio_mean": ratio,
            "guard_bias": terms.bias,
        }
        return PairTerms(terms.loss, terms.policy_loss, terms.kl, extra)
