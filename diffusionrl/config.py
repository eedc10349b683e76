"""One typed configuration tree for a run.

Every default lives here, once. Sections: ``model``, ``sampling``, ``algorithm``, ``reward``,
``train``, ``eval``, ``data`` and ``tracking``. Each field carries its help text in ``metadata["help"]``.
Presets are named configurations (``tiny-cpu``, ``sd35m-ocr``, ...); a YAML/JSON file and dotted
``key=value`` overrides are applied on top of a preset. Unknown keys and inconsistent settings are
rejected with a message that says what to change.

The tree is kept plain (str/int/float/bool/list/dict leaves, no Optional dataclasses) so that it
travels as a Flyte dataclass input and the Flyte console can show it with its defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

SD3_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _choice(section: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not one of {list(choices)}")


def _positive(section: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}={value!r} must be {bound}")


@dataclass
class ModelConfig:
    name: str = _f("builtin:tiny-sd3", "Model reference: 'builtin:tiny-sd3', a local diffusers folder, or a hub id")
    revision: str = _f("", "Hub revision (branch, tag or commit); empty for the default branch")
    dtype: str = _f("float32", "Weights dtype of the frozen modules: float32 | float16 | bfloat16")
    device: str = _f("auto", "Device: auto | cpu | cuda | cuda:N")
    max_sequence_length: int = _f(32, "T5 prompt length in tokens (SD3 pipelines default to 256)")
    lora_rank: int = _f(8, "LoRA rank r")
    lora_alpha: int = _f(16, "LoRA alpha (scale = alpha / r)")
    lora_init: str = _f("gaussian", "peft init_lora_weights: gaussian | true (kaiming, B = 0 in both)")
    lora_targets: list[str] = _f(SD3_LORA_TARGETS, "Module name suffixes that get a LoRA adapter")
    gradient_checkpointing: bool = _f(False, "Recompute transformer activations in backward")

    def __post_init__(self) -> None:
        _choice("model", "dtype", self.dtype, ("float32", "float16", "bfloat16"))
        _choice("model", "lora_init", self.lora_init, ("gaussian", "true"))
        _positive("model", "lora_rank", self.lora_rank)
        _positive("model", "lora_alpha", self.lora_alpha)
        _positive("model", "max_sequence_length", self.max_sequence_length)
        if not self.lora_targets:
            raise ConfigError("model.lora_targets is empty: list at least one module suffix, e.g. 'attn.to_q'")


@dataclass
class SamplingConfig:
    resolution: int = _f(64, "Image height and width in pixels (a multiple of 16)")
    num_steps: int = _f(10, "Denoising steps T of a rollout")
    guidance_scale: float = _f(4.5, "Classifier-free guidance scale g (1.0 = no CFG pass)")
    negative_prompt: str = _f("", "Negative prompt used for CFG")
    sde_type: str = _f("sde", "Stochastic step: sde (Flow-GRPO) | cps (coefficients-preserving) | ode")
    noise_level: float = _f(0.7, "SDE noise level a (0.7 for sde, 0.8 recommended for cps)")
    step_strategy: str = _f("all", "Which steps are stochastic: all | sde_window | epoch_random_choice")
    num_sde_steps: int = _f(2, "Number of SDE steps for sde_window / epoch_random_choice")
    window_range: list[int] = _f([0, 5], "[lo, hi): the SDE window lies inside these step indices")
    candidate_steps: list[int] = _f([0, 1, 2, 3, 4, 5, 6, 7, 8], "Steps epoch_random_choice draws from")
    ode_solver: str = _f("euler", "Deterministic solver for NFT rollouts and eval: euler | heun")
    engine: str = _f("local", "Rollout engine: local (in-process diffusers) | sglang (SGLang diffusion server)")
    sglang_python: str = _f(
        "", "sglang engine: Python interpreter of the SGLang venv ('' = $DIFFUSIONRL_SGLANG_PYTHON, else "
        "the repo's .venv-sglang/bin/python, else the current interpreter if it imports sglang)"
    )
    sglang_port: int = _f(0, "sglang engine: HTTP port of the server it launches on 127.0.0.1 (0 = a free port)")
    sglang_verify_weights: bool = _f(
        False, "sglang engine: after each weight push, check the server's /get_weights_checksum against ours"
    )
    sglang_ipc_bucket_mb: int = _f(512, "sglang engine: CUDA IPC weight-push bucket size in MiB (colocated GPU only)")
    sglang_start_timeout_s: float = _f(300.0, "sglang engine: seconds to wait for the server to become healthy")
    sglang_max_restarts: int = _f(3, "sglang engine: server restarts (then a batch retry) allowed per run")

    def __post_init__(self) -> None:
        _choice("sampling", "sde_type", self.sde_type, ("sde", "cps", "ode"))
        _choice("sampling", "step_strategy", self.step_strategy, ("all", "sde_window", "epoch_random_choice"))
        _choice("sampling", "ode_solver", self.ode_solver, ("euler", "heun"))
        _choice("sampling", "engine", self.engine, ("local", "sglang"))
        if not 0 <= self.sglang_port <= 65535:
            raise ConfigError(f"sampling.sglang_port={self.sglang_port} must be in [0, 65535] (0 picks a free port)")
        _positive("sampling", "sglang_ipc_bucket_mb", self.sglang_ipc_bucket_mb)
        _positive("sampling", "sglang_start_timeout_s", self.sglang_start_timeout_s)
        _positive("sampling", "sglang_max_restarts", self.sglang_max_restarts, allow_zero=True)
        if self.resolution <= 0 or self.resolution % 16:
            raise ConfigError(f"sampling.resolution={self.resolution} must be a positive multiple of 16")
        if self.num_steps < 2:
            raise ConfigError(f"sampling.num_steps={self.num_steps} must be >= 2")
        _positive("sampling", "guidance_scale", self.guidance_scale)
        _positive("sampling", "noise_level", self.noise_level, allow_zero=True)
        if self.step_strategy != "all":
            _positive("sampling", "num_sde_steps", self.num_sde_steps)
        if self.step_strategy == "sde_window":
            if len(self.window_range) != 2:
                raise ConfigError(f"sampling.window_range={self.window_range} must be [lo, hi)")
            lo, hi = self.window_range
            if not 0 <= lo < hi <= self.num_steps - 1:
                raise ConfigError(
                    f"sampling.window_range={self.window_range} must satisfy 0 <= lo < hi <= num_steps - 1 "
                    f"= {self.num_steps - 1} (the last step is never stochastic)"
                )
            if hi - lo < self.num_sde_steps:
                raise ConfigError(
                    f"sampling.window_range={self.window_range} is narrower than num_sde_steps="
                    f"{self.num_sde_steps}; widen it to at least [{lo}, {lo + self.num_sde_steps}]"
                )
        if self.step_strategy == "epoch_random_choice":
            bad = [s for s in self.candidate_steps if not 0 <= s < self.num_steps - 1]
            if bad:
                raise ConfigError(
                    f"sampling.candidate_steps has {bad} outside [0, {self.num_steps - 2}] "
                    "(the last step is never stochastic)"
                )
            if len(set(self.candidate_steps)) < self.num_sde_steps:
                raise ConfigError(
                    f"sampling.candidate_steps has {len(set(self.candidate_steps))} distinct steps, fewer "
                    f"than num_sde_steps={self.num_sde_steps}"
                )


@dataclass
class AlgorithmConfig:
    name: str = _f("flow_grpo", "Policy update: flow_grpo | nft")
    clip_range: float = _f(1e-4, "PPO ratio clip epsilon (log-probs are per-element means, hence tiny)")
    kl_beta: float = _f(0.04, "Weight of the KL term against the LoRA-disabled reference (0 skips it)")
    adv_clip_max: float = _f(5.0, "Advantages are clamped to [-adv_clip_max, adv_clip_max]")
    global_std: bool = _f(True, "Normalise advantages by the batch std instead of the group std")
    nft_beta: float = _f(1.0, "DiffusionNFT guidance strength b of the implicit positive/negative policies")
    nft_adv_clip: float = _f(5.0, "DiffusionNFT advantage clip c in r = clamp(A, -c, c) / (2c) + 0.5")
    old_policy_rate: float = _f(0.001, "DiffusionNFT old-policy EMA ramp: eta = min(rate * max(step - flat, 0), cap)")
    old_policy_flat: int = _f(0, "DiffusionNFT steps before the old-policy eta ramp starts")
    old_policy_cap: float = _f(0.5, "DiffusionNFT maximum old-policy eta")

    def __post_init__(self) -> None:
        _choice("algorithm", "name", self.name, ("flow_grpo", "nft"))
        _positive("algorithm", "clip_range", self.clip_range)
        _positive("algorithm", "kl_beta", self.kl_beta, allow_zero=True)
        _positive("algorithm", "adv_clip_max", self.adv_clip_max)
        _positive("algorithm", "nft_beta", self.nft_beta)
        _positive("algorithm", "nft_adv_clip", self.nft_adv_clip)
        if not 0 <= self.old_policy_cap < 1:
            raise ConfigError(f"algorithm.old_policy_cap={self.old_policy_cap} must be in [0, 1)")
        _positive("algorithm", "old_policy_rate", self.old_policy_rate, allow_zero=True)
        _positive("algorithm", "old_policy_flat", self.old_policy_flat, allow_zero=True)


@dataclass
class RewardConfig:
    weights: dict[str, float] = _f({"jpeg_compressibility": 1.0}, "Reward name -> weight of a weighted sum")
    num_actors: int = _f(0, "Ray CPU actors scoring rewards (0 scores in-process)")
    ocr_backend: str = _f("rapidocr", "OCR backend: rapidocr | paddleocr")
    ocr_model_dir: str = _f("", "PaddleOCR: folder holding det/ and rec/ model folders")
    ocr_threads: int = _f(0, "onnxruntime intra-op threads per OCR engine (0: the backend's default)")
    pickscore_processor: str = _f("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "PickScore processor id or folder")
    pickscore_model: str = _f("yuvalkirstain/PickScore_v1", "PickScore model id or folder")

    def __post_init__(self) -> None:
        if not self.weights:
            raise ConfigError("reward.weights is empty: give at least one reward, e.g. {jpeg_compressibility: 1.0}")
        _choice("reward", "ocr_backend", self.ocr_backend, ("rapidocr", "paddleocr"))
        _positive("reward", "num_actors", self.num_actors, allow_zero=True)


@dataclass
class TrainConfig:
    steps: int = _f(40, "Number of RL steps (rollout + update)")
    prompts_per_step: int = _f(4, "Distinct prompts (groups) sampled per step")
    group_size: int = _f(8, "Samples per prompt k")
    micro_batch_size: int = _f(8, "Samples per forward pass; sampling and training use the same batches")
    inner_epochs: int = _f(1, "Passes over each rollout batch (log_prob_old stays the rollout's)")
    minibatches: int = _f(1, "Optimizer steps per inner epoch (the batch is split into this many)")
    learning_rate: float = _f(3e-4, "AdamW learning rate")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    weight_decay: float = _f(1e-4, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0 disables)")
    mixed_precision: str = _f("no", "Forward precision: no (fp32) | fp16 (with grad scaler) | bf16")
    ema: bool = _f(False, "Keep an EMA of the LoRA weights for evaluation")
    ema_decay: float = _f(0.9, "EMA decay")
    seed: int = _f(0, "Seed of prompts, sample seeds and the LoRA init")
    checkpoint_every: int = _f(5, "Save a resumable checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "How many recent checkpoints to keep")
    log_images_every: int = _f(10, "Keep sample images every N steps (0 disables)")
    save_latents: bool = _f(True, "Store latents and conditioning in the trajectory Parquet (rebuildable Trajectory)")
    world_size: int = _f(1, "Trainer ranks (one per GPU bundle); > 1 trains FSDP2-sharded across Ray actors (docs/scaling.md)")
    placement: str = _f("colocate", "Ray layout when world_size > 1: colocate (trainer rank + rollout engine per GPU bundle) | split")
    rollout_engines: int = _f(1, "Rollout engines when world_size > 1, held by ranks 0..n-1 (colocate: at most world_size)")
    cpus_per_bundle: int = _f(1, "CPUs of each placement-group bundle (the trainer rank's and its engine's)")
    engine_gpu_fraction: float = _f(0.5, "Colocate: share of each bundle's GPU reserved for the engine; the rank takes the rest")
    memory_handoff: bool = _f(False, "Colocate on GPU: the engine releases its memory while the trainer trains and resumes before rollouts")
    offload_optimizer: bool = _f(False, "Move the optimizer state to CPU while the engine samples (back before the update)")
    deterministic: bool = _f(False, "Deterministic algorithms, cuBLAS workspace, deterministic attention backends in the trainer")

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "micro_batch_size", "inner_epochs", "minibatches"):
            _positive("train", name, getattr(self, name))
        _positive("train", "learning_rate", self.learning_rate)
        _positive("train", "max_grad_norm", self.max_grad_norm, allow_zero=True)
        _choice("train", "mixed_precision", self.mixed_precision, ("no", "fp16", "bf16"))
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
        _positive("train", "world_size", self.world_size)
        _positive("train", "rollout_engines", self.rollout_engines)
        _positive("train", "cpus_per_bundle", self.cpus_per_bundle)
        _choice("train", "placement", self.placement, ("colocate", "split"))
        if not 0 < self.engine_gpu_fraction < 1:
            raise ConfigError(f"train.engine_gpu_fraction={self.engine_gpu_fraction} must be in (0, 1)")
        if self.world_size == 1:
            return
        if self.placement == "colocate" and self.rollout_engines > self.world_size:
            raise ConfigError(
                f"train.rollout_engines={self.rollout_engines} > world_size={self.world_size}: colocated engines "
                f"live in the trainer bundles; use rollout_engines <= {self.world_size} or placement=split"
            )
        # Ranks and engines get whole blocks: a block is a whole number of groups and of micro-batches.
        block = math.lcm(self.group_size, self.micro_batch_size)
        blocks = batch // block if batch % block == 0 else 0
        for name, n in (("world_size", self.world_size), ("rollout_engines", self.rollout_engines)):
            if blocks == 0 or blocks % n:
                raise ConfigError(
                    f"train.{name}={n}: a step's {batch} samples must split into {n} equal shares of whole groups "
                    f"and whole micro-batches (blocks of lcm(group_size, micro_batch_size) = {block}); "
                    f"make prompts_per_step * group_size a multiple of {block * n}"
                )


@dataclass
class EvalConfig:
    num_steps: int = _f(20, "ODE denoising steps for evaluation")
    guidance_scale: float = _f(4.5, "CFG scale for evaluation")
    num_prompts: int = _f(8, "Held-out prompts evaluated (0 = all)")
    seed: int = _f(1234, "Seed of the evaluation noise (same for base and tuned)")
    use_ema: bool = _f(True, "Evaluate the EMA weights when train.ema is on")
    champion_margin: float = _f(0.0, "Registry: promote to champion only if better by more than this")


@dataclass
class DataConfig:
    source: str = _f("builtin:objects", "Prompts: builtin:<generator>, a .txt/.jsonl/.parquet file or folder, or hf://datasets/...")
    num_prompts: int = _f(256, "Prompts a built-in generator writes")
    test_fraction: float = _f(0.1, "Share of prompts held out for evaluation")
    seed: int = _f(0, "Seed of the generator and the train/test split")

    def __post_init__(self) -> None:
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"data.test_fraction={self.test_fraction} must be in (0, 1)")


@dataclass
class TrackingConfig:
    uri: str = _f("", "MLflow tracking URI; empty: $MLFLOW_TRACKING_URI, else a SQLite store in ./runs/mlflow")
    experiment: str = _f("diffusionrl", "MLflow experiment of the workflow runs")
    registered_model: str = _f("tiny-sd3-jpeg", "Registry name; versions of one name compete for @champion")
    log_retries: int = _f(5, "Attempts per MLflow logging call (exponential backoff) before buffering for later")
    max_artifact_mb: float = _f(200.0, "Trajectory folders up to this size are copied to MLflow; larger ones are linked")

    def __post_init__(self) -> None:
        _positive("tracking", "log_retries", self.log_retries)
        _positive("tracking", "max_artifact_mb", self.max_artifact_mb, allow_zero=True)
        if not self.registered_model.strip():
            raise ConfigError("tracking.registered_model is empty: name the registry entry, e.g. 'tiny-sd3-jpeg'")


class ConfigTree:
    """What a config tree (this ``Config``, ``diffusionrl.bdlm.BDLMConfig``) does with its sections:
    dict round trip with unknown-key checks, dotted flattening, a content digest."""

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Field name -> dataclass of each section."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params and logs."""
        out: dict[str, Any] = {}
        for section, values in self.to_dict().items():
            if isinstance(values, dict):
                out.update({f"{section}.{k}": v for k, v in values.items()})
            else:
                out[section] = values
        return out

    def digest(self) -> str:
        """Content digest of the config (sha256 of its canonical JSON), 16 hex chars."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config"):
        return _build(cls, data, where, cls.sections())


@dataclass
class Config(ConfigTree):
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    preset: str = _f("tiny-cpu", "Name of the preset this config started from (informational)")

    def __post_init__(self) -> None:
        if self.algorithm.name == "flow_grpo" and self.sampling.sde_type == "ode":
            raise ConfigError(
                "algorithm.name=flow_grpo needs stochastic rollouts: set sampling.sde_type to sde or cps "
                "(ode has no log-probs to train on)"
            )
        if self.algorithm.name == "nft" and self.algorithm.nft_adv_clip > self.algorithm.adv_clip_max:
            ac = self.algorithm
            lo = 0.5 - ac.adv_clip_max / (2 * ac.nft_adv_clip)
            raise ConfigError(
                f"algorithm.nft_adv_clip={ac.nft_adv_clip} exceeds algorithm.adv_clip_max={ac.adv_clip_max}: "
                f"advantages are already clamped to +-{ac.adv_clip_max}, so DiffusionNFT's r would never leave "
                f"[{lo:g}, {1 - lo:g}]; set nft_adv_clip <= adv_clip_max (the reference uses 5 for both)"
            )
        if self.train.mixed_precision != "no" and self.model.device == "cpu":
            raise ConfigError(
                f"train.mixed_precision={self.train.mixed_precision} needs a GPU; set it to 'no' on CPU"
            )

    @classmethod
    def sections(cls) -> dict[str, type]:
        return _section_classes()


def _section_classes() -> dict[str, type]:
    return {
        "model": ModelConfig,
        "sampling": SamplingConfig,
        "algorithm": AlgorithmConfig,
        "reward": RewardConfig,
        "train": TrainConfig,
        "eval": EvalConfig,
        "data": DataConfig,
        "tracking": TrackingConfig,
    }


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    hint = difflib.get_close_matches(key, known, n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown key {key!r} in {where}{suggestion}")


def _build(cls: type, data: dict[str, Any], where: str, sections: dict[str, type] | None = None) -> Any:
    """``cls(**data)`` with unknown keys rejected and leaves coerced; ``sections`` are built recursively."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    known = [f.name for f in fields(cls)]
    types = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    sections = sections or {}
    for key, value in data.items():
        if key not in known:
            raise _unknown(key, known, where)
        if key in sections:
            kwargs[key] = _build(sections[key], value, f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, types[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - defensive, names are checked above
        raise ConfigError(f"{where}: {exc}") from exc


def _merge(base: dict[str, Any], update: dict[str, Any], where: str) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if key not in out:
            raise _unknown(key, list(out), where)
        if isinstance(out[key], dict) and isinstance(value, dict) and key not in ("weights",):
            out[key] = _merge(out[key], value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def _parse_value(raw: str) -> Any:
    """A CLI override value: numbers (`3`, `1e-4`), YAML scalars/lists/maps (`true`, `[0, 5]`, `{a: 1}`)."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _coerce(value: Any, type_name: str, where: str) -> Any:
    """Check a leaf against its annotation (``float`` also takes ints and numeric strings like
    YAML's ``3e-4``); nested containers are checked by their outer type."""
    base = str(type_name).split("[")[0]
    if base == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    expected = {"int": int, "bool": bool, "str": str, "list": list, "dict": dict}.get(base)
    if expected is None:
        return value
    if expected is int and isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"{where} must be of type {type_name}, got {value!r}")
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``section.key=value`` overrides to a config dict (returns a new dict)."""
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = out
        for i, part in enumerate(parts):
            where = ".".join(parts[:i]) or "config"
            if not isinstance(node, dict) or part not in node:
                known = list(node) if isinstance(node, dict) else []
                raise _unknown(part, known, f"override {dotted!r} ({where})")
            if i == len(parts) - 1:
                node[part] = _parse_value(raw)
            else:
                node = node[part]
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def load_config(
    preset: str | None = None,
    file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """Preset (default ``tiny-cpu``, or the file's ``preset`` key) + file + dotted overrides."""
    file_data = read_config_file(file) if file else {}
    name = preset or file_data.get("preset") or "tiny-cpu"
    data = get_preset(name).to_dict()
    if file_data:
        data = _merge(data, file_data, str(file))
    data["preset"] = name
    data = apply_overrides(data, overrides or [])
    return Config.from_dict(data, where=str(file) if file else "config")


# -- presets ------------------------------------------------------------------------------------


def _tiny_cpu() -> dict[str, Any]:
    # The embedded default: Flow-GRPO on builtin:tiny-sd3 at 64 px, JPEG compressibility.
    # Chosen so that the reward visibly rises within minutes on a 2-core CPU (bench/learning.py):
    # the "Fast" regime (a 2-step SDE window, so most steps are cheap ODE steps and credit is
    # concentrated), 8 groups of 8 for a less noisy gradient, LoRA also on the feed-forward and
    # output projections, and a learning rate suited to a 0.3 M-parameter random transformer.
    # With the reference recipe's attention-only adapter at 3e-4 the reward does not move.
    return {
        "model": {"lora_targets": SD3_LORA_TARGETS + ["proj_out", "ff.net.0.proj", "ff.net.2"]},
        "sampling": {"step_strategy": "sde_window", "num_sde_steps": 2, "window_range": [0, 5]},
        "train": {"prompts_per_step": 8, "group_size": 8, "micro_batch_size": 8, "learning_rate": 1e-2},
    }


def _sd35m_gpu() -> dict[str, Any]:
    # What the SD3.5-medium recipes share on GPUs: the gated hub model in fp16 with an fp32 LoRA
    # (r32, alpha 64), 512 px and 10 sampling steps, fp16 forward with a grad scaler, EMA 0.9 for
    # evaluation (40 ODE steps), checkpoints every 20 steps, no latents in the trajectory Parquet.
    return {
        "model": {
            "name": "stabilityai/stable-diffusion-3.5-medium",
            "dtype": "float16",
            "device": "cuda",
            "lora_rank": 32,
            "lora_alpha": 64,
            "gradient_checkpointing": True,
        },
        "sampling": {"resolution": 512, "num_steps": 10},
        "train": {
            "steps": 1000,
            "micro_batch_size": 8,
            "learning_rate": 3e-4,
            "mixed_precision": "fp16",
            "memory_handoff": True,
            "offload_optimizer": True,
            "ema": True,
            "ema_decay": 0.9,
            "checkpoint_every": 20,
            "log_images_every": 20,
            "save_latents": False,
        },
        "eval": {"num_steps": 40, "num_prompts": 1024},
    }


def _sd35m_ocr() -> dict[str, Any]:
    # The Flow-GRPO reference recipe (docs/algorithms.md section 9): OCR reward, 48 groups of 16.
    return _overlay(
        _sd35m_gpu(),
        {
            "model": {"max_sequence_length": 256},
            "sampling": {"guidance_scale": 4.5, "noise_level": 0.7},
            "algorithm": {"clip_range": 1e-4, "kl_beta": 0.04, "adv_clip_max": 5.0, "global_std": True},
            "reward": {"weights": {"ocr": 1.0}, "num_actors": 8},
            # The reference layout: 2 GPUs, each a trainer rank (FSDP2) + an SGLang engine (docs/scaling.md).
            "train": {"prompts_per_step": 48, "group_size": 16, "minibatches": 2, "world_size": 2,
                      "placement": "colocate", "rollout_engines": 2, "cpus_per_bundle": 4},
            "eval": {"guidance_scale": 4.5},
            "data": {"source": "builtin:ocr", "num_prompts": 20000, "test_fraction": 0.05},
            "tracking": {"registered_model": "sd35m-ocr"},
        },
    )


def _tiny_cpu_ocr() -> dict[str, Any]:
    # OCR prompts + OCR reward scored by Ray CPU actors on the tiny model: it will not learn to
    # write on a CPU, it proves the plumbing of the reference recipe end to end.
    return _overlay(
        _tiny_cpu(),
        {
            "reward": {"weights": {"ocr": 1.0}, "num_actors": 2},
            "data": {"source": "builtin:ocr", "num_prompts": 256},
            "tracking": {"registered_model": "tiny-sd3-ocr"},
            "sampling": {"resolution": 128},
            "train": {"prompts_per_step": 4},
        },
    )


def _overlay(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` laid over it, section by section (for presets built on presets)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict) and key != "weights":
            out[key] = _overlay(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _tiny_cpu_nft() -> dict[str, Any]:
    # DiffusionNFT on the tiny model: tiny-cpu's model, data and batch, CFG-free ODE rollouts of
    # the EMA old policy (docs/algorithms.md 7), the reference's KL weight and guidance strength.
    # LoRA on the feed-forward and output projections too, and a larger learning rate: with the
    # attention-only adapter at 3e-4 the tiny model's jpeg reward does not move within minutes;
    # with these it gains ~8 first-step stds in 40 steps (bench/learning.py --compare nft).
    return _overlay(
        _tiny_cpu(),
        {
            "model": {"lora_targets": SD3_LORA_TARGETS + ["proj_out", "ff.net.0.proj", "ff.net.2"]},
            "train": {"learning_rate": 1e-2},
            "algorithm": {"name": "nft", "kl_beta": 0.0001, "nft_beta": 1.0},
            "sampling": {"guidance_scale": 1.0},
            "reward": {"weights": {"jpeg_compressibility": 1.0}},
            "eval": {"guidance_scale": 1.0},
        },
    )


def _sd35m_pickscore_nft() -> dict[str, Any]:
    # DiffusionNFT's SD3.5-medium PickScore recipe (its config/nft.py sd3_pickscore, decay type 1)
    # on one GPU: 8 groups of 8 instead of 48 x 24 over 8 GPUs, one optimizer step per rollout.
    # The reference samples with a second-order DPM solver; ours are Euler ODE steps.
    return _overlay(
        _sd35m_gpu(),
        {
            "model": {"max_sequence_length": 128},
            "sampling": {"guidance_scale": 1.0},
            "algorithm": {
                "name": "nft",
                "kl_beta": 0.0001,
                "nft_beta": 1.0,
                "nft_adv_clip": 5.0,
                "adv_clip_max": 5.0,
                "global_std": True,
                "old_policy_rate": 0.001,
                "old_policy_flat": 0,
                "old_policy_cap": 0.5,
            },
            "reward": {"weights": {"pickscore": 1.0}},
            "tracking": {"registered_model": "sd35m-pickscore"},
            "train": {"prompts_per_step": 8, "group_size": 8, "minibatches": 1},
            "eval": {"guidance_scale": 1.0},
        },
    )


def _tiny_cpu_sglang() -> dict[str, Any]:
    # tiny-cpu with rollouts from a real SGLang diffusion server (CPU, fp32) that this run launches
    # from .venv-sglang (`make sglang-env`); LoRA pushed as merged weights, checksum-verified.
    return _overlay(_tiny_cpu(), {"sampling": {"engine": "sglang", "sglang_verify_weights": True}})


PRESETS: dict[str, Any] = {
    "tiny-cpu": _tiny_cpu,
    "tiny-cpu-sglang": _tiny_cpu_sglang,
    "tiny-cpu-ocr": _tiny_cpu_ocr,
    "sd35m-ocr": _sd35m_ocr,
    "tiny-cpu-nft": _tiny_cpu_nft,
    "sd35m-pickscore-nft": _sd35m_pickscore_nft,
}


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        hint = difflib.get_close_matches(name, list(PRESETS), n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}{extra}")
    data = _merge(Config().to_dict(), PRESETS[name](), f"preset {name}")
    data["preset"] = name
    return Config.from_dict(data, where=f"preset {name}")


def describe() -> str:
    """Every key with its default and help text (for --help-config)."""
    lines = []
    for section, cls in _section_classes().items():
        lines.append(f"[{section}]")
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"  {section}.{f.name} = {default!r}  # {f.metadata.get('help', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m diffusionrl.config --preset NAME [--set k=v ...]``: print the full config as YAML."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m diffusionrl.config")
    ap.add_argument("--preset", default="tiny-cpu", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--config", default=None, help="YAML/JSON file applied over the preset")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    cfg = load_config(args.preset, args.config, args.overrides)
    print(f"# Full config of preset {args.preset} (generated: python -m diffusionrl.config --preset {args.preset}).")
    print(f"# Pass it to pyflyte run ... --config configs/{args.preset}.yaml; every key is required there.")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
