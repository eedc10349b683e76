"""The served models refuse requests outside ``request_limits`` in one line, before generating:
``num_inference_steps=0`` returned noise and ``100000`` was accepted."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from diffusionrl.serving.request_limits import MAX_PROMPTS, RequestError, check_params, describe, prompts_of

from .conftest import tiny_config
from .family_checks import served_vs_evaluated


@pytest.mark.parametrize("name, value, bound", [
    ("num_inference_steps", 0, r"an integer in \[1, 1000\]"),
    ("num_inference_steps", 100000, r"an integer in \[1, 1000\]"),
    ("num_inference_steps", 2.5, "an integer"),
    ("num_inference_steps", True, "an integer"),
    ("num_inference_steps", None, "an integer"),
    ("guidance_scale", -0.5, r"a number in \[0, 30\]"),
    ("guidance_scale", 31.0, r"a number in \[0, 30\]"),
    ("guidance_scale", float("nan"), r"a number in \[0, 30\]"),
    ("height", 24, "a multiple of 16"),
    ("width", 4096, r"\[16, 2048\]"),
    ("num_frames", 6, "1 \\+ a multiple of 4"),
    ("max_sequence_length", 0, r"\[1, 512\]"),
    ("negative_prompt", "x" * 1001, "a string of at most 1000 characters"),
    ("threshold", 1.5, r"a number in \(0, 1\]"),
])
def test_every_parameter_out_of_bounds_is_one_line_naming_it(name, value, bound):
    with pytest.raises(RequestError, match=rf"request: {name}=.* is out of bounds: it must be .*{bound}") as err:
        check_params({name: value})
    assert "\n" not in str(err.value) and err.value.get_http_status_code() == 400


def test_values_inside_the_bounds_and_unbounded_keys_pass():
    ok = {"num_inference_steps": 1, "guidance_scale": 30.0, "height": 2048, "width": 16, "num_frames": 81,
          "max_sequence_length": 512, "negative_prompt": None, "threshold": 1.0, "output_type": "np"}
    assert check_params(ok) == ok


def test_prompts_count_type_and_length_are_bounded():
    assert prompts_of(pd.DataFrame({"prompt": ["a", "b"]})) == ["a", "b"]
    assert prompts_of({"prompt": "a"}) == ["a"] and prompts_of("a") == ["a"] and prompts_of([["a", "b"]]) == ["a", "b"]
    for bad, why in ((pd.DataFrame({"prompt": []}), "0 prompts"), (["p"] * (MAX_PROMPTS + 1), "65 prompts"),
                     ([None], "prompt 0 is NoneType"), (["ok", "x" * 1001], "prompt 1 has 1001 characters"),
                     (pd.DataFrame({"a": ["x"], "b": ["y"]}), "needs a 'prompt' column")):
        with pytest.raises(RequestError, match=why):
            prompts_of(bad)
    assert describe(["num_inference_steps"]).startswith(f"prompts: 1 to {MAX_PROMPTS} strings")


def test_the_image_model_refuses_bad_requests_through_pyfunc_before_loading_the_pipeline(tmp_path):
    """The registered image model (mlflow.diffusers) loads through request_limits, shipped as its code."""
    import mlflow.diffusers
    import mlflow.pyfunc
    import torch
    from mlflow.models import Model
    from safetensors.torch import save_file

    from diffusionrl.serving import model_signature
    from diffusionrl.serving.request_limits import save_model

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"w": torch.zeros(2)}, str(adapter / "pytorch_lora_weights.safetensors"))
    path = tmp_path / "model"
    save_model(path, Model(), adapter_path=str(adapter), base_model=str(tmp_path / "no-base"),
               signature=model_signature(tiny_config()))
    mlmodel = (path / "MLmodel").read_text()
    assert "loader_module: request_limits" in mlmodel and (path / "code" / "request_limits.py").is_file()
    assert (path / "code" / "request_pipelines.py").is_file()  # how it calls the pipeline, shipped beside
    assert mlflow.diffusers.load_model(str(path)).base_model == str(tmp_path / "no-base")  # the flavor is intact
    model = mlflow.pyfunc.load_model(str(path))
    for params, why in (({"num_inference_steps": 0}, "num_inference_steps=0 is out of bounds"),
                        ({"num_inference_steps": 100000}, "num_inference_steps=100000 is out of bounds"),
                        ({"guidance_scale": 100.0}, "guidance_scale=100.0 is out of bounds"),
                        ({"height": 33}, "height=33 is out of bounds")):
        with pytest.raises(MlflowException, match=why):  # the RequestError of the model's copy of the module
            model.predict(pd.DataFrame({"prompt": ["a red cat"]}), params=params)
    with pytest.raises(MlflowException, match="65 prompts"):
        model.predict(pd.DataFrame({"prompt": ["a"] * 65}))


def test_a_model_whose_own_defaults_are_out_of_bounds_is_not_logged():
    from diffusionrl.serving import image_params

    with pytest.raises(RequestError, match=r"the served model's defaults .*guidance_scale=50.0 is out of bounds"):
        image_params(tiny_config("eval.guidance_scale=50"))


class FakeWan:
    def __init__(self):
        self.calls = []

    def __call__(self, prompt, output_type, **kw):
        self.calls.append((prompt, kw))
        frames = np.zeros((len(prompt), kw["num_frames"], 16, 16, 3), np.float32)
        return type("Out", (), {"frames": frames})()


def test_the_video_model_refuses_bad_requests_before_generating():
    from diffusionrl.serving.video_model import VideoLoraModel, generation_settings

    cfg = tiny_config(preset="tiny-cpu-wan")
    model = VideoLoraModel()
    model.settings = {"generation": generation_settings(cfg)}
    model.pipe = FakeWan()
    for params, why in (({"num_inference_steps": 0}, "num_inference_steps=0"), ({"num_frames": 4}, "num_frames=4"),
                        ({"width": 8}, "width=8")):
        with pytest.raises(RequestError, match=why):
            model.predict(None, pd.DataFrame({"prompt": ["a cat"]}), params=params)
    assert model.pipe.calls == []
    (gif,) = model.predict(None, pd.DataFrame({"prompt": ["a cat"]}), params={"num_inference_steps": 2})
    assert gif[:3] == b"GIF" and model.pipe.calls[0][0] == ["a cat"]
    assert model.pipe.calls[0][1]["max_sequence_length"] == cfg.model.max_sequence_length  # as the run encoded


def test_the_text_model_refuses_bad_requests_before_decoding():
    from diffusionrl.bdlm.serving import BDLMDecoder

    model = BDLMDecoder()  # no weights: a refused request never reaches them
    model.settings = {"threshold": 0.9}
    for params, model_input, why in (({"threshold": 0.0}, ["31"], "threshold=0.0"),
                                     ({"threshold": 2.0}, ["31"], "threshold=2.0"),
                                     (None, ["31"] * 65, "65 prompts")):
        with pytest.raises(RequestError, match=why):
            model.predict(None, model_input, params=params)


def test_a_logged_image_lora_serves_within_bounds_and_refuses_outside_them(tmp_path):
    """serving.log_lora_model end to end on the tiny model: MLflow's input-example check and a
    request inside the bounds generate; one outside them is refused. Seeded as the evaluation seeds its
    sample, a request with the model's defaults serves the evaluation's tuned image pixel for pixel: the
    prompt's T5 tokens at the run's model.max_sequence_length (32), not the SD3 pipeline's 256 (which
    model_config can still ask for: the same request is then off)."""
    import io

    import mlflow
    import mlflow.pyfunc
    import torch
    from PIL import Image

    from diffusionrl import serving
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.models import build_tiny_sd3_pipeline
    from diffusionrl.tracking import TrackingRun
    from diffusionrl.train import train

    cfg = tiny_config("train.steps=1", "eval.every=0", "train.group_size=2", "train.micro_batch_size=4")
    lora = train(cfg, tmp_path / "run", resume=None, progress=False).model_dir
    base = tmp_path / "base"
    build_tiny_sd3_pipeline().save_pretrained(str(base))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("limits", artifact_location=str(tmp_path / "artifacts"))
    run = TrackingRun(uri, experiment, client.create_run(experiment).info.run_id)
    info = serving.log_lora_model(run, cfg, lora, str(base), example_prompt="a cat", metadata={})
    assert "num_inference_steps: an integer in [1, 1000]" in info.metadata["request_limits"]
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(info.model_uri)
    (png,) = model.predict(pd.DataFrame({"prompt": ["a red cat"]}), params={"num_inference_steps": 2})
    assert Image.open(io.BytesIO(png)).size == (32, 32)
    with pytest.raises(MlflowException, match="num_inference_steps=0 is out of bounds"):
        model.predict(pd.DataFrame({"prompt": ["a red cat"]}), params={"num_inference_steps": 0})

    assert info.flavors["python_function"]["config"] == {"max_sequence_length": 32}  # model.max_sequence_length
    torch.manual_seed(cfg.eval.seed)  # the pipeline draws its initial noise from it: as the evaluation's seeded sample
    (served,) = model.predict({"prompt": "a red cat"})
    ev = evaluate_lora(cfg, [{"prompt": "a red cat"}], lora, model_path=str(base))
    diff, lora_effect = served_vs_evaluated(served, ev, "sd3 image")
    assert diff == 0 and lora_effect > 0
    # the length matters: loaded with the pipeline's default 256 T5 tokens instead, the same request is off
    stock = mlflow.pyfunc.load_model(info.model_uri, model_config={"max_sequence_length": 256})
    stock.predict({"prompt": "a red cat"}, params={"num_inference_steps": 1})  # loads the pipeline
    torch.manual_seed(cfg.eval.seed)
    off = np.asarray(Image.open(io.BytesIO(stock.predict({"prompt": "a red cat"})[0])).convert("RGB")).astype(int)
    assert np.abs(off - ev.tuned_images[0]).max() > 0


class FakeEdit:
    """An editing pipeline's call surface (as FluxKontextPipeline's): it records the input image it is given."""

    default_sample_size, vae_scale_factor = 2, 8

    def __init__(self):
        self.images = []
        self.image_processor = type("Processor", (), {"resize": staticmethod(lambda im, h, w: im.resize((w, h)))})()

    def __call__(self, prompt, image=None, height=None, width=None, num_inference_steps=None, guidance_scale=None,
                 negative_prompt=None, max_area=None, _auto_resize=True):
        from PIL import Image

        self.images.append(image)
        return type("Out", (), {"images": [Image.new("RGB", (width, height))]})()


def test_an_edit_request_as_json_inputs_edits_the_png_and_its_errors_echo_no_image(tmp_path):
    """The REST body {"inputs": {"prompt": ..., "image": <base64>}} reached predict with the base64 text as bytes,
    refused as "not a readable image"; it edits the PNG, as the other forms do. An image over the pixel bound (a
    header claiming 400 MP) is refused from its header in one line, and MLflow's scoring server, which rewrites
    every error as "Failed to predict data '<the request>'", leaves that line (no image bytes) as it is; so does
    a prompt/image count mismatch."""
    import base64
    import io
    import json
    import types

    import mlflow.pyfunc
    import torch
    from mlflow.models import Model
    from mlflow.pyfunc.scoring_server import invocations
    from PIL import Image
    from safetensors.torch import save_file

    from diffusionrl.data.images import MAX_IMAGE_PIXELS as DATA_BOUND
    from diffusionrl.serving import model_signature
    from diffusionrl.serving.request_limits import MAX_IMAGE_PIXELS, save_model

    from .test_data_images import png_header

    assert MAX_IMAGE_PIXELS == DATA_BOUND  # the served bound is the training data's
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"w": torch.zeros(2)}, str(adapter / "pytorch_lora_weights.safetensors"))
    editing = types.SimpleNamespace(editing=True, served_guidance=lambda g: g)
    save_model(tmp_path / "model", Model(), adapter_path=str(adapter), base_model=str(tmp_path / "no-base"),
               signature=model_signature(tiny_config(), editing))
    model = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    pipeline = FakeEdit()
    model._model_impl.inner = types.SimpleNamespace(get_raw_model=lambda: pipeline)
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 10)).save(buf, format="PNG")
    source, b64 = buf.getvalue(), base64.b64encode(buf.getvalue()).decode()
    schema = model.metadata.get_input_schema()
    params = {"num_inference_steps": 2, "height": 16, "width": 16}
    for body in ({"inputs": {"prompt": "make it blue", "image": b64}, "params": params},
                 {"dataframe_split": {"columns": ["prompt", "image"], "data": [["make it blue", b64]]},
                  "params": params}):
        answer = invocations(json.dumps(body), "application/json", model, schema)
        assert answer.status == 200, answer.response
        (png,) = json.loads(answer.response)["predictions"]
        assert Image.open(io.BytesIO(base64.b64decode(png))).size == (16, 16)
    model.predict({"prompt": "make it blue", "image": source}, params=params)  # bytes, in the process
    assert len(pipeline.images) == 3
    for image in pipeline.images:  # the sent PNG, resized to the output's area
        assert image.size == (16, 16) and image.getpixel((8, 8)) == (200, 30, 10)

    bomb = base64.b64encode(png_header(20000, 20000)).decode()
    line = (f"request: image 0 is 400000000 pixels (400 MP), over the bound of {MAX_IMAGE_PIXELS} pixels "
            "(4096x4096) an input image may have; downscale it")
    with pytest.raises(MlflowException) as err:
        invocations(json.dumps({"inputs": {"prompt": "make it blue", "image": bomb}}), "application/json", model,
                    schema)
    assert err.value.message == line and err.value.get_http_status_code() == 400
    with pytest.raises(MlflowException, match=r"12000x12000 pixels \(144 MP\), over the bound"):
        model.predict({"prompt": "x", "image": base64.b64encode(png_header(12000, 12000)).decode()})
    with pytest.raises(MlflowException) as err:
        model.predict({"prompt": ["a", "b"], "image": [b64] * 3})
    assert err.value.message == "request: 3 input images for 2 prompts; send one per prompt or one for all"
    assert len(pipeline.images) == 3  # nothing refused was generated
