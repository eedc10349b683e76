"""Serving a trained LoRA: the MLflow model, its request limits, the registry and ``@champion``.

- ``lora_export``: a peft LoRA folder as a diffusers LoRA folder (``pytorch_lora_weights.safetensors``,
  or a file per expert of a Wan2.2 two-expert LoRA, plus ``peft/``);
- ``signature``: the image model's signature (prompt -> PNG bytes, this run's evaluation settings as
  the params' defaults);
- ``mlflow_model``: ``log_lora_model``, the LoRA as an ``mlflow.diffusers`` model (video families:
  ``video_model``);
- ``model_card``: a LoRA folder's ``README.md`` (``render_card``, ``write_card``: what it is, held-out
  results, how to load it) and a registered version's description (``version_description``);
- ``request_limits``: bounds on every request a served model takes; the image model's pyfunc loader,
  shipped as its code (so it imports only the standard library and mlflow, and is imported as a
  module: its names are not re-exported here);
- ``video_model``, ``video_pyfunc``: a video LoRA as a pyfunc model from code (prompts -> GIF bytes);
- ``champion``: comparable evaluations (``eval_key``), the score and the base model's bar
  (``champion_scores``), the decision, champions whose run failed;
- ``registry``: ``register`` (a version, alias ``candidate``, ``@champion`` only if better) and
  ``register_lora`` (the image workflow's registration, re-scoring a champion evaluated otherwise);
- ``cli``: ``show``, ``python -m diffusionrl.serving show [--name NAME] [--tracking-uri URI]``.

The names other modules import are re-exported here, but for ``request_limits`` and the video
model's modules: ``video_model`` defines a pyfunc model class, which makes MLflow warn at import, so
it is imported only to log or load a video model (``video_pyfunc`` is what MLflow executes then).
"""

from .champion import (
    CANDIDATE,
    CHAMPION,
    base_metric,
    champion_scores,
    current_champion,
    decide,
    eval_key,
    run_state,
    valid_champion,
)
from .cli import main, show
from .lora_export import ADAPTER_FILE, PEFT_SUBDIR, diffusers_adapter_dir
from .mlflow_model import log_lora_model
from .model_card import render_card, version_description, write_card
from .registry import Registration, register, register_lora, version_url
from .signature import image_params, model_signature

__all__ = [
    "ADAPTER_FILE", "CANDIDATE", "CHAMPION", "PEFT_SUBDIR", "Registration", "base_metric", "champion_scores",
    "current_champion", "decide", "diffusers_adapter_dir", "eval_key", "image_params", "log_lora_model", "main",
    "model_signature", "register", "register_lora", "render_card", "run_state", "show", "valid_champion",
    "version_description", "version_url", "write_card",
]
