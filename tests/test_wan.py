"""Wan2.1 text-to-video through the model-family seam: video latent shapes, parity with the stock WanPipeline,
DiffusionNFT end to end, the SGLang refusal. The exactness invariants (docs/algorithms.md section 11) on 5-D
video latents with a CFG pass: ``test_family_exactness.py``; the builtin loaded by the stock pipeline:
``test_family_builtins.py``."""


import numpy as np
import pytest
import torch

from diffusionrl.models import (
    WanAdapter,
    build_tiny_wan_pipeline,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine

from .family_checks import nft_one_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMPONENTS = ("transformer", "vae", "text_encoder")


@pytest.fixture(scope="module")
def wan():
    return WanAdapter(build_tiny_wan_pipeline(), device="cpu")


def test_video_latent_shape_and_frame_counts(wan):
    assert wan.sample_shape(32, 5) == (16, 2, 4, 4) and wan.sample_shape(64, 9) == (16, 3, 8, 8)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        wan.sample_shape(32, 4)
    cond = wan.encode_prompts(["a red cat", "a red cat"], "", 16)
    assert cond.prompt_embeds.shape == (2, 16, 64) and cond.pooled_embeds.shape == (2, 0)
    assert wan.needs_negative(5.0) and not wan.needs_negative(1.0)


def test_ode_sampling_equals_the_stock_wan_pipeline(wan):
    """Our engine's ODE rollout (CFG 5.0, a negative prompt) vs ``WanPipeline.__call__`` from the same
    initial latents: the final latents agree to <= 1e-5 (measured: 0.0), so do the sigmas and the
    decoded frames (uint8, exactly)."""
    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=5.0, sde_type="ode", max_sequence_length=16,
                        num_frames=5, negative_prompt="blurry")
    prompts, seeds = ["a red cat", "a blue dog"], [3, 4]
    traj = LocalRolloutEngine(wan, wan.transformer, micro_batch_size=2).generate(prompts, [0, 1], seeds, spec)
    x0 = torch.stack([torch.randn((spec.num_steps + 1, *wan.sample_shape(32, 5)),
                                  generator=torch.Generator().manual_seed(s))[0] for s in seeds])
    assert torch.equal(traj.latents[:, 0], x0) and traj.is_video
    kw = dict(prompt=prompts, negative_prompt="blurry", num_inference_steps=4, guidance_scale=5.0, height=32,
              width=32, num_frames=5, max_sequence_length=16, latents=x0)
    stock = wan.pipe(**kw, output_type="latent").frames
    diff = float((stock - traj.latents[:, -1]).abs().max())
    assert diff <= 1e-5, diff
    assert torch.equal(wan.pipe.scheduler.sigmas.float(), traj.sigmas)
    frames = (wan.pipe(**kw, output_type="np").frames * 255).round().astype(np.uint8)
    assert traj.images.shape == (2, 5, 32, 32, 3) and np.array_equal(frames, traj.images)


def test_nft_trains_on_wan_end_to_end(tmp_path):
    nft_one_step("tiny-cpu-wan-nft", tmp_path, WanAdapter)


def test_the_sglang_engine_refuses_wan_naming_why():
    from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError

    with pytest.raises(SGLangServerError, match="not 'wan'.*fused_norm_scale_shift_cpu.*sampling.engine=local"):
        SGLangServer("python", "/nonexistent", "fp32", family="wan")
