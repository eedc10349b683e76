"""Every objective's configuration facts, one block each: its own ``algorithm.*`` keys, its flags,
its checks and its registration.

A block is an options dataclass (the keys only this objective reads, their defaults, help texts,
choices and bounds in their type hints: ``Literal[...]``, pydantic's ``PositiveFloat``..., and other
value checks in an optional ``check``, which runs whatever ``algorithm.name`` is) and an ``Objective``
record: the name, what it is (the model card's line), the options, its flags and ``fit``, the checks
that tie it to the sampling and train sections when it is the one named. The flags:

- ``rollouts``: ``sde`` = recomputes the per-step log-probs of SDE rollouts (``kl_space`` auto = x,
  ``same_latent`` allowed, ``ode`` refused), ``ode`` = re-noises the clean latents of ODE samples,
  ``data`` = trains on a dataset of (prompt, image) pairs, no rewards;
- ``old_policy``: keeps an fp32 copy of the old policy's LoRA (the planner counts it);
- ``one_process``: the config refuses ``train.world_size > 1``; every other objective runs on
  ``train.world_size`` FSDP ranks (``ranks``: ``distributed/worker.py`` drives its class on every rank).

``OBJECTIVES`` lists the records: that line registers an objective. ``diffusionrl.config.AlgorithmConfig``
is composed from them: the keys several objectives share, then each registered objective's options
in this order (``option_classes``). The class the trainer drives is the one in
``diffusionrl/training/<name>.py`` whose ``name`` is the objective's (``training.objective``), its maths
``diffusionrl/algorithms/<name>.py``, its row ``docs/algorithms.md`` 14.1. This module imports no
schema and no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat

from .tree import ConfigError, option

# Rollout dynamics with an exact Gaussian log-density (GRPO-Guard's ratio normalisation needs one).
EXACT_SDE_TYPES = ("sde", "dance")


@dataclass(frozen=True)
class Objective:
    """The configuration facts of one objective (see the module docstring); naming it in ``OBJECTIVES``
    registers the objective.

    Args:
        name (`str`): ``algorithm.name``; ``diffusionrl/training/<name>.py`` holds its class.
        title (`str`): what it is, with its paper (the model card's line).
        options (`type`, *optional*, defaults to `None`): the dataclass of its own ``algorithm.*`` keys.
        rollouts (`str`, *optional*, defaults to ``"sde"``): ``sde`` | ``ode`` | ``data`` (see the module docstring).
        old_policy (`bool`, *optional*, defaults to `False`): it keeps an fp32 copy of the old policy's LoRA.
        one_process (`bool`, *optional*, defaults to `False`): the config refuses ``train.world_size > 1``
            (else it runs on ranks: ``ranks``).
        fit (`Callable[[Config], None]`, *optional*, defaults to `None`): cross-section checks, run when it is
            the objective named; raises ``ConfigError``.
    """

    name: str
    title: str
    options: type | None = None
    rollouts: str = "sde"  # sde | ode | data
    old_policy: bool = False
    one_process: bool = False
    fit: Callable[[object], None] | None = None

    @property
    def ranks(self) -> bool:
        """It runs with ``train.world_size > 1`` (``distributed/worker.py`` drives its class on every rank)."""
        return not self.one_process

    @property
    def sde(self) -> bool:
        """It recomputes the step log-probs of stochastic rollouts (it has step Gaussians)."""
        return self.rollouts == "sde"

    @property
    def rewarded(self) -> bool:
        """It learns from scored rollouts (group advantages), not from a dataset."""
        return self.rollouts != "data"


# -- flow_grpo: Flow-GRPO (section 5) ----------------------------------------------------------------
FLOW_GRPO = Objective("flow_grpo", "Flow-GRPO (Liu et al. 2025)")


# -- nft: DiffusionNFT (section 7) -------------------------------------------------------------------
@dataclass
class NFTOptions:
    nft_beta: PositiveFloat = option(1.0, "DiffusionNFT guidance strength b of the implicit positive/negative policies")
    nft_adv_clip: PositiveFloat = option(5.0, "DiffusionNFT advantage clip c in r = clamp(A, -c, c) / (2c) + 0.5")
    old_policy_rate: NonNegativeFloat = option(
        0.001, "DiffusionNFT old-policy EMA ramp: eta = min(rate * max(step - flat, 0), cap)"
    )
    old_policy_flat: NonNegativeInt = option(0, "DiffusionNFT steps before the old-policy eta ramp starts")
    old_policy_cap: float = option(0.5, "DiffusionNFT maximum old-policy eta")
    nft_timesteps: NonNegativeInt = option(
        0, "DiffusionNFT noise levels trained per sample and step: 0 = all T - 1; k = the first k of each sample's "
        "random order (a timestep fraction of k / T): k / (T - 1) of the update's cost"
    )

    def check(self) -> None:
        if not 0 <= self.old_policy_cap < 1:
            raise ConfigError(f"algorithm.old_policy_cap={self.old_policy_cap} must be in [0, 1)")


def _nft_fit(cfg) -> None:
    algo_cfg = cfg.algorithm
    if algo_cfg.nft_timesteps > cfg.sampling.num_steps - 1:
        raise ConfigError(f"algorithm.nft_timesteps={algo_cfg.nft_timesteps} exceeds the rollout's "
                          f"{cfg.sampling.num_steps - 1} trainable noise levels (sampling.num_steps - 1); "
                          "use 0 for all of them")
    if algo_cfg.nft_adv_clip > algo_cfg.adv_clip_max:
        lo = 0.5 - algo_cfg.adv_clip_max / (2 * algo_cfg.nft_adv_clip)
        raise ConfigError(
            f"algorithm.nft_adv_clip={algo_cfg.nft_adv_clip} exceeds algorithm.adv_clip_max={algo_cfg.adv_clip_max}: "
            f"advantages are already clamped to +-{algo_cfg.adv_clip_max}, so DiffusionNFT's r would never leave "
            f"[{lo:g}, {1 - lo:g}]; set nft_adv_clip <= adv_clip_max (the reference uses 5 for both)"
        )


NFT = Objective("nft", "DiffusionNFT (Zheng et al. 2025)", NFTOptions, rollouts="ode", old_policy=True, fit=_nft_fit)


# -- grpo_guard: GRPO-Guard (section 14.2) -------------------------------------------------------------
@dataclass
class GuardOptions:
    guard_ratio_norm: bool = option(
        True, "GRPO-Guard RatioNorm: ratio = exp(step_std * (log_ratio + |mean - mean_old|^2 / (2 step_std^2)))"
    )
    guard_reweight: bool = option(True, "GRPO-Guard gradient reweighting: each step's policy loss divided by |dt|")


def _guard_fit(cfg) -> None:
    if cfg.sampling.sde_type not in EXACT_SDE_TYPES:
        raise ConfigError(
            f"algorithm.name=grpo_guard needs rollouts with an exact Gaussian log-prob (sampling.sde_type "
            f"{' or '.join(EXACT_SDE_TYPES)}): its ratio normalisation adds back |mean - mean_old|^2 / (2 "
            f"step_std^2), which {cfg.sampling.sde_type} does not have in its log-prob"
        )


GRPO_GUARD = Objective("grpo_guard", "GRPO-Guard (Wang et al. 2025)", GuardOptions, old_policy=True, fit=_guard_fit)


# -- dppo: Flow-DPPO (section 14.3) --------------------------------------------------------------------
@dataclass
class DPPOOptions:
    dppo_kl_threshold: NonNegativeFloat = option(
        1e-6, "Flow-DPPO trust region: a pair whose KL(current || old) > this and whose ratio moved in the "
        "direction of its advantage is masked out of the gradient"
    )
    dppo_kl_space: Literal["x", "v"] = option(
        "x", "Flow-DPPO trust-region divergence: x = exact KL of the step Gaussians (mean over elements) | "
        "v = mean |v - v_old|^2"
    )


DPPO = Objective("dppo", "Flow-DPPO (Ping et al. 2026)", DPPOOptions, old_policy=True)


# -- awm: Advantage Weighted Matching (section 14.4) ---------------------------------------------------
def _awm_fit(cfg) -> None:
    train_cfg = cfg.train
    if train_cfg.minibatches != 1 or train_cfg.inner_epochs != 1:
        raise ConfigError(
            f"algorithm.name=awm with train.minibatches={train_cfg.minibatches}, "
            f"train.inner_epochs={train_cfg.inner_epochs}: AWM has no ratio or clip: every update after the first "
            "would be off-policy; set train.minibatches=1 and train.inner_epochs=1"
        )


AWM = Objective("awm", "Advantage Weighted Matching (Xue et al. 2025)", rollouts="ode", fit=_awm_fit)


# -- dpo: online Diffusion-DPO (section 14.5) ----------------------------------------------------------
@dataclass
class DPOOptions:
    dpo_beta: PositiveFloat = option(
        5000.0, "Online Diffusion-DPO temperature beta on the per-element-mean error (Diffusion-DPO's SD1.5 value, "
        "with a full fine-tune at lr ~2e-5); the margin moves by ~beta/2 * lr per Adam step, so keep beta * "
        "learning_rate <~ 0.1 or the sigmoid saturates after a step and nothing is learned (tiny-cpu-dpo: 5 at lr 1e-2)"
    )
    dpo_pairs: Literal["best_worst", "all"] = option(
        "best_worst", "Online Diffusion-DPO pairs per prompt group: best_worst (highest vs lowest reward) | all "
        "(every positive-advantage sample vs every negative-advantage one)"
    )


def _dpo_fit(cfg) -> None:
    if cfg.train.group_size < 2:
        raise ConfigError(
            f"algorithm.name=dpo pairs samples of the same prompt: train.group_size={cfg.train.group_size} forms no "
            "pair, so no step would update the weights; use train.group_size >= 2"
        )


DPO = Objective("dpo", "online Diffusion-DPO (after Wallace et al. 2024)", DPOOptions, rollouts="ode", fit=_dpo_fit)


# -- sft: supervised flow matching on (prompt, image) pairs (section 14.7) ---------------------------------
@dataclass
class SFTOptions:
    sft_source: str = option(
        "", "SFT (prompt, image) pairs: a folder of images with prompts.jsonl/metadata.jsonl, a .parquet with "
        "prompt and image-bytes columns, or builtin:shapes[:N] (diffusionrl/data/image_pairs.py)"
    )

    def check(self) -> None:
        if getattr(self, "name", "") == "sft" and not self.sft_source.strip():
            raise ConfigError("algorithm.name=sft needs algorithm.sft_source (a folder, a .parquet or builtin:shapes)")


SFT = Objective("sft", "supervised flow matching (SFT warm start)", SFTOptions, rollouts="data", one_process=True)


# -- the registry ------------------------------------------------------------------------------------
OBJECTIVES = (FLOW_GRPO, NFT, GRPO_GUARD, DPPO, AWM, DPO, SFT)
ALGORITHMS = tuple(o.name for o in OBJECTIVES)  # the values of algorithm.name
SDE_OBJECTIVES = tuple(o.name for o in OBJECTIVES if o.sde)
RANKED = tuple(o.name for o in OBJECTIVES if o.ranks)  # those train.world_size > 1 runs
_BY_NAME = {o.name: o for o in OBJECTIVES}


def objective(name: str) -> Objective:
    """The record of ``algorithm.name`` ``name`` (a ``ConfigError`` naming the known ones if none)."""
    if name not in _BY_NAME:
        raise ConfigError(f"algorithm.name={name!r} is not one of {list(ALGORITHMS)}")
    return _BY_NAME[name]


def option_classes() -> tuple[type, ...]:
    """The registered objectives' options dataclasses, in registration order."""
    return tuple(o.options for o in OBJECTIVES if o.options is not None)


def resolved_kl_space(algorithm) -> str:
    """``algorithm.kl_space`` with ``auto`` resolved for ``algorithm.name``."""
    if algorithm.kl_space != "auto":
        return algorithm.kl_space
    return "x" if objective(algorithm.name).sde else "v"


def check_objective_fit(cfg) -> None:
    """Checks that tie the named objective to the sampling and train sections (``Config.__post_init__``)."""
    spec, sampling_cfg, train_cfg = objective(cfg.algorithm.name), cfg.sampling, cfg.train
    name = spec.name
    if spec.fit is not None:
        spec.fit(cfg)
    # Every rewarded objective learns from group advantages (algorithms.advantages; with group_size 1
    # the batch is z-scored instead, docs/algorithms.md section 4): a batch of one sample has none.
    if spec.rewarded and train_cfg.prompts_per_step * train_cfg.group_size < 2:
        raise ConfigError(
            f"algorithm.name={name} learns from advantages relative to other samples: a step of "
            f"train.prompts_per_step * group_size = 1 sample has none (its advantage is 0), so no step would "
            "update the weights; use train.group_size >= 2"
        )
    if spec.sde and sampling_cfg.sde_type == "ode":
        raise ConfigError(
            f"algorithm.name={name} needs stochastic rollouts: set sampling.sde_type to sde, dance or cps "
            "(ode has no log-probs to train on)"
        )
    if train_cfg.world_size > 1 and spec.one_process:
        raise ConfigError(f"algorithm.name={name} runs in one process: set train.world_size=1")
    if cfg.model.finetune == "full":
        check_full_finetune(cfg)
    if sampling_cfg.same_latent and not spec.sde:
        raise ConfigError(
            f"sampling.same_latent with algorithm.name={name}: its rollouts are ODE, so a group sharing its initial "
            "latent would be one image repeated (no reward spread); same_latent is for " + ", ".join(SDE_OBJECTIVES)
        )
    if sampling_cfg.post_window_ode_steps and not spec.sde:
        raise ConfigError(f"sampling.post_window_ode_steps with algorithm.name={name}: its rollouts are all ODE, with "
                          "no SDE window to compress after; it is for " + ", ".join(SDE_OBJECTIVES))
    if spec.sde and sampling_cfg.engine == "sglang" and sampling_cfg.sde_type == "dance":
        raise ConfigError(
            "sampling.sde_type=dance is not available with sampling.engine=sglang (the server samples sde or cps); "
            "use sampling.engine=local"
        )


def needs_reference(cfg) -> bool:
    """Whether the objective forwards the reference model: a KL term, or DPO's implicit reward (a full
    fine-tune then holds a frozen copy of the base transformer, ``training.full.FullPolicy``)."""
    if not objective(cfg.algorithm.name).rewarded:  # sft: plain flow matching, no reference
        return False
    return cfg.algorithm.kl_beta > 0 or cfg.algorithm.name == "dpo"


def check_full_finetune(cfg) -> None:
    """``model.finetune=full``: what full fine-tuning runs with (``training.full.FullPolicy``)."""
    if cfg.model.dtype != "float32":
        raise ConfigError(
            f"model.finetune=full with model.dtype={cfg.model.dtype}: every transformer weight trains, so the weights "
            "are the fp32 master copy; set model.dtype=float32 (train.mixed_precision sets the compute precision)"
        )
    if cfg.algorithm.init_lora:
        raise ConfigError("model.finetune=full starts from the base weights: algorithm.init_lora (a LoRA) does not "
                          "apply; set algorithm.init_lora='' or model.finetune=lora")
    if cfg.model.lora_experts != "both":
        raise ConfigError(f"model.finetune=full trains both experts' weights: model.lora_experts="
                          f"{cfg.model.lora_experts} is for a LoRA; leave it at both")
