"""FLUX.1 through the model-family seam: packing, the resolution-dependent schedule, parity with the stock
FluxPipeline and DiffusionNFT end to end. The exactness invariants (docs/algorithms.md section 11) on a
Flow-GRPO loop without a CFG pass: ``test_family_exactness.py``; the builtin loaded by the stock pipeline:
``test_family_builtins.py``."""

import json

import pytest
import torch

from diffusionrl.models import (
    FluxAdapter,
    SD3Adapter,
    adapter_class,
    build_tiny_flux_pipeline,
)
from diffusionrl.models.families import UnknownModelFamily
from diffusionrl.models.flux import pack, unpack
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine

from .family_checks import nft_one_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def flux():
    return FluxAdapter(build_tiny_flux_pipeline(), device="cpu")


def test_the_family_is_read_from_model_index_json(tmp_path):
    for name, expected in (("StableDiffusion3Pipeline", SD3Adapter), ("FluxPipeline", FluxAdapter)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": name}))
        assert adapter_class(str(folder)) is expected
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(UnknownModelFamily, match="KandinskyPipeline"):
        adapter_class(str(tmp_path / "other"))
    assert adapter_class("builtin:tiny-flux") is FluxAdapter and adapter_class("builtin:tiny-sd3") is SD3Adapter
    with pytest.raises(UnknownModelFamily, match="builtin:tiny-flux"):
        adapter_class("builtin:tiny-nothing")


def test_packing_is_the_pipelines_and_exactly_invertible(flux):
    x = torch.randn(3, 16, 8, 6)
    assert torch.equal(pack(x), flux.pipe._pack_latents(x, 3, 16, 8, 6))
    assert torch.equal(unpack(pack(x), 8, 6), x)


def test_schedule_has_the_resolution_dependent_shift(flux):
    s32, _ = flux.schedule(4, 32)
    s512, t512 = flux.schedule(4, 512)
    assert s32.shape == (5,) and float(s32[-1]) == 0.0 and float(s32[0]) == 1.0
    assert (s512[1:4] > s32[1:4]).all()  # more image tokens, larger mu, more time at high noise
    torch.testing.assert_close(t512, s512[:-1] * 1000, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="resolution"):
        flux.schedule(4)


@pytest.mark.parametrize("resolution", [32, 64])
def test_ode_sampling_equals_the_stock_flux_pipeline(flux, resolution):
    """Our engine's ODE rollout vs ``FluxPipeline.__call__`` from the same initial latents: the final
    latents agree to <= 1e-5 (measured: 0.0) and so do the recorded sigmas."""
    spec = SamplingSpec(resolution=resolution, num_steps=4, guidance_scale=3.5, sde_type="ode",
                        max_sequence_length=16)
    prompts, seeds = ["a red cat", "a blue dog"], [3, 4]
    engine = LocalRolloutEngine(flux, flux.transformer, micro_batch_size=2)
    traj = engine.generate(prompts, [0, 1], seeds, spec)
    shape = flux.latent_shape(resolution)
    x0 = torch.stack([torch.randn((spec.num_steps + 1, *shape), generator=torch.Generator().manual_seed(s))[0]
                      for s in seeds])
    assert torch.equal(traj.latents[:, 0], x0)
    stock = flux.pipe(prompt=prompts, num_inference_steps=4, guidance_scale=3.5, height=resolution,
                      width=resolution, max_sequence_length=16, latents=pack(x0), output_type="latent").images
    diff = float((unpack(stock, *shape[1:]) - traj.latents[:, -1]).abs().max())
    assert diff <= 1e-5, diff
    assert torch.equal(flux.pipe.scheduler.sigmas.float(), traj.sigmas)


def test_nft_trains_on_flux_end_to_end(tmp_path):
    nft_one_step("tiny-cpu-flux-nft", tmp_path, FluxAdapter)
