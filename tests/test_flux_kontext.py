"""FLUX.1 Kontext (image editing) through the model-family seam: builtin:tiny-flux-kontext, parity with the stock
FluxKontextPipeline on the same input image, the preset's training run, trajectories that trace each sample
back to its input image, the logged LoRA serving edits, NFT on edits. The exactness invariants
(docs/algorithms.md section 11) on rows that carry an input image: ``test_family_exactness.py``; the builtin
loaded by the stock pipeline: ``test_family_builtins.py``."""

import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from diffusionrl.data.images import image_bytes
from diffusionrl.models import (
    TINY_FLUX_KONTEXT_REF,
    FluxAdapter,
    FluxKontextAdapter,
    build_tiny_flux_kontext_pipeline,
    build_tiny_flux_pipeline,
    save_builtin,
)
from diffusionrl.models.flux import pack, unpack
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.train import build_loop
from diffusionrl.trajectory import TrajectoryWriter, list_step_files, read_trajectory

from .conftest import tiny_config
from .family_checks import meta_of, png, scene, served_vs_evaluated, write_kontext_edits

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def kontext():
    return FluxKontextAdapter(build_tiny_flux_kontext_pipeline(), device="cpu")


@pytest.mark.parametrize("resolution", [32, 64])
def test_ode_editing_equals_the_stock_kontext_pipeline(kontext, resolution):
    """Our engine's ODE rollout of an edit vs ``FluxKontextPipeline.__call__`` with the same input image
    and initial latents: the final latents agree to <= 1e-5 and so do the recorded sigmas."""
    spec = SamplingSpec(resolution=resolution, num_steps=4, guidance_scale=3.5, sde_type="ode",
                        max_sequence_length=16)
    prompts, seeds = ["make the square blue", "make it a circle"], [3, 4]
    source = scene("red", "square", resolution)
    engine = LocalRolloutEngine(kontext, kontext.transformer, micro_batch_size=2)
    traj = engine.generate(prompts, [0, 1], seeds, spec, metadata=meta_of(source, source))
    shape = kontext.latent_shape(resolution)
    assert traj.conditioning.image_latents.shape == (2, *shape)  # the input image at the sample's size
    x0 = torch.stack([torch.randn((spec.num_steps + 1, *shape), generator=torch.Generator().manual_seed(s))[0]
                      for s in seeds])
    stock = kontext.pipe(prompt=prompts, image=source, num_inference_steps=4, guidance_scale=3.5, height=resolution,
                         width=resolution, max_area=resolution**2, _auto_resize=False, max_sequence_length=16,
                         latents=pack(x0), output_type="latent").images
    diff = float((unpack(stock, *shape[1:]) - traj.latents[:, -1]).abs().max())
    print(f"kontext parity at {resolution} px: max |stock - ours| = {diff:.3g}")
    assert diff <= 1e-5, diff
    assert torch.equal(kontext.pipe.scheduler.sigmas.float(), traj.sigmas)
    # the input image matters: without it (text-to-image, as FLUX.1) the edit comes out otherwise
    plain = engine.generate(prompts, [0, 1], seeds, spec)
    assert plain.conditioning.image_latents is None
    assert float((plain.latents[:, -1] - traj.latents[:, -1]).abs().max()) > 1e-3


def test_a_kontext_model_without_a_guidance_embedding_takes_true_cfg_as_the_stock_pipeline():
    """A Kontext transformer without a guidance embedding (the shapes edit model's, trained with instruction
    dropout) samples with true CFG at ``guidance_scale > 1``: a second forward on the negative text beside the same
    input image, as ``FluxKontextPipeline(true_cfg_scale=g, negative_prompt=...)``; at 1, one forward, as the
    pipeline with ``true_cfg_scale=1``. The mix moves the edit, and an embedded-guidance model takes none."""
    from diffusionrl.models.tiny_flux_shapes import build_kontext_shapes_pipeline

    adapter = FluxKontextAdapter(build_kontext_shapes_pipeline(weights=None), device="cpu")
    assert adapter.cfg_mode == "separate" and adapter.needs_negative(3.0) and not adapter.needs_negative(1.0)
    assert adapter.pipeline_kwargs(3.0, ["", ""]) == {"true_cfg_scale": 3.0, "negative_prompt": ["", ""]}
    assert adapter.pipeline_kwargs(1.0, ["", ""]) == {"true_cfg_scale": 1.0}
    prompts, seeds, shape = ["make the square blue", "remove the square"], [3, 4], adapter.latent_shape(64)
    source = scene("red", "square", 64)
    engine = LocalRolloutEngine(adapter, adapter.transformer, micro_batch_size=2)
    x0 = torch.stack([torch.randn((5, *shape), generator=torch.Generator().manual_seed(s))[0] for s in seeds])
    ours = {}
    for g in (1.0, 3.0):
        spec = SamplingSpec(resolution=64, num_steps=4, guidance_scale=g, sde_type="ode", max_sequence_length=20)
        ours[g] = engine.generate(prompts, [0, 1], seeds, spec, metadata=meta_of(source, source)).latents[:, -1]
        stock = adapter.pipe(prompt=prompts, image=source, num_inference_steps=4, height=64, width=64, max_area=64**2,
                             _auto_resize=False, max_sequence_length=20, latents=pack(x0), output_type="latent",
                             **adapter.pipeline_kwargs(g, ["", ""])).images
        diff = float((unpack(stock, *shape[1:]) - ours[g]).abs().max())
        print(f"kontext true CFG {g:g}: max |stock - ours| = {diff:.3g}")
        assert diff <= 1e-5, (g, diff)
    assert float((ours[3.0] - ours[1.0]).abs().max()) > 1e-3
    distilled = FluxKontextAdapter(build_tiny_flux_kontext_pipeline(), device="cpu")
    assert distilled.cfg_mode == "embedded" and not distilled.needs_negative(3.5)
    assert distilled.pipeline_kwargs(3.5, [""]) == {"guidance_scale": 3.5}
    # a served model guides as the adapter samples: true CFG from the request's guidance_scale where it takes it
    from diffusionrl.serving.request_pipelines import takes_true_cfg, true_cfg

    assert takes_true_cfg(adapter.pipe) and not takes_true_cfg(distilled.pipe)
    assert true_cfg({}, {"guidance_scale": 3.0, "negative_prompt": ""}) == adapter.pipeline_kwargs(3.0, "")


def test_without_an_input_image_kontext_is_flux_and_a_text_to_image_model_refuses_images(kontext):
    flux = FluxAdapter(build_tiny_flux_pipeline())
    spec = SamplingSpec(resolution=32, num_steps=2, guidance_scale=3.5, sde_type="ode", max_sequence_length=16)
    ours = LocalRolloutEngine(kontext, kontext.transformer, 1).generate(["a red cat"], [0], [5], spec)
    theirs = LocalRolloutEngine(flux, flux.transformer, 1).generate(["a red cat"], [0], [5], spec)
    assert torch.equal(ours.latents, theirs.latents)
    from diffusionrl.config import ConfigError

    with pytest.raises(ConfigError, match="flux is a text-to-image model"):
        LocalRolloutEngine(flux, flux.transformer, 1).generate(["x"], [0], [5], spec,
                                                               metadata=meta_of(scene("red", "square")))


def test_input_images_are_encoded_once_each_and_alone(kontext):
    a, b = np.asarray(scene("red", "square")), np.asarray(scene("blue", "circle"))
    together = kontext.encode_references([a, b, a], 32)
    assert torch.equal(together[0], together[2]) and torch.equal(together[:1], kontext.encode_references([a], 32))
    assert kontext.reference_size(48, 32, 32) == (32, 16)  # the image's aspect at the sample's area, 16-px patches
    with pytest.raises(ValueError, match="one aspect ratio"):
        kontext.encode_references([a, np.zeros((48, 32, 3), np.uint8)], 32)


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """An editing dataset: 16 rows, each a prompt and a source scene (a path relative to the file)."""
    return write_kontext_edits(tmp_path_factory.mktemp("edits"))


def test_the_preset_trains_two_steps_and_trajectories_trace_to_the_input_image(edits, tmp_path):
    cfg = tiny_config(f"data.source={edits}", "data.test_fraction=0.2", preset="tiny-cpu-flux-kontext")
    writer = TrajectoryWriter(tmp_path / "trajectories", "run", latents=True)  # as the workflow's train task
    lp = build_loop(cfg, tmp_path / "run", progress=False, callbacks=[writer])
    result = lp.run(resume=None)
    lp.close()
    assert result.steps_done == 2 and all(np.isfinite(v) for m in result.metrics for v in m.values())
    files = list_step_files(tmp_path / "trajectories")
    assert len(files) == 2
    traj = read_trajectory(files[0])
    assert traj.conditioning.image_latents.shape == (8, 16, 4, 4)
    for m in traj.metadata:  # digest, URI and bytes of the very file the row named
        data = open(m["image_uri"], "rb").read()
        assert image_bytes(m["image"]) == data and m["image_sha256"] == hashlib.sha256(data).hexdigest()

    # the evaluation and the report show input | base edit | tuned edit
    from diffusionrl.data import load_prompts
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.report import build_report

    test_rows = load_prompts(cfg.data).test
    ev = evaluate_lora(cfg, test_rows, result.model_dir)
    n = len(ev.table)
    assert ev.grid.shape == (3 * 32, n * 32, 3) and ev.input_images.shape == (n, 32, 32, 3)
    assert np.array_equal(ev.grid[:32, :32], ev.input_images[0])
    assert np.array_equal(ev.grid[32:64], np.concatenate(list(ev.base_images), axis=1))
    assert ev.table["input_image_sha256"].tolist()[0] == test_rows[0]["image_sha256"]
    assert not np.array_equal(ev.base_images, ev.tuned_images)
    page = build_report(config=cfg.to_dict(), metrics=None, eval_table=ev.table, eval_summary=ev.summary, grid=ev.grid)
    edits = len(ev.table.drop_duplicates(["prompt", "input_image_sha256"]))
    assert "<th>input</th><th>base</th><th>tuned</th>" in page and page.count('alt="input"') == edits


def test_the_sglang_engine_refuses_kontext_naming_why():
    from diffusionrl.rollout.sglang.server import SGLangServer, SGLangServerError

    with pytest.raises(SGLangServerError, match="not 'flux-kontext'.*editing family.*no input image.*engine=local"):
        SGLangServer("python", "/nonexistent", "fp32", family=FluxKontextAdapter.family)


def test_the_logged_kontext_lora_edits_the_image_of_a_request(edits, tmp_path):
    """serving.log_lora_model on the Kontext preset: MLflow's input-example check runs an edit; the pyfunc
    takes {"prompt", "image"} (bytes or base64), the image changes the output, a bad image is refused. Seeded
    as the evaluation seeds its sample, a request with the model's defaults serves the evaluation's tuned edit
    of a held-out row pixel for pixel: the prompt's T5 tokens at the run's model.max_sequence_length (32), not
    the Kontext pipeline's 512."""
    import base64

    import mlflow
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.exceptions import MlflowException

    from diffusionrl import serving
    from diffusionrl.data import load_prompts
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.tracking import TrackingRun
    from diffusionrl.train import train

    cfg = tiny_config(f"data.source={edits}", "data.test_fraction=0.2", "train.steps=1", "eval.every=0",
                      "train.group_size=2", "train.micro_batch_size=4", preset="tiny-cpu-flux-kontext")
    lora = train(cfg, tmp_path / "run", resume=None, progress=False).model_dir
    base = save_builtin(TINY_FLUX_KONTEXT_REF, tmp_path / "base")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("kontext", artifact_location=str(tmp_path / "artifacts"))
    run = TrackingRun(uri, experiment, client.create_run(experiment).info.run_id)
    source = png(scene("red", "square"))
    info = serving.log_lora_model(run, cfg, lora, str(base), example_prompt="make it blue", metadata={},
                                  example_image=source)
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["prompt", "image"]
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(info.model_uri)
    params = {"num_inference_steps": 2}
    (red,) = model.predict(pd.DataFrame({"prompt": ["make it blue"], "image": [source]}), params=params)
    (b64,) = model.predict({"prompt": "make it blue", "image": base64.b64encode(source).decode()}, params=params)
    (green,) = model.predict({"prompt": "make it blue", "image": png(scene("green", "circle"))}, params=params)
    size = Image.open(io.BytesIO(red)).size
    assert size == (32, 32) and Image.open(io.BytesIO(green)).size == size
    # the input image reaches the transformer: another image gives another edit
    assert not np.array_equal(np.asarray(Image.open(io.BytesIO(red))), np.asarray(Image.open(io.BytesIO(green))))
    assert Image.open(io.BytesIO(b64)).size == size
    # a prompt alone is text to image at the requested size (or the served default), never Kontext's 1 MP
    for side, expected in ((16, (16, 16)), (64, (64, 64)), (None, size)):
        sized = {**params, "height": side, "width": side} if side else params
        (out,) = model.predict({"prompt": "a red square"}, params=sized)
        assert Image.open(io.BytesIO(out)).size == expected, side
    with pytest.raises(MlflowException, match="image 0 is not a readable image"):
        model.predict({"prompt": "make it blue", "image": b"not an image"}, params=params)
    from diffusionrl.serving.request_limits import images_of

    assert images_of({"prompt": ["a", "b"], "image": source}, 2) == [source, source]  # one for all
    with pytest.raises(MlflowException, match="3 input images for 2 prompts"):
        images_of({"prompt": ["a", "b"], "image": [source] * 3}, 2)

    assert info.flavors["python_function"]["config"] == {"max_sequence_length": 32}  # model.max_sequence_length
    row = load_prompts(cfg.data).test[0]
    torch.manual_seed(cfg.eval.seed)  # the pipeline draws its initial noise from it: as the evaluation's seeded sample
    (served,) = model.predict({"prompt": row["prompt"], "image": image_bytes(row["image"])})
    ev = evaluate_lora(cfg, [row], lora, model_path=str(base))
    diff, lora_effect = served_vs_evaluated(served, ev, "kontext edit")
    assert diff == 0 and lora_effect > 0


def test_nft_trains_on_edits_end_to_end(edits, tmp_path):
    """DiffusionNFT (CFG-free ODE rollouts of the old policy, its own loss on the stored conditioning) on
    the editing rows: every LoRA tensor moves, the metrics are finite."""
    import copy

    cfg = tiny_config(f"data.source={edits}", "data.test_fraction=0.2", "train.steps=1", "algorithm.name=nft",
                      "algorithm.kl_beta=0.0", preset="tiny-cpu-flux-kontext")
    lp = build_loop(cfg, tmp_path, progress=False)
    before = copy.deepcopy(lp.backend.worker.policy.lora_state())
    result = lp.run(resume=None)
    after = lp.backend.worker.policy.lora_state()
    lp.close()
    assert result.steps_done == 1 and all(not torch.equal(before[n], after[n]) for n in before)
    assert all(np.isfinite(v) for v in result.metrics[0].values())
