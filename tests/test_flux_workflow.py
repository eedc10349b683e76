"""The Flyte workflow with the tiny-cpu-flux preset, in-process (local Flyte execution, local Ray):
train, evaluate, register as an mlflow.diffusers model on the FluxPipeline base, serve through pyfunc."""

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
    return grpo(config=get_preset("tiny-cpu-flux"), overrides=SMALL, checkpoint_dir=str(ckpt)), ckpt


def test_the_workflow_trains_evaluates_and_registers_flux(run):
    out, ckpt = run
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file()
    assert len(out.metrics) == 2 and (out.metrics["train/log_prob_mean_abs_diff"] <= 1e-6).all()
    assert out.eval_table["seed"].tolist() == [1234, 1235]
    assert out.registered.name == "tiny-flux-jpeg" and "candidate" in out.registered.aliases


def test_the_registered_flux_lora_serves_through_pyfunc_and_equals_ours(run):
    import mlflow.diffusers
    import mlflow.pyfunc
    from diffusers import FluxPipeline
    from peft import PeftModel
    from PIL import Image

    from diffusionrl.models import build_tiny_flux_pipeline

    out, _ = run
    uri = f"models:/{out.registered.name}/{out.registered.version}"
    images = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame({"prompt": ["a red cat"]}),
                                                   params={"num_inference_steps": 2})
    img = Image.open(io.BytesIO(images[0]))
    assert img.size == (32, 32) and np.asarray(img).std() > 0

    pipe = mlflow.diffusers.load_model(uri).load_pipeline(device="cpu")
    assert isinstance(pipe, FluxPipeline)  # DiffusionPipeline picked the class from the base's model_index.json
    ours = PeftModel.from_pretrained(build_tiny_flux_pipeline().transformer, out.lora.path).eval()
    c = pipe.transformer.config
    gen = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(2, 4, c.in_channels, generator=gen),
              encoder_hidden_states=torch.randn(2, 6, c.joint_attention_dim, generator=gen),
              pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=gen),
              timestep=torch.tensor([0.3, 0.7]), guidance=torch.tensor([3.5, 3.5]),
              txt_ids=torch.zeros(6, 3), img_ids=torch.zeros(4, 3), return_dict=False)
    with torch.no_grad():
        a, b = pipe.transformer(**kw)[0], ours(**kw)[0]
        with ours.disable_adapter():
            base = ours(**kw)[0]
    assert (a - b).abs().max().item() <= 1e-6
    assert (a - base).abs().max().item() > 1e-6  # the adapter is really applied
