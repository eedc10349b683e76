"""The objective-specific keys of the ``algorithm`` section and the checks that tie them to the rest.

``ObjectiveOptions`` is a base class of ``diffusionrl.config.AlgorithmConfig``: its fields are
``algorithm.*`` keys like the others (same YAML, overrides, digest and help), kept in this module so
that the schema file stays small. The maths of each objective is in ``docs/algorithms.md``
(section 14 has the table of objectives, their knobs and their tests). This module imports no schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import NonNegativeFloat, PositiveFloat

from .tree import ConfigError, option

# algorithm.name -> objective (training/objective.py OBJECTIVES holds the classes)
ALGORITHMS = ("flow_grpo", "nft", "grpo_guard", "dppo", "awm", "dpo", "sft")
# Objectives that recompute the per-step log-probs of SDE rollouts (the others re-noise ODE samples).
SDE_OBJECTIVES = ("flow_grpo", "grpo_guard", "dppo")
# Rollout dynamics with an exact Gaussian log-density (GRPO-Guard's ratio normalisation needs one).
EXACT_SDE_TYPES = ("sde", "dance")


@dataclass
class ObjectiveOptions:
    kl_space: Literal["auto", "x", "v"] = option(
        "auto", "Space of the KL to the reference (weight kl_beta): x = the step Gaussians' term of section 5 "
        "(SDE objectives only) | v = mean |v - v_ref|^2 | auto = x for flow_grpo/grpo_guard/dppo, v otherwise"
    )
    guard_ratio_norm: bool = option(
        True, "GRPO-Guard RatioNorm: ratio = exp(step_std * (log_ratio + |mean - mean_old|^2 / (2 step_std^2)))"
    )
    guard_reweight: bool = option(True, "GRPO-Guard gradient reweighting: each step's policy loss divided by |dt|")
    dppo_kl_threshold: NonNegativeFloat = option(
        1e-6, "Flow-DPPO trust region: a pair whose KL(current || old) > this and whose ratio moved in the "
        "direction of its advantage is masked out of the gradient"
    )
    dppo_kl_space: Literal["x", "v"] = option(
        "x", "Flow-DPPO trust-region divergence: x = exact KL of the step Gaussians (mean over elements) | "
        "v = mean |v - v_old|^2"
    )
    dpo_beta: PositiveFloat = option(
        5000.0, "Online Diffusion-DPO temperature beta on the per-element-mean error (Diffusion-DPO's SD1.5 value, "
        "with a full fine-tune at lr ~2e-5); the margin moves by ~beta/2 * lr per Adam step, so keep beta * "
        "learning_rate <~ 0.1 or the sigmoid saturates after a step and nothing is learned (tiny-cpu-dpo: 5 at lr 1e-2)"
    )
    dpo_pairs: Literal["best_worst", "all"] = option(
        "best_worst", "Online Diffusion-DPO pairs per prompt group: best_worst (highest vs lowest reward) | all "
        "(every positive-advantage sample vs every negative-advantage one)"
    )
    sft_source: str = option(
        "", "SFT (prompt, image) pairs: a folder of images with prompts.jsonl/metadata.jsonl, a .parquet with "
        "prompt and image-bytes columns, or builtin:shapes[:N] (diffusionrl/data/image_pairs.py)"
    )
    init_lora: str = option("", "peft LoRA folder the policy starts from (e.g. an SFT run's lora/); '' = fresh init")
    group_renoise: bool = option(
        False, "DiffusionNFT / AWM: re-noise the samples of a prompt group at the same noise levels with the same "
        "noise (common random numbers): the part of each sample's gradient that does not depend on its clean "
        "latent cancels between the group's positive and negative samples (docs/algorithms.md section 7)"
    )

    def check_objective_options(self) -> None:
        name = getattr(self, "name", "")
        if name == "sft" and not self.sft_source.strip():
            raise ConfigError("algorithm.name=sft needs algorithm.sft_source (a folder, a .parquet or builtin:shapes)")
        if self.kl_space == "x" and name not in SDE_OBJECTIVES:
            raise ConfigError(
                f"algorithm.kl_space=x needs the step Gaussians of SDE rollouts; {name} re-noises clean samples "
                "and has no step Gaussian: use kl_space=v (or auto)"
            )


def resolved_kl_space(algorithm) -> str:
    """``algorithm.kl_space`` with ``auto`` resolved for ``algorithm.name``."""
    if algorithm.kl_space != "auto":
        return algorithm.kl_space
    return "x" if algorithm.name in SDE_OBJECTIVES else "v"


def check_objective_fit(cfg) -> None:
    """Checks that tie an objective to the sampling and train sections (called by ``Config.__post_init__``)."""
    name, sc = cfg.algorithm.name, cfg.sampling
    tc = cfg.train
    # Every objective but SFT learns from group advantages (algorithms.advantages; with group_size 1
    # the batch is z-scored instead, docs/algorithms.md section 4): a batch of one sample has none,
    # and DPO pairs samples of one prompt group, of which group_size 1 has no pair.
    if name == "dpo" and tc.group_size < 2:
        raise ConfigError(
            f"algorithm.name=dpo pairs samples of the same prompt: train.group_size={tc.group_size} forms no "
            "pair, so no step would update the weights; use train.group_size >= 2"
        )
    if name != "sft" and tc.prompts_per_step * tc.group_size < 2:
        raise ConfigError(
            f"algorithm.name={name} learns from advantages relative to other samples: a step of "
            f"train.prompts_per_step * group_size = 1 sample has none (its advantage is 0), so no step would "
            "update the weights; use train.group_size >= 2"
        )
    if name == "awm" and (tc.minibatches != 1 or tc.inner_epochs != 1):
        raise ConfigError(
            f"algorithm.name=awm with train.minibatches={tc.minibatches}, train.inner_epochs={tc.inner_epochs}: AWM "
            "has no ratio or clip: every update after the first would be off-policy; set train.minibatches=1 and "
            "train.inner_epochs=1"
        )
    if name == "grpo_guard" and sc.sde_type not in EXACT_SDE_TYPES:
        raise ConfigError(
            f"algorithm.name=grpo_guard needs rollouts with an exact Gaussian log-prob (sampling.sde_type "
            f"{' or '.join(EXACT_SDE_TYPES)}): its ratio normalisation adds back |mean - mean_old|^2 / (2 "
            f"step_std^2), which {sc.sde_type} does not have in its log-prob"
        )
    if name in SDE_OBJECTIVES and sc.sde_type == "ode":
        raise ConfigError(
            f"algorithm.name={name} needs stochastic rollouts: set sampling.sde_type to sde, dance or cps "
            "(ode has no log-probs to train on)"
        )
    if cfg.train.world_size > 1 and (cfg.algorithm.init_lora or name == "sft"):
        raise ConfigError("algorithm.init_lora and algorithm.name=sft run in one process: set train.world_size=1")
    if sc.same_latent and name not in SDE_OBJECTIVES:
        raise ConfigError(
            f"sampling.same_latent with algorithm.name={name}: its rollouts are ODE, so a group sharing its initial "
            "latent would be one image repeated (no reward spread); same_latent is for " + ", ".join(SDE_OBJECTIVES)
        )
    if sc.same_latent and sc.engine == "sglang":
        raise ConfigError("sampling.same_latent is not available with sampling.engine=sglang (the server draws each "
                          "output's initial latent from its own seed); use sampling.engine=local")
    if sc.engine == "sglang" and sc.step_strategy == "mix_window":
        raise ConfigError("sampling.step_strategy=mix_window is not available with sampling.engine=sglang (MixGRPO's "
                          "sliding window is not verified against SGLang's diffusion runtime); use "
                          "sampling.engine=local")
    if sc.engine == "sglang" and sc.ode_solver != "euler":
        raise ConfigError(f"sampling.ode_solver={sc.ode_solver} is not available with sampling.engine=sglang (its "
                          "server takes Euler ODE steps only); use sampling.engine=local")
    if name in SDE_OBJECTIVES and sc.engine == "sglang" and sc.sde_type == "dance":
        raise ConfigError(
            "sampling.sde_type=dance is not available with sampling.engine=sglang (the server samples sde or cps); "
            "use sampling.engine=local"
        )
