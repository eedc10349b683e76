"""GPU scale-out benchmark: an SD3.5-medium-sized transformer with random weights at
512 px with LoRA r=32 (fp16 base, fp32 LoRA, fp16 autocast), measuring

- ``ipc_push_s``: one weight push of the merged LoRA layers (``W0 + s * B @ A``, fp16) as CUDA IPC
  handles of flattened per-dtype buckets to a consumer process on the same GPU, which rebuilds and
  copies them (the colocated trainer -> engine path); ``by_value_push_s``: the fallback (CPU copy,
  pickle, unpickle, copy back to the GPU);
- ``rollout_images_per_s``: a local-engine-style denoising loop (10 steps, CFG 4.5, micro-batch 8,
  transformer only: random-weight text encoders/VAE would only add constant cost), and SGLang's if
  ``sglang`` is importable in this interpreter (else the reason it was skipped);
- ``train_step_s``: one Flow-GRPO-style update unit (forward with CFG + backward + AdamW step) per
  micro-batch of 8 at one denoising step, and the peak memory;
- next to them the planner's prediction for the same shape (``diffusionrl.plan``: sd35m-ocr on one
  GPU with this micro-batch, resolution and rank, no checkpointing, no KL forward, no EMA):
  ``plan_train_alloc_gib`` (the parts ``torch.cuda.max_memory_allocated`` sees: weights, LoRA,
  gradients, AdamW, activations, backward working set) and ``plan_train_unit_s`` at the plan's
  assumed MFU; on a GPU the ratios ``train_peak_ratio`` (measured / planned) and ``implied_mfu``.

Transformer config = SD3.5-medium's (stabilityai/stable-diffusion-3.5-medium transformer/config.json):
24 layers, 24 heads x 64, joint_attention_dim 4096, caption_projection_dim 1536, pooled 2048,
patch 2, pos_embed_max_size 384, sample_size 128, dual attention in layers 0-12, qk_norm rms_norm.

Run: ``python bench/gpu_scaleout.py > bench/results/gpu_scaleout-$(date +%F).json`` on a GPU
machine (sized to finish in a few minutes on one H200: one model build, 1 + repeats rollouts of 10
steps, 1 + repeats train steps, 1 + repeats IPC pushes and one by-value push). Without a CUDA device
it prints ``{"skipped": ...}`` and exits 0.

``--dry-run`` runs every branch that can run without a GPU, on the CPU, at a toy size (a 2-layer
transformer of the same architecture, 32 px, LoRA r4, fp32 without autocast or grad scaler): the
model build and LoRA wrap, the rollout loop, the train step, the LoRA merge and per-dtype buckets,
and the push to a consumer process both ways (shared-memory handles from ``reduce_tensor`` stand
in for CUDA IPC handles, which need a GPU). Its numbers mean nothing; ``tests/test_bench_gpu.py``
runs it so the GPU run does not fail on a typo.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time

from _common import emit

SD35M = dict(  # keyword form mirrors the model config
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out"]


# --dry-run: the same architecture at a toy size (every option SD35M sets, smaller numbers).
TOY = dict(
    sample_size=4, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=24, out_channels=16,
    pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
)


class Setup:
    """Device, dtypes and sizes: the GPU run's, or the dry run's on the CPU."""

    def __init__(self, dry_run: bool):
        import torch

        self.dry = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.dtype = torch.float32 if dry_run else torch.float16
        self.config = TOY if dry_run else SD35M
        self.text_len = 8 if dry_run else 333

    def autocast(self, torch):
        import contextlib

        return contextlib.nullcontext() if self.dry else torch.autocast("cuda", dtype=torch.float16)

    def sync(self, torch) -> None:
        if not self.dry:
            torch.cuda.synchronize()


SETUP: Setup | None = None


def build(torch, rank: int):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    with torch.device(SETUP.device):
        model = SD3Transformer2DModel(**SETUP.config).to(SETUP.dtype)
    model.requires_grad_(False)
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and any(n.endswith(t) for t in TARGETS)]
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian", target_modules=names)
    peft = get_peft_model(model, cfg)
    for _name, p in peft.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 master LoRA
    return peft


def inputs(torch, batch: int, px: int):
    h, dev, cfg = px // 8, SETUP.device, SETUP.config
    g = torch.Generator(dev).manual_seed(1)
    return (torch.randn(batch, 16, h, h, device=dev, generator=g),
            torch.randn(batch, SETUP.text_len, cfg["joint_attention_dim"], device=dev, generator=g, dtype=SETUP.dtype),
            torch.randn(batch, cfg["pooled_projection_dim"], device=dev, generator=g, dtype=SETUP.dtype))


def velocity(torch, model, x, emb, pooled, t, cfg_scale=4.5):
    xx = torch.cat([x, x]).to(SETUP.dtype)
    with SETUP.autocast(torch):
        out = model(hidden_states=xx, timestep=torch.full((xx.shape[0],), float(t), device=SETUP.device),
                    encoder_hidden_states=torch.cat([emb, emb]), pooled_projections=torch.cat([pooled, pooled]),
                    return_dict=False)[0].float()
    neg, pos = out.chunk(2)
    return neg + cfg_scale * (pos - neg)


def timed(torch, fn, repeats: int) -> float:
    fn()
    SETUP.sync(torch)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    SETUP.sync(torch)
    return (time.perf_counter() - t0) / repeats


def bench_train(torch, model, batch, px, repeats):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4)
    scaler = torch.amp.GradScaler(SETUP.device, enabled=not SETUP.dry)
    x, emb, pooled = inputs(torch, batch, px)

    def step():
        loss = velocity(torch, model, x, emb, pooled, 500.0).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    if SETUP.dry:
        return timed(torch, step, repeats), None, sum(p.numel() for p in params)
    torch.cuda.reset_peak_memory_stats()
    s = timed(torch, step, repeats)
    return s, torch.cuda.max_memory_allocated() / 2**30, sum(p.numel() for p in params)



def bench_rollout(torch, model, batch, px, steps):
    x, emb, pooled = inputs(torch, batch, px)
    sigmas = torch.linspace(1, 0, steps + 1)

    def run():
        with torch.no_grad():
            z = x.clone()
            for i in range(steps):
                v = velocity(torch, model, z, emb, pooled, float(sigmas[i]) * 1000)
                z = z + v * float(sigmas[i + 1] - sigmas[i])

    s = timed(torch, run, 1)
    return batch / s


PLANNED_PARTS = ("base weights", "LoRA (fp32)", "gradients (fp32)", "optimizer (AdamW, 2 x fp32)",
                 "activations (training forward)", "backward working set (one block, assumed)")


def plan_prediction(args) -> dict:
    """The planner's figures for the shape this bench trains (tokens: 77 CLIP + 256 T5, as ``text_len``)."""
    from diffusionrl.config import Config, apply_overrides, get_preset
    from diffusionrl.plan.model import GIB, MFU, plan

    over = ["train.world_size=1", "train.rollout_engines=1", f"train.micro_batch_size={args.micro_batch}",
            f"sampling.resolution={args.resolution}", f"model.lora_rank={args.lora_rank}",
            f"model.lora_alpha={2 * args.lora_rank}", "model.gradient_checkpointing=false", "algorithm.kl_beta=0",
            "train.ema=false", "model.max_sequence_length=256"]
    p = plan(Config.from_dict(apply_overrides(get_preset("sd35m-ocr").to_dict(), over)), "H200")
    return {"plan_train_alloc_gib": sum(p.train[k] for k in PLANNED_PARTS) / GIB, "plan_train_unit_s": p.unit_s,
            "plan_mfu": MFU, "plan_note": "no prediction of this planner is GPU-confirmed before this run"}


def merged_layers(torch, model):
    from diffusionrl.rollout.sglang import lora_layers, merge_lora

    layers = lora_layers(model)
    state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return lambda: merge_lora(layers, state, SETUP.dtype)


def _consumer(q_in, q_out, device):
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    while True:
        msg = q_in.get()
        if msg is None:
            return
        kind, payload = msg
        if kind == "ipc":
            flat = payload["rebuild"][0](*payload["rebuild"][1])  # the producer's memory, no copy
            dst = torch.empty_like(flat)
            dst.copy_(flat)
        else:
            dst = pickle.loads(payload).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        q_out.put(int(dst.numel()))


def bench_ipc(torch, merge, bucket_mb, repeats):
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    from diffusionrl.rollout.sglang import buckets

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(q_in, q_out, SETUP.device), daemon=True)
    proc.start()

    def push(by_value: bool):
        named = merge()
        n = 0
        for chunk in buckets(named, bucket_mb * 2**20, by_dtype=True):
            flat = torch.cat([t.reshape(-1) for _, t in chunk])  # one flattened bucket per dtype
            SETUP.sync(torch)
            if by_value:
                q_in.put(("value", pickle.dumps(flat.cpu())))
            else:
                fn, args = reduce_tensor(flat)
                q_in.put(("ipc", {"rebuild": (fn, args)}))
            n += q_out.get()  # the bucket stays alive until the consumer copied it
            del flat
        return n

    push(False)
    t0 = time.perf_counter()
    for _ in range(repeats):
        numel = push(False)
    ipc = (time.perf_counter() - t0) / repeats
    t0 = time.perf_counter()
    push(True)
    by_value = time.perf_counter() - t0
    q_in.put(None)
    proc.join(timeout=30)
    return ipc, by_value, numel * (4 if SETUP.dry else 2) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="every branch that runs without a GPU, on the CPU, toy size")
    args = ap.parse_args()
    import torch

    global SETUP
    SETUP = Setup(args.dry_run)
    if args.dry_run:
        args.resolution, args.lora_rank, args.micro_batch, args.steps, args.repeats = 32, 4, 2, 2, 1
    elif not torch.cuda.is_available():
        emit({"benchmark": "gpu_scaleout", "skipped": "no CUDA device: run this on a GPU machine "
              "(python bench/gpu_scaleout.py > bench/results/gpu_scaleout-<date>.json)"})
        return 0
    device = "cpu (dry run: the numbers mean nothing)" if args.dry_run else torch.cuda.get_device_name(0)
    out = {"benchmark": "gpu_scaleout", "date": time.strftime("%Y-%m-%d"), "device": device,
           "torch": torch.__version__, "resolution": args.resolution, "lora_rank": args.lora_rank,
           "micro_batch": args.micro_batch,
           "transformer": "toy config, fp32" if args.dry_run else "SD3.5-medium config, random weights, fp16"}
    model = build(torch, args.lora_rank)
    out["transformer_params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    out["rollout_images_per_s_local"] = bench_rollout(torch, model, args.micro_batch, args.resolution, args.steps)
    try:
        import sglang  # noqa: F401

        out["rollout_images_per_s_sglang"] = None
        out["sglang_note"] = ("importable; serving a random-weight SD3.5-M needs a saved pipeline folder: "
                              "see bench/sglang_vs_local.py")
    except ImportError:
        out["rollout_images_per_s_sglang"] = None
        out["sglang_note"] = "sglang not importable in this interpreter (it lives in .venv-sglang)"
    step_s, peak_gib, lora_params = bench_train(torch, model, args.micro_batch, args.resolution, args.repeats)
    out.update(train_step_s=step_s, train_peak_mem_gib=peak_gib, lora_params_m=lora_params / 1e6)
    out.update(plan_prediction(args))
    if peak_gib is not None:
        out["train_peak_ratio"] = peak_gib / out["plan_train_alloc_gib"]
        out["implied_mfu"] = out["plan_mfu"] * out["plan_train_unit_s"] / step_s
    ipc_s, value_s, mib = bench_ipc(torch, merged_layers(torch, model), args.bucket_mb, args.repeats)
    out.update(ipc_push_s=ipc_s, by_value_push_s=value_s, pushed_mib=mib, bucket_mb=args.bucket_mb)
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
