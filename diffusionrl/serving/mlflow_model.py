"""A run's LoRA as an MLflow model of its workflow run: the ``mlflow.diffusers`` flavor for image
families, whose pyfunc loader is ``request_limits`` (shipped as the model's code), a pyfunc model from
code for video families (``video_model``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from diffusionrl.tracking import TrackingRun

from .lora_export import diffusers_adapter_dir
from .signature import model_signature


def log_lora_model(run: TrackingRun, cfg, peft_dir: str | Path, base_ref: str, example_prompt: str,
                   metadata: dict[str, str], card: str = "", example_image: bytes | None = None):
    """The LoRA as an ``mlflow.diffusers`` model of the workflow run -> ModelInfo.

    MLflow checks the input example by loading the model through pyfunc and generating from it
    (a failure there is logged as a warning): the registered model is known to serve. Its pyfunc
    refuses requests outside ``request_limits`` (listed in the model's ``request_limits`` metadata) and
    samples as the run's evaluation does, prompts encoded at ``model.max_sequence_length`` (the pyfunc
    flavor's model configuration, ``config`` in ``MLmodel``).
    ``card`` (``model_card.render_card``, diffusers layout) is the adapter folder's ``README.md``.
    ``example_image``: an editing model's input example's image (encoded bytes; the held-out row's)."""
    import mlflow
    import pandas as pd
    from mlflow.models import Model

    from diffusionrl.models.families import adapter_class

    from . import request_limits

    mlflow.set_tracking_uri(run.uri)
    mlflow.set_registry_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)  # the logged model lives beside its run
    family = adapter_class(base_ref, cfg.model.revision)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = diffusers_adapter_dir(peft_dir, Path(tmp) / "adapter", family.pipeline_class)
        if card:
            (adapter / "README.md").write_text(card)
        if family.video:  # mlflow.diffusers serves images only: our pyfunc returns GIFs (video_model.py)
            from .video_model import log_video_lora_model

            return log_video_lora_model(run, cfg, adapter, base_ref, example_prompt, metadata)
        signature = model_signature(cfg, family)
        # what mlflow.diffusers.log_model does, its pyfunc loader behind the bounds (request_limits.save_model)
        return Model.log(
            artifact_path=None,
            name="lora",
            flavor=request_limits,
            flavor_name="mlflow.diffusers",
            run_id=run.run_id,
            adapter_path=str(adapter),
            base_model=base_ref,
            max_sequence_length=cfg.model.max_sequence_length,  # prompts encoded as the run's (request_limits)
            signature=signature,
            input_example=pd.DataFrame({"prompt": [example_prompt], **(
                {"image": [example_image]} if family.editing and example_image is not None else {})}),
            metadata={**metadata, "request_limits": request_limits.describe(p.name for p in signature.params)},
        )
