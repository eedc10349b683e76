"""The sections of the image config tree (``model``, ``algorithm``, ``reward``, ``train``, ``eval``,
``data``, ``tracking``; ``sampling`` is ``config.sampling``'s): every default, its help text and its
one-section checks. ``diffusionrl.config.Config`` assembles them and checks what spans sections.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from .objectives import ALGORITHMS, SDE_OBJECTIVES, objective, option_classes
from .sampling import check_guidance_2
from .tree import (
    ConfigError,
    check_constraints,
    option,
)


@dataclass
class ModelConfig:
    name: str = option(
        "builtin:tiny-sd3", "Model reference: a builtin ('builtin:tiny-sd3', 'builtin:tiny-flux', ...: "
        "docs/families.md), a local diffusers folder, or a hub id; the family is read from the folder's or hub's "
        "model_index.json"
    )
    revision: str = option("", "Hub revision (branch, tag or commit); empty for the default branch")
    dtype: Literal["float32", "float16", "bfloat16"] = option(
        "float32", "Weights dtype of the frozen modules: float32 | float16 | bfloat16"
    )
    device: str = option("auto", "Device: auto (cuda if available, else cpu) | cpu | cuda | cuda:N")
    max_sequence_length: PositiveInt = option(32, "T5 prompt length in tokens (SD3 pipelines default to 256)")
    lora_rank: PositiveInt = option(8, "LoRA rank r")
    lora_alpha: PositiveInt = option(16, "LoRA alpha (scale = alpha / r)")
    lora_init: Literal["gaussian", "true"] = option(
        "gaussian", "peft init_lora_weights: gaussian | true (kaiming, B = 0 in both)"
    )
    lora_targets: list[str] = option([], "Module name suffixes that get a LoRA adapter; empty: the family's own "
                                     "(its adapter's default_lora_targets, e.g. SD3's attention projections)")
    lora_experts: Literal["both", "high", "low"] = option(
        "both", "A model with two experts (Wan2.2 A14B): which gets the LoRA: both | high (transformer, high-noise "
        "steps) | low (transformer_2, low-noise steps)"
    )
    gradient_checkpointing: bool = option(False, "Recompute transformer activations in backward")
    finetune: Literal["lora", "full"] = option(
        "lora", "What trains: lora (a peft LoRA on model.lora_targets, the base frozen) | full (every transformer "
        "weight, fp32 master weights; the KL reference is a frozen copy of the base transformer)"
    )

    def __post_init__(self) -> None:
        check_constraints(self, "model")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"model.device={self.device!r} is not a device: use auto, cpu, cuda or cuda:N")


@dataclass
class AlgorithmKeys:
    """The ``algorithm.*`` keys several objectives read; each objective's own are in its block of
    ``diffusionrl/config/objectives.py``."""

    name: Literal[ALGORITHMS] = option("flow_grpo", "Policy update: " + " | ".join(ALGORITHMS))
    clip_range: PositiveFloat = option(1e-4, "PPO ratio clip epsilon (log-probs are per-element means, hence tiny)")
    kl_beta: NonNegativeFloat = option(0.04, "Weight of the KL term against the LoRA-disabled reference (0 skips it)")
    adv_clip_max: PositiveFloat = option(5.0, "Advantages are clamped to [-adv_clip_max, adv_clip_max]")
    global_std: bool = option(True, "Normalise advantages by the batch std instead of the group std")
    kl_space: Literal["auto", "x", "v"] = option(
        "auto", "Space of the KL to the reference (weight kl_beta): x = the step Gaussians' term of section 5 "
        f"(SDE objectives only) | v = mean |v - v_ref|^2 | auto = x for {'/'.join(SDE_OBJECTIVES)}, v otherwise"
    )
    init_lora: str = option("", "peft LoRA folder the policy starts from (e.g. an SFT run's lora/); '' = fresh init")
    group_renoise: bool = option(
        False, "DiffusionNFT / AWM: re-noise the samples of a prompt group at the same noise levels with the same "
        "noise (common random numbers): the part of each sample's gradient that does not depend on its clean "
        "latent cancels between the group's positive and negative samples (docs/algorithms.md section 7)"
    )


@dataclass
class AlgorithmConfig(*reversed(option_classes()), AlgorithmKeys):  # fields: AlgorithmKeys', then each option class'
    """The ``algorithm`` section: the shared keys, then every registered objective's own keys."""

    def __post_init__(self) -> None:
        check_constraints(self, "algorithm")
        for options in option_classes():
            if hasattr(options, "check"):
                options.check(self)
        if self.kl_space == "x" and not objective(self.name).sde:
            raise ConfigError(
                f"algorithm.kl_space=x needs the step Gaussians of SDE rollouts; {self.name} re-noises clean samples "
                "and has no step Gaussian: use kl_space=v (or auto)"
            )


@dataclass
class RewardConfig:
    weights: dict[str, float] = option({"jpeg_compressibility": 1.0}, "Reward name -> weight of a weighted sum")
    num_actors: NonNegativeInt = option(0, "Ray CPU actors scoring rewards (0 scores in-process)")
    ocr_backend: Literal["rapidocr", "paddleocr"] = option("rapidocr", "OCR backend: rapidocr | paddleocr")
    ocr_model_dir: str = option("", "PaddleOCR: folder holding det/ and rec/ model folders")
    ocr_threads: int = option(0, "onnxruntime intra-op threads per OCR engine (0: the reward actor's CPU "
                              "share, else onnxruntime's default)")
    pickscore_processor: str = option("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "PickScore processor id or folder")
    pickscore_model: str = option("yuvalkirstain/PickScore_v1", "PickScore model id or folder")

    def __post_init__(self) -> None:
        check_constraints(self, "reward")
        if not self.weights:
            raise ConfigError("reward.weights is empty: give at least one reward, e.g. {jpeg_compressibility: 1.0}")


@dataclass
class TrainConfig:
    steps: PositiveInt = option(40, "Number of RL steps (rollout + update)")
    prompts_per_step: PositiveInt = option(4, "Distinct prompts (groups) sampled per step")
    group_size: PositiveInt = option(8, "Samples per prompt k")
    micro_batch_size: PositiveInt = option(8, "Samples per forward pass; sampling and training use the same batches")
    inner_epochs: PositiveInt = option(1, "Passes over each rollout batch (log_prob_old stays the rollout's)")
    minibatches: PositiveInt = option(1, "Optimizer steps per inner epoch (the batch is split into this many)")
    learning_rate: PositiveFloat = option(3e-4, "AdamW learning rate")
    lr_schedule: Literal["constant", "cosine"] = option(
        "constant", "Learning rate over the run's steps: constant | cosine (decays from learning_rate to "
        "learning_rate * lr_min_ratio at the last of train.steps; a resume that changes train.steps spreads the rest "
        "of the decay over the new count); both after lr_warmup_steps of linear warm-up")
    lr_warmup_steps: NonNegativeInt = option(0, "Steps of linear warm-up from learning_rate / lr_warmup_steps")
    lr_min_ratio: NonNegativeFloat = option(0.1, "cosine: the last step's learning rate as a share of learning_rate")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.999, "AdamW beta2")
    weight_decay: float = option(1e-4, "AdamW weight decay")
    max_grad_norm: NonNegativeFloat = option(1.0, "Gradient clipping norm (0 disables)")
    max_idle_steps: NonNegativeInt = option(
        3, "Stop the run (one line, exit 2) after this many steps in a row without an optimizer step (every update "
        "skipped as non-finite, or no sample with a learning signal), or at its end if it never made one; 0 never "
        "stops (diffusionrl/training/guard.py)")
    max_skipped_fraction: float = option(
        0.2, "Stop the run when more than this share of its updates so far were skipped as non-finite (checked "
        "from step 5); 1 never stops")
    mixed_precision: Literal["no", "fp16", "bf16"] = option(
        "no", "Forward precision: no (fp32) | fp16 (with grad scaler) | bf16"
    )
    ema: bool = option(False, "Keep an EMA of the LoRA weights for evaluation")
    ema_decay: float = option(0.9, "EMA decay")
    seed: int = option(0, "Seed of prompts, sample seeds and the LoRA init")
    checkpoint_every: int = option(5, "Save a resumable checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = option(2, "How many recent checkpoints to keep")
    checkpoint_format: Literal["gathered", "sharded"] = option(
        "gathered", "gathered: the full trained tensors and optimizer states written by the driver | sharded: "
        "each rank writes its own shards (torch.distributed.checkpoint); both resume on any world size")
    log_images_every: int = option(10, "Keep sample images every N steps (0 disables)")
    save_latents: bool = option(True, "Store latents and conditioning in the trajectory Parquet (rebuildable "
                                "Trajectory)")
    world_size: PositiveInt = option(
        1, "Trainer ranks (one per GPU bundle); > 1 trains FSDP2-sharded across Ray actors (docs/scaling.md)"
    )
    placement: Literal["colocate", "split"] = option(
        "colocate", "Ray layout when world_size > 1: colocate (trainer rank + rollout engine per GPU bundle) | split"
    )
    rollout_engines: PositiveInt = option(
        1, "Rollout engines when world_size > 1, held by ranks 0..n-1 (colocate: at most world_size)"
    )
    cpus_per_bundle: PositiveInt = option(
        1, "CPUs of each placement-group bundle (the trainer rank's and its engine's)"
    )
    engine_gpu_fraction: float = option(0.5, "Colocate: share of each bundle's GPU reserved for the engine; the rank "
                                        "takes the rest")
    memory_handoff: bool = option(False, "Colocate on GPU: the engine releases its memory while the trainer trains "
                                  "and resumes before rollouts")
    offload_optimizer: bool = option(False, "Move the optimizer state to CPU while the engine samples (back before "
                                     "the update)")
    deterministic: bool = option(False, "Deterministic algorithms, cuBLAS workspace, deterministic attention backends "
                                 "in the trainer")

    def __post_init__(self) -> None:
        check_constraints(self, "train")
        if not 0 < self.max_skipped_fraction <= 1:
            raise ConfigError(f"train.max_skipped_fraction={self.max_skipped_fraction} must be in (0, 1] "
                              "(1 never stops)")
        if self.lr_min_ratio > 1:
            raise ConfigError(f"train.lr_min_ratio={self.lr_min_ratio} must be in [0, 1]")
        if self.lr_warmup_steps >= self.steps:
            raise ConfigError(f"train.lr_warmup_steps={self.lr_warmup_steps} leaves none of the run's "
                              f"train.steps={self.steps} at the full learning rate; use fewer")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"train.ema_decay={self.ema_decay} must be in [0, 1)")
        batch = self.prompts_per_step * self.group_size
        if batch % self.micro_batch_size:
            fit = [m for m in range(self.micro_batch_size, 0, -1) if batch % m == 0][0]
            raise ConfigError(
                f"train: a step's batch of prompts_per_step * group_size = {self.prompts_per_step} * "
                f"{self.group_size} = {batch} samples is not divisible by micro_batch_size "
                f"{self.micro_batch_size}; use micro_batch_size={fit}"
            )
        n_micro = batch // self.micro_batch_size
        if n_micro % self.minibatches:
            raise ConfigError(
                f"train: {n_micro} micro-batches per step cannot be split into minibatches={self.minibatches} "
                "equal optimizer steps; pick a divisor of the micro-batch count"
            )
        self._check_distributed(batch)

    def _check_distributed(self, batch: int) -> None:
        if not 0 < self.engine_gpu_fraction < 1:
            raise ConfigError(f"train.engine_gpu_fraction={self.engine_gpu_fraction} must be in (0, 1)")
        if self.world_size == 1:
            return
        if self.placement == "colocate" and self.rollout_engines > self.world_size:
            raise ConfigError(
                f"train.rollout_engines={self.rollout_engines} > world_size={self.world_size}: colocated engines "
                f"live in the trainer bundles; use rollout_engines <= {self.world_size} or placement=split"
            )
        # Engines get whole blocks: a block is a whole number of groups and of micro-batches (the trainer
        # ranks share each optimizer step's units, whatever the batch: distributed/worker.deal).
        block = math.lcm(self.group_size, self.micro_batch_size)
        blocks = batch // block if batch % block == 0 else 0
        for name, n in (("rollout_engines", self.rollout_engines),):
            if blocks == 0 or blocks % n:
                raise ConfigError(
                    f"train.{name}={n}: a step's {batch} samples must split into {n} equal shares of whole groups "
                    f"and whole micro-batches (blocks of lcm(group_size, micro_batch_size) = {block}); "
                    f"make prompts_per_step * group_size a multiple of {block * n}"
                )


@dataclass
class EvalConfig:
    num_steps: PositiveInt = option(20, "ODE denoising steps for evaluation")
    guidance_scale: PositiveFloat = option(4.5, "CFG scale for evaluation")
    guidance_scale_2: NonNegativeFloat = option(
        0.0, "Two experts (Wan2.2 A14B): the evaluation's CFG scale of the low-noise expert's steps; 0 = guidance_scale"
    )
    base_guidance_scale: NonNegativeFloat = option(
        0.0, "Also sample the base model at this CFG scale (same seeds): the eval/base_cfg_* figures, the bar a "
        "CFG-free tuned model is held to (0 = off)"
    )
    num_prompts: NonNegativeInt = option(8, "Held-out prompts evaluated (0 = all)")
    seeds_per_prompt: PositiveInt = option(
        1, "Samples per held-out prompt in the evaluation (seeds seed, seed + 1, ...)"
    )
    seed: int = option(1234, "Seed of the evaluation noise (same for base and tuned)")
    use_ema: bool = option(True, "Evaluate the EMA weights when train.ema is on")
    champion_margin: NonNegativeFloat = option(0.0, "Registry: promote to champion only if better by more than this")
    champion_metric: str = option(
        "eval/reward_mean", "Registry: the held-out evaluation's figure that decides @champion, higher is better: "
        "eval/reward_mean, eval/<reward>_mean, or a reward's per-sample figure (eval/geneval_mini_success, "
        "eval/geneval_mini_success/category_mean: GenEval's overall)"
    )
    champion_over_base: bool = option(
        True, "Registry: champion only if champion_metric also beats the base model's on the same evaluation "
        "by more than champion_margin (a version worse than its base weights stays candidate)"
    )
    every: NonNegativeInt = option(
        10, "Held-out probe every this many steps during training (0 = off): held-out reward and diversity, for the "
        "reward-hacking alarm (diffusionrl.heldout)"
    )
    probe_prompts: NonNegativeInt = option(8, "Held-out prompts of each probe during training (0 = all), one seed each")

    def __post_init__(self) -> None:
        check_constraints(self, "eval")
        check_guidance_2(self, "eval")


@dataclass
class DataConfig:
    source: str = option("builtin:objects", "Prompts: builtin:<generator>, a .txt/.jsonl/.parquet file or folder, or "
                         "hf://datasets/...")
    num_prompts: int = option(256, "Prompts a built-in generator writes")
    test_fraction: float = option(0.1, "Share of prompts held out for evaluation")
    seed: int = option(0, "Seed of the generator and the train/test split")
    balance_by: str = option("", "A row field (e.g. category): each value gets an equal share of every step's "
                             "prompts, whatever its number of rows; empty: rows drawn uniformly")

    def __post_init__(self) -> None:
        check_constraints(self, "data")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"data.test_fraction={self.test_fraction} must be in (0, 1)")
        if self.source.startswith("builtin:") and self.num_prompts < 2:
            raise ConfigError(f"data.num_prompts={self.num_prompts}: {self.source} must make at least 2 prompts, "
                              "one to train on and one held out for evaluation")


@dataclass
class TrackingConfig:
    uri: str = option("", "MLflow tracking URI; empty: $MLFLOW_TRACKING_URI, else a SQLite store in ./runs/mlflow")
    experiment: str = option("diffusionrl", "MLflow experiment of the workflow runs")
    registered_model: str = option("tiny-sd3-jpeg", "Registry name; versions of one name compete for @champion")
    log_retries: PositiveInt = option(
        5, "Attempts per MLflow logging call (exponential backoff) before buffering for later"
    )
    max_artifact_mb: NonNegativeFloat = option(
        200.0, "Trajectory folders up to this size are copied to MLflow; larger ones are linked (.inf: always "
        "copied)", allow_inf=True
    )

    def __post_init__(self) -> None:
        check_constraints(self, "tracking")
        from diffusionrl.secrets import credentials_error

        refusal = credentials_error(self.uri, "tracking.uri")
        if refusal:
            raise ConfigError(refusal)
        if not self.registered_model.strip():
            raise ConfigError("tracking.registered_model is empty: name the registry entry, e.g. 'tiny-sd3-jpeg'")
