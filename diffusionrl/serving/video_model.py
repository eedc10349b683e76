"""A LoRA on a video base model (Wan2.1) as an MLflow pyfunc model: prompts in, animated GIFs out.

MLflow's ``mlflow.diffusers`` flavor serves image pipelines only: its pyfunc reads ``output.images``
and passes no frame count, while ``WanPipeline`` returns ``output.frames``. So a video LoRA is
logged as a pyfunc model from code (``video_pyfunc.py``): its artifacts are the diffusers LoRA
folder that ``lora_export.diffusers_adapter_dir`` writes (``pytorch_lora_weights.safetensors`` for
``WanPipeline.load_lora_weights``, and ``peft/``) and ``video_settings.json`` (the base model
reference and revision, and the run's evaluation settings: steps, guidance, size, frames, negative
prompt). ``predict`` loads the base with ``DiffusionPipeline.from_pretrained`` (the class comes from
its ``model_index.json``), applies the LoRA and returns one GIF (bytes) per prompt. Every request is
checked against ``request_limits`` first (prompts, steps, guidance, size, frames, text length; the
model's ``request_limits`` metadata lists them): one line, and nothing generated, when it is outside.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

SETTINGS_FILE = "video_settings.json"
ADAPTER_ARTIFACT = "adapter"  # artifacts/adapter/{pytorch_lora_weights.safetensors, peft/}


class VideoLoraModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: ``predict`` takes a ``prompt`` column (or strings) and returns GIF bytes per prompt."""

    def load_context(self, context) -> None:
        import torch
        from diffusers import DiffusionPipeline

        from diffusionrl.models.base import dtype_kwargs, hf_token, no_progress_bars

        self.settings = json.loads(Path(context.artifacts["settings"]).read_text())
        s = self.settings
        with no_progress_bars():
            pipe = DiffusionPipeline.from_pretrained(s["base_model"], revision=s.get("revision") or None,
                                                     token=hf_token(), **dtype_kwargs(torch.float32))
        pipe.load_lora_weights(context.artifacts[ADAPTER_ARTIFACT], weight_name=s["weight_name"])
        self.pipe = pipe.to("cuda" if torch.cuda.is_available() else "cpu")

    def predict(self, context, model_input, params=None) -> list[bytes]:
        import numpy as np

        from diffusionrl.video import gif_bytes

        from .request_limits import check_params, prompts_of

        prompts = prompts_of(model_input)
        s = check_params({**self.settings["generation"], **(params or {})})
        if not s.get("negative_prompt"):
            s.pop("negative_prompt", None)  # the pipeline's own default
        out = self.pipe(prompt=prompts, output_type="np", **s).frames  # [B, F, H, W, 3] in [0, 1]
        return [gif_bytes((np.asarray(v) * 255).round().astype(np.uint8)) for v in out]


def generation_settings(cfg) -> dict:
    """The run's evaluation settings, as ``WanPipeline.__call__`` keywords (the defaults of ``predict``),
    which must lie within ``request_limits.LIMITS`` (a model that would refuse its own defaults is not logged)."""
    from .request_limits import check_params

    res = cfg.sampling.eval_resolution or cfg.sampling.resolution  # evaluation.eval_resolution
    settings = {"num_inference_steps": cfg.eval.num_steps, "guidance_scale": float(cfg.eval.guidance_scale),
                "height": res, "width": res, "num_frames": cfg.sampling.num_frames,
                "negative_prompt": cfg.sampling.negative_prompt, "max_sequence_length": cfg.model.max_sequence_length}
    return check_params(settings, where="the served model's defaults (eval.*, sampling.*, model.max_sequence_length)")


def video_signature(cfg):
    from mlflow.models import ModelSignature
    from mlflow.types import DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import ColSpec

    types = {int: DataType.integer, float: DataType.double, str: DataType.string}
    return ModelSignature(
        inputs=Schema([ColSpec(type=DataType.string, name="prompt")]),
        outputs=Schema([ColSpec(type=DataType.binary, name="video_gif")]),
        params=ParamSchema([ParamSpec(name=k, dtype=types[type(v)], default=v)
                            for k, v in generation_settings(cfg).items()]),
    )


def log_video_lora_model(run, cfg, adapter_dir: str | Path, base_ref: str, weight_name: str, example_prompt: str,
                         metadata: dict[str, str]):
    """Log the diffusers LoRA folder ``adapter_dir`` as a pyfunc model of the workflow ``run`` ->
    ModelInfo (MLflow checks the input example by loading the model and generating a video)."""
    from mlflow.models import Model

    from .request_limits import describe

    with tempfile.TemporaryDirectory() as tmp:
        settings = Path(tmp) / SETTINGS_FILE
        settings.write_text(json.dumps({"base_model": base_ref, "revision": cfg.model.revision,
                                        "weight_name": weight_name, "generation": generation_settings(cfg)},
                                       indent=1))
        # Model.log (what pyfunc.log_model wraps) takes the run explicitly: the workflow run stays open.
        return Model.log(
            artifact_path=None,
            name="lora",
            flavor=mlflow.pyfunc,
            run_id=run.run_id,
            metadata={**metadata, "request_limits": describe(generation_settings(cfg))},
            python_model=str(Path(__file__).with_name("video_pyfunc.py")),  # models from code
            artifacts={ADAPTER_ARTIFACT: str(adapter_dir), "settings": str(settings)},
            signature=video_signature(cfg),
            input_example=pd.DataFrame({"prompt": [example_prompt]}),
            pip_requirements=["torch", "diffusers", "transformers", "peft", "pillow", "numpy", "pandas", "mlflow"],
        )
