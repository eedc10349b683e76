"""The tiny CPU presets: every ``tiny-cpu*`` preset, a change set laid over ``TINY_CPU``.

Each runs a builtin tiny model (``builtin:tiny-sd3``, ``builtin:tiny-flux``, ...; ``diffusionrl.models``) on a CPU
in seconds a step: one preset per objective, rollout variant, model family and CPU task, the ones CI and
``make demo`` run. ``TINY_CPU_PRESETS`` names them (``presets.PRESETS`` takes it whole). Data only.
"""

from __future__ import annotations

from typing import Any

# ``model.lora_targets``: empty (the schema's default) is the family's own list, which sits on its adapter
# class (``default_lora_targets`` in diffusionrl/models/<family>.py). A preset that adapts more layers
# spells its whole list: the family's default (as a literal: this package sits below diffusionrl.models;
# tests/test_config_files.py checks it against the adapter's) and what it adds.

# The embedded default: Flow-GRPO on builtin:tiny-sd3 at 64 px, JPEG compressibility.
# Chosen so that the reward visibly rises within minutes on a 2-core CPU (bench/learning.py):
# the "Fast" regime (a 2-step SDE window, so most steps are cheap ODE steps and credit is
# concentrated), 8 groups of 8 for a less noisy gradient, LoRA also on the feed-forward and
# output projections, and a learning rate suited to a 0.3 M-parameter random transformer, where
# the reference recipe's attention-only adapter at 3e-4 leaves the reward flat (bench/README.md,
# "The tiny presets on the JPEG task").
TINY_CPU: dict[str, Any] = {
    "model": {"lora_targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                               "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",  # SD3's default
                               "proj_out", "ff.net.0.proj", "ff.net.2"]},
    "sampling": {"step_strategy": "sde_window", "num_sde_steps": 2, "window_range": [0, 5]},
    "train": {"prompts_per_step": 8, "group_size": 8, "micro_batch_size": 8, "learning_rate": 1e-2},
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
# LoRA on the feed-forward and output projections too, and a larger learning rate, as tiny-cpu and for the
# same reason (bench/README.md, "The tiny presets on the JPEG task": bench/learning.py --compare nft).
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
# pretrained on (its held-out prompts never drawn). Chosen by bench/geneval_mini.py over Flow-GRPO at CFG 4.5,
# DiffusionNFT without group re-noising and other learning rates (bench/README.md, "GenEval in miniature", "RL and
# SFT runs on the demo task").
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

# Over TINY_CPU: MixGRPO's sliding window (docs/algorithms.md 3): 2 SDE steps for every group, starting at
# step 0 and moving one step later every 10 RL steps over [0, 6); ODE (Euler) steps outside it.
# MixGRPO-Flash: --set sampling.ode_solver=dpm2m --set sampling.post_window_ode_steps=2 (the 8 ODE steps after
# the window at its first position taken as 2; bench/README.md, "MixGRPO-Flash's step compression").
TINY_CPU_MIXGRPO: dict[str, Any] = {
    "sampling": {"step_strategy": "mix_window", "num_sde_steps": 2, "window_range": [0, 6],
                 "window_shift_interval": 10, "window_stride": 1},
}

# Over TINY_CPU: Flow-GRPO on builtin:tiny-zimage with a CFG pass at 4 (Z-Image's base-model regime; the
# Turbo recipe, zimage-turbo-pickscore, samples without one), LoRA on every block plus the final projection
# ("linear"), prompts of up to 64 Qwen3 tokens after the chat template.
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

# Over TINY_CPU: Flow-GRPO on builtin:tiny-flux2-klein (FLUX.2 [klein] base: no guidance embedding, a CFG pass
# on the empty negative prompt at 4, two forwards a step), LoRA as tiny-cpu-flux2.
TINY_CPU_FLUX2_KLEIN: dict[str, Any] = {
    "model": {"name": "builtin:tiny-flux2-klein", "lora_targets": FLUX2_TINY_LORA_TARGETS,
              "max_sequence_length": 64},
    "train": {"learning_rate": 3e-2},  # as tiny-cpu-flux2 (bench/README.md, "Model families")
    "sampling": {"guidance_scale": 4.0},
    "eval": {"guidance_scale": 4.0},
    "tracking": {"registered_model": "tiny-flux2-klein-jpeg"},
}

# Over TINY_CPU + TINY_CPU_WAN: the same run on builtin:tiny-wan22, Wan2.2 A14B's two experts
# (transformer for t >= 875, transformer_2 below), LoRA on both (model.lora_experts=high|low: one).
TINY_CPU_WAN22: dict[str, Any] = {
    "model": {"name": "builtin:tiny-wan22", "lora_experts": "both"},
    "tracking": {"registered_model": "tiny-wan22-jpeg-temporal"},
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
# data.test_fraction and data.seed) on builtin:shape-edits rows, CFG-free (the
# transformer has no guidance embedding: guidance_scale is not an input), each group re-noised with shared noise,
# as tiny-cpu-shapes does for generation. Instructions take up to 17 T5 tokens (the edit verbs are characters).
# 3 of each sample's 9 noise levels a step, a cosine learning rate from 6e-4 and an EMA of the LoRA for the
# evaluation: more steps in the same minutes, and a steadier held-out gain than all levels at a constant 1e-3
# (bench/README.md, "Image edits in the shapes world"). The reward is shape_edit_gated: the strict judge's partial
# credit only where the edit is made and the rest kept, since shape_edit's pays an unedited copy more than a
# wrong edit, and a policy learns to copy (bench/README.md, "A reward that a copy or an over-edit cannot raise").
TINY_CPU_SHAPE_EDITS: dict[str, Any] = {
    "data": {"source": "builtin:shape-edits", "num_prompts": 256, "test_fraction": 0.2, "seed": 0},
    "model": {"name": "builtin:tiny-flux-kontext-shapes", "max_sequence_length": 20,
              "lora_targets": TINY_CPU_FLUX_KONTEXT["model"]["lora_targets"]},
    "reward": {"weights": {"shape_edit_gated": 1.0}},
    "algorithm": {"name": "nft", "kl_beta": 0.0, "group_renoise": True, "nft_timesteps": 3},
    "sampling": {"guidance_scale": 1.0},
    "train": {"learning_rate": 6e-4, "lr_schedule": "cosine", "steps": 80, "ema": True, "ema_decay": 0.95},
    # every held-out row (13 per category), 2 seeds each in the final evaluation; a probe of all every 10 steps;
    # @champion on the strict edit success, and only above the base model's
    "eval": {"num_prompts": 0, "seeds_per_prompt": 2, "every": 10, "probe_prompts": 0, "guidance_scale": 1.0,
             "champion_metric": "eval/shape_edit_gated_success"},
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

# Preset name -> its change sets, laid over the schema's defaults in this order.
TINY_CPU_PRESETS: dict[str, tuple[dict[str, Any], ...]] = {
    "tiny-cpu": (TINY_CPU,),
    "tiny-cpu-shapes": (TINY_CPU, TINY_CPU_SHAPES),
    "tiny-cpu-sglang": (TINY_CPU, TINY_CPU_SGLANG),
    "tiny-cpu-ocr": (TINY_CPU, TINY_CPU_OCR),
    "tiny-cpu-nft": (TINY_CPU, TINY_CPU_NFT),
    "tiny-cpu-dance": (TINY_CPU, TINY_CPU_DANCE),
    "tiny-cpu-grpo-guard": (TINY_CPU, TINY_CPU_GRPO_GUARD),
    "tiny-cpu-dppo": (TINY_CPU, TINY_CPU_DPPO),
    "tiny-cpu-awm": (TINY_CPU, TINY_CPU_AWM),
    "tiny-cpu-dpo": (TINY_CPU, TINY_CPU_DPO),
    "tiny-cpu-sft": (TINY_CPU, TINY_CPU_SFT),
    "tiny-cpu-mixgrpo": (TINY_CPU, TINY_CPU_MIXGRPO),
    "tiny-cpu-flux": (TINY_CPU, TINY_CPU_FLUX),
    # tiny-cpu-nft's objective on builtin:tiny-flux (FLUX keeps its distilled guidance: no CFG pass to drop)
    "tiny-cpu-flux-nft": (TINY_CPU, TINY_CPU_NFT, TINY_CPU_FLUX),
    "tiny-cpu-qwen-image": (TINY_CPU, TINY_CPU_QWEN_IMAGE),
    "tiny-cpu-wan": (TINY_CPU, TINY_CPU_WAN),
    # tiny-cpu-nft's objective on builtin:tiny-wan (CFG-free ODE rollouts of the old policy)
    "tiny-cpu-wan-nft": (TINY_CPU, TINY_CPU_NFT, TINY_CPU_WAN, TINY_CPU_WAN_NFT),
    "tiny-cpu-wan22": (TINY_CPU, TINY_CPU_WAN, TINY_CPU_WAN22),
    "tiny-cpu-zimage": (TINY_CPU, TINY_CPU_ZIMAGE),
    "tiny-cpu-flux2": (TINY_CPU, TINY_CPU_FLUX2),
    "tiny-cpu-flux2-klein": (TINY_CPU, TINY_CPU_FLUX2_KLEIN),
    "tiny-cpu-flux-kontext": (TINY_CPU, TINY_CPU_FLUX_KONTEXT),
    "tiny-cpu-shape-edits": (TINY_CPU, TINY_CPU_SHAPE_EDITS),
    "tiny-cpu-qwen-image-edit": (TINY_CPU, TINY_CPU_QWEN_IMAGE_EDIT),
    "tiny-cpu-qwen-image-edit-v1": (TINY_CPU, TINY_CPU_QWEN_IMAGE_EDIT, TINY_CPU_QWEN_IMAGE_EDIT_V1),
}
