"""The Flow-DPPO objective (docs/algorithms.md section 14.3): Flow-GRPO's units and recompute, the
ratio clip replaced by the asymmetric trust-region mask of ``algorithms.dppo``.

The divergence compares the live step with the rollout policy's (``needs_old``): 0 on the first
optimizer step of an RL step (the live policy is the rollout policy), a forward with the step's
starting LoRA after it. Logged: ``train/clipfrac`` is the share of pairs the mask removed (the
counterpart of PPO's clipped share), ``train/dppo_kl`` the mean KL(current || old).
"""

from __future__ import annotations

import torch

from diffusionrl.algorithms.dppo import dppo_terms, trust_region_divergence

from .flow_grpo import FlowGRPOObjective, PairTerms, StepEval


class DPPOObjective(FlowGRPOObjective):
    name = "dppo"
    needs_old = True

    def pair_terms(self, step_eval: StepEval, log_prob_old: torch.Tensor, advantages: torch.Tensor) -> PairTerms:
        algo_cfg = self.cfg.algorithm
        divergence = trust_region_divergence(
            algo_cfg.dppo_kl_space, mean_new=step_eval.out.mean, mean_old=step_eval.mean_old,
            step_std=step_eval.out.step_std, v_new=step_eval.v, v_old=step_eval.v_old,
        )
        terms = dppo_terms(step_eval.out.log_prob, log_prob_old, advantages, divergence=divergence,
                           threshold=algo_cfg.dppo_kl_threshold, kl_beta=algo_cfg.kl_beta,
                           kl=self.reference_kl(step_eval))
        ratio = terms.ratio.detach()
        extra = {"clipfrac": terms.masked.float(), "dppo_kl": terms.divergence, "ratio_abs_minus_1": (ratio - 1).abs()}
        return PairTerms(terms.loss, terms.policy_loss, terms.kl, extra)
