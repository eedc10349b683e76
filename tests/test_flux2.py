"""FLUX.2 through the model-family seam: builtin:tiny-flux2 (FLUX.2 [dev]) and builtin:tiny-flux2-klein (FLUX.2
[klein] base, a CFG pass): ODE parity with the stock pipelines (distilled guidance or CFG, the empirical mu
schedule), the VAE round trip through the batch-norm statistics and the patchify, [klein]'s SGLang text length
(both served: ``test_sglang.py``). The exactness invariants (docs/algorithms.md section 11) of both presets and
their LoRA targets:
``test_family_exactness.py``; both builtins loaded by their stock pipelines: ``test_family_builtins.py``."""

import numpy as np
import pytest
import torch

from diffusionrl.models import (
    Flux2Adapter,
    Flux2KleinAdapter,
    build_tiny_flux2_klein_pipeline,
    build_tiny_flux2_pipeline,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red cat", "a dog on the big beach"]


@pytest.fixture(scope="module")
def flux2():
    return Flux2Adapter(build_tiny_flux2_pipeline(), device="cpu")


def test_the_prompt_survives_the_templated_system_message(flux2):
    """The system message takes whole tokens, so the prompt fits in 64 tokens and changes the embedding."""
    ids = flux2.pipe.tokenizer.apply_chat_template(
        [[{"role": "system", "content": [{"type": "text", "text": flux2.pipe.system_message}]},
          {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]], tokenize=True, return_dict=True)
    assert len(ids["input_ids"][0]) < 48
    cond = flux2.encode_prompts(PROMPTS, None, 64)
    assert cond.prompt_embeds.shape == (2, 64, 48) and cond.pooled_embeds.shape == (2, 0)
    assert cond.negative_prompt_embeds is None  # guidance-distilled: no CFG pass
    assert not torch.allclose(cond.prompt_embeds[0], cond.prompt_embeds[1])


@pytest.mark.parametrize("resolution", [32, 64])
def test_ode_sampling_equals_the_stock_flux2_pipeline(flux2, resolution):
    """Same initial latents, the resolution-dependent empirical-mu schedule: <= 1e-5 (measured 0.0)."""
    spec = SamplingSpec(resolution=resolution, num_steps=4, guidance_scale=4.0, sde_type="ode",
                        max_sequence_length=64)
    traj = LocalRolloutEngine(flux2, flux2.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    assert traj.latents.shape[2:] == (128, resolution // 16, resolution // 16)
    stock = flux2.pipe(prompt=PROMPTS, num_inference_steps=4, height=resolution, width=resolution,
                       max_sequence_length=64, latents=flux2.to_pipeline_latents(traj.latents[:, 0]),
                       output_type="latent", **flux2.pipeline_kwargs(4.0, [""] * 2)).images
    diff = float((flux2.from_pipeline_latents(stock, resolution) - traj.latents[:, -1]).abs().max())
    assert diff <= 1e-5, diff
    assert torch.equal(flux2.pipe.scheduler.sigmas.float(), traj.sigmas)
    assert float((traj.latents[:, -1] - traj.latents[:, 0]).abs().max()) > 0.1


def test_decode_is_the_stock_pipelines_and_encode_images_inverts_its_layout(flux2):
    spec = SamplingSpec(resolution=32, num_steps=2, guidance_scale=4.0, sde_type="ode", max_sequence_length=64)
    traj = LocalRolloutEngine(flux2, flux2.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    stock = flux2.pipe(prompt=PROMPTS, num_inference_steps=2, height=32, width=32, max_sequence_length=64,
                       latents=traj.latents[:, 0], output_type="np", guidance_scale=4.0).images
    assert np.abs(traj.images.astype(np.float64) - np.round(stock * 255)).max() <= 1
    z = flux2.encode_images(traj.images)
    assert z.shape == traj.latents[:, -1].shape and torch.isfinite(z).all()


def test_the_sglang_engine_serves_klein_only_at_its_fixed_text_length():
    """Both are served (tests/test_sglang.py); [klein]'s SGLang config encodes prompts at 512 tokens whatever it is
    asked, so another model.max_sequence_length is refused naming the one it takes."""
    from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError

    with pytest.raises(SGLangServerError, match="at 512 tokens.*max_sequence_length=64.*set model.max_sequence_length"
                                                "=512.*engine=local"):
        SGLangServer("python", "/nonexistent", "fp32", family="flux2-klein", t5_tokens=64)
    SGLangServer("python", "/nonexistent", "fp32", family="flux2-klein", t5_tokens=512)  # no process until start()


@pytest.fixture(scope="module")
def klein():
    return Flux2KleinAdapter(build_tiny_flux2_klein_pipeline(), device="cpu")


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_ode_sampling_equals_the_stock_klein_pipeline(klein, guidance):
    """A CFG pass on the empty negative prompt at 4, none at 1: <= 1e-5 (measured 0.0 and 1.2e-7; the
    pipeline's latent output is the VAE's, renormalised and patchified by from_pipeline_latents)."""
    spec = SamplingSpec(resolution=64, num_steps=4, guidance_scale=guidance, sde_type="ode", max_sequence_length=64)
    traj = LocalRolloutEngine(klein, klein.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    assert (traj.conditioning.negative_prompt_embeds is not None) == (guidance > 1)
    stock = klein.pipe(prompt=PROMPTS, num_inference_steps=4, height=64, width=64, max_sequence_length=64,
                       latents=traj.latents[:, 0], output_type="latent", **klein.pipeline_kwargs(guidance, "")).images
    diff = float((klein.from_pipeline_latents(stock, 64) - traj.latents[:, -1]).abs().max())
    assert diff <= 1e-5, diff
