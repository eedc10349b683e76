"""A LoRA on a video base model (Wan2.1, Wan2.2) as an MLflow pyfunc model: prompts in, animated GIFs out.

MLflow's ``mlflow.diffusers`` flavor serves image pipelines only: its pyfunc reads ``output.images``
and passes no frame count, while ``WanPipeline`` returns ``output.frames``. So a video LoRA is
logged as a pyfunc model from code (``video_pyfunc.py``): its artifacts are the diffusers LoRA
folder that ``lora_export.diffusers_adapter_dir`` writes (``pytorch_lora_weights.safetensors`` for
``WanPipeline.load_lora_weights``, or a Wan2.2 two-expert LoRA's file per expert, and ``peft/``) and
``video_settings.json`` (the base model reference and revision, the LoRA file of each pipeline component,
``weight_names``, and the run's evaluation settings: steps, guidance, for two experts the low-noise
expert's ``guidance_scale_2``, size, frames, negative prompt). ``predict`` loads the base with
``DiffusionPipeline.from_pretrained`` (the class comes from its ``model_index.json``), applies the LoRA
(a two-expert LoRA's second file with ``load_into_transformer_2=True``) and returns one GIF (bytes) per
prompt. Every request is checked against ``request_limits`` first (prompts, steps, guidance, size,
frames, text length; the model's ``request_limits`` metadata lists them): one line, and nothing
generated, when it is outside.
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

        from diffusionrl.models.base import dtype_kwargs, hf_token
        from diffusionrl.models.truncation import no_progress_bars

        self.settings = json.loads(Path(context.artifacts["settings"]).read_text())
        s = self.settings
        with no_progress_bars():
            pipe = DiffusionPipeline.from_pretrained(s["base_model"], revision=s.get("revision") or None,
                                                     token=hf_token(), **dtype_kwargs(torch.float32))
        for component, name in s["weight_names"].items():  # pipeline component -> its LoRA file
            pipe.load_lora_weights(context.artifacts[ADAPTER_ARTIFACT], weight_name=name,
                                   **({"load_into_transformer_2": True} if component == "transformer_2" else {}))
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


def generation_settings(cfg, two_experts: bool = False) -> dict:
    """The run's evaluation settings, as ``WanPipeline.__call__`` keywords (the defaults of ``predict``),
    which must lie within ``request_limits.LIMITS`` (a model that would refuse its own defaults is not logged).
    A base model with two experts (Wan2.2 A14B) also takes ``guidance_scale_2``, the low-noise expert's scale
    (``eval.guidance_scale_2``; 0: ``eval.guidance_scale``, as the pipeline's default)."""
    from .request_limits import check_params

    res = cfg.sampling.eval_resolution or cfg.sampling.resolution  # evaluation.eval_resolution
    ev = cfg.eval
    settings = {"num_inference_steps": ev.num_steps, "guidance_scale": float(ev.guidance_scale),
                **({"guidance_scale_2": float(ev.guidance_scale_2 or ev.guidance_scale)} if two_experts else {}),
                "height": res, "width": res, "num_frames": cfg.sampling.num_frames,
                "negative_prompt": cfg.sampling.negative_prompt, "max_sequence_length": cfg.model.max_sequence_length}
    return check_params(settings, where="the served model's defaults (eval.*, sampling.*, model.max_sequence_length)")


def video_signature(cfg, settings: dict | None = None):
    from mlflow.models import ModelSignature
    from mlflow.types import DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import ColSpec

    types = {int: DataType.integer, float: DataType.double, str: DataType.string}
    return ModelSignature(
        inputs=Schema([ColSpec(type=DataType.string, name="prompt")]),
        outputs=Schema([ColSpec(type=DataType.binary, name="video_gif")]),
        params=ParamSchema([ParamSpec(name=k, dtype=types[type(v)], default=v)
                            for k, v in (settings or generation_settings(cfg)).items()]),
    )


def log_video_lora_model(run, cfg, adapter_dir: str | Path, base_ref: str, example_prompt: str,
                         metadata: dict[str, str]):
    """Log the diffusers LoRA folder ``adapter_dir`` as a pyfunc model of the workflow ``run`` ->
    ModelInfo (MLflow checks the input example by loading the model and generating a video)."""
    from mlflow.models import Model

    from diffusionrl.models.families import two_experts

    from .lora_export import adapter_files
    from .request_limits import describe

    generation = generation_settings(cfg, two_experts(base_ref, cfg.model.revision))
    files = adapter_files(adapter_dir)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Path(tmp) / SETTINGS_FILE
        settings.write_text(json.dumps({"base_model": base_ref, "revision": cfg.model.revision,
                                        "weight_names": files, "generation": generation}, indent=1))
        # Model.log (what pyfunc.log_model wraps) takes the run explicitly: the workflow run stays open.
        return Model.log(
            artifact_path=None,
            name="lora",
            flavor=mlflow.pyfunc,
            run_id=run.run_id,
            metadata={**metadata, "request_limits": describe(generation)},
            python_model=str(Path(__file__).with_name("video_pyfunc.py")),  # models from code
            artifacts={ADAPTER_ARTIFACT: str(adapter_dir), "settings": str(settings)},
            signature=video_signature(cfg, generation),
            input_example=pd.DataFrame({"prompt": [example_prompt]}),
            pip_requirements=["torch", "diffusers", "transformers", "peft", "pillow", "numpy", "pandas", "mlflow"],
        )
