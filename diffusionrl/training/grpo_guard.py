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

    def pair_terms(self, ev: StepEval, log_prob_old: torch.Tensor, advantages: torch.Tensor) -> PairTerms:
        ac = self.cfg.algorithm
        terms = grpo_guard_terms(
            ev.out.log_prob, log_prob_old, advantages, mean_new=ev.out.mean, mean_old=ev.mean_old,
            step_std=ev.out.step_std, dt=ev.dt, clip_range=ac.clip_range, ratio_norm=ac.guard_ratio_norm,
            reweight=ac.guard_reweight, kl_beta=ac.kl_beta, kl=self.reference_kl(ev),
        )
        ratio = terms.ratio.detach()
        extra = {
            "clipfrac": ((ratio - 1.0).abs() > ac.clip_range).float(),  # of the ratio that is clipped
            "ratio_abs_minus_1": (ratio - 1.0).abs(),
            "guard_ratio_mean": ratio,
            "guard_bias": terms.bias,
        }
        return PairTerms(terms.loss, terms.policy_loss, terms.kl, extra)
