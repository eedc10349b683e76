"""The GPU recipes: whole recipes over the schema's defaults (``sd35m-*``, ``flux1-*``, ``flux2-*``, ``wan2*``,
``zimage-*``), each a hub model in its published training recipe (or as close as this code gets).

The 8-GPU recipes lay ``EIGHT_GPU_COLOCATED``, their shared multi-rank layout, under their own change set; the
SD3.5-medium ones (1 and 2 GPUs) keep their layout in their own change sets. ``GPU_PRESETS`` names them
(``presets.PRESETS`` takes it whole). Data only. None has been run (no GPU has run this code): their hub ids are
the models' official repositories, pinned to no revision (the default branch; set ``model.revision`` to a commit
to pin).
"""

from __future__ import annotations

from typing import Any

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

# Over SD35M_GPU and EIGHT_GPU_COLOCATED: DiffusionNFT's SD3.5-medium PickScore recipe (its config/nft.py
# sd3_pickscore, decay type 1) on the reference's 8 GPUs: 48 groups of 24 per step, one optimizer step per
# rollout, the old policy sharded like the LoRA. The reference samples with a second-order DPM solver; ours
# are Euler ODE steps. On one GPU: --set train.world_size=1 --set train.rollout_engines=1 --set
# train.prompts_per_step=8 --set train.group_size=8.
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
    "train": {"prompts_per_step": 48, "group_size": 24, "minibatches": 1},
    "eval": {"guidance_scale": 1.0},
}

# Over sd35m-pickscore-nft: the same recipe with every transformer weight trained (model.finetune=full): fp32
# master weights computed in bf16 (FSDP2's param_dtype), fp32 gradients and AdamW state sharded over the 8
# ranks and offloaded to the host while the engines sample; the KL reference is a frozen fp32 copy of the
# base transformer, sharded like it; a full fine-tune's learning rate; each rank writes its own shards of a
# checkpoint (no process gathers the 2.5 B weights with their AdamW, EMA and old-policy copies). Never run (no
# GPU has run this code).
SD35M_PICKSCORE_NFT_FULL: dict[str, Any] = {
    "model": {"finetune": "full", "dtype": "float32"},
    "train": {"mixed_precision": "bf16", "learning_rate": 1e-5, "checkpoint_format": "sharded"},
    "tracking": {"registered_model": "sd35m-pickscore-full"},
}

# What the 8-GPU recipes share (not a preset by itself), laid under each: 8 FSDP2 trainer ranks, each GPU bundle
# (4 CPUs) also holding a local rollout engine (placement colocate, one engine a rank; docs/scaling.md); the
# engines hand their memory to the trainer while it trains (memory_handoff) and the optimizer state waits in
# host memory while they sample (offload_optimizer).
EIGHT_GPU_COLOCATED: dict[str, Any] = {
    "train": {
        "world_size": 8,
        "placement": "colocate",
        "rollout_engines": 8,
        "cpus_per_bundle": 4,
        "memory_handoff": True,
        "offload_optimizer": True,
    },
}

# Over EIGHT_GPU_COLOCATED: FLUX.1-dev, flow_grpo's pickscore_flux recipe (config/grpo.py; scripts/train_flux.py):
# the gated hub model in bf16 with an fp32 LoRA r64/alpha128 on FLUX.1's default targets, T5 prompts of 128 tokens,
# 512 px, 6 sampling steps at distilled guidance 3.5, SDE noise level 0.9 on every step, no KL, global std; 48
# prompts x 24 images a step, 3 images per micro-batch, 2 optimizer steps per step, bf16 forward, EMA 0.9,
# evaluation with 28 ODE steps; PickScore reward. The reference spreads this over 32 GPUs (data parallel); here
# EIGHT_GPU_COLOCATED's 8 FSDP2 ranks, each with a colocated local rollout engine.
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
    },
    "eval": {"num_steps": 28, "guidance_scale": 3.5, "num_prompts": 1024},
    "tracking": {"registered_model": "flux1-dev-pickscore"},
}

# Over EIGHT_GPU_COLOCATED: Wan2.1-T2V-1.3B, flow_grpo's general_ocr_wan2_1 recipe (config/grpo.py;
# scripts/train_wan2_1.py): the hub model with an fp32 LoRA r32/alpha64 on Wan's default targets, UMT5 prompts of
# 512 tokens, 33 frames, 20 sampling steps at CFG 4.5 with the empty negative prompt, 50 evaluation steps, 4 videos
# per prompt, 8 videos per micro-batch, OCR reward. flow_grpo samples 240x416; our resolution is square: 256 (also
# Flow-Factory's Wan2.1 T2V training resolution). bf16 forward with EMA 0.9, as the reference's mixed-precision LoRA
# runs; EIGHT_GPU_COLOCATED's 8 ranks, each with a colocated local rollout engine.
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
    },
    "eval": {"num_steps": 50, "guidance_scale": 4.5, "num_prompts": 1024},
    "data": {"source": "builtin:ocr", "num_prompts": 20000, "test_fraction": 0.05},
    "tracking": {"registered_model": "wan21-t2v-1.3b-ocr"},
}

# Over EIGHT_GPU_COLOCATED + WAN21_T2V_OCR: Wan2.2-T2V-A14B (two 14B experts split at boundary_ratio 0.875, UMT5,
# the Wan2.1 VAE) on the same OCR recipe, LoRA r32 on both experts' attention, gradient checkpointing,
# bf16, on Wan2.1's layout: 8 FSDP ranks, each with its local engine (distributed/worker.aligned_work keeps
# every rank on one expert per collective). Memory per rank, weights only (bf16): the engine's copy of both
# experts (~56 GB), a 1/8 shard of the trained pair (~7 GB), UMT5 (~11 GB), ~74 GB of a 141 GB GPU (H200
# class); one rank would hold the pair twice (~123 GB). Loading peaks as one rank does (the full pair and the
# engine's copy before sharding). No planner sizes for Wan2.2 (plan/archs.py), so the activations are unchecked.
# CFG 4.0 on the high-noise expert's steps and 3.0 on the low-noise expert's (guidance_scale_2), the model
# card's example (Wan2.2's own sample_guide_scale). Never run; registered as two diffusers LoRA files, one
# per expert (serving/lora_export.py).
WAN22_T2V_A14B_OCR: dict[str, Any] = {
    "model": {"name": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "lora_experts": "both"},
    "sampling": {"guidance_scale": 4.0, "guidance_scale_2": 3.0},
    "train": {"micro_batch_size": 2},
    "eval": {"guidance_scale": 4.0, "guidance_scale_2": 3.0},
    "tracking": {"registered_model": "wan22-t2v-a14b-ocr"},
}

# Over EIGHT_GPU_COLOCATED: Z-Image-Turbo (Tongyi-MAI/Z-Image-Turbo, 6B single-stream DiT, Qwen3-4B text encoder,
# FLUX VAE), Flow-GRPO on PickScore: bf16 weights with an fp32 LoRA r64/alpha128 on Z-Image's default targets,
# gradient checkpointing, 512 px, the model's 8 steps without CFG (guidance-distilled: our guidance_scale 1 = the
# pipeline's 0), a 2-step SDE window in the first 4 steps, on EIGHT_GPU_COLOCATED's layout: 8 FSDP2 ranks with
# colocated local engines that hand their memory to the trainer (memory_handoff) and an offloaded optimizer.
ZIMAGE_TURBO_PICKSCORE: dict[str, Any] = {
    "model": {
        "name": "Tongyi-MAI/Z-Image-Turbo",
        "dtype": "bfloat16",
        "device": "cuda",
        "max_sequence_length": 512,
        "lora_rank": 64,
        "lora_alpha": 128,
        "gradient_checkpointing": True,
    },
    "sampling": {"resolution": 512, "num_steps": 8, "guidance_scale": 1.0, "noise_level": 0.7,
                 "step_strategy": "sde_window", "num_sde_steps": 2, "window_range": [0, 4]},
    "algorithm": {"kl_beta": 0.0, "global_std": True, "adv_clip_max": 5.0},
    "reward": {"weights": {"pickscore": 1.0}},
    "train": {
        "steps": 1000,
        "prompts_per_step": 32,
        "group_size": 16,
        "micro_batch_size": 4,
        "minibatches": 2,
        "learning_rate": 1e-4,
        "mixed_precision": "bf16",
        "ema": True,
        "ema_decay": 0.9,
        "checkpoint_every": 30,
        "log_images_every": 30,
        "save_latents": False,
    },
    "eval": {"num_steps": 8, "guidance_scale": 1.0, "num_prompts": 1024},
    "tracking": {"registered_model": "zimage-turbo-pickscore"},
}

# Over EIGHT_GPU_COLOCATED: FLUX.2 [dev] (black-forest-labs/FLUX.2-dev, gated: HF_TOKEN; a 32B transformer and
# Mistral Small 3.1 24B as text encoder), Flow-GRPO on PickScore: bf16 with an fp32 LoRA r32/alpha64 on FLUX.2's
# default targets, gradient checkpointing, 512 px, 10 steps at the distilled guidance 4, a 2-step SDE window in the
# first 5 steps, one image per micro-batch. Memory: every rank holds the whole pipeline (~64 GB transformer + ~48 GB
# text encoder in bf16) before FSDP2 shards the trained transformer, so this needs 141 GB GPUs (H200 class); the
# rollout engines hand their memory to the trainer and the optimizer is offloaded.
FLUX2_DEV_PICKSCORE: dict[str, Any] = {
    "model": {
        "name": "black-forest-labs/FLUX.2-dev",
        "dtype": "bfloat16",
        "device": "cuda",
        "max_sequence_length": 512,
        "lora_rank": 32,
        "lora_alpha": 64,
        "gradient_checkpointing": True,
    },
    "sampling": {"resolution": 512, "num_steps": 10, "guidance_scale": 4.0, "noise_level": 0.7,
                 "step_strategy": "sde_window", "num_sde_steps": 2, "window_range": [0, 5]},
    "algorithm": {"kl_beta": 0.0, "global_std": True, "adv_clip_max": 5.0},
    "reward": {"weights": {"pickscore": 1.0}},
    "train": {
        "steps": 1000,
        "prompts_per_step": 16,
        "group_size": 16,
        "micro_batch_size": 1,
        "minibatches": 2,
        "learning_rate": 1e-4,
        "mixed_precision": "bf16",
        "ema": True,
        "ema_decay": 0.9,
        "checkpoint_every": 30,
        "log_images_every": 30,
        "save_latents": False,
    },
    "eval": {"num_steps": 28, "guidance_scale": 4.0, "num_prompts": 1024},
    "tracking": {"registered_model": "flux2-dev-pickscore"},
}

# Over EIGHT_GPU_COLOCATED + FLUX2_DEV_PICKSCORE: FLUX.2 [klein] base 4B (black-forest-labs/FLUX.2-klein-base-4B,
# Apache-2.0; the undistilled variant BFL names for fine-tuning; Qwen3-4B text encoder): Flow-GRPO on PickScore,
# bf16 with an fp32 LoRA r32/alpha64 on FLUX.2's default targets, 512 px, 16 steps at CFG 4 (two forwards a step), a
# 2-step SDE window in the first 8 steps, 8 ranks with colocated engines; ~8 GB transformer + ~8 GB text encoder per
# rank (80 GB GPUs): the engines keep their memory while the trainer trains and the optimizer stays on the GPU.
FLUX2_KLEIN_BASE_PICKSCORE: dict[str, Any] = {
    "model": {"name": "black-forest-labs/FLUX.2-klein-base-4B"},
    "sampling": {"num_steps": 16, "window_range": [0, 8]},
    "train": {"prompts_per_step": 32, "micro_batch_size": 4, "memory_handoff": False, "offload_optimizer": False},
    "eval": {"num_steps": 50},
    "tracking": {"registered_model": "flux2-klein-base-4b-pickscore"},
}

# Preset name -> its change sets, laid over the schema's defaults in this order.
GPU_PRESETS: dict[str, tuple[dict[str, Any], ...]] = {
    "sd35m-ocr": (SD35M_GPU, SD35M_OCR),
    "sd35m-pickscore-nft": (SD35M_GPU, EIGHT_GPU_COLOCATED, SD35M_PICKSCORE_NFT),
    "sd35m-pickscore-nft-full": (SD35M_GPU, EIGHT_GPU_COLOCATED, SD35M_PICKSCORE_NFT, SD35M_PICKSCORE_NFT_FULL),
    "flux1-dev-pickscore": (EIGHT_GPU_COLOCATED, FLUX1_DEV_PICKSCORE),
    "flux2-dev-pickscore": (EIGHT_GPU_COLOCATED, FLUX2_DEV_PICKSCORE),
    "flux2-klein-base-4b-pickscore": (EIGHT_GPU_COLOCATED, FLUX2_DEV_PICKSCORE, FLUX2_KLEIN_BASE_PICKSCORE),
    "zimage-turbo-pickscore": (EIGHT_GPU_COLOCATED, ZIMAGE_TURBO_PICKSCORE),
    "wan21-t2v-1.3b-ocr": (EIGHT_GPU_COLOCATED, WAN21_T2V_OCR),
    "wan22-t2v-a14b-ocr": (EIGHT_GPU_COLOCATED, WAN21_T2V_OCR, WAN22_T2V_A14B_OCR),
}
