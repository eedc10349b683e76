"""Qwen-Image through the model-family seam: builtin:tiny-qwen-image, the prompt past the template, true-CFG
parity with the stock pipeline with padded text (token masks), token masks through Parquet, NFT end to end.
The exactness invariants (docs/algorithms.md section 11) and the dead LoRA targets:
``test_family_exactness.py``; the builtin loaded by the stock pipeline: ``test_family_builtins.py``."""

import copy

import pytest
import torch

from diffusionrl.models import (
    QwenImageAdapter,
    build_tiny_qwen_image_pipeline,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.train import build_loop
from diffusionrl.trajectory import read_trajectory, write_step

from .conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red cat", "a dog on the big beach"]  # different lengths: the shorter one is padded


@pytest.fixture(scope="module")
def qwen():
    return QwenImageAdapter(build_tiny_qwen_image_pipeline(), device="cpu")


def test_the_prompt_reaches_the_conditioning_past_the_template(qwen):
    """The pipeline drops the template's first 34 positions: the tiny tokenizer makes them exactly the
    template prefix, so what is left is the prompt (+ the template's 5 closing tokens), padded."""
    cond = qwen.encode_prompts(PROMPTS, " ", 64)
    lengths = cond.prompt_embeds_mask.sum(1).tolist()
    assert lengths[0] < lengths[1] == cond.prompt_embeds.shape[1]
    assert cond.pooled_embeds.shape == (2, 0) and cond.negative_prompt_embeds.shape[0] == 2
    single = qwen.encode_prompts(PROMPTS[:1], None, 64)
    torch.testing.assert_close(single.prompt_embeds[0], cond.prompt_embeds[0, : lengths[0]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_ode_sampling_equals_the_stock_qwen_image_pipeline(qwen, guidance):
    """Same initial latents; true CFG with the norm rescale (4.0) and without (1.0): <= 1e-5 (measured 0.0)."""
    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=guidance, sde_type="ode", negative_prompt=" ",
                        max_sequence_length=64)
    traj = LocalRolloutEngine(qwen, qwen.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    assert traj.conditioning.prompt_embeds_mask is not None  # padded text goes through the mask
    stock = qwen.pipe(prompt=PROMPTS, num_inference_steps=4, height=32, width=32, max_sequence_length=64,
                      latents=qwen.to_pipeline_latents(traj.latents[:, 0]), output_type="latent",
                      **qwen.pipeline_kwargs(guidance, [" "] * 2)).images
    diff = float((qwen.from_pipeline_latents(stock, 32) - traj.latents[:, -1]).abs().max())
    assert diff <= 1e-5, diff
    assert torch.equal(qwen.pipe.scheduler.sigmas.float(), traj.sigmas)


def test_token_masks_survive_the_trajectory_parquet(qwen, tmp_path):
    spec = SamplingSpec(resolution=32, num_steps=2, guidance_scale=4.0, negative_prompt=" ", max_sequence_length=64)
    traj = LocalRolloutEngine(qwen, qwen.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    traj = traj.with_rewards(torch.zeros(2), {}, torch.zeros(2))
    path = write_step(tmp_path, traj, run_id="r", step=1, latents=True)
    back = read_trajectory(path)
    assert torch.equal(back.conditioning.prompt_embeds_mask, traj.conditioning.prompt_embeds_mask)
    assert back.conditioning.prompt_embeds_mask.dtype == torch.int64


def test_nft_trains_on_qwen_image_end_to_end(tmp_path):
    cfg = tiny_config("train.steps=1", "algorithm.name=nft", "algorithm.kl_beta=0.0001", "sampling.guidance_scale=1.0",
                      preset="tiny-cpu-qwen-image")
    lp = build_loop(cfg, tmp_path, progress=False)
    before = copy.deepcopy(lp.backend.worker.policy.lora_state())
    result = lp.run(resume=None)
    after = lp.backend.worker.policy.lora_state()
    lp.close()
    assert result.steps_done == 1 and all(not torch.equal(before[n], after[n]) for n in before)
    assert (result.model_dir / "adapter_model.safetensors").is_file()
