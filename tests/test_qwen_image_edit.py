"""Qwen-Image-Edit (image editing, ``QwenImageEditPlusPipeline``) through the model-family seam:
builtin:tiny-qwen-image-edit built without torchvision, parity with the stock pipeline on the same input
image, the input image in both the text encoding and the transformer's tokens, the exactness invariants
(docs/algorithms.md section 11) on builtin:shape-edits rows, and the preset's training run."""

import io
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from diffusionrl.data.images import resolve_row_image
from diffusionrl.models import (
    TINY_QWEN_IMAGE_EDIT_REF,
    QwenImageAdapter,
    QwenImageEditAdapter,
    adapter_class,
    build_tiny_qwen_image_edit_pipeline,
    save_builtin,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine

from .conftest import started_loop, tiny_config
from .family_checks import nft_one_step, recompute_diff, split_rel_diff, unchanged_after_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLUS = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"


def scene(color: tuple, shape: str, size: int = 32) -> Image.Image:
    im = Image.new("RGB", (size, size), (245, 245, 240))
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    (ImageDraw.Draw(im).ellipse if shape == "circle" else ImageDraw.Draw(im).rectangle)(box, fill=color)
    return im


def meta_of(*images: Image.Image) -> list[dict]:
    def png(im):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return buf.getvalue()

    return [{k: v for k, v in resolve_row_image({"prompt": "x", "image": png(im)}, "test").items() if k != "prompt"}
            for im in images]


@pytest.fixture(scope="module")
def edit():
    adapter = QwenImageEditAdapter(build_tiny_qwen_image_edit_pipeline(), device="cpu")
    adapter.pipe.set_progress_bar_config(disable=True)
    return adapter


def test_the_builtin_is_the_stock_edit_pipeline_with_a_processor_that_needs_no_torchvision(edit, tmp_path):
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2VLProcessor

    assert adapter_class(TINY_QWEN_IMAGE_EDIT_REF) is QwenImageEditAdapter and edit.editing
    assert not QwenImageAdapter.editing
    assert type(edit.pipe) is QwenImageEditPlusPipeline
    assert isinstance(edit.pipe.processor, Qwen2VLProcessor) and edit.pipe.processor.video_processor is None
    prefix = edit.pipe.prompt_template_encode.split("{}")[0]
    assert len(edit.pipe.tokenizer(prefix).input_ids) == edit.pipe.prompt_template_encode_start_idx == 64
    # a saved folder is the same model to the stock pipeline's from_pretrained, still without torchvision
    save_builtin(TINY_QWEN_IMAGE_EDIT_REF, tmp_path / "tiny")
    assert adapter_class(str(tmp_path / "tiny")) is QwenImageEditAdapter  # read from model_index.json
    loaded = QwenImageEditAdapter(QwenImageEditPlusPipeline.from_pretrained(tmp_path / "tiny"))
    assert loaded.digest() == edit.digest() and loaded.pipe.processor.video_processor is None
    image = np.asarray(scene((220, 30, 30), "square"))
    ours, theirs = (a.encode_conditioning(["make it blue"], " ", 64, [image], 32) for a in (edit, loaded))
    assert torch.equal(ours.prompt_embeds, theirs.prompt_embeds)
    assert torch.equal(ours.image_latents, theirs.image_latents)
    assert "torchvision" not in sys.modules


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_editing_equals_the_stock_pipeline(edit, guidance_scale, monkeypatch):
    """Our engine's ODE rollout of two edits (one batch, two prompts and two input images) vs
    ``QwenImageEditPlusPipeline.__call__`` on each (it takes one prompt a call) with the same input image and
    initial latents, its VAE image area set to the sampling resolution's (the reference size we encode at):
    the final latents agree to <= 1e-5, and the sigmas are the pipeline's."""
    monkeypatch.setattr(f"{PLUS}.VAE_IMAGE_SIZE", 32 * 32)
    spec = SamplingSpec(resolution=32, num_steps=3, guidance_scale=guidance_scale, sde_type="ode",
                        max_sequence_length=64, negative_prompt=" ")
    prompts, seeds = ["make the square blue", "make it a circle"], [3, 4]
    sources = [scene((220, 30, 30), "square"), scene((40, 60, 220), "circle")]
    engine = LocalRolloutEngine(edit, edit.transformer, micro_batch_size=2)
    traj = engine.generate(prompts, [0, 1], seeds, spec, metadata=meta_of(*sources))
    shape = edit.latent_shape(32)
    assert traj.conditioning.image_latents.shape == (2, *shape)
    for i, (prompt, seed, source) in enumerate(zip(prompts, seeds, sources)):
        x0 = torch.randn((spec.num_steps + 1, *shape), generator=torch.Generator().manual_seed(seed))[0]
        stock = edit.pipe(prompt=prompt, image=source, num_inference_steps=3, height=32, width=32,
                          latents=edit.to_pipeline_latents(x0[None]), output_type="latent",
                          **edit.pipeline_kwargs(guidance_scale, " ")).images
        diff = float((edit.from_pipeline_latents(stock, 32)[0] - traj.latents[i, -1]).abs().max())
        print(f"qwen-image-edit parity at g={guidance_scale}, row {i}: max |stock - ours| = {diff:.3g}")
        assert diff <= 1e-5, diff
    assert torch.equal(edit.pipe.scheduler.sigmas.float(), traj.sigmas)
    # the input image matters: without it the prompt is encoded alone and the edit comes out otherwise
    plain = engine.generate(prompts, [0, 1], seeds, spec)
    assert plain.conditioning.image_latents is None
    assert plain.conditioning.prompt_embeds.shape[1] < traj.conditioning.prompt_embeds.shape[1]
    assert float((plain.latents[:, -1] - traj.latents[:, -1]).abs().max()) > 1e-3


def test_the_image_enters_the_text_encoding_and_each_pair_is_encoded_alone(edit):
    a, b = np.asarray(scene((220, 30, 30), "square")), np.asarray(scene((40, 60, 220), "circle"))
    both = edit.encode_conditioning(["make it blue", "make it blue", "a longer instruction to move it left"], " ",
                                    64, [a, b, a], 32)
    alone = edit.encode_conditioning(["make it blue"], " ", 64, [b], 32)
    n = alone.prompt_embeds.shape[1]
    assert alone.prompt_embeds_mask is None and both.prompt_embeds_mask is not None
    assert both.prompt_embeds_mask[1].sum() == n and torch.equal(both.prompt_embeds[1, :n], alone.prompt_embeds[0])
    assert torch.equal(both.negative_prompt_embeds[1], alone.negative_prompt_embeds[0])
    # the same words with another image: another embedding (the VL encoder saw the picture), same length
    assert float((both.prompt_embeds[0, :n] - both.prompt_embeds[1, :n]).abs().max()) > 1e-4
    assert torch.equal(both.image_latents[0], both.image_latents[2])
    assert edit.reference_size(48, 32, 32) == (32, 32) and edit.reference_size(64, 32, 64) == (96, 32)
    with pytest.raises(ValueError, match="one aspect ratio"):
        edit.encode_references([a, np.zeros((64, 32, 3), np.uint8)], 64)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    cfg = tiny_config("algorithm.kl_beta=0.04", preset="tiny-cpu-qwen-image-edit")
    with started_loop(cfg, tmp_path_factory.mktemp("loop")) as lp:
        yield lp


def test_the_loop_edits_the_shape_edit_rows_with_cfg(loop, scored):
    traj, _ = scored
    assert isinstance(loop.backend.worker.adapter, QwenImageEditAdapter)
    assert traj.conditioning.image_latents.shape == (8, 16, 4, 4)
    assert traj.conditioning.negative_prompt_embeds is not None
    assert all(len(m["image_sha256"]) == 64 and "target" in m for m in traj.metadata)
    assert torch.isfinite(torch.as_tensor(traj.rewards)).all()


def test_recomputed_log_probs_equal_rollout_log_probs_before_the_update(loop, scored):
    diff = recompute_diff(loop, scored[0])
    print(f"qwen-image-edit recompute: max |rollout - recompute| = {diff:.3g}")
    assert diff <= 1e-6, diff


def test_gradient_does_not_depend_on_the_micro_batch_split(loop, scored):
    rel = split_rel_diff(loop, *scored)
    print(f"qwen-image-edit micro-batch split: relative gradient difference = {rel:.3g}")
    assert rel <= 1e-5, rel


def test_every_lora_parameter_changes_after_a_step(loop, scored):
    unchanged, metrics = unchanged_after_update(loop, *scored)  # the dead targets are left out of the LoRA
    assert not unchanged, f"{len(unchanged)} LoRA tensors did not change, e.g. {unchanged[:2]}"
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6


def test_the_preset_trains_a_step_and_evaluates_input_base_and_tuned_edits(tmp_path):
    from diffusionrl.data import load_prompts
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.train import build_loop

    cfg = tiny_config("train.steps=1", "eval.num_prompts=2", "eval.seeds_per_prompt=1",
                      preset="tiny-cpu-qwen-image-edit")
    lp = build_loop(cfg, tmp_path / "run", progress=False)
    result = lp.run(resume=None)
    lp.close()
    assert result.steps_done == 1 and all(np.isfinite(v) for v in result.metrics[0].values())
    assert result.metrics[0]["rollout/reward/shape_edit_failures"] == 0  # the judge read every edit
    ev = evaluate_lora(cfg, load_prompts(cfg.data).test, result.model_dir)
    n = len(ev.table)
    assert ev.grid.shape == (3 * 32, n * 32, 3) and ev.input_images.shape == (n, 32, 32, 3)
    assert "input_image_sha256" in ev.table and "tuned_shape_edit" in ev.table
    assert not np.array_equal(ev.base_images, ev.tuned_images)


def test_nft_trains_on_edits_end_to_end(tmp_path):
    nft_one_step("tiny-cpu-qwen-image-edit", tmp_path, QwenImageEditAdapter)


def test_the_sglang_engine_refuses_qwen_image_edit_naming_why():
    from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError

    with pytest.raises(SGLangServerError, match="not 'qwen-image-edit'.*editing family.*engine=local"):
        SGLangServer("python", "/nonexistent", "fp32", family=QwenImageEditAdapter.family)
