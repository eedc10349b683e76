"""The Flyte workflow with each non-SD3 family's tiny preset, in-process (local Flyte execution, local
Ray): train, evaluate, register as an mlflow.diffusers model on the family's pipeline class, serve
through pyfunc; the registered LoRA equals ours. (SD3: tests/test_workflow.py, tests/test_tracking.py.)"""

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


def flux_inputs(c, gen):
    return dict(hidden_states=torch.randn(2, 4, c.in_channels, generator=gen),
                encoder_hidden_states=torch.randn(2, 6, c.joint_attention_dim, generator=gen),
                pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=gen),
                timestep=torch.tensor([0.3, 0.7]), guidance=torch.tensor([3.5, 3.5]),
                txt_ids=torch.zeros(6, 3), img_ids=torch.zeros(4, 3), return_dict=False)


def qwen_image_inputs(c, gen):
    return dict(hidden_states=torch.randn(2, 4, c.in_channels, generator=gen),
                encoder_hidden_states=torch.randn(2, 6, c.joint_attention_dim, generator=gen),
                timestep=torch.tensor([0.3, 0.7]), img_shapes=[[(1, 2, 2)]] * 2, return_dict=False)


FAMILIES = {  # preset -> (registered name, pipeline class, builtin builder, transformer inputs)
    "tiny-cpu-flux": ("tiny-flux-jpeg", "FluxPipeline", "build_tiny_flux_pipeline", flux_inputs),
    "tiny-cpu-qwen-image": ("tiny-qwen-image-jpeg", "QwenImagePipeline", "build_tiny_qwen_image_pipeline",
                            qwen_image_inputs),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request, tmp_path_factory):
    sys.path.insert(0, str(ROOT))
    from diffusionrl.config import get_preset
    from workflows.grpo import grpo

    ckpt = tmp_path_factory.mktemp("run")
    return request.param, grpo(config=get_preset(request.param), overrides=SMALL, checkpoint_dir=str(ckpt))


def test_the_workflow_trains_evaluates_and_registers(run):
    preset, out = run
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file()
    assert len(out.metrics) == 2 and (out.metrics["train/log_prob_mean_abs_diff"] <= 1e-6).all()
    assert out.eval_table["seed"].tolist() == [1234, 1235]
    assert out.registered.name == FAMILIES[preset][0] and "candidate" in out.registered.aliases


def test_the_registered_lora_serves_through_pyfunc_and_equals_ours(run):
    import diffusers
    import mlflow.diffusers
    import mlflow.pyfunc
    from peft import PeftModel
    from PIL import Image

    import diffusionrl.models as models

    preset, out = run
    _, pipeline_class, builder, inputs = FAMILIES[preset]
    uri = f"models:/{out.registered.name}/{out.registered.version}"
    images = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame({"prompt": ["a red cat"]}),
                                                   params={"num_inference_steps": 2})
    img = Image.open(io.BytesIO(images[0]))
    assert img.size == (32, 32) and np.asarray(img).std() > 0

    pipe = mlflow.diffusers.load_model(uri).load_pipeline(device="cpu")
    # DiffusionPipeline picked the class from the base's model_index.json
    assert isinstance(pipe, getattr(diffusers, pipeline_class))
    ours = PeftModel.from_pretrained(getattr(models, builder)().transformer, out.lora.path).eval()
    kw = inputs(pipe.transformer.config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = pipe.transformer(**kw)[0], ours(**kw)[0]
        with ours.disable_adapter():
            base = ours(**kw)[0]
    assert (a - b).abs().max().item() <= 1e-6
    assert (a - base).abs().max().item() > 1e-6  # the adapter is really applied
