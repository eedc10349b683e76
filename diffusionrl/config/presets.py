"""Named configurations of the image ``Config`` (``tiny-cpu``, ``sd35m-ocr``, ...).

A preset is a sequence of change sets: partial config dicts that ``diffusionrl.config.get_preset``
lays, in order, over the schema's defaults (``Config.merge_dicts``: sections key by key, leaves
replaced whole, unknown keys rejected). Presets built on presets list their parent's change sets
first. ``configs/<preset>.yaml`` holds each preset's full dump (``python -m diffusionrl.config
--preset NAME``); ``tests/test_config_files.py`` checks that they agree.

This module holds data only: it imports no schema, so ``diffusionrl.config`` can import it.
"""

from __future__ import annotations

from typing import Any

from .presets_ext import GPU_EXT_PRESETS, TINY_CPU_WAN22, TINY_EXT_PRESETS, WAN22_T2V_A14B_OCR
from .tree import lookup_preset

# ``model.lora_targets``: empty (the schema's default) is the family's own list, which sits on its adapter
# class (``default_lora_targets`` in diffusionrl/models/<family>.py). A preset that adapts more layers
# spells its whole list: the family's default (as a literal: this package sits below diffusionrl.models;
# tests/test_config_files.py checks it against the adapter's) and what it adds.

# The embedded default: Flow-GRPO on builtin:tiny-sd3 at 64 px, JPEG compressibility.
# Chosen so that the reward visibly rises within minutes on a 2-core CPU (bench/learning.py):
# the "Fast" regime (a 2-step SDE window, so most steps are cheap ODE steps and credit is
# concentrated), 8 groups of 8 for a less noisy gradient, LoRA also on the feed-forward and
# output projections, and a learning rate suited to a 0.3 M-parameter random transformer.
# With the reference recipe's attention-only adapter at 3e-4 the reward does not move.
TINY_CPU: dict[str, Any] = {
    "model": {"lora_targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                               "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",  # SD3's default
                               "proj_out", "ff.net.0.proj", "ff.net.2"]},
    "sampling": {"step_strategy": "sde_window", "num_sde_steps": 2, "window_range": [0, 5]},
    "train": {"prompts_per_step": 8, "group_size": 8, "micro_batch_size": 8, "learning_rate": 1e-2},
}

# What the SD3.5-medium recipes share on GPUs (not a preset by itself): the gated hub model in
# fp16 with an fp32 LoRA (r32, alpha 64), 512 px and 10 sampling steps, fp16 forward with a grad
# scaler, EMA 0.9 for evaluation (40 ODE steps), checkpoints every 20 steps, no latents in the
# trajectory Parquet.
SD35M_GPU: dict[str, Any] = {
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

# Over SD35M_GPU: the Flow-GRPO reference recipe (docs/algorithms.md section 9): OCR reward, 48 groups of 16.
SD35M_OCR: dict[str, Any] = {
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
}

# Over TINY_CPU: OCR prompts + OCR reward scored by Ray CPU actors on the tiny model: it will not
# learn to write on a CPU, it proves the plumbing of the reference recipe end to end.
TINY_CPU_OCR: dict[str, Any] = {
    "reward": {"weights": {"ocr": 1.0}, "num_actors": 2},
    "data": {"source": "builtin:ocr", "num_prompts": 256},
    "tracking": {"registered_model": "tiny-sd3-ocr"},
    "sampling": {"resolution": 128},
    # plumbing only: a CPU model draws no legible text, every sample's OCR reward is 0 and no group
    # has a learning signal, so the idle-update guard (training/guard.py) is off for this preset
    "train": {"prompts_per_step": 4, "max_idle_steps": 0},
}

# Over TINY_CPU: DiffusionNFT on the tiny model: tiny-cpu's model, data and batch, CFG-free ODE
# rollouts of the EMA old policy (docs/algorithms.md section 7), the reference's KL weight and guidance strength.
# LoRA on the feed-forward and output projections too, and a larger learning rate: with the
# attention-only adapter at 3e-4 the tiny model's jpeg reward does not move within minutes;
# with these it gains ~8 first-step stds in 40 steps (bench/learning.py --compare nft).
TINY_CPU_NFT: dict[str, Any] = {
    "model": {"lora_targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                               "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",  # SD3's default
                               "proj_out", "ff.net.0.proj", "ff.net.2"]},
    "train": {"learning_rate": 1e-2},
    "algorithm": {"name": "nft", "kl_beta": 0.0001, "nft_beta": 1.0},
    "sampling": {"guidance_scale": 1.0},
    "reward": {"weights": {"jpeg_compressibility": 1.0}},
    "eval": {"guidance_scale": 1.0},
}

# Over SD35M_GPU: DiffusionNFT's SD3.5-medium PickScore recipe (its config/nft.py sd3_pickscore,
# decay type 1) on one GPU: 8 groups of 8 instead of 48 x 24 over 8 GPUs, one optimizer step per
# rollout. The reference samples with a second-order DPM solver; ours are Euler ODE steps.
SD35M_PICKSCORE_NFT: dict[str, Any] = {
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
}

# Over TINY_CPU: rollouts from a real SGLang diffusion server (CPU, fp32) that this run launches
# from .venv-sglang (`make sglang-env`); LoRA pushed as merged weights, checksum-verified.
TINY_CPU_SGLANG: dict[str, Any] = {"sampling": {"engine": "sglang", "sglang_verify_weights": True}}

# Over TINY_CPU: Flow-GRPO on DanceGRPO's SDE (constant noise g = eta, DanceGRPO's eta 0.3).
TINY_CPU_DANCE: dict[str, Any] = {"sampling": {"sde_type": "dance", "noise_level": 0.3}}

# Over TINY_CPU: GRPO-Guard (RatioNorm + 1/|dt| reweighting) on tiny-cpu's Flow-SDE rollouts, without the
# heavy KL it is meant to make unnecessary (docs/algorithms.md section 14.2).
TINY_CPU_GRPO_GUARD: dict[str, Any] = {"algorithm": {"name": "grpo_guard", "kl_beta": 0.0}}

# Over TINY_CPU: Flow-DPPO, the x-based trust region at this project's default threshold (1e-6, tighter than
# the published 1e-5; docs/algorithms.md 14.3), no reference KL, and two optimizer steps per rollout so that
# the trust region has an old policy to hold the second one to.
TINY_CPU_DPPO: dict[str, Any] = {
    "algorithm": {"name": "dppo", "kl_beta": 0.0, "dppo_kl_space": "x", "dppo_kl_threshold": 1e-6},
    "train": {"minibatches": 2},
}

# Over TINY_CPU: Advantage Weighted Matching on CFG-free ODE rollouts (the trained velocity is the one
# sampled), a small velocity-space KL as in AWM's recipes.
TINY_CPU_AWM: dict[str, Any] = {
    "algorithm": {"name": "awm", "kl_beta": 0.001, "kl_space": "v"},
    "sampling": {"guidance_scale": 1.0},
    "eval": {"guidance_scale": 1.0},
}

# Over TINY_CPU: online Diffusion-DPO, best-vs-worst pairs of each prompt group, CFG-free ODE rollouts.
# beta 5, not Diffusion-DPO's 5000 (SD1.5 fully fine-tuned at lr ~2e-5): one Adam step at lr 1e-2 moves
# a pair's error difference by ~lr, so at 5000 the margin beta/2 * 0.01 ~ 25 saturates the sigmoid after
# the first step and the reward does not move (algorithms/dpo.py); keep beta * learning_rate <~ 0.1.
TINY_CPU_DPO: dict[str, Any] = {
    "algorithm": {"name": "dpo", "kl_beta": 0.0, "dpo_pairs": "best_worst", "dpo_beta": 5.0},
    "sampling": {"guidance_scale": 1.0},
    "eval": {"guidance_scale": 1.0},
}

# Over TINY_CPU: supervised fine-tuning (the warm start before RL) on built-in pictures of shapes.
TINY_CPU_SFT: dict[str, Any] = {
    "algorithm": {"name": "sft", "sft_source": "builtin:shapes:256"},
    "train": {"learning_rate": 1e-3},
    "eval": {"guidance_scale": 1.0},
}

# Over TINY_CPU: GenEval in miniature, the `make demo` default. DiffusionNFT on builtin:tiny-sd3-shapes
# (pretrained on the shapes world by diffusionrl.models.pretrain) with the strict geneval_mini reward on
# builtin:shapes prompts, CFG-free (rollouts, probes and evaluation at g = 1, as DiffusionNFT trains), each
# prompt group re-noised with shared noise (algorithm.group_renoise); the split is the one the model was
# pretrained on (its held-out prompts never drawn). Chosen by bench/geneval_mini.py (bench/README.md, "GenEval
# in miniature"): Flow-GRPO at CFG 4.5 lost held-out success at every lr tried; NFT without group re-noising
# did not move it; at lr 3e-3 it fell.
TINY_CPU_SHAPES: dict[str, Any] = {
    "model": {"name": "builtin:tiny-sd3-shapes", "max_sequence_length": 16},
    "reward": {"weights": {"geneval_mini": 1.0}},
    "data": {"source": "builtin:shapes", "num_prompts": 256, "test_fraction": 0.2, "seed": 0},
    "algorithm": {"name": "nft", "kl_beta": 0.0, "group_renoise": True},
    "sampling": {"guidance_scale": 1.0},
    "train": {"learning_rate": 1e-3, "steps": 30},
    # every held-out prompt, 8 seeds each in the final evaluation (1-2 prompts hold a category: fewer seeds
    # move a category's figure by whole steps); a probe of all of them every 5 steps
    # @champion on the strict score (GenEval's overall), and only above the base model's
    "eval": {"num_prompts": 0, "seeds_per_prompt": 8, "every": 5, "probe_prompts": 0, "guidance_scale": 1.0,
             "champion_metric": "eval/geneval_mini_success/category_mean"},
    "tracking": {"registered_model": "tiny-sd3-shapes"},
}

# Over TINY_CPU: the same Flow-GRPO run on builtin:tiny-flux (guidance-distilled, no CFG pass: the
# guidance scale is FLUX.1-dev's 3.5, an input of the transformer), LoRA on flow_grpo's FLUX targets
# plus the single-stream blocks' MLP and the output projections (as tiny-cpu adds them for SD3).
TINY_CPU_FLUX: dict[str, Any] = {
    "model": {"name": "builtin:tiny-flux",
              "lora_targets": ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                               "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                               "ff_context.net.0.proj", "ff_context.net.2",  # FLUX.1's default
                               "proj_mlp", "proj_out"]},
    "sampling": {"guidance_scale": 3.5},
    "eval": {"guidance_scale": 3.5},
    "tracking": {"registered_model": "tiny-flux-jpeg"},
}

# FLUX.1-dev, flow_grpo's pickscore_flux recipe (config/grpo.py; scripts/train_flux.py): the gated hub
# model in bf16 with an fp32 LoRA r64/alpha128 on FLUX.1's default targets, T5 prompts of 128 tokens, 512 px,
# 6 sampling steps at distilled guidance 3.5, SDE noise level 0.9 on every step, no KL, global std;
# 48 prompts x 24 images a step, 3 images per micro-batch, 2 optimizer steps per step, bf16 forward, EMA
# 0.9, evaluation with 28 ODE steps; PickScore reward. The reference spreads this over 32 GPUs (data
# parallel); here 8 FSDP2 ranks, each with a colocated local rollout engine.
FLUX1_DEV_PICKSCORE: dict[str, Any] = {
    "model": {
        "name": "black-forest-labs/FLUX.1-dev",
        "dtype": "bfloat16",
        "device": "cuda",
        "max_sequence_length": 128,
        "lora_rank": 64,
        "lora_alpha": 128,
        "gradient_checkpointing": True,
    },
    "sampling": {"resolution": 512, "num_steps": 6, "guidance_scale": 3.5, "noise_level": 0.9},
    "algorithm": {"kl_beta": 0.0, "global_std": True, "adv_clip_max": 5.0},
    "reward": {"weights": {"pickscore": 1.0}},
    "train": {
        "steps": 1000,
        "prompts_per_step": 48,
        "group_size": 24,
        "micro_batch_size": 3,
        "minibatches": 2,
        "learning_rate": 3e-4,
        "mixed_precision": "bf16",
        "ema": True,
        "ema_decay": 0.9,
        "checkpoint_every": 30,
        "log_images_every": 30,
        "save_latents": False,
        "world_size": 8,
        "placement": "colocate",
        "rollout_engines": 8,
        "cpus_per_bundle": 4,
        "memory_handoff": True,
        "offload_optimizer": True,
    },
    "eval": {"num_steps": 28, "guidance_scale": 3.5, "num_prompts": 1024},
    "tracking": {"registered_model": "flux1-dev-pickscore"},
}

# Over TINY_CPU: Flow-GRPO on builtin:tiny-qwen-image: true CFG at flow_grpo's Qwen-Image guidance 4
# (two forwards a step, the mix rescaled to the positive prediction's norm), LoRA on both streams plus
# the output projection.
TINY_CPU_QWEN_IMAGE: dict[str, Any] = {
    "model": {"name": "builtin:tiny-qwen-image",
              "lora_targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                               "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                               "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",  # Qwen-Image's default
                               "proj_out"]},
    "sampling": {"guidance_scale": 4.0, "negative_prompt": " "},
    "eval": {"guidance_scale": 4.0},
    "tracking": {"registered_model": "tiny-qwen-image-jpeg"},
}

# Over TINY_CPU: Flow-GRPO on builtin:tiny-wan, 32 px x 5 frames (2 latent frames), CFG 5.0 (Wan's
# default; two forwards a step), the reward the per-frame JPEG compressibility (averaged over frames)
# plus the temporal consistency (-mean frame-to-frame change); LoRA also on the feed-forward and output
# projections (as tiny-cpu adds them for SD3); 4 groups of 4 videos (a video costs ~ 2 images of work).
TINY_CPU_WAN: dict[str, Any] = {
    "model": {"name": "builtin:tiny-wan",
              "lora_targets": ["to_q", "to_k", "to_v", "to_out.0",  # Wan's default
                               "ffn.net.0.proj", "ffn.net.2", "proj_out"]},
    "sampling": {"resolution": 32, "num_frames": 5, "guidance_scale": 5.0},
    "reward": {"weights": {"jpeg_compressibility": 1.0, "temporal_consistency": 1.0}},
    "train": {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 4},
    "eval": {"guidance_scale": 5.0},
    "tracking": {"registered_model": "tiny-wan-jpeg-temporal"},
}

# Over TINY_CPU_NFT + TINY_CPU_WAN: DiffusionNFT samples and trains CFG-free (guidance 1.0: one forward a step).
TINY_CPU_WAN_NFT: dict[str, Any] = {"sampling": {"guidance_scale": 1.0}, "eval": {"guidance_scale": 1.0}}

# Wan2.1-T2V-1.3B, flow_grpo's general_ocr_wan2_1 recipe (config/grpo.py; scripts/train_wan2_1.py): the hub
# model with an fp32 LoRA r32/alpha64 on Wan's default targets, UMT5 prompts of 512 tokens, 33 frames, 20
# sampling steps at CFG 4.5 with the empty negative prompt, 50 evaluation steps, 4 videos per prompt,
# 8 videos per micro-batch, OCR reward. flow_grpo samples 240x416; our resolution is square: 256 (also
# Flow-Factory's Wan2.1 T2V training resolution). bf16 forward with EMA 0.9, as the reference's
# mixed-precision LoRA runs; 8 ranks each with a colocated local rollout engine.
WAN21_T2V_OCR: dict[str, Any] = {
    "model": {
        "name": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "dtype": "bfloat16",
        "device": "cuda",
        "max_sequence_length": 512,
        "lora_rank": 32,
        "lora_alpha": 64,
        "gradient_checkpointing": True,
    },
    "sampling": {"resolution": 256, "num_frames": 33, "num_steps": 20, "guidance_scale": 4.5},
    "reward": {"weights": {"ocr": 1.0}, "num_actors": 8},
    "train": {
        "steps": 1000,
        "prompts_per_step": 32,
        "group_size": 4,
        "micro_batch_size": 8,
        "minibatches": 2,
        "learning_rate": 3e-4,
        "mixed_precision": "bf16",
        "ema": True,
        "ema_decay": 0.9,
        "checkpoint_every": 20,
        "log_images_every": 20,
        "save_latents": False,
        "world_size": 8,
        "placement": "colocate",
        "rollout_engines": 8,
        "cpus_per_bundle": 4,
        "memory_handoff": True,
        "offload_optimizer": True,
    },
    "eval": {"num_steps": 50, "guidance_scale": 4.5, "num_prompts": 1024},
    "data": {"source": "builtin:ocr", "num_prompts": 20000, "test_fraction": 0.05},
    "tracking": {"registered_model": "wan21-t2v-1.3b-ocr"},
}

# Preset name -> its change sets, laid over the schema's defaults in this order.
PRESETS: dict[str, tuple[dict[str, Any], ...]] = {
    "tiny-cpu": (TINY_CPU,),
    "tiny-cpu-shapes": (TINY_CPU, TINY_CPU_SHAPES),
    "tiny-cpu-sglang": (TINY_CPU, TINY_CPU_SGLANG),
    "tiny-cpu-ocr": (TINY_CPU, TINY_CPU_OCR),
    "sd35m-ocr": (SD35M_GPU, SD35M_OCR),
    "tiny-cpu-nft": (TINY_CPU, TINY_CPU_NFT),
    "sd35m-pickscore-nft": (SD35M_GPU, SD35M_PICKSCORE_NFT),
    "tiny-cpu-dance": (TINY_CPU, TINY_CPU_DANCE),
    "tiny-cpu-grpo-guard": (TINY_CPU, TINY_CPU_GRPO_GUARD),
    "tiny-cpu-dppo": (TINY_CPU, TINY_CPU_DPPO),
    "tiny-cpu-awm": (TINY_CPU, TINY_CPU_AWM),
    "tiny-cpu-dpo": (TINY_CPU, TINY_CPU_DPO),
    "tiny-cpu-sft": (TINY_CPU, TINY_CPU_SFT),
    "tiny-cpu-flux": (TINY_CPU, TINY_CPU_FLUX),
    # tiny-cpu-nft's objective on builtin:tiny-flux (FLUX keeps its distilled guidance: no CFG pass to drop)
    "tiny-cpu-flux-nft": (TINY_CPU, TINY_CPU_NFT, TINY_CPU_FLUX),
    "flux1-dev-pickscore": (FLUX1_DEV_PICKSCORE,),
    "tiny-cpu-qwen-image": (TINY_CPU, TINY_CPU_QWEN_IMAGE),
    "tiny-cpu-wan": (TINY_CPU, TINY_CPU_WAN),
    # tiny-cpu-nft's objective on builtin:tiny-wan (CFG-free ODE rollouts of the old policy)
    "tiny-cpu-wan-nft": (TINY_CPU, TINY_CPU_NFT, TINY_CPU_WAN, TINY_CPU_WAN_NFT),
    "wan21-t2v-1.3b-ocr": (WAN21_T2V_OCR,),
    "tiny-cpu-wan22": (TINY_CPU, TINY_CPU_WAN, TINY_CPU_WAN22),
    "wan22-t2v-a14b-ocr": (WAN21_T2V_OCR, WAN22_T2V_A14B_OCR),
}
# presets_ext.py (MixGRPO, Z-Image, FLUX.2, Wan2.2): its tiny change sets over TINY_CPU, its GPU recipes alone
PRESETS.update({name: (TINY_CPU, *sets) for name, sets in TINY_EXT_PRESETS.items()} | GPU_EXT_PRESETS)


def preset_changes(name: str) -> tuple[dict[str, Any], ...]:
    """The change sets of preset ``name``; an unknown name is a ``ConfigError`` with a suggestion."""
    return lookup_preset(PRESETS, name)
