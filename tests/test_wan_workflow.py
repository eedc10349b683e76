"""The Flyte workflow with the tiny-cpu-wan preset, in-process (local Flyte execution, local Ray):
train, evaluate, register (a pyfunc model that returns GIFs), the report with animated grids."""

import io
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from .conftest import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
SMALL = TINY_OVERRIDES + ["train.steps=2", "data.num_prompts=24", "data.test_fraction=0.2", "eval.num_prompts=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    sys.path.insert(0, str(ROOT))
    from diffusionrl.config import get_preset
    from workflows.grpo import grpo

    ckpt = tmp_path_factory.mktemp("run")
    return grpo(config=get_preset("tiny-cpu-wan"), overrides=SMALL, checkpoint_dir=str(ckpt)), ckpt


def test_the_workflow_trains_evaluates_and_registers_wan(run):
    out, _ = run
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file()
    assert len(out.metrics) == 2 and (out.metrics["train/log_prob_mean_abs_diff"] <= 1e-6).all()
    assert out.eval_table["seed"].tolist() == [1234, 1235]
    assert out.registered.name == "tiny-wan-jpeg-temporal" and "candidate" in out.registered.aliases
    page = Path(out.report.path).read_text()
    assert page.count("data:image/gif;base64,") >= 1  # the evaluation grid is an animated GIF


def test_the_mlflow_evaluate_run_holds_the_grid_as_a_gif(run):
    import mlflow
    from mlflow import MlflowClient

    c = MlflowClient()
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    gifs = [a.path for r in runs for a in c.list_artifacts(r.info.run_id, "eval") if a.path.endswith(".gif")]
    assert "eval/grid_base_top_tuned_bottom.gif" in gifs


def test_the_registered_wan_lora_serves_videos_through_pyfunc_and_equals_ours(run):
    import mlflow.pyfunc
    from peft import PeftModel
    from PIL import Image, ImageSequence

    from diffusionrl.models import build_tiny_wan_pipeline

    out, _ = run
    uri = f"models:/{out.registered.name}/{out.registered.version}"
    model = mlflow.pyfunc.load_model(uri)
    videos = model.predict(pd.DataFrame({"prompt": ["a red cat"]}), params={"num_inference_steps": 2})
    gif = Image.open(io.BytesIO(videos[0]))
    frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)]
    assert gif.format == "GIF" and gif.size == (32, 32) and 1 <= len(frames) <= 5

    pipe = model.unwrap_python_model().pipe  # WanPipeline with the LoRA loaded by diffusers
    ours = PeftModel.from_pretrained(build_tiny_wan_pipeline().transformer, out.lora.path).eval()
    c = pipe.transformer.config
    gen = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(2, c.in_channels, 2, 4, 4, generator=gen),
              encoder_hidden_states=torch.randn(2, 6, c.text_dim, generator=gen),
              timestep=torch.tensor([300.0, 700.0]), return_dict=False)
    with torch.no_grad():
        a, b = pipe.transformer(**kw)[0], ours(**kw)[0]
        with ours.disable_adapter():
            base = ours(**kw)[0]
    assert (a - b).abs().max().item() <= 1e-6
    assert (a - base).abs().max().item() > 1e-6  # the adapter is really applied
