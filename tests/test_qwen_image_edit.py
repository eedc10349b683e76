"""Qwen-Image-Edit (image editing) through the model-family seam, each test on both pipelines: the 2509/2511
releases' ``QwenImageEditPlusPipeline`` (builtin:tiny-qwen-image-edit) and the first release's
``QwenImageEditPipeline`` (builtin:tiny-qwen-image-edit-v1, the same weights): the builtin built without
torchvision, parity with the stock pipeline on the same input image, the input image in both the text encoding
and the transformer's tokens, the preset's training run, NFT on edits, the SGLang refusal, and its LoRA served
through the registered MLflow pyfunc as the evaluation edits. The exactness invariants (docs/algorithms.md
section 11) on builtin:shape-edits rows: ``test_family_exactness.py``."""

import io
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from diffusionrl.config import ConfigError
from diffusionrl.models import (
    QwenImageAdapter,
    QwenImageEditAdapter,
    QwenImageEditV1Adapter,
    adapter_class,
    save_builtin,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine

from .conftest import tiny_config
from .family_checks import meta_of, nft_one_step, scene, served_vs_evaluated

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PIPELINES = "diffusers.pipelines.qwenimage"
MODULES = {QwenImageEditAdapter: f"{PIPELINES}.pipeline_qwenimage_edit_plus",
           QwenImageEditV1Adapter: f"{PIPELINES}.pipeline_qwenimage_edit"}
PRESETS = {QwenImageEditAdapter: "tiny-cpu-qwen-image-edit", QwenImageEditV1Adapter: "tiny-cpu-qwen-image-edit-v1"}
both_pipelines = pytest.mark.parametrize("adapter", list(PRESETS), ids=["plus", "v1"])


@pytest.fixture(scope="module", params=[QwenImageEditAdapter, QwenImageEditV1Adapter], ids=["plus", "v1"])
def edit(request):
    adapter = request.param(request.param.build_tiny(), device="cpu")
    adapter.pipe.set_progress_bar_config(disable=True)
    return adapter


def at_area(monkeypatch, edit, area: int) -> None:
    """The stock pipeline's fixed input area (1024^2) set to ``area``, the area the adapter encodes at: the Plus
    pipeline's module constant ``VAE_IMAGE_SIZE``, the first release's ``calculate_dimensions(1024 * 1024, ...)``."""
    import importlib

    module = MODULES[type(edit)]
    if type(edit) is QwenImageEditAdapter:
        monkeypatch.setattr(f"{module}.VAE_IMAGE_SIZE", area)
    else:
        rule = importlib.import_module(module).calculate_dimensions
        monkeypatch.setattr(f"{module}.calculate_dimensions", lambda _fixed, ratio: rule(area, ratio))


def test_the_builtin_is_the_stock_edit_pipeline_with_a_processor_that_needs_no_torchvision(edit, tmp_path):
    import diffusers
    from transformers import Qwen2VLProcessor

    stock = getattr(diffusers, edit.pipeline_class)
    assert adapter_class(edit.builtin) is type(edit) and edit.editing
    assert not QwenImageAdapter.editing
    assert type(edit.pipe) is stock
    assert isinstance(edit.pipe.processor, Qwen2VLProcessor) and edit.pipe.processor.video_processor is None
    prefix = edit.pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]  # v1: the picture next
    assert len(edit.pipe.tokenizer(prefix).input_ids) == edit.pipe.prompt_template_encode_start_idx == 64
    # a saved folder is the same model to the stock pipeline's from_pretrained, still without torchvision
    save_builtin(edit.builtin, tmp_path / "tiny")
    assert adapter_class(str(tmp_path / "tiny")) is type(edit)  # read from model_index.json
    loaded = type(edit)(stock.from_pretrained(tmp_path / "tiny"))
    assert loaded.digest() == edit.digest() and loaded.pipe.processor.video_processor is None
    image = np.asarray(scene("red", "square"))
    ours, theirs = (a.encode_conditioning(["make it blue"], " ", 64, [image], 32) for a in (edit, loaded))
    assert torch.equal(ours.prompt_embeds, theirs.prompt_embeds)
    assert torch.equal(ours.image_latents, theirs.image_latents)
    assert "torchvision" not in sys.modules


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_editing_equals_the_stock_pipeline(edit, guidance_scale, monkeypatch):
    """Our engine's ODE rollout of two edits (one batch, two prompts and two input images) vs the stock
    pipeline's ``__call__`` on each (it takes one prompt a call) with the same input image and initial latents,
    its input image area set to the sampling resolution's (the reference size we encode at; ``at_area``): the
    final latents agree to <= 1e-5, and the sigmas are the pipeline's."""
    at_area(monkeypatch, edit, 32 * 32)
    spec = SamplingSpec(resolution=32, num_steps=3, guidance_scale=guidance_scale, sde_type="ode",
                        max_sequence_length=64, negative_prompt=" ")
    prompts, seeds = ["make the square blue", "make it a circle"], [3, 4]
    sources = [scene("red", "square"), scene("blue", "circle")]
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
        print(f"{edit.family} parity at g={guidance_scale}, row {i}: max |stock - ours| = {diff:.3g}")
        assert diff <= 1e-5, diff
    assert torch.equal(edit.pipe.scheduler.sigmas.float(), traj.sigmas)
    # the input image matters: without it the prompt is encoded alone and the edit comes out otherwise; the first
    # release's pipeline only edits (its template holds the picture), as the stock call does
    if type(edit) is QwenImageEditV1Adapter:
        with pytest.raises(ConfigError, match="QwenImageEditPipeline.*edits images only.*every prompt row an 'image'"):
            engine.generate(prompts, [0, 1], seeds, spec)
        with pytest.raises(AttributeError):
            edit.pipe(prompt=prompts[0], num_inference_steps=1, height=32, width=32)  # reads image.size first
        return
    plain = engine.generate(prompts, [0, 1], seeds, spec)
    assert plain.conditioning.image_latents is None
    assert plain.conditioning.prompt_embeds.shape[1] < traj.conditioning.prompt_embeds.shape[1]
    assert float((plain.latents[:, -1] - traj.latents[:, -1]).abs().max()) > 1e-3


def test_the_image_enters_the_text_encoding_and_each_pair_is_encoded_alone(edit):
    a, b = np.asarray(scene("red", "square")), np.asarray(scene("blue", "circle"))
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


def test_each_pipeline_shows_its_vl_encoder_the_image_at_its_own_size(edit):
    """The Plus pipeline's VL encoder sees the input at 384^2 of area (``CONDITION_IMAGE_SIZE``) whatever the
    output's size; the first release's sees the image its VAE encodes (one resize, to the output's area here).
    Either prompt embedding is the stock ``encode_prompt``'s with that picture; the two differ (template, size)."""
    from PIL import Image

    image = np.asarray(scene("red", "square").resize((48, 32)))  # 3:2
    vl_size = edit.condition_size(32, 48, 32)
    assert vl_size == ((320, 480) if type(edit) is QwenImageEditAdapter else edit.reference_size(32, 48, 32))
    assert edit.reference_size(32, 48, 32) == (32, 32)  # 1024 px of area at 3:2, in 32-px steps
    ours = edit.encode_conditioning(["make it blue"], None, 64, [image], 32).prompt_embeds
    picture = edit.pipe.image_processor.resize(Image.fromarray(image), *vl_size)
    assert picture.size == vl_size[::-1]
    stock, _ = edit.pipe.encode_prompt(prompt=["make it blue"], image=[picture], device="cpu")
    assert torch.equal(ours, stock)
    other = (QwenImageEditV1Adapter if type(edit) is QwenImageEditAdapter else QwenImageEditAdapter)(edit.pipe)
    theirs = other.encode_conditioning(["make it blue"], None, 64, [image], 32).prompt_embeds
    assert theirs.shape != ours.shape or float((theirs - ours).abs().max()) > 1e-4


@both_pipelines
def test_the_preset_trains_a_step_and_evaluates_input_base_and_tuned_edits(adapter, tmp_path):
    from diffusionrl.data import load_prompts
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.train import build_loop

    cfg = tiny_config("train.steps=1", "eval.num_prompts=2", "eval.seeds_per_prompt=1", preset=PRESETS[adapter])
    lp = build_loop(cfg, tmp_path / "run", progress=False)
    assert type(lp.backend.worker.adapter) is adapter
    result = lp.run(resume=None)
    lp.close()
    assert result.steps_done == 1 and all(np.isfinite(v) for v in result.metrics[0].values())
    assert result.metrics[0]["rollout/reward/shape_edit_failures"] == 0  # the judge read every edit
    ev = evaluate_lora(cfg, load_prompts(cfg.data).test, result.model_dir)
    n = len(ev.table)
    assert ev.grid.shape == (3 * 32, n * 32, 3) and ev.input_images.shape == (n, 32, 32, 3)
    assert "input_image_sha256" in ev.table and "tuned_shape_edit" in ev.table
    assert not np.array_equal(ev.base_images, ev.tuned_images)


@both_pipelines
def test_nft_trains_on_edits_end_to_end(adapter, tmp_path):
    nft_one_step(PRESETS[adapter], tmp_path, adapter)


@both_pipelines
def test_the_sglang_engine_refuses_qwen_image_edit_naming_why(adapter):
    from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError

    with pytest.raises(SGLangServerError, match=f"not '{adapter.family}'.*editing family.*engine=local"):
        SGLangServer("python", "/nonexistent", "fp32", family=adapter.family)


FRESH_PROCESS = """
import json, sys
assert "diffusionrl" not in sys.modules
import mlflow.pyfunc, torch
torch.set_num_threads(1)
uri, image, prompt, seed, out = sys.argv[1:]
model = mlflow.pyfunc.load_model(uri)
data = {"prompt": prompt, "image": open(image, "rb").read()}
model.predict(data, params={"num_inference_steps": 2})  # loads the pipeline (which may draw from torch's generator)
torch.manual_seed(int(seed))  # the pipeline draws its initial noise from it: as the evaluation's seeded sample
open(out, "wb").write(model.predict(data)[0])
print(json.dumps({m: m in sys.modules for m in ("torchvision", "diffusionrl.models.tiny_qwen_image_edit")}))
"""


@both_pipelines
def test_the_logged_lora_serves_the_evaluations_edit_and_its_card_runs(adapter, tmp_path, monkeypatch):
    """serving.log_lora_model on the preset after one training step: MLflow's input-example check runs an
    edit. In a fresh process (diffusionrl not imported first, no torchvision) the pyfunc loads the builtin's
    folder and, seeded as the evaluation seeds its sample, serves the evaluation's tuned edit pixel for pixel:
    the run's steps, true CFG 4 against " ", the input image VAE-encoded at the output's 32x32 area (not the
    stock pipeline's 1024x1024). Here: bytes and base64 inputs, another image gives another edit, a bad image
    and a prompt without an image are refused, the pipeline modules' input areas are untouched; the model
    card's snippets run as written."""
    import base64
    import json
    import logging
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import mlflow
    import mlflow.pyfunc
    import pandas as pd
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as v1
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from mlflow.exceptions import MlflowException

    from diffusionrl import serving
    from diffusionrl.data import load_prompts
    from diffusionrl.data.images import image_bytes
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.serving.model_card import DIFFUSERS, render_card
    from diffusionrl.tracking import TrackingRun
    from diffusionrl.train import train

    cfg = tiny_config("train.steps=1", "eval.every=0", "train.prompts_per_step=1", "train.group_size=2",
                      "train.micro_batch_size=2", "reward.weights={jpeg_compressibility: 1.0}", "eval.num_prompts=1",
                      "eval.seeds_per_prompt=1", preset=PRESETS[adapter])
    lora = train(cfg, tmp_path / "run", resume=None, progress=False).model_dir
    base = save_builtin(adapter.builtin, tmp_path / "base")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("qwen-image-edit", artifact_location=str(tmp_path / "artifacts"))
    run = TrackingRun(uri, experiment, client.create_run(experiment).info.run_id)
    row = load_prompts(cfg.data).test[0]
    source = image_bytes(row["image"])
    card = render_card(json.loads((Path(lora) / "diffusionrl.json").read_text()), layout=DIFFUSERS)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("mlflow").addHandler(handler)
    try:
        info = serving.log_lora_model(run, cfg, lora, str(base), example_prompt=row["prompt"], metadata={},
                                      card=card, example_image=source)
    finally:
        logging.getLogger("mlflow").removeHandler(handler)
    assert not [w for w in warnings if "serving input example" in w], warnings  # the example's edit ran
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["prompt", "image"]

    # a fresh process, as `mlflow models serve`: the evaluation's edit of the same row and seed
    (tmp_path / "input.png").write_bytes(source)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, info.model_uri, str(tmp_path / "input.png"),
                           row["prompt"], str(cfg.eval.seed), str(tmp_path / "served.png")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torchvision": False,
                                                                "diffusionrl.models.tiny_qwen_image_edit": True}
    diff, lora_effect = served_vs_evaluated((tmp_path / "served.png").read_bytes(), evaluate_lora(cfg, [row], lora),
                                            f"{adapter.family} edit")
    assert diff == 0 and lora_effect > 0

    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(info.model_uri)
    params = {"num_inference_steps": 2}
    other = io.BytesIO()
    scene("blue", "circle").save(other, format="PNG")
    pixels = []
    for request in (pd.DataFrame({"prompt": ["make it blue"], "image": [source]}),
                    {"prompt": "make it blue", "image": base64.b64encode(source).decode()},
                    {"prompt": "make it blue", "image": other.getvalue()}):
        torch.manual_seed(0)  # the same initial noise for each
        pixels.append(np.asarray(Image.open(io.BytesIO(model.predict(request, params=params)[0]))))
    assert pixels[0].shape == (32, 32, 3) and np.array_equal(pixels[0], pixels[1])  # bytes or their base64
    assert not np.array_equal(pixels[0], pixels[2])  # the input image reaches the model
    torch.manual_seed(0)
    (plain,) = model.predict({"prompt": "make it blue", "image": source}, params={**params, "guidance_scale": 1.0})
    assert not np.array_equal(pixels[0], np.asarray(Image.open(io.BytesIO(plain))))  # the param is the CFG scale
    with pytest.raises(MlflowException, match="image 0 is not a readable image"):
        model.predict({"prompt": "make it blue", "image": b"not an image"}, params=params)
    with pytest.raises(MlflowException, match=f"{adapter.pipeline_class}.*edits images; send an 'image'"):
        model.predict({"prompt": "make it blue"}, params=params)
    # the served call read its own input area; the modules' stay the stock 1024^2
    assert plus.VAE_IMAGE_SIZE == 1024 * 1024 and v1.calculate_dimensions(1024 * 1024, 1.0) == (1024, 1024, None)

    # the registered adapter's card: its diffusers and peft snippets load this LoRA, the served one edits
    folder = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path / "model")))
    written = (folder / "adapter_weights" / "README.md").read_text()
    assert written == card and "pipeline_tag: image-to-image" in card
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    raw = model.get_raw_model()  # the served pipeline, LoRA loaded
    c = raw.transformer.config
    gen = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 8, c.in_channels, generator=gen),
              encoder_hidden_states=torch.randn(1, 6, c.joint_attention_dim, generator=gen),
              timestep=torch.tensor([0.5]), img_shapes=[[(1, 2, 2), (1, 2, 2)]], return_dict=False)
    with torch.no_grad():
        want = raw.transformer(**kw)[0]
        for block in blocks[:2]:  # diffusers, peft
            scope: dict = {}
            exec(block.replace("path/to/this/folder", str(folder / "adapter_weights")), scope)
            assert (scope["pipe"].transformer(**kw)[0] - want).abs().max().item() <= 1e-6
    # the sampling call passes the run's text length (the edit pipeline takes max_sequence_length; its default is 512)
    assert f"image=load_image(\"input.png\"), max_sequence_length={cfg.model.max_sequence_length})" in blocks[2]
    served_block = blocks[3].replace(f"models:/{cfg.tracking.registered_model}@champion", info.model_uri)
    monkeypatch.chdir(tmp_path)  # input.png is here
    scope = {}
    exec(served_block, scope)
    assert Image.open(io.BytesIO(scope["edits"][0])).size == (32, 32)
