"""The plan of one config on one cluster shape: per-rank peak GPU memory by part, and time per
training step and per rollout (docs/scaling.md, "Planning").

Bytes come from counted parameters (``facts.py``) and measured activations (``measure.py``):

- training phase: base weights (FSDP2 shards every block of the block lists, FLUX's single-stream
  blocks included; the root unit stays whole while gathered; two block units gathered at a time),
  LoRA (fp32), gradients (fp32), AdamW state (2 x fp32), EMA and old-policy copies (fp32), the
  reference (0 bytes: the LoRA-disabled policy), activations of one work unit (every forward of its
  CFG passes at ``train.micro_batch_size``; with checkpointing each block's inputs plus one block
  recomputed), the backward's working set (assumed one block's saved bytes), text encoders and VAE
  (the adapter keeps the whole pipeline on the device), the colocated engine's share (a local engine
  is a full copy of the transformer made before sharding; an SGLang server holds its own pipeline,
  released during training with ``train.memory_handoff``), reward models on a GPU (PickScore, when
  scored in-process: on rank 0), and the engine's rollout working set in the rollout phase;
- a fragmentation margin (``FRAGMENTATION`` of the tensors) and a CUDA context per process, which
  ``torch.cuda.max_memory_allocated`` does not see.

With ``model.finetune=full`` the trained tensors are the whole transformer: fp32 weights (sharded,
their units gathered in the compute precision), fp32 gradients and AdamW state of every weight, the
EMA and old-policy copies of every weight, a frozen fp32 reference copy when the objective forwards
one (``config.objectives.needs_reference``), and an fp32 engine copy; activations and FLOPs stay the
LoRA targets' measurement (a note says so).

Time: FLOPs of every forward and backward of the step (FlopCounterMode on the real shapes) at a
stated MFU of the GPU's dense fp16/bf16 (tf32 without mixed precision) peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diffusionrl.config import RANKED, ConfigError, objective
from diffusionrl.config.objectives import needs_reference

from .archs import tokens
from .facts import flops, lora_params, model_facts, reward_params
from .measure import CACHE, cache_key, load_cache, lora_suffixes, measure_saved, predict_saved, stub_adapter

GIB = 2**30
FRAGMENTATION = 0.10  # of the tensor bytes: the caching allocator's blocks that a peak cannot reuse
CUDA_CONTEXT = 1.0 * GIB  # per process on the GPU (CUDA context, cuBLAS/NCCL workspaces)
MFU = 0.35  # the model FLOPs utilisation the time estimates assume
PCIE = 25e9  # bytes/s of a host <-> device copy (optimizer offload)
# name -> (memory in bytes as nvidia-smi reports it, dense fp16/bf16 FLOP/s, dense tf32 FLOP/s)
GPUS = {
    "H200": (143771 * 2**20, 989e12, 494e12),
    "H100": (81559 * 2**20, 989e12, 494e12),
    "A100-80G": (81920 * 2**20, 312e12, 156e12),
    "L40S-48G": (46068 * 2**20, 362e12, 181e12),
}
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Plan:
    """One rank's prediction (the busiest rank: rank 0, which holds an engine and any GPU reward)."""

    gpus: int
    gpu_memory: float
    train: dict[str, float]  # part -> bytes at the training peak
    rollout: dict[str, float]  # part -> bytes at the rollout peak
    step_s: float
    rollout_s: float
    unit_s: float = 0.0  # one work unit (forward + backward of one micro-batch at one timestep)
    notes: list[str] = field(default_factory=list)
    refused: str = ""  # why the training code would refuse this config, if it would
    knobs: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(sum(self.train.values()), sum(self.rollout.values()))

    @property
    def phase(self) -> str:
        return "train" if sum(self.train.values()) >= sum(self.rollout.values()) else "rollout"

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory


def forward_batches(cfg_mode: str, micro_batch: int, cfg_pass: bool) -> list[int]:
    """The batches of the transformer forwards of one velocity, from the adapter's ``cfg_mode``: a
    batched CFG pass is one forward of 2m (SD3, Z-Image), a separate one two of m (Qwen-Image, Wan)."""
    if not cfg_pass:
        return [micro_batch]
    return [2 * micro_batch] if cfg_mode == "batched" else [micro_batch, micro_batch]


def activation_entry(cfg, cache: dict, family: str, config: dict) -> tuple[dict, str]:
    """The measured fit of ``cfg``'s model and precision (cached; measured now for a builtin)."""
    m = cfg.model
    full = m.finetune == "full"
    targets = None if full else lora_suffixes(family, m.lora_targets)
    key = cache_key(m.name, m.dtype, cfg.train.mixed_precision, m.finetune)
    if key in cache["saved"]:
        entry, note = cache["saved"][key], ""
    elif m.name.startswith("builtin:"):
        entry, note = measure_saved(family, config, m.dtype, cfg.train.mixed_precision, m.lora_rank, targets), ""
    else:
        same = [k for k in cache["saved"] if k.startswith(m.name + "|") and k.endswith("|full") == full]
        if not same and full and any(k.startswith(m.name + "|") for k in cache["saved"]):
            raise ConfigError(f"no full fine-tuning activation measurement of {m.name}: run python -m "
                              "diffusionrl.plan.refresh with a preset that sets model.finetune=full for it")
        if not same:
            raise ConfigError(f"no activation measurement of {m.name}: run python -m diffusionrl.plan.refresh")
        entry = cache["saved"][same[0]]
        note = f"activations scaled from the {same[0].split('|', 1)[1]} measurement by element size"
        ratio = BYTES[m.dtype] / BYTES[entry["weights_dtype"]]
        entry = dict(entry, coef={k: [c * ratio for c in v] for k, v in entry["coef"].items()})
    if not full and (entry["lora_rank"], entry["lora_targets"]) != (m.lora_rank, targets):
        note = (note + "; " if note else "") + (
            f"activations measured with LoRA rank {entry['lora_rank']} on {len(entry['lora_targets'])} target "
            "suffixes, not this config's (each adapted layer saves rank x tokens more or less)")
    return entry, note


def units_per_micro_batch(cfg) -> int:
    """Forward/backward units one micro-batch gives per inner epoch (the step's trained timesteps)."""
    s, name = cfg.sampling, cfg.algorithm.name
    if objective(name).sde:
        if s.step_strategy == "all":
            return min(int(s.num_steps * 0.99), s.num_steps - 1)
        groups = max(1, math.ceil(cfg.train.micro_batch_size / cfg.train.group_size))
        width = (s.window_range[1] - s.window_range[0]) if s.step_strategy == "sde_window" else s.num_sde_steps
        return min(s.num_sde_steps * groups, max(width, s.num_sde_steps), s.num_steps - 1)
    if name == "nft" and cfg.algorithm.nft_timesteps:
        return cfg.algorithm.nft_timesteps  # DiffusionNFT on k of the T - 1 levels
    return s.num_steps - 1  # objectives that re-noise the clean latent at T - 1 levels


def rollout_steps(cfg) -> int:
    """Denoising steps one training rollout takes: ``num_steps``, or with MixGRPO-Flash's compression
    (``sampling.post_window_ode_steps``) the steps up to the SDE window's end plus the compressed ones,
    for the window's last position in ``window_range`` (the longest; ``algorithms.sde.compressed_steps``)."""
    s = cfg.sampling
    k, end = s.post_window_ode_steps, s.window_range[1] if s.step_strategy == "mix_window" else s.num_steps
    return end + k if 0 < k < s.num_steps - end else s.num_steps


def plan(cfg, gpu: str = "H200", gpu_memory: float | None = None, mfu: float = MFU, cache: dict | None = None,
         rank: int = 0) -> Plan:
    """The plan of ``cfg`` (its ``train.world_size`` ranks) on GPUs of kind ``gpu``."""
    cache = load_cache(CACHE) if cache is None else cache
    m, s, tc, ac = cfg.model, cfg.sampling, cfg.train, cfg.algorithm
    facts = model_facts(m.name, cache)
    family, config = facts["family"], facts["config"]
    entry, note = activation_entry(cfg, cache, family, config)
    notes = [note] if note else []
    mem, peak16, peak32 = GPUS[gpu]
    mem = gpu_memory or mem
    flops_peak = (peak32 if tc.mixed_precision == "no" else peak16) * mfu
    W, mb, wb = tc.world_size, tc.micro_batch_size, BYTES[m.dtype]
    amp_b = wb if tc.mixed_precision == "no" else 2
    n_img, n_txt = tokens(family, config, s.resolution, s.num_frames, m.max_sequence_length, facts["vae_scale"],
                          facts["temporal_scale"])
    stub = stub_adapter(family, None, "no")
    cfg_pass = stub.needs_negative(s.guidance_scale)
    batches = forward_batches(stub.cfg_mode, mb, cfg_pass)
    side = s.resolution // facts["vae_scale"]
    frames = (s.num_frames - 1) // facts["temporal_scale"] + 1 if family == "wan" else 1
    full = m.finetune == "full"  # every transformer weight trains (fp32 master weights: model.dtype float32)
    # the trained tensors: the LoRA, or the whole transformer
    lora = facts["params"] * 4 if full else lora_params(facts, lora_suffixes(family, m.lora_targets), m.lora_rank) * 4
    holds_engine = W == 1 or (tc.placement == "colocate" and rank < tc.rollout_engines)
    weights = (facts["params"] + facts["buffers"]) * wb
    kind = "transformer" if full else "LoRA"

    # -- parts present in both phases
    common: dict[str, float] = {}
    base = "transformer weights (fp32, trained)" if full else "base weights"
    if W == 1:
        common[base] = weights
    else:
        gathered = 2 * max(facts["fsdp_units"] or [0]) * amp_b
        common[base] = facts["params"] * wb / W + facts["buffers"] * wb
        common["base weights (gathered: root unit + 2 blocks)"] = facts["fsdp_root"] * amp_b + gathered
    if not full:
        common["LoRA (fp32)"] = lora / W
        common["reference (LoRA disabled: no copy)"] = 0.0
    elif needs_reference(cfg):  # a frozen fp32 copy of the base transformer, sharded like it
        common["reference (frozen copy of the base transformer)"] = common[base]
    old = int(objective(ac.name).old_policy)  # an fp32 copy (and no-grad forwards) of the old policy
    copies = int(tc.ema) + old
    common[f"EMA / old-policy {kind} copies"] = copies * lora / W
    common["text encoders + VAE"] = sum(facts["others"].values()) * wb
    if holds_engine and s.engine == "local":
        common["rollout engine (local: full transformer copy)"] = weights if full else weights + lora
    if rank == 0 and cfg.reward.num_actors == 0:
        common["reward models (GPU)"] = reward_params(cfg.reward.weights) * 2
    common["CUDA context"] = CUDA_CONTEXT

    # -- training phase
    train = dict(common)
    train["gradients (fp32)"] = lora / W
    train["optimizer (AdamW, 2 x fp32)"] = 2 * lora / W
    ckpt = m.gradient_checkpointing
    saved = [predict_saved(entry, config, b, n_img, n_txt, ckpt, again=i > 0) for i, b in enumerate(batches)]
    block = max(x["block_peak"] for x in saved)
    train["activations (training forward" + (", checkpointed)" if ckpt else ")")] = sum(x["total"] for x in saved)
    train["backward working set (one block, assumed)"] = block * (2 if ckpt else 1)
    if holds_engine and s.engine == "sglang" and not tc.memory_handoff:
        train["SGLang server (weights, not released)"] = weights + common["text encoders + VAE"] + CUDA_CONTEXT

    # -- rollout phase (no gradients; optimizer state on the host with offload_optimizer)
    rollout = dict(common)
    if W > 1:
        rollout["base weights (gathered: root unit + 2 blocks)"] = 0.0
    if not tc.offload_optimizer:
        rollout["optimizer (AdamW, 2 x fp32)"] = 2 * lora / W
    if holds_engine:
        if s.engine == "sglang":
            rollout["SGLang server (pipeline weights)"] = weights + common["text encoders + VAE"] + CUDA_CONTEXT
        channels = config["in_channels"] // (4 if family in ("flux", "qwen-image") else 1)
        sample = channels * frames * side * side  # one latent, fp32; a trajectory keeps T + 1 of them
        rollout["rollout working set (one block, no grad; latents)"] = (
            max(predict_saved(entry, config, b, n_img, n_txt)["block_peak"] for b in batches)
            + mb * (rollout_steps(cfg) + 1) * sample * 4)
    for parts in (train, rollout):
        tensors = sum(v for k, v in parts.items() if k != "CUDA context")
        parts["fragmentation margin"] = FRAGMENTATION * tensors

    # -- time
    f = flops(m.name, facts, side, n_txt, frames, cache)
    if full:  # every weight's gradient besides the inputs': twice the forward (the LoRA's is counted)
        f = dict(f, backward=2 * f["forward"])
    per_sample = f["forward"] * (2 if cfg_pass else 1)
    batch = tc.prompts_per_step * tc.group_size
    units = batch // (W * mb) * units_per_micro_batch(cfg) * tc.inner_epochs
    extra = (1 if ac.kl_beta > 0 else 0) + old + (1 if ckpt else 0)
    unit_flops = mb * (per_sample * (1 + extra) + f["backward"] * (2 if cfg_pass else 1))
    step_s = units * unit_flops / flops_peak
    if tc.offload_optimizer:
        step_s += 2 * (2 * lora / W) / PCIE
    engines = 1 if W == 1 else max(1, tc.rollout_engines)
    rollout_s = (batch / engines) * rollout_steps(cfg) * per_sample / flops_peak
    if rollout_steps(cfg) < s.num_steps:
        notes.append(f"MixGRPO-Flash compression: a rollout takes {rollout_steps(cfg)} of {s.num_steps} steps (the "
                     "window at the end of window_range, its longest)")
    notes.append(f"{n_img} image + {n_txt} text tokens per forward; {len(batches)} forward(s) of {batches} per unit")
    if full:
        notes.append("model.finetune=full: activations measured with every weight trained; the backward counted "
                     "as twice the forward's FLOPs (input and weight gradients)")
    if family == "qwen-image":
        notes.append("Qwen-Image's text is as long as the batch's longest prompt: model.max_sequence_length is planned")
    refused = ""
    if W > 1 and not objective(ac.name).ranks:  # distributed/ranks.py
        refused = f"world_size > 1 runs algorithm.name={'/'.join(RANKED)} only, not {ac.name}"
        notes.append(f"refused at launch: {refused}")
    return Plan(W, mem, train, rollout, step_s, rollout_s, unit_flops / flops_peak, notes, refused)
