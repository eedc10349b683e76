"""Z-Image through the model-family seam: ODE parity with the stock pipeline with and without a CFG pass and with
padded text (per-prompt lengths), the SGLang refusal, the served guidance default. The exactness invariants
(docs/algorithms.md section 11) and its LoRA targets: ``test_family_exactness.py``; the builtin loaded by the
stock pipeline: ``test_family_builtins.py``."""

import pytest
import torch

from diffusionrl.models import (
    ZImageAdapter,
    build_tiny_zimage_pipeline,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine

from .conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red cat", "a dog on the big beach"]  # different lengths: the shorter one is padded


@pytest.fixture(scope="module")
def zimage():
    return ZImageAdapter(build_tiny_zimage_pipeline(), device="cpu")


def test_each_prompt_keeps_its_own_tokens(zimage):
    cond = zimage.encode_prompts(PROMPTS, "", 64)
    lengths = cond.prompt_embeds_mask.sum(1).tolist()
    assert lengths[0] < lengths[1] == cond.prompt_embeds.shape[1]
    assert cond.pooled_embeds.shape == (2, 0) and cond.negative_prompt_embeds.shape[0] == 2
    single = zimage.encode_prompts(PROMPTS[:1], None, 64)
    torch.testing.assert_close(single.prompt_embeds[0], cond.prompt_embeds[0, : lengths[0]], rtol=1e-5, atol=1e-6)
    assert single.negative_prompt_embeds is None


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_ode_sampling_equals_the_stock_zimage_pipeline(zimage, guidance):
    """Same initial latents; a CFG pass (ours 4.0 = the pipeline's 3.0) and none (1.0 = the pipeline's
    0.0, Z-Image-Turbo's): <= 1e-5 (measured 1.9e-6 and 0.0)."""
    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=guidance, sde_type="ode", max_sequence_length=64)
    traj = LocalRolloutEngine(zimage, zimage.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    assert traj.conditioning.prompt_embeds_mask is not None  # padded text goes through the mask
    stock = zimage.pipe(prompt=PROMPTS, num_inference_steps=4, height=32, width=32, max_sequence_length=64,
                        latents=traj.latents[:, 0], output_type="latent",
                        **zimage.pipeline_kwargs(guidance, [""] * 2)).images
    diff = float((stock - traj.latents[:, -1]).abs().max())
    assert diff <= 1e-5, diff
    assert torch.equal(zimage.pipe.scheduler.sigmas.float(), traj.sigmas)
    assert float((traj.latents[:, -1] - traj.latents[:, 0]).abs().max()) > 0.1  # it did move


def test_the_sglang_engine_refuses_zimage_naming_why():
    from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError

    with pytest.raises(SGLangServerError, match="not 'zimage'.*n_heads.*one caption per request.*engine=local"):
        SGLangServer("python", "/nonexistent", "fp32", family="zimage")


def test_the_served_guidance_default_is_the_pipelines_own_scale():
    """The registered model's guidance_scale param is ZImagePipeline's (ours - 1): CFG 4 is its 3, and
    Z-Image-Turbo's no-CFG (ours 1) its 0, which the request bounds accept."""
    from diffusionrl.serving import image_params

    assert image_params(tiny_config(preset="tiny-cpu-zimage"), ZImageAdapter)["guidance_scale"] == 3.0
    turbo = tiny_config("eval.guidance_scale=1.0", "sampling.guidance_scale=1.0", preset="tiny-cpu-zimage")
    assert image_params(turbo, ZImageAdapter)["guidance_scale"] == 0.0
    assert image_params(turbo)["guidance_scale"] == 1.0  # every other family: ours
