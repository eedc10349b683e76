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
from the preset's model reference). An editing family (``adapter.editing``: FLUX.1 Kontext,
both Qwen-Image-Edit pipelines) edits the input images of its preset's prompt rows (``builtin:shape-edits``: an
instruction and its source scene): our engine gets them as the rows' metadata, the stock pipeline as
``image=``. Kontext's takes a list, one per prompt, at the sample's area without its preferred-resolution
resize (``max_area``, ``_auto_resize=False``), as ``tests/test_flux_kontext.py`` calls it;
``QwenImageEditPlusPipeline`` and ``QwenImageEditPipeline`` (Qwen-Image-Edit's first release) take one prompt a
call, so they run one edit a call with their input image area set to the sampling resolution's (the size the
adapter encodes the input at; ``serving/request_limits.area_bound_call``), and their ``stock_images_per_s`` is
that one-at-a-time rate.

A family with ``VARIANTS`` prints a parity row per variant after its own row (``variant``: its preset with the
variant's overrides, ``ode_parity_max_abs`` as above and ``stock_default_max_abs``, the stock pipeline without the
variant's own arguments, which shows the comparison can tell them apart): Wan2.2's ``guidance_scale_2``, CFG 4 on
the high-noise expert's steps and 3 on the low-noise expert's against ``WanPipeline(guidance_scale=4.0,
guidance_scale_2=3.0)``.

    python bench/families.py [--families sd3,flux,qwen-image,wan,zimage,flux2,flux2-klein,wan22,flux-kontext,
                                         qwen-image-edit,qwen-image-edit-v1] [--budget-s 600] [--repeats 5]
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
from diffusionrl.data import load_prompts
from diffusionrl.data.images import row_images
from diffusionrl.models import QwenImageEditAdapter, load_adapter
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.train import build_loop
from diffusionrl.training.trainer import UpdateStats

# family -> its tiny preset
FAMILIES = {"sd3": "tiny-cpu", "flux": "tiny-cpu-flux", "qwen-image": "tiny-cpu-qwen-image", "wan": "tiny-cpu-wan",
            "zimage": "tiny-cpu-zimage", "flux2": "tiny-cpu-flux2", "flux2-klein": "tiny-cpu-flux2-klein",
            "wan22": "tiny-cpu-wan22", "flux-kontext": "tiny-cpu-flux-kontext",
            "qwen-image-edit": "tiny-cpu-qwen-image-edit", "qwen-image-edit-v1": "tiny-cpu-qwen-image-edit-v1"}
# family -> its parity variants: (name, overrides of its preset, the stock pipeline's own arguments for them)
VARIANTS = {"wan22": [("guidance_scale_2", ["sampling.guidance_scale=4.0", "sampling.guidance_scale_2=3.0"],
                       ("guidance_scale_2",))]}
# The learning run's reward where it is not jpeg_compressibility alone: a video family learns its
# preset's reward, per-frame JPEG compressibility + temporal consistency (on tiny-wan, 40 steps: the
# per-frame JPEG reward alone gains ~0.7 first-step stds, the sum ~6).
LEARNING_OVERRIDES = {video: ["reward.weights={jpeg_compressibility: 1.0, temporal_consistency: 1.0}"]
                      for video in ("wan", "wan22")}
PROMPTS = ["a red cat on the beach", "a blue car in the city", "a small house", "a golden cake on a table",
           "a green tree", "a black dog", "a silver robot", "a wooden boat"]


def inputs(adapter, cfg, n: int, group: int = 1) -> tuple[list[str], list[dict] | None]:
    """``n`` prompts, ``group`` consecutive ones alike, and for an editing family the rows' metadata
    with their input images (the preset's training rows), else None."""
    if not adapter.editing:
        return [PROMPTS[(i // group) % len(PROMPTS)] for i in range(n)], None
    rows = load_prompts(cfg.data).train
    picked = [rows[(i // group) % len(rows)] for i in range(n)]
    return [r["prompt"] for r in picked], [{k: v for k, v in r.items() if k != "prompt"} for r in picked]


def stock(adapter, spec: SamplingSpec, metadata: list[dict] | None = None, **kwargs):
    """The stock pipeline's ``__call__`` at ``spec``'s size (and frame count, for a video family), with
    the rows' input images for an editing family: its ``.frames`` (video) or ``.images``."""
    from PIL import Image

    if isinstance(adapter, QwenImageEditAdapter):  # both pipelines: one prompt a call, a fixed input area
        return stock_one_by_one(adapter, spec, metadata, **kwargs)
    frames = {"num_frames": spec.num_frames} if adapter.video else {}
    if spec.guidance_scale_2 is not None:  # Wan2.2: the low-noise expert's CFG scale
        frames["guidance_scale_2"] = spec.guidance_scale_2
    references = row_images(metadata)
    if references is not None:  # the input images at the sample's area, as our engine encodes them
        frames.update(image=[Image.fromarray(im) for im in references], max_area=spec.resolution ** 2,
                      _auto_resize=False)
    out = adapter.pipe(num_inference_steps=spec.num_steps, height=spec.resolution, width=spec.resolution,
                       max_sequence_length=spec.max_sequence_length, **frames,
                       **adapter.pipeline_kwargs(spec.guidance_scale, [spec.negative_prompt] * len(kwargs["prompt"])),
                       **kwargs)
    return out.frames if adapter.video else out.images


def stock_one_by_one(adapter, spec: SamplingSpec, metadata: list[dict], prompt: list[str], latents=None,
                     generator=None, output_type: str = "latent"):
    """A Qwen-Image-Edit pipeline, one edit a call (it takes one prompt), its outputs stacked; its input image
    area is the sampling resolution's, as the adapter encodes the input image."""
    from PIL import Image

    from diffusionrl.serving.request_limits import area_bound_call

    outs = []
    guidance = adapter.pipeline_kwargs(spec.guidance_scale, spec.negative_prompt)
    call = area_bound_call(adapter.pipe, spec.resolution ** 2)  # the stock __call__, its input area this one
    for i, (text, image) in enumerate(zip(prompt, row_images(metadata))):
        one = {} if latents is None else {"latents": latents[i:i + 1]}
        one.update({} if generator is None else {"generator": generator[i]})
        outs.append(call(prompt=text, image=Image.fromarray(image), height=spec.resolution, width=spec.resolution,
                         num_inference_steps=spec.num_steps, output_type=output_type, **guidance, **one).images)
    return torch.cat(outs) if output_type == "latent" else np.concatenate(outs)


def ode_parity(adapter, cfg, spec: SamplingSpec, batch: int = 4, stock_spec: SamplingSpec | None = None) -> float:
    """max |our ODE rollout's final latents - the stock pipeline's| from the same initial latents; the stock
    pipeline at ``stock_spec`` where given (a variant's check that the comparison tells its arguments apart)."""
    spec = dataclasses.replace(spec, sde_type="ode")
    (prompts, metadata), seeds = inputs(adapter, cfg, batch), list(range(batch))
    traj = LocalRolloutEngine(adapter, adapter.transformer, batch).generate(prompts, list(range(batch)), seeds, spec,
                                                                            metadata=metadata)
    x0 = traj.latents[:, 0]  # the engine's initial noise, drawn from each sample's seed
    out = stock(adapter, stock_spec or spec, metadata, prompt=prompts, latents=adapter.to_pipeline_latents(x0),
                output_type="latent")
    return float((adapter.from_pipeline_latents(out, spec.resolution) - traj.latents[:, -1]).abs().max())


def variant_rows(family: str, preset: str, adapter) -> list[dict]:
    """The parity row of each of ``family``'s ``VARIANTS``: ours against the stock pipeline given the variant's
    arguments, and against it without them (``stock_default_max_abs``)."""
    rows = []
    for name, overrides, own in VARIANTS.get(family, []):
        cfg = load_config(preset, overrides=overrides)
        spec = SamplingSpec.from_config(cfg)
        default = dataclasses.replace(spec, **{k: None for k in own})
        rows.append({"family": family, "variant": name, "preset": preset, "overrides": overrides,
                     "resolution": spec.resolution, "steps": spec.num_steps, "guidance_scale": spec.guidance_scale,
                     "guidance_scale_2": spec.guidance_scale_2, "ode_parity_max_abs": ode_parity(adapter, cfg, spec),
                     "stock_default_max_abs": ode_parity(adapter, cfg, spec, stock_spec=default)})
    return rows


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


def speed(adapter, cfg, spec: SamplingSpec, images: int, repeats: int) -> dict:
    group = 4
    prompts, metadata = inputs(adapter, cfg, images, group)
    groups, seeds = [i // group for i in range(images)], list(range(images))
    engine = LocalRolloutEngine(adapter, adapter.transformer, micro_batch_size=images)
    adapter.pipe.set_progress_bar_config(disable=True)

    def ours() -> None:
        engine.generate(prompts, groups, seeds, spec, metadata=metadata)

    def theirs() -> None:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        stock(adapter, spec, metadata, prompt=prompts, output_type="np", generator=generators)

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
                  "ode_parity_max_abs": ode_parity(adapter, cfg, spec), **exactness(preset),
                  **speed(adapter, cfg, spec, args.images, args.repeats)}
        if not args.skip_learning:
            learned = learning_run(None, None, args.budget_s, LEARNING_OVERRIDES.get(family, []), preset=preset)
            result["learning"] = {k: learned[k] for k in ("gain_in_std", "steps", "wall_s", "reward_first",
                                                          "reward_last3")}
        _common.emit(result)
        for row in variant_rows(family, preset, adapter):
            _common.emit(row)


if __name__ == "__main__":
    main()
