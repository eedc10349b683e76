"""What a served model's ``predict`` accepts: bounds on every generation parameter and on the prompts.

The registered models took any value: ``num_inference_steps=0`` returned noise, ``100000`` was
accepted and held the server for hours, and so were a 2048-prompt batch or a 10 MB prompt. MLflow's
``ParamSpec`` has a type and a default but no bounds, so the bounds live here: ``LIMITS`` (per
parameter), ``MAX_PROMPTS`` prompts of at most ``MAX_PROMPT_CHARS`` characters per request. They are
written into each logged model's metadata (``request_limits``: ``describe``) and checked by its
``predict`` before anything is generated; a request outside them is one line naming the parameter
and its range (``RequestError``, an ``MlflowException`` with ``INVALID_PARAMETER_VALUE``, which
``mlflow models serve`` answers with HTTP 400).

- images (``mlflow.diffusers``): this module is the model's pyfunc loader (``_load_pyfunc``), shipped
  with it as its code (``code/request_limits.py``: ``save_model``, what ``mlflow_model.log_lora_model``
  logs with) around MLflow's own diffusers wrapper, so serving still needs no diffusionrl install;
  hence it imports only the standard library and mlflow (pandas through mlflow; Pillow, which diffusers
  needs, for input images). An editing model (FLUX.1 Kontext) also takes ``{"prompt", "image"}``: one
  input image (encoded bytes, or base64 as JSON carries them) per prompt or one for all (``images_of``),
  each edited as training sampled it (``BoundedDiffusers.edit``);
- videos: ``video_model.VideoLoraModel.predict``; text (block diffusion): ``bdlm.serving.BDLMDecoder``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

LOADER_MODULE = "request_limits"  # the image model's pyfunc loader: this file, as the model's code/
MAX_PROMPTS = 64  # prompts per request
MAX_PROMPT_CHARS = 1000  # characters per prompt (and per negative prompt)
MAX_IMAGE_BYTES = 32 * 2**20  # per input image (editing models)
GENERATION_PARAMS = ("num_inference_steps", "guidance_scale", "height", "width", "negative_prompt")  # MLflow's


class RequestError(MlflowException):
    """A request outside the served model's limits (HTTP 400 from ``mlflow models serve``)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()), error_code=INVALID_PARAMETER_VALUE)


@dataclass(frozen=True)
class Bound:
    """``lo <= value <= hi`` (``lo < value`` when ``lo_open``); integers also ``value % multiple == offset``."""

    lo: float
    hi: float
    integer: bool = True
    lo_open: bool = False
    multiple: int = 1
    offset: int = 0

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        text = f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        if self.multiple > 1:
            text += f", {self.offset} + a multiple of {self.multiple}" if self.offset else \
                f", a multiple of {self.multiple}"
        return text

    def ok(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not float(value).is_integer():
            return False
        if not math.isfinite(value) or value > self.hi or value < self.lo or (self.lo_open and value == self.lo):
            return False
        return not self.integer or (int(value) - self.offset) % self.multiple == 0


@dataclass(frozen=True)
class Text:
    """A string (or None: the pipeline's default) of at most ``max_chars`` characters."""

    max_chars: int

    def describe(self) -> str:
        return f"a string of at most {self.max_chars} characters"

    def ok(self, value: Any) -> bool:
        return value is None or (isinstance(value, str) and len(value) <= self.max_chars)


SIZE = Bound(16, 2048, multiple=16)  # pixels: the VAE's 8x and the transformer's 2x2 patches
LIMITS: dict[str, Bound | Text] = {
    "num_inference_steps": Bound(1, 1000),
    "guidance_scale": Bound(0, 30, integer=False),  # 0: no CFG where the pipeline's scale counts from 0 (Z-Image)
    "guidance_scale_2": Bound(0, 30, integer=False),  # Wan2.2 A14B: the low-noise expert's CFG scale
    "height": SIZE,
    "width": SIZE,
    "num_frames": Bound(1, 161, multiple=4, offset=1),  # Wan: 1 + 4k frames, up to twice its 81
    "max_sequence_length": Bound(1, 512),  # text-encoder tokens (T5 / umT5 take 512)
    "negative_prompt": Text(MAX_PROMPT_CHARS),
    "threshold": Bound(0, 1, integer=False, lo_open=True),  # block diffusion's commit confidence
}


def describe(names) -> str:
    """The limits of the parameters ``names`` and of the prompts, as one line (the model's metadata)."""
    parts = [f"prompts: 1 to {MAX_PROMPTS} strings of at most {MAX_PROMPT_CHARS} characters"]
    parts += [f"{name}: {LIMITS[name].describe()}" for name in names if name in LIMITS]
    return "; ".join(parts)


def check_params(params: dict[str, Any] | None, where: str = "request") -> dict[str, Any]:
    """``params`` itself when every parameter with a limit is inside it, else ``RequestError``."""
    for name, value in (params or {}).items():
        limit = LIMITS.get(name)
        if limit is not None and not limit.ok(value):
            long = isinstance(value, str) and len(value) > 40
            shown = f"a string of {len(value)} characters" if long else repr(value)
            raise RequestError(f"{where}: {name}={shown} is out of bounds: it must be {limit.describe()}")
    return params or {}


def _flatten(items) -> list:
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)
    return out


def prompts_of(model_input) -> list[str]:
    """The prompts of a request (a DataFrame's ``prompt`` column or only column, a string, a list, a
    ``{"prompt": ...}`` dict), each a string of at most ``MAX_PROMPT_CHARS``, 1 to ``MAX_PROMPTS`` of them."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        if "prompt" not in model_input.columns and len(model_input.columns) != 1:
            raise RequestError(f"request: a table needs a 'prompt' column; it has {list(model_input.columns)}")
        column = model_input["prompt" if "prompt" in model_input.columns else model_input.columns[0]]
        prompts = _flatten(column.tolist())  # schema enforcement may put a list in one cell
    elif isinstance(model_input, dict):
        prompts = model_input.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else _flatten(prompts or [])
    elif isinstance(model_input, str):
        prompts = [model_input]
    else:
        prompts = _flatten(list(model_input))
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise RequestError(f"request: {len(prompts)} prompts; send 1 to {MAX_PROMPTS} per request")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(f"request: prompt {i} is {type(prompt).__name__}, not a string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"request: prompt {i} has {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")
    return prompts


def images_of(model_input, n: int) -> list[bytes] | None:
    """The input images of a request to an editing model (a DataFrame's ``image`` column, a dict's
    ``image``): encoded bytes or their base64, one per prompt or one for all ``n``; None when there are none."""
    import base64
    import binascii

    import pandas as pd

    if isinstance(model_input, pd.DataFrame) and "image" in model_input.columns:
        images = _flatten(model_input["image"].tolist())
    elif isinstance(model_input, dict) and model_input.get("image") is not None:
        images = model_input["image"]
        images = images if isinstance(images, (list, tuple)) else [images]
    else:
        return None
    images = [i for i in images if i is not None]
    if not images:
        return None
    if len(images) not in (1, n):
        raise RequestError(f"request: {len(images)} input images for {n} prompts; send one per prompt or one for all")
    out = []
    for i, image in enumerate(images):
        if isinstance(image, str):
            try:
                image = base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(f"request: image {i} is a string but not base64-encoded image bytes") from None
        if not isinstance(image, (bytes, bytearray)):
            raise RequestError(f"request: image {i} is {type(image).__name__}, not encoded image bytes")
        if len(image) > MAX_IMAGE_BYTES:
            raise RequestError(f"request: image {i} has {len(image)} bytes; at most {MAX_IMAGE_BYTES}")
        out.append(bytes(image))
    return out * n if len(out) == 1 else out


def reference_size(height: int, width: int, area: int, multiple: int = 16) -> tuple[int, int]:
    """Where an editing model's input image is encoded: its aspect at ``area`` pixels, in whole
    ``multiple``-pixel patches (``models/flux_kontext.FluxKontextAdapter.reference_size``, as trained)."""
    aspect = width / height
    w = round((area * aspect) ** 0.5) // multiple * multiple
    h = round((area / aspect) ** 0.5) // multiple * multiple
    return max(h, multiple), max(w, multiple)


class BoundedDiffusers:
    """MLflow's diffusers pyfunc wrapper, behind the request limits; an editing model's requests with
    input images go to its pipeline here (MLflow's wrapper passes prompts only)."""

    def __init__(self, inner):
        self.inner = inner

    def get_raw_model(self):
        return self.inner.get_raw_model()

    def predict(self, data, params: dict[str, Any] | None = None):
        prompts = prompts_of(data)
        images = images_of(data, len(prompts))
        check_params(params)
        if images is None:
            return self.inner.predict(prompts, params)
        return self.edit(prompts, images, params or {})

    def edit(self, prompts: list[str], images: list[bytes], params: dict[str, Any]) -> list[bytes]:
        """Each prompt's edit of its image, PNG bytes: the image resized to the output's area at its own
        aspect (``reference_size``) and passed as the pipeline's ``image``, output at ``height x width``."""
        import inspect
        import io

        from PIL import Image, UnidentifiedImageError

        pipeline = self.get_raw_model()
        accepted = inspect.signature(pipeline.__call__).parameters
        if "image" not in accepted:
            raise RequestError(f"request: this model ({type(pipeline).__name__}) does not edit images; send prompts "
                               "without an 'image'")
        kwargs = {k: params[k] for k in GENERATION_PARAMS if k in params and params[k] != ""}
        height = kwargs.get("height") or pipeline.default_sample_size * pipeline.vae_scale_factor
        width = kwargs.get("width") or height
        if "max_area" in accepted:  # Kontext: the output at height x width, not rescaled to its 1 MP default
            kwargs.update(height=height, width=width, max_area=height * width)
        if "_auto_resize" in accepted:
            kwargs["_auto_resize"] = False  # the input at reference_size, as trained
        out = []
        for i, (prompt, data) in enumerate(zip(prompts, images)):
            try:
                with Image.open(io.BytesIO(data)) as im:
                    image = im.convert("RGB")
            except (UnidentifiedImageError, OSError) as exc:
                raise RequestError(f"request: image {i} is not a readable image ({exc})") from None
            h, w = reference_size(image.height, image.width, height * width)
            image = pipeline.image_processor.resize(image, h, w)  # what the adapter does before encoding
            result = pipeline(prompt=prompt, image=image, **kwargs).images[0]
            buf = io.BytesIO()
            result.save(buf, format="PNG")
            out.append(buf.getvalue())
        return out


def _load_pyfunc(path, model_config=None):
    """The image model's pyfunc loader (its ``MLmodel`` names this module): MLflow's diffusers
    wrapper (the pipeline loads on the first request) behind the limits."""
    from mlflow.diffusers import _load_pyfunc as load_diffusers

    return BoundedDiffusers(load_diffusers(path, model_config))


def save_model(path, mlflow_model, **kwargs) -> None:
    """``mlflow.diffusers.save_model`` whose pyfunc flavor loads through this module, shipped as the
    model's ``code/``: every request is bounded before MLflow's diffusers wrapper generates. The
    ``diffusers`` flavor (``mlflow.diffusers.load_model``) and the folder layout are unchanged.
    (``mlflow_model.log_lora_model`` passes this module to ``Model.log`` as the flavor.)"""
    from pathlib import Path

    import mlflow.diffusers
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.pyfunc import FLAVOR_NAME, MAIN

    kwargs["code_paths"] = [*(kwargs.get("code_paths") or []), __file__]
    mlflow.diffusers.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
    mlflow_model.flavors[FLAVOR_NAME][MAIN] = LOADER_MODULE
    mlflow_model.save(str(Path(path) / MLMODEL_FILE_NAME))
