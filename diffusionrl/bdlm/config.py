"""Configuration tree of a block-diffusion language-model run (``BDLMConfig``).

Sections: ``model`` (network and decoding), ``task`` (the verifiable digit task and its splits),
``warm_start`` (masked-diffusion supervised stage), ``grpo`` (RL on exact traces) and ``eval``.
Same conventions as the image ``Config`` (both are built on ``diffusionrl.config.tree``): every
default lives here once, each field carries its help text, unknown keys and inconsistent settings
are rejected with a message that says what to change, and the tree stays plain so that it travels
as a Flyte dataclass input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from diffusionrl.config import (
    ConfigError,
    ConfigTree,
    TrackingConfig,
    apply_overrides,
    check_constraints,
    lookup_preset,
    option,
)

TASK_KINDS = ("reverse", "sort", "add")
OBJECTIVE_NAMES = ("grpo", "dapo", "dr_grpo", "opd")


@dataclass
class BDLMModelConfig:
    name: str = option("builtin:tiny-bdlm", "Model: 'builtin:tiny-bdlm' or 'builtin:tiny-diffusiongemma' (built in "
                       "code), a saved model folder, or a DiffusionGemma hub id")
    revision: str = option("", "Hub revision (branch, tag or commit) of a hub model; empty for the default branch")
    dim: PositiveInt = option(96, "builtin: hidden size")
    layers: PositiveInt = option(3, "builtin: transformer blocks")
    heads: PositiveInt = option(4, "builtin: attention heads (must divide dim)")
    ff_dim: PositiveInt = option(256, "builtin: feed-forward hidden size")
    max_length: PositiveInt = option(
        32, "builtin: longest canvas (prompt region + gen_length) the position table holds"
    )
    init_seed: int = option(0, "builtin: seed of the random initial weights")
    num_experts: PositiveInt = option(
        4, "builtin:tiny-diffusiongemma: MoE experts per layer (every layer has an MoE block "
        "beside its dense MLP; 2 are active per token)"
    )
    gen_length: PositiveInt = option(8, "Generated tokens per sample (answer + EOS + EOS padding)")
    block_size: PositiveInt = option(4, "Semi-autoregressive block: positions decoded before the next block opens")
    temperature: PositiveFloat = option(1.0, "Rollout proposal temperature T in softmax(logits / T)")
    threshold: float = option(0.9, "Commit every position whose confidence (max prob) >= threshold")
    steps_per_block: PositiveInt = option(
        4, "DiffusionGemma: denoising steps per canvas (the pipeline's num_inference_steps)"
    )
    editing_threshold: float = option(
        0.0, "DiffusionGemma: re-sample an already committed token when the new one's prob > this (0: no editing)")
    max_post_steps: NonNegativeInt = option(4, "LLaDA2: extra editing steps per block once it has no MASK left")
    hub_family: Literal["diffusiongemma", "llada2"] = option(
        "diffusiongemma", "A hub model.name's family: diffusiongemma | llada2"
    )
    confidence_threshold: float = option(
        0.0, "DiffusionGemma: the pipeline's adaptive early stop (0: off; the replay does not cover it)")
    scheduler: str = option("block_refinement", "DiffusionGemma: the pipeline's scheduler (block_refinement; "
                            "discrete_ddim and entropy_bound are not replayable)")

    def __post_init__(self) -> None:
        check_constraints(self, "model")
        if self.dim % self.heads:
            raise ConfigError(
                f"model.heads={self.heads} does not divide model.dim={self.dim}; use heads=4 or dim={self.heads * 32}"
            )
        if self.gen_length % self.block_size:
            raise ConfigError(
                f"model.gen_length={self.gen_length} is not a multiple of model.block_size={self.block_size}; "
                f"use gen_length={-(-self.gen_length // self.block_size) * self.block_size}"
            )
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"model.threshold={self.threshold} must be in (0, 1] (1 commits one token per step)")


@dataclass
class TaskConfig:
    kind: Literal[TASK_KINDS] = option("sort", "Digit task: reverse | sort | add (two operands)")
    min_len: PositiveInt = option(3, "Shortest digit string (per operand for add)")
    max_len: int = option(6, "Longest digit string (per operand for add)")
    num_train: PositiveInt = option(4000, "Distinct training prompts generated")
    num_test: PositiveInt = option(200, "Distinct held-out prompts (disjoint from train)")
    seed: int = option(0, "Seed of the generator and the split")
    partial_weight: NonNegativeFloat = option(0.5, "Reward = exact match + partial_weight * share of correct positions")

    def __post_init__(self) -> None:
        check_constraints(self, "task")
        if self.max_len < self.min_len:
            raise ConfigError(f"task.max_len={self.max_len} < task.min_len={self.min_len}")

    @property
    def prompt_length(self) -> int:
        """Prompt region P: digits then SEP (add: a SEP b SEP), left-padded with PAD."""
        return 2 * self.max_len + 2 if self.kind == "add" else self.max_len + 1

    @property
    def max_answer_length(self) -> int:
        return self.max_len + 1 if self.kind == "add" else self.max_len


@dataclass
class WarmStartConfig:
    steps: NonNegativeInt = option(150, "Masked-diffusion supervised steps before GRPO")
    lr: PositiveFloat = option(3e-3, "AdamW learning rate")
    batch_size: PositiveInt = option(64, "Sequences per step")
    weight_decay: float = option(0.0, "AdamW weight decay")
    seed: int = option(0, "Seed of batches and mask ratios")

    def __post_init__(self) -> None:
        check_constraints(self, "warm_start")


@dataclass
class GRPOConfig:
    objective: Literal[OBJECTIVE_NAMES] = option(
        "grpo", "grpo | dapo (clip-higher, dynamic sampling) | dr_grpo (no std or length "
        "normalisation) | opd (on-policy distillation from grpo.teacher); docs/bdlm.md"
    )
    steps: PositiveInt = option(60, "RL steps (rollout + update)")
    prompts_per_step: PositiveInt = option(16, "Distinct prompts (groups) per step")
    group_size: PositiveInt = option(8, "Samples per prompt k")
    micro_batch_size: PositiveInt = option(32, "Rows per forward; rollout and replay use the same composition")
    inner_iterations: PositiveInt = option(2, "Optimizer steps per rollout batch (old policy = start-of-step snapshot)")
    clip_range: PositiveFloat = option(0.2, "PPO ratio clip epsilon (per-token log-probs, hence the usual 0.2)")
    clip_range_high: NonNegativeFloat = option(
        0.0, "dapo: upper clip epsilon (clip-higher, e.g. 0.28); 0 uses clip_range"
    )
    dapo_max_refills: NonNegativeInt = option(
        3, "dapo: extra rollout batches per step at most, drawn to refill the groups without reward variance "
        "(dynamic sampling; 0: filter only)"
    )
    teacher: str = option("", "opd: the teacher's model folder (same model kind as the student; never updated)")
    opd_temperature: PositiveFloat = option(
        1.0, "opd: distillation temperature tau of the forward KL (scaled by tau^2)"
    )
    opd_hard_ce: NonNegativeFloat = option(0.0, "opd: weight of the hard CE on the teacher's argmax token (0: KL only)")
    kl_beta: NonNegativeFloat = option(
        0.01, "Weight of the exact categorical KL to the reference (0 skips the reference pass)"
    )
    adv_clip_max: PositiveFloat = option(5.0, "Advantages are clamped to [-adv_clip_max, adv_clip_max]")
    global_std: bool = option(False, "Normalise advantages by the batch std instead of the group std")
    lr: PositiveFloat = option(2e-4, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: NonNegativeFloat = option(1.0, "Gradient clipping norm (0 disables)")
    max_idle_steps: NonNegativeInt = option(
        3, "Stop the run (one line, exit 2) after this many steps in a row without an optimizer step (every update "
        "skipped as non-finite, or no group with reward variance), or at its end if it never made one; 0 never "
        "stops (diffusionrl/training/guard.py)")
    max_skipped_fraction: float = option(
        0.2, "Stop the run when more than this share of its updates so far were skipped as non-finite (checked "
        "from step 5); 1 never stops")
    seed: int = option(0, "Seed of prompts and sample seeds")
    checkpoint_every: int = option(10, "Save a resumable checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = option(2, "How many recent checkpoints to keep")
    save_traces: bool = option(True, "Write each step's traces to traces/step-XXXXXX.parquet")
    sequence_packing: bool = option(False, "Pack several sequences per row (not supported: replay needs one per row)")

    def __post_init__(self) -> None:
        check_constraints(self, "grpo")
        if not 0 < self.max_skipped_fraction <= 1:
            raise ConfigError(f"grpo.max_skipped_fraction={self.max_skipped_fraction} must be in (0, 1] "
                              "(1: never stop for skipped updates)")
        if self.sequence_packing:
            raise ConfigError(
                "grpo.sequence_packing=true is not supported: trace replay re-masks whole rows by commit "
                "step, so a row must hold exactly one sequence; set grpo.sequence_packing=false"
            )
        if self.objective == "opd" and not self.teacher.strip():
            raise ConfigError("grpo.objective=opd distils from a teacher, but grpo.teacher is empty; set "
                              "grpo.teacher=FOLDER (a model folder of the same kind, e.g. a longer warm start's), "
                              "or choose another grpo.objective")
        if self.group_size < 2 and self.objective != "opd":
            raise ConfigError(
                f"grpo.group_size={self.group_size}: GRPO needs >= 2 samples per prompt for a group baseline"
            )
        batch = self.prompts_per_step * self.group_size
        if batch % self.micro_batch_size:
            fit = next(m for m in range(self.micro_batch_size, 0, -1) if batch % m == 0)
            raise ConfigError(
                f"grpo: a step's batch of prompts_per_step * group_size = {batch} rows is not divisible by "
                f"micro_batch_size {self.micro_batch_size}; use micro_batch_size={fit}"
            )


@dataclass
class BDLMEvalConfig:
    batch_size: PositiveInt = option(100, "Rows per greedy decoding batch")
    num_samples: NonNegativeInt = option(0, "Held-out prompts evaluated (0 = the whole test split)")
    threshold: float = option(0.9, "Commit threshold of the greedy evaluation decoder")
    champion_margin: float = option(
        0.0, "Registry: promote to champion only if champion_metric is better by more than this"
    )
    champion_metric: Literal["eval/reward_mean", "eval/exact_match"] = option(
        "eval/reward_mean", "Registry: the held-out figure that decides @champion (higher is better)"
    )
    champion_over_base: bool = option(
        True, "Registry: champion only if champion_metric also beats the warm-start model's on the same "
        "evaluation by more than champion_margin"
    )

    def __post_init__(self) -> None:
        check_constraints(self, "eval")
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"eval.threshold={self.threshold} must be in (0, 1]")


SECTIONS: dict[str, type] = {
    "model": BDLMModelConfig,
    "task": TaskConfig,
    "warm_start": WarmStartConfig,
    "grpo": GRPOConfig,
    "eval": BDLMEvalConfig,
    "tracking": TrackingConfig,
}


@dataclass
class BDLMConfig(ConfigTree):
    model: BDLMModelConfig = field(default_factory=BDLMModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: BDLMEvalConfig = field(default_factory=BDLMEvalConfig)
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(registered_model="tiny-bdlm-sort"))
    preset: str = option("tiny-bdlm", "Name of the preset this config started from (informational)")

    def __post_init__(self) -> None:
        check_constraints(self, "")
        need = self.task.max_answer_length + 1
        if self.model.gen_length < need:
            raise ConfigError(
                f"model.gen_length={self.model.gen_length} cannot hold the longest {self.task.kind} answer "
                f"({self.task.max_answer_length} digits) plus EOS; use gen_length >= {need} (a multiple of block_size)"
            )
        length = self.canvas_length
        if self.model.name.startswith("builtin:") and length > self.model.max_length:
            raise ConfigError(
                f"canvas length task.prompt_length + model.gen_length = {length} exceeds model.max_length="
                f"{self.model.max_length}; raise model.max_length to {length}"
            )

    @property
    def canvas_length(self) -> int:
        return self.task.prompt_length + self.model.gen_length

    @classmethod
    def sections(cls) -> dict[str, type]:
        return SECTIONS

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "bdlm config") -> BDLMConfig:
        return super().from_dict(data, where)

    @classmethod
    def preset_dict(cls, name: str) -> dict[str, Any]:
        return load_bdlm_config(name).to_dict()


def _tiny_bdlm() -> dict[str, Any]:
    # Sort 3-6 digit strings with a 0.27 M-parameter model. (Reverse is too easy with a
    # left-padded prompt: it is a fixed positional copy; add with most-significant-first answers
    # does not move within minutes.) The warm start is kept short on purpose (150 steps) so that
    # groups have reward variance and GRPO has room to add a clear margin (bench/README.md,
    # "Block-diffusion LMs").
    return {"task": {"kind": "sort"}, "warm_start": {"steps": 150}, "grpo": {"steps": 60}}


def _tiny_diffusiongemma(objective: str = "grpo", **grpo: Any):
    # Sort 3-6 digits with a ~0.2 M-parameter DiffusionGemma (2 layers, 4 experts) sampled through
    # the stock DiffusionGemmaPipeline: canvases of 4, 4 denoising steps each, after 800 uniform-corruption
    # SFT steps (what they reach: bench/README.md, "Block-diffusion LMs").
    def changes() -> dict[str, Any]:
        return {
            "model": {"name": "builtin:tiny-diffusiongemma", "dim": 64, "layers": 2, "heads": 2, "ff_dim": 128,
                      "num_experts": 4, "block_size": 4, "steps_per_block": 4, "threshold": 0.9},
            "task": {"kind": "sort"}, "warm_start": {"steps": 800},
            "grpo": {"objective": objective, "steps": 30, "prompts_per_step": 8, "group_size": 8,
                     "micro_batch_size": 32, "lr": 5e-4, **grpo},
            "tracking": {"registered_model": "tiny-diffusiongemma-sort"},
        }
    return changes


def _tiny_llada2() -> dict[str, Any]:
    # The same task with a 2-layer BERT masked LM sampled through the stock LLaDA2Pipeline.
    return {"model": {"name": "builtin:tiny-llada2", "dim": 64, "layers": 2, "heads": 2, "ff_dim": 128,
                      "block_size": 4, "steps_per_block": 4, "threshold": 0.9},
            "task": {"kind": "sort"}, "warm_start": {"steps": 300},
            "grpo": {"steps": 30, "prompts_per_step": 8, "group_size": 8, "micro_batch_size": 32, "lr": 5e-4},
            "tracking": {"registered_model": "tiny-llada2-sort"}}


PRESETS = {
    "tiny-bdlm": _tiny_bdlm,
    "tiny-diffusiongemma": _tiny_diffusiongemma(),
    "tiny-diffusiongemma-dapo": _tiny_diffusiongemma("dapo", clip_range_high=0.28),
    "tiny-diffusiongemma-dr_grpo": _tiny_diffusiongemma("dr_grpo"),
    # set grpo.teacher to a model folder (e.g. a longer warm start's): bench/bdlm_learning.py does
    "tiny-diffusiongemma-opd": _tiny_diffusiongemma("opd", opd_temperature=1.0),
    "tiny-llada2": _tiny_llada2,
}


def load_bdlm_config(preset: str = "tiny-bdlm", overrides: list[str] | None = None,
                     data: dict[str, Any] | None = None) -> BDLMConfig:
    """Preset + an optional dict laid over it + dotted ``section.key=value`` overrides."""
    changes = lookup_preset(PRESETS, preset, "bdlm preset")()
    base = BDLMConfig.merge_dicts(BDLMConfig().to_dict(), changes, f"preset {preset}")
    base["preset"] = preset
    if data:
        base = BDLMConfig.merge_dicts(base, data, "bdlm config")
    return BDLMConfig.from_dict(apply_overrides(base, overrides or []), where=f"preset {preset}")
