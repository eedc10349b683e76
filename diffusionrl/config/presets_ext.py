"""The presets of the newer families and objectives: MixGRPO, Z-Image, FLUX.2, Wan2.2, FLUX.1 Kontext, shape
edits and Qwen-Image-Edit.

``TINY_EXT_PRESETS`` are laid over ``presets.TINY_CPU`` (as every ``tiny-cpu-*`` preset);
``GPU_EXT_PRESETS`` are whole recipes over the schema's defaults. ``presets.PRESETS`` takes both, and
lays the Wan2.2 change sets over its Wan2.1 ones.
The GPU recipes have not been run (no GPU has run this code): their hub ids are the models' official
repositories, pinned to no revision (the default branch; set ``model.revision`` to a commit to pin).
"""

from __future__ import annotations

from typing import Any

# Over TINY_CPU: MixGRPO's sliding window (docs/algorithms.md 3): 2 SDE steps for every group, starting at
# step 0 and moving one step later every 10 RL steps over [0, 6); ODE (Euler) steps outside it.
# MixGRPO-Flash: --set sampling.ode_solver=dpm2m --set sampling.post_window_ode_steps=2 (the 8 ODE steps after
# the window at its first position taken as 2; bench/mixgrpo.py).
TINY_CPU_MIXGRPO: dict[str, Any] = {
    "sampling": {"step_strategy": "mix_window", "num_sde_steps": 2, "window_range": [0, 6],
                 "window_shift_interval": 10, "window_stride": 1},
}

# Over TINY_CPU: Flow-GRPO on builtin:tiny-zimage with a CFG pass at 4 (Z-Image's base-model regime; the
# Turbo recipe below samples without one), LoRA on every block plus the final projection ("linear"),
# prompts of up to 64 Qwen3 tokens after the chat template.
TINY_CPU_ZIMAGE: dict[str, Any] = {
    "model": {"name": "builtin:tiny-zimage",
              "lora_targets": ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",  # Z-Image's default
                               "linear"],
              "max_sequence_length": 64},
    # lr 3e-2: the tiny transformer learns several times faster than at tiny-cpu's 1e-2 (bench/README.md,
    # "Model families": bench/learning.py --compare zimage,flux2,flux2-klein)
    "train": {"learning_rate": 3e-2},
    "sampling": {"guidance_scale": 4.0},
    "eval": {"guidance_scale": 4.0},
    "tracking": {"registered_model": "tiny-zimage-jpeg"},
}

# Z-Image-Turbo (Tongyi-MAI/Z-Image-Turbo, 6B single-stream DiT, Qwen3-4B text encoder, FLUX VAE), Flow-GRPO
# on PickScore: bf16 weights with an fp32 LoRA r64/alpha128 on Z-Image's default targets, gradient checkpointing,
# 512 px, the model's 8 steps without CFG (guidance-distilled: our guidance_scale 1 = the pipeline's 0),
# a 2-step SDE window in the first 4 steps, 8 FSDP2 ranks with colocated local engines that hand their
# memory to the trainer (memory_handoff) and an offloaded optimizer.
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
        "world_size": 8,
        "placement": "colocate",
        "rollout_engines": 8,
        "cpus_per_bundle": 4,
        "memory_handoff": True,
        "offload_optimizer": True,
    },
    "eval": {"num_steps": 8, "guidance_scale": 1.0, "num_prompts": 1024},
    "tracking": {"registered_model": "zimage-turbo-pickscore"},
}

# FLUX.2's default LoRA targets (FLUX.2 [dev] and [klein]; ``Flux2Adapter.default_lora_targets``) plus the
# output projection: the tiny FLUX.2 presets' list.
FLUX2_TINY_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",
    "proj_out",
]

# Over TINY_CPU: Flow-GRPO on builtin:tiny-flux2 at FLUX.2 [dev]'s distilled guidance 4 (a transformer
# input, no CFG pass), LoRA on FLUX.2's default targets plus the output projection, 64 text tokens (the
# templated system message takes ~30 of them). Learning rate 3e-2: the 0.1 M-parameter transformer
# (width 32) barely moves at tiny-cpu's 1e-2 (bench/README.md, "Model families").
TINY_CPU_FLUX2: dict[str, Any] = {
    "model": {"name": "builtin:tiny-flux2", "lora_targets": FLUX2_TINY_LORA_TARGETS,
              "max_sequence_length": 64},
    "train": {"learning_rate": 3e-2},
    "sampling": {"guidance_scale": 4.0},
    "eval": {"guidance_scale": 4.0},
    "tracking": {"registered_model": "tiny-flux2-jpeg"},
}

# FLUX.2 [dev] (black-forest-labs/FLUX.2-dev, gated: HF_TOKEN; a 32B transformer and Mistral Small 3.1
# 24B as text encoder), Flow-GRPO on PickScore: bf16 with an fp32 LoRA r32/alpha64 on FLUX.2's default targets,
# gradient checkpointing, 512 px, 10 steps at the distilled guidance 4, a 2-step SDE window in the first 5
# steps, one image per micro-batch. Memory: every rank holds the whole pipeline (~64 GB transformer +
# ~48 GB text encoder in bf16) before FSDP2 shards the trained transformer, so this needs 141 GB GPUs
# (H200 class); the rollout engines hand their memory to the trainer and the optimizer is offloaded.
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
        "world_size": 8,
        "placement": "colocate",
        "rollout_engines": 8,
        "cpus_per_bundle": 4,
        "memory_handoff": True,
        "offload_optimizer": True,
    },
    "eval": {"num_steps": 28, "guidance_scale": 4.0, "num_prompts": 1024},
    "tracking": {"registered_model": "flux2-dev-pickscore"},
}

# Over TINY_CPU: Flow-GRPO on builtin:tiny-flux2-klein (FLUX.2 [klein] base: no guidance embedding, a CFG pass
# on the empty negative prompt at 4, two forwards a step), LoRA as tiny-cpu-flux2.
TINY_CPU_FLUX2_KLEIN: dict[str, Any] = {
    "model": {"name": "builtin:tiny-flux2-klein", "lora_targets": FLUX2_TINY_LORA_TARGETS,
              "max_sequence_length": 64},
    "train": {"learning_rate": 3e-2},  # as tiny-cpu-flux2: 3.7 first-step stds in 25 steps (0.03 at 1e-2)
    "sampling": {"guidance_scale": 4.0},
    "eval": {"guidance_scale": 4.0},
    "tracking": {"registered_model": "tiny-flux2-klein-jpeg"},
}

# FLUX.2 [klein] base 4B (black-forest-labs/FLUX.2-klein-base-4B, Apache-2.0; the undistilled variant BFL
# names for fine-tuning; Qwen3-4B text encoder): Flow-GRPO on PickScore, bf16 with an fp32 LoRA r32/alpha64
# on FLUX.2's default targets, 512 px, 16 steps at CFG 4 (two forwards a step), a 2-step SDE window in the first
# 8 steps, 8 ranks with colocated engines; ~8 GB transformer + ~8 GB text encoder per rank (80 GB GPUs).
FLUX2_KLEIN_BASE_PICKSCORE: dict[str, Any] = {
    **FLUX2_DEV_PICKSCORE,
    "model": {**FLUX2_DEV_PICKSCORE["model"], "name": "black-forest-labs/FLUX.2-klein-base-4B"},
    "sampling": {**FLUX2_DEV_PICKSCORE["sampling"], "num_steps": 16, "window_range": [0, 8]},
    "train": {**FLUX2_DEV_PICKSCORE["train"], "prompts_per_step": 32, "micro_batch_size": 4,
              "memory_handoff": False, "offload_optimizer": False},
    "eval": {"num_steps": 50, "guidance_scale": 4.0, "num_prompts": 1024},
    "tracking": {"registered_model": "flux2-klein-base-4b-pickscore"},
}

# Over TINY_CPU + TINY_CPU_WAN (presets.py): the same run on builtin:tiny-wan22, Wan2.2 A14B's two experts
# (transformer for t >= 875, transformer_2 below), LoRA on both (model.lora_experts=high|low: one).
TINY_CPU_WAN22: dict[str, Any] = {
    "model": {"name": "builtin:tiny-wan22", "lora_experts": "both"},
    "tracking": {"registered_model": "tiny-wan22-jpeg-temporal"},
}

# Over WAN21_T2V_OCR (presets.py): Wan2.2-T2V-A14B (two 14B experts split at boundary_ratio 0.875, UMT5,
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

# Over TINY_CPU: Flow-GRPO on builtin:tiny-flux-kontext (FLUX.1 Kontext, image editing), tiny-cpu-flux's
# settings (guidance-distilled 3.5, flow_grpo's FLUX targets plus the single-stream MLP and output projections).
# It edits the input images of the builtin:shape-edits rows (data/shape_edits.py: an instruction, its source
# scene as the row's ``image``); any dataset whose rows carry an ``image`` works (data/images.py). The tiny model
# is untrained, so the reward stays JPEG compressibility; shape_edit judges a trained edit model's edits.
TINY_CPU_FLUX_KONTEXT: dict[str, Any] = {
    "data": {"source": "builtin:shape-edits"},
    "model": {"name": "builtin:tiny-flux-kontext", "lora_targets": [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
        "ff_context.net.2", "proj_mlp", "proj_out"]},
    "sampling": {"guidance_scale": 3.5},
    "eval": {"guidance_scale": 3.5},
    "tracking": {"registered_model": "tiny-flux-kontext-jpeg"},
}

# Over TINY_CPU: edit success in miniature. DiffusionNFT on builtin:tiny-flux-kontext-shapes (FLUX.1 Kontext
# pretrained to edit shapes-world scenes by diffusionrl.models.pretrain_edit, on the training split of the same
# data.test_fraction and data.seed) with the strict shape_edit reward on builtin:shape-edits rows, CFG-free (the
# transformer has no guidance embedding: guidance_scale is not an input), each group re-noised with shared noise,
# as tiny-cpu-shapes does for generation. Instructions take up to 17 T5 tokens (the edit verbs are characters).
# 3 of each sample's 9 noise levels a step, a cosine learning rate from 6e-4 and an EMA of the LoRA for the
# evaluation: more steps in the same minutes, and a steadier held-out gain than all levels at a constant 1e-3
# (bench/README.md, "Image edits in the shapes world").
TINY_CPU_SHAPE_EDITS: dict[str, Any] = {
    "data": {"source": "builtin:shape-edits", "num_prompts": 256, "test_fraction": 0.2, "seed": 0},
    "model": {"name": "builtin:tiny-flux-kontext-shapes", "max_sequence_length": 20,
              "lora_targets": TINY_CPU_FLUX_KONTEXT["model"]["lora_targets"]},
    "reward": {"weights": {"shape_edit": 1.0}},
    "algorithm": {"name": "nft", "kl_beta": 0.0, "group_renoise": True, "nft_timesteps": 3},
    "sampling": {"guidance_scale": 1.0},
    "train": {"learning_rate": 6e-4, "lr_schedule": "cosine", "steps": 80, "ema": True, "ema_decay": 0.95},
    # every held-out row (13 per category), 2 seeds each in the final evaluation; a probe of all every 10 steps;
    # @champion on the strict edit success, and only above the base model's
    "eval": {"num_prompts": 0, "seeds_per_prompt": 2, "every": 10, "probe_prompts": 0, "guidance_scale": 1.0,
             "champion_metric": "eval/shape_edit_success"},
    "tracking": {"registered_model": "tiny-flux-kontext-shapes"},
}

# Over TINY_CPU: Flow-GRPO on builtin:tiny-qwen-image-edit (Qwen-Image-Edit, QwenImageEditPlusPipeline: the input
# image reaches the Qwen2.5-VL text encoder and, VAE-encoded, the transformer), tiny-cpu-qwen-image's settings
# (true CFG 4 with a " " negative prompt, LoRA on both streams and the output projection), on builtin:shape-edits
# rows judged by the shape_edit reward. The tiny model is untrained: the reward is the task's, not yet a signal.
TINY_CPU_QWEN_IMAGE_EDIT: dict[str, Any] = {
    "data": {"source": "builtin:shape-edits"},
    "model": {"name": "builtin:tiny-qwen-image-edit",
              "lora_targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                               "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                               "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",  # Qwen-Image's default
                               "proj_out"]},
    "reward": {"weights": {"shape_edit": 1.0}},
    "sampling": {"guidance_scale": 4.0, "negative_prompt": " "},
    "eval": {"guidance_scale": 4.0},
    "tracking": {"registered_model": "tiny-qwen-image-edit-shapes"},
}
# The same over Qwen-Image-Edit's first release's pipeline (QwenImageEditPipeline: the VL encoder sees the input
# image at the VAE's size, with no "Picture 1:" label) on builtin:tiny-qwen-image-edit-v1, the same weights.
TINY_CPU_QWEN_IMAGE_EDIT_V1: dict[str, Any] = {
    "model": {"name": "builtin:tiny-qwen-image-edit-v1"},
    "tracking": {"registered_model": "tiny-qwen-image-edit-v1-shapes"},
}

TINY_EXT_PRESETS: dict[str, tuple[dict[str, Any], ...]] = {
    "tiny-cpu-mixgrpo": (TINY_CPU_MIXGRPO,),
    "tiny-cpu-zimage": (TINY_CPU_ZIMAGE,),
    "tiny-cpu-flux2": (TINY_CPU_FLUX2,),
    "tiny-cpu-flux2-klein": (TINY_CPU_FLUX2_KLEIN,),
    "tiny-cpu-flux-kontext": (TINY_CPU_FLUX_KONTEXT,),
    "tiny-cpu-shape-edits": (TINY_CPU_SHAPE_EDITS,),
    "tiny-cpu-qwen-image-edit": (TINY_CPU_QWEN_IMAGE_EDIT,),
    "tiny-cpu-qwen-image-edit-v1": (TINY_CPU_QWEN_IMAGE_EDIT, TINY_CPU_QWEN_IMAGE_EDIT_V1),
}
GPU_EXT_PRESETS: dict[str, tuple[dict[str, Any], ...]] = {
    "zimage-turbo-pickscore": (ZIMAGE_TURBO_PICKSCORE,),
    "flux2-dev-pickscore": (FLUX2_DEV_PICKSCORE,),
    "flux2-klein-base-4b-pickscore": (FLUX2_KLEIN_BASE_PICKSCORE,),
}
