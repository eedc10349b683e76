"""Every model family on its tiny builtin model, one JSON object per family (one line each):

- ``ode_parity_max_abs``: our engine's ODE rollout vs the stock diffusers pipeline's ``__call__`` from
  the same initial latents (max |difference| of the final latents; target <= 1e-5);
- ``recompute_mean_abs``: mean |rollout log-prob - trainer recompute| before any update, and
  ``grad_split_max_rel``: max over LoRA tensors of |g_1 - g_4| / |g_1| for 1 vs 4 micro-batches
  (targets <= 1e-6, <= 1e-5; as bench/exactness.py);
- ``ours_images_per_s`` / ``stock_images_per_s`` / ``time_ratio`` (for a video family, ``sample`` says
  so: videos per second): our SDE rollout with log-probs and
  trajectory recording vs the stock pipeline, same prompts, seeds, steps, guidance, size and batch,
  timed alternately in one process (medians; target ratio <= 1.05);
- ``learning``: the family's tiny preset on jpeg_compressibility (a video family: its preset's reward,
  ``LEARNING_OVERRIDES``) for ``--budget-s`` seconds
  (bench/learning.py's ``run``): ``gain_in_std`` is the last-3-steps mean reward minus the first
  step's, in units of the first step's reward std (target >= 2 within 10 minutes).

A family is one entry of ``FAMILIES`` (its tiny preset; the adapter and the stock pipeline come
from the preset's model reference). An editing family (``adapter.editing``: qwen-image-edit) edits the
input images of its preset's dataset rows (the first training rows), and its stock pipeline runs one
edit a call (``stock_edit``: ``QwenImageEditPlusPipeline`` takes one prompt; its VAE image area set to
the sampling resolution's, the size the adapter encodes the input at), so ``stock_images_per_s`` is that
pipeline's one-at-a-time rate.

    python bench/families.py [--families sd3,flux,qwen-image,wan,zimage,flux2,wan22,qwen-image-edit]
                             [--budget-s 600] [--repeats 5]
                             [--threads 1] [--skip-learning]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import _common  # sets sys.path and offline env
import numpy as np
import torch
from learning import run as learning_run

from diffusionrl.config import load_config
from diffusionrl.models import load_adapter
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.train import build_loop
from diffusionrl.training.trainer import UpdateStats

# family -> its tiny preset
FAMILIES = {"sd3": "tiny-cpu", "flux": "tiny-cpu-flux", "qwen-image": "tiny-cpu-qwen-image", "wan": "tiny-cpu-wan",
            "zimage": "tiny-cpu-zimage", "flux2": "tiny-cpu-flux2", "flux2-klein": "tiny-cpu-flux2-klein",
            "wan22": "tiny-cpu-wan22", "qwen-image-edit": "tiny-cpu-qwen-image-edit"}
# The learning run's reward where it is not jpeg_compressibility alone: a video family learns its
# preset's reward, per-frame JPEG compressibility + temporal consistency (on tiny-wan, 40 steps: the
# per-frame JPEG reward alone gains ~0.7 first-step stds, the sum ~6).
LEARNING_OVERRIDES = {video: ["reward.weights={jpeg_compressibility: 1.0, temporal_consistency: 1.0}"]
                      for video in ("wan", "wan22")}
PROMPTS = ["a red cat on the beach", "a blue car in the city", "a small house", "a golden cake on a table",
           "a green tree", "a black dog", "a silver robot", "a wooden boat"]


def stock(adapter, spec: SamplingSpec, **kwargs):
    """The stock pipeline's ``__call__`` at ``spec``'s size (and frame count, for a video family):
    its ``.frames`` (video) or ``.images``."""
    frames = {"num_frames": spec.num_frames} if adapter.video else {}
    out = adapter.pipe(num_inference_steps=spec.num_steps, height=spec.resolution, width=spec.resolution,
                       max_sequence_length=spec.max_sequence_length, **frames,
                       **adapter.pipeline_kwargs(spec.guidance_scale, [spec.negative_prompt] * len(kwargs["prompt"])),
                       **kwargs)
    return out.frames if adapter.video else out.images


def edit_rows(cfg, n: int) -> tuple[list[str], list[dict]]:
    """An editing family's ``n`` prompts and their rows' metadata (the input image) from its preset's data."""
    from diffusionrl.data import load_prompts

    rows = load_prompts(cfg.data).train[:n]
    if len(rows) < n:
        raise SystemExit(f"{cfg.data.source} has {len(rows)} training rows; the bench edits {n}")
    return [r["prompt"] for r in rows], [{k: v for k, v in r.items() if k != "prompt"} for r in rows]


def stock_edit(adapter, spec: SamplingSpec, prompts: list[str], metadata: list[dict], latents=None,
               generators=None, output_type: str = "latent"):
    """An editing family's stock pipeline, one edit a call, its outputs stacked."""
    from unittest import mock

    from PIL import Image

    from diffusionrl.data.images import row_images

    if adapter.family != "qwen-image-edit":
        raise SystemExit(f"bench/families.py has no stock call for the editing family {adapter.family}")
    outs = []
    adapter.pipe.set_progress_bar_config(disable=True)
    guidance = adapter.pipeline_kwargs(spec.guidance_scale, spec.negative_prompt)
    with mock.patch("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE", spec.resolution ** 2):
        for i, (prompt, image) in enumerate(zip(prompts, row_images(metadata))):
            one = {} if latents is None else {"latents": latents[i:i + 1]}
            one.update({} if generators is None else {"generator": generators[i]})
            outs.append(adapter.pipe(prompt=prompt, image=Image.fromarray(image), height=spec.resolution,
                                     width=spec.resolution, num_inference_steps=spec.num_steps, output_type=output_type,
                                     **guidance, **one).images)
    return torch.cat(outs) if output_type == "latent" else np.concatenate(outs)


def ode_parity(adapter, spec: SamplingSpec, batch: int = 4, cfg=None) -> float:
    spec = dataclasses.replace(spec, sde_type="ode")
    prompts, seeds = PROMPTS[:batch], list(range(batch))
    metadata = None
    if adapter.editing:
        prompts, metadata = edit_rows(cfg, batch)
    traj = LocalRolloutEngine(adapter, adapter.transformer, batch).generate(prompts, list(range(batch)), seeds, spec,
                                                                            None, metadata)
    x0 = traj.latents[:, 0]  # the engine's initial noise, drawn from each sample's seed
    if adapter.editing:
        out = stock_edit(adapter, spec, prompts, metadata, latents=adapter.to_pipeline_latents(x0))
    else:
        out = stock(adapter, spec, prompt=prompts, latents=adapter.to_pipeline_latents(x0), output_type="latent")
    return float((adapter.from_pipeline_latents(out, spec.resolution) - traj.latents[:, -1]).abs().max())


def _grads(loop, traj, active, micro: int) -> dict[str, torch.Tensor]:
    traj = dataclasses.replace(traj, micro_batch_size=micro)
    worker = loop.backend.worker
    worker.trainer.optimizer.zero_grad(set_to_none=True)
    units = worker.objective.units(traj, traj.micro_batches(), active, np.random.default_rng(0))
    assert worker.trainer.accumulate(units, UpdateStats())
    out = {n: p.grad.detach().clone() for n, p in worker.policy.params.items()}
    worker.trainer.optimizer.zero_grad(set_to_none=True)
    return out


def exactness(preset: str) -> dict:
    cfg = load_config(preset, overrides=["train.prompts_per_step=2", "train.group_size=8",
                                         "train.micro_batch_size=16"])
    with tempfile.TemporaryDirectory() as tmp:
        loop = build_loop(cfg, tmp, progress=False)
        loop.backend.push_weights(0)
        traj, active, _ = loop.backend.score(loop.backend.rollout(0))
        diff, pairs = loop.backend.worker.objective.recompute_log_prob_diff(traj)
        g1, g4 = _grads(loop, traj, active, traj.batch_size), _grads(loop, traj, active, traj.batch_size // 4)
        rel = max(float((g1[n] - g4[n]).norm() / g1[n].norm()) for n in g1 if float(g1[n].norm()) > 0)
        loop.close()
    return {"recompute_mean_abs": diff, "recompute_pairs": pairs, "grad_split_max_rel": rel}


def speed(adapter, spec: SamplingSpec, images: int, repeats: int, cfg=None) -> dict:
    group = 4
    prompts = [PROMPTS[(i // group) % len(PROMPTS)] for i in range(images)]
    metadata = None
    if adapter.editing:  # each group edits one row's input image
        rows, row_meta = edit_rows(cfg, -(-images // group))
        prompts, metadata = [rows[i // group] for i in range(images)], [row_meta[i // group] for i in range(images)]
    groups, seeds = [i // group for i in range(images)], list(range(images))
    engine = LocalRolloutEngine(adapter, adapter.transformer, micro_batch_size=images)
    adapter.pipe.set_progress_bar_config(disable=True)

    def ours() -> None:
        engine.generate(prompts, groups, seeds, spec, None, metadata)

    def theirs() -> None:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        if adapter.editing:
            stock_edit(adapter, spec, prompts, metadata, generators=generators, output_type="np")
        else:
            stock(adapter, spec, prompt=prompts, output_type="np", generator=generators)

    for fn in (ours, theirs):  # warm-up
        fn()
    times: dict[str, list[float]] = {"ours": [], "stock": []}
    with torch.no_grad():
        for i in range(repeats):
            order = (("ours", ours), ("stock", theirs)) if i % 2 == 0 else (("stock", theirs), ("ours", ours))
            for name, fn in order:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ours_s, stock_s = statistics.median(times["ours"]), statistics.median(times["stock"])
    return {"ours_images_per_s": round(images / ours_s, 3), "stock_images_per_s": round(images / stock_s, 3),
            "time_ratio": round(ours_s / stock_s, 4), "images": images, "repeats": repeats,
            "sample": f"video of {spec.num_frames} frames" if adapter.video else "image"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-time budget of each learning run")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-learning", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for family in args.families.split(","):
        preset = FAMILIES[family]
        cfg = load_config(preset)
        adapter = load_adapter(cfg.model)
        spec = SamplingSpec.from_config(cfg)
        result = {"family": family, "preset": preset, "model": cfg.model.name, "resolution": spec.resolution,
                  "steps": spec.num_steps, "guidance_scale": spec.guidance_scale,
                  "ode_parity_max_abs": ode_parity(adapter, spec, cfg=cfg), **exactness(preset),
                  **speed(adapter, spec, args.images, args.repeats, cfg=cfg)}
        if not args.skip_learning:
            learned = learning_run(None, None, args.budget_s, LEARNING_OVERRIDES.get(family, []), preset=preset)
            result["learning"] = {k: learned[k] for k in ("gain_in_std", "steps", "wall_s", "reward_first",
                                                          "reward_last3")}
        _common.emit(result)


if __name__ == "__main__":
    main()
