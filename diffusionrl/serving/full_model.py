"""A full fine-tune (``model.finetune=full``) as an MLflow pyfunc model from code (``full_pyfunc.py``).

Its artifacts are the run's model folder (``training.full.write_full_model``: one diffusers model folder
per trained transformer, ``transformer/`` and for Wan2.2 ``transformer_2/``) and ``full_settings.json``
(the base model reference and revision, the components, the run's ``model.max_sequence_length``). On
the first request the base pipeline loads with ``DiffusionPipeline.from_pretrained`` and each trained
component replaces the pipeline's (``<TransformerClass>.from_pretrained``); requests go through the same
bounds and sampling as a LoRA's (``request_limits.BoundedDiffusers``): prompts (and an editing model's
images) in, PNG bytes out. Image families only: a video family's full fine-tune trains and is
evaluated, and its registration is refused in one line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlflow
import mlflow.pyfunc
import pandas as pd

SETTINGS_FILE = "full_settings.json"
MODEL_ARTIFACT = "model"  # artifacts/model/{transformer/, diffusionrl.json, README.md}


class TunedPipeline:
    """The base pipeline with the trained transformer(s) in place, loaded on first use (``get_raw_model``,
    what ``BoundedDiffusers`` calls)."""

    def __init__(self, settings: dict, model_dir: str):
        self.settings, self.model_dir, self.pipe = settings, model_dir, None

    def get_raw_model(self):
        if self.pipe is None:
            import torch
            from diffusers import DiffusionPipeline

            from diffusionrl.models.base import dtype_kwargs, hf_token
            from diffusionrl.models.truncation import no_progress_bars

            s = self.settings
            with no_progress_bars():
                pipe = DiffusionPipeline.from_pretrained(s["base_model"], revision=s.get("revision") or None,
                                                         token=hf_token(), **dtype_kwargs(torch.float32))
                for component in s["components"]:
                    trained = type(getattr(pipe, component)).from_pretrained(str(Path(self.model_dir) / component))
                    setattr(pipe, component, trained)
            self.pipe = pipe.to("cuda" if torch.cuda.is_available() else "cpu")
        return self.pipe


class FullModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: ``predict`` takes a ``prompt`` column (and an editing model's ``image``) and returns PNG
    bytes per prompt, within ``request_limits``."""

    def load_context(self, context) -> None:
        from .request_limits import BoundedDiffusers

        s = json.loads(Path(context.artifacts["settings"]).read_text())
        self.bounded = BoundedDiffusers(TunedPipeline(s, context.artifacts[MODEL_ARTIFACT]), s["base_model"],
                                        s["max_sequence_length"])

    def predict(self, context, model_input, params=None) -> list[bytes]:
        return self.bounded.predict(model_input, params)


def log_full_model(run, cfg, model_dir: str | Path, base_ref: str, example_prompt: str, metadata: dict[str, str],
                   card: str = "", example_image: bytes | None = None):
    """Log a full fine-tune's model folder as a pyfunc model of the workflow ``run`` -> ModelInfo (MLflow checks
    the input example by loading the model and generating from it)."""
    import shutil

    from mlflow.models import Model

    from diffusionrl.errors import UserError
    from diffusionrl.models.families import adapter_class

    from .request_limits import describe
    from .signature import model_signature

    mlflow.set_tracking_uri(run.uri)
    mlflow.set_registry_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)  # the logged model lives beside its run
    family = adapter_class(base_ref, cfg.model.revision)
    if family.video:
        raise UserError(f"model.finetune=full on {cfg.model.name} (a video family): trained and evaluated, but a "
                        "video full fine-tune is not registered (its pyfunc serves images); use model.finetune=lora "
                        "to register a video model")
    components = json.loads((Path(model_dir) / "diffusionrl.json").read_text())["components"]
    signature = model_signature(cfg, family)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(model_dir, model)
        if card:
            (model / "README.md").write_text(card)
        settings = Path(tmp) / SETTINGS_FILE
        settings.write_text(json.dumps({"base_model": base_ref, "revision": cfg.model.revision,
                                        "components": components,
                                        "max_sequence_length": cfg.model.max_sequence_length}, indent=1))
        return Model.log(
            artifact_path=None,
            name="model",
            flavor=mlflow.pyfunc,
            run_id=run.run_id,
            metadata={**metadata, "request_limits": describe(p.name for p in signature.params)},
            python_model=str(Path(__file__).with_name("full_pyfunc.py")),  # models from code
            artifacts={MODEL_ARTIFACT: str(model), "settings": str(settings)},
            signature=signature,
            input_example=pd.DataFrame({"prompt": [example_prompt], **(
                {"image": [example_image]} if family.editing and example_image is not None else {})}),
            pip_requirements=["torch", "diffusers", "transformers", "pillow", "numpy", "pandas", "mlflow"],
        )
