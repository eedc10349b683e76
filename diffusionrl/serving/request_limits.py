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
  with it as its code (``code/request_limits.py`` and ``code/request_pipelines.py``, how it calls the pipeline:
  ``save_model``, what ``mlflow_model.log_lora_model``
  logs with) around MLflow's own diffusers wrapper, so serving still needs no diffusionrl install;
  hence it imports only the standard library and mlflow (pandas through mlflow; Pillow and torch, which
  diffusers needs, for input images). Every request samples as the run's evaluation does (``call_kwargs``): the
  prompt encoded at the run's ``model.max_sequence_length`` (the pyfunc's logged model configuration, ``SEQ_LEN``; not
  the pipeline's default, 512 for FLUX.1, 256 for SD3), a true-CFG pipeline's scale from ``guidance_scale``. An
  editing model (FLUX.1 Kontext, Qwen-Image-Edit) also takes ``{"prompt", "image"}``: one input image (encoded
  bytes, or base64 as JSON carries them; at most ``MAX_IMAGE_PIXELS``, read from the header) per prompt or one for
  all (``images_of``), each edited as training sampled it (``BoundedDiffusers.edit``; Qwen-Image-Edit, which only
  edits, refuses prompts without an image);
- videos: ``video_model.VideoLoraModel.predict``; text (block diffusion): ``bdlm.serving.BDLMDecoder``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

try:  # as diffusionrl.serving.request_limits, or as the model's code/ (top-level modules, shipped together)
    from .request_pipelines import IMAGE_REQUIRED, area_bound_call, png, reference_size, takes_true_cfg, true_cfg
except ImportError:
    from request_pipelines import IMAGE_REQUIRED, area_bound_call, png, reference_size, takes_true_cfg, true_cfg

LOADER_MODULE = "request_limits"  # the image model's pyfunc loader: this file, as the model's code/
MAX_PROMPTS = 64  # prompts per request
MAX_PROMPT_CHARS = 1000  # characters per prompt (and per negative prompt)
MAX_IMAGE_BYTES = 32 * 2**20  # per input image (editing models)
MAX_IMAGE_PIXELS = 4096 * 4096  # per input image, read from its header before it is decoded (data.images' bound)
GENERATION_PARAMS = ("num_inference_steps", "guidance_scale", "height", "width", "negative_prompt")  # MLflow's
SEQ_LEN = "max_sequence_length"  # the pyfunc's model_config: the text-encoder tokens the run encoded prompts at


class RequestError(MlflowException):
    """A request outside the served model's limits (HTTP 400 from ``mlflow models serve``).

    Its ``message`` is the one line it was made with: MLflow's scoring server rewrites the message of every
    error ``predict`` raises as ``Failed to predict data '<the whole request>'. Error: ...``, which would send a
    request's input images back, encoded, in the answer; here that rewrite keeps the line as it was."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()), error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_line"):  # set once, by MlflowException.__init__
            self._line = value


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
        elif isinstance(image, (bytes, bytearray)):
            try:  # base64 as bytes: MLflow's JSON "inputs" (and "instances") hand a binary column's text on as is
                image = base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                pass  # encoded image bytes (every image format has bytes outside base64's alphabet)
        if not isinstance(image, (bytes, bytearray)):
            raise RequestError(f"request: image {i} is {type(image).__name__}, not encoded image bytes")
        if len(image) > MAX_IMAGE_BYTES:
            raise RequestError(f"request: image {i} has {len(image)} bytes; at most {MAX_IMAGE_BYTES}")
        check_image_size(bytes(image), i)
        out.append(bytes(image))
    return out * n if len(out) == 1 else out


def check_image_size(data: bytes, i: int) -> None:
    """Input image ``i`` is a readable image of at most ``MAX_IMAGE_PIXELS``, read from its header (nothing is
    decoded: PIL's decompression-bomb warning and error never reach the request), else ``RequestError``."""
    import io
    import re
    import warnings

    from PIL import Image, UnidentifiedImageError

    pixels = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as im:
                size = im.size
        except Image.DecompressionBombError as exc:
            found = re.search(r"\((\d+) pixels\)", str(exc))
            size, pixels = None, int(found.group(1)) if found else MAX_IMAGE_PIXELS + 1
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            why = "not an image format PIL reads" if isinstance(exc, UnidentifiedImageError) else exc
            raise RequestError(f"request: image {i} is not a readable image ({why})") from None
    pixels = size[0] * size[1] if size else pixels
    if pixels > MAX_IMAGE_PIXELS:
        shown = f"{size[0]}x{size[1]} pixels" if size else f"{pixels} pixels"
        raise RequestError(f"request: image {i} is {shown} ({pixels / 1e6:.0f} MP), over the bound of "
                           f"{MAX_IMAGE_PIXELS} pixels (4096x4096) an input image may have; downscale it")


class BoundedDiffusers:
    """MLflow's diffusers pyfunc wrapper (which loads the pipeline), behind the request limits; the pipeline is
    called here, with the arguments the run's evaluation samples with (MLflow's wrapper passes prompts and its
    five params only: the pipeline's default ``max_sequence_length``, a true-CFG pipeline's default scale)."""

    def __init__(self, inner, base: str = "", max_sequence_length: int | None = None):
        self.inner = inner
        self.base = base  # the base model's reference (hub id or folder)
        self.max_sequence_length = max_sequence_length  # None (a model logged without it): the pipeline's default
        self.imported = False  # import_base_modules ran (once: it reads the base folder's model_index.json)

    def get_raw_model(self):
        if not self.imported:
            import_base_modules(self.base)
            self.imported = True
        return self.inner.get_raw_model()

    def predict(self, data, params: dict[str, Any] | None = None):
        prompts = prompts_of(data)
        images = images_of(data, len(prompts))
        check_params(params)
        pipeline = self.get_raw_model()
        if images is None:
            name = type(pipeline).__name__
            if name in IMAGE_REQUIRED:
                raise RequestError(f"request: this model ({name}) edits images; send an 'image' (encoded bytes, or "
                                   "their base64) with the prompts, one per prompt or one for all")
            return self.generate(pipeline, prompts, params or {})
        return self.edit(pipeline, prompts, images, params or {})

    def call_kwargs(self, pipeline, params: dict[str, Any]) -> dict[str, Any]:
        """The pipeline's arguments for ``params`` as the run's evaluation samples: the ``GENERATION_PARAMS``
        given (an empty negative prompt: the pipeline's default), the prompt encoded at the logged
        ``max_sequence_length`` where the pipeline takes one, a true-CFG pipeline's guidance (``true_cfg``)."""
        import inspect

        kwargs = {k: params[k] for k in GENERATION_PARAMS if k in params and params[k] != ""}
        if self.max_sequence_length and SEQ_LEN in inspect.signature(pipeline.__call__).parameters:
            kwargs[SEQ_LEN] = int(self.max_sequence_length)
        return true_cfg(kwargs, params) if takes_true_cfg(pipeline) else kwargs

    def generate(self, pipeline, prompts: list[str], params: dict[str, Any]) -> list[bytes]:
        """Text to image, PNG bytes per prompt: one pipeline call for the batch, as MLflow's wrapper makes it, at
        the requested ``height x width`` (else the served size ``edit`` uses: the pipeline's default sample size)."""
        import inspect

        kwargs = self.call_kwargs(pipeline, params)
        if "max_area" in inspect.signature(pipeline.__call__).parameters:  # Kontext rescales to max_area (1 MP)
            height = kwargs.get("height") or pipeline.default_sample_size * pipeline.vae_scale_factor
            width = kwargs.get("width") or height
            kwargs.update(height=height, width=width, max_area=height * width)
        images = pipeline(prompt=prompts, **kwargs).images
        if not images:
            raise MlflowException(f"the pipeline ({type(pipeline).__name__}) returned no images")
        return [png(image) for image in images]

    def edit(self, pipeline, prompts: list[str], images: list[bytes], params: dict[str, Any]) -> list[bytes]:
        """Each prompt's edit of its image, PNG bytes, output at ``height x width`` and sampled as the adapter
        samples: the image at the output's area at its own aspect (resized to ``reference_size`` and passed as
        the pipeline's ``image``, or as sent to a pipeline that encodes it at a fixed area: ``area_bound_call``),
        the rest as ``call_kwargs``."""
        import inspect
        import io

        from PIL import Image, UnidentifiedImageError

        accepted = inspect.signature(pipeline.__call__).parameters
        if "image" not in accepted:
            raise RequestError(f"request: this model ({type(pipeline).__name__}) does not edit images; send prompts "
                               "without an 'image'")
        kwargs = self.call_kwargs(pipeline, params)
        height = kwargs.get("height") or pipeline.default_sample_size * pipeline.vae_scale_factor
        width = kwargs.get("width") or height
        kwargs.update(height=height, width=width)
        if "max_area" in accepted:  # Kontext: the output at height x width, not rescaled to its 1 MP default
            kwargs["max_area"] = height * width
        if "_auto_resize" in accepted:
            kwargs["_auto_resize"] = False  # the input at reference_size, as trained
        call = area_bound_call(pipeline, height * width)
        out = []
        for i, (prompt, data) in enumerate(zip(prompts, images)):
            try:
                with Image.open(io.BytesIO(data)) as im:
                    image = im.convert("RGB")
            except (UnidentifiedImageError, OSError) as exc:
                raise RequestError(f"request: image {i} is not a readable image ({exc})") from None
            if call is None:
                h, w = reference_size(image.height, image.width, height * width)
                image = pipeline.image_processor.resize(image, h, w)  # what the adapter does before encoding
            out.append(png((call or pipeline)(prompt=prompt, image=image, **kwargs).images[0]))
        return out


def import_base_modules(base: str) -> None:
    """Import the diffusionrl modules a local base folder's ``model_index.json`` names for its components
    (``builtin:tiny-qwen-image-edit``'s processor: ``diffusionrl.models.tiny_qwen_image_edit``'s
    ``ImageOnlyQwen2VLProcessor``, which needs no torchvision): diffusers loads components from the libraries
    it knows and from modules already imported, and never imports one a folder names. Only diffusionrl's are
    imported (the library that wrote the folder); a hub id names the stock classes."""
    import importlib
    import json
    from pathlib import Path

    index = Path(base) / "model_index.json" if base else None
    if index is None or not index.is_file():
        return
    for name, value in json.loads(index.read_text()).items():
        if isinstance(value, list) and value and str(value[0]).startswith("diffusionrl."):
            try:
                importlib.import_module(value[0])
            except ImportError as exc:
                raise MlflowException(f"the base model {base} has its {name} from {value[0]} ({exc}); serve it "
                                      "where diffusionrl is installed") from None


def _load_pyfunc(path, model_config=None):
    """The image model's pyfunc loader (its ``MLmodel`` names this module): MLflow's diffusers
    wrapper (the pipeline loads on the first request) behind the limits. ``model_config``: the logged
    one (``max_sequence_length``), as ``mlflow.pyfunc.load_model(..., model_config=...)`` overrides it."""
    from mlflow.diffusers import FLAVOR_NAME
    from mlflow.diffusers import _load_pyfunc as load_diffusers
    from mlflow.utils.model_utils import _get_flavor_configuration

    config = model_config or {}
    base = config.get("base_model") or _get_flavor_configuration(str(path), FLAVOR_NAME)["base_model"]
    return BoundedDiffusers(load_diffusers(path, model_config), base, config.get(SEQ_LEN))


def save_model(path, mlflow_model, max_sequence_length: int | None = None, **kwargs) -> None:
    """``mlflow.diffusers.save_model`` whose pyfunc flavor loads through this module, shipped as the
    model's ``code/`` with ``request_pipelines.py``: every request is bounded, then generated as the run
    evaluated (``call_kwargs``).
    ``max_sequence_length`` (the run's ``model.max_sequence_length``) is the pyfunc flavor's model
    configuration (``MLmodel``'s ``config``, which ``load_model(..., model_config=...)`` overrides). The
    ``diffusers`` flavor (``mlflow.diffusers.load_model``) and the folder layout are unchanged.
    (``mlflow_model.log_lora_model`` passes this module to ``Model.log`` as the flavor.)"""
    from pathlib import Path

    import mlflow.diffusers
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.pyfunc import FLAVOR_NAME, MAIN, MODEL_CONFIG

    here = Path(__file__)
    kwargs["code_paths"] = [*(kwargs.get("code_paths") or []), str(here), str(here.with_name("request_pipelines.py"))]
    mlflow.diffusers.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
    mlflow_model.flavors[FLAVOR_NAME][MAIN] = LOADER_MODULE
    if max_sequence_length:
        mlflow_model.flavors[FLAVOR_NAME][MODEL_CONFIG] = {SEQ_LEN: int(max_sequence_length)}
    mlflow_model.save(str(Path(path) / MLMODEL_FILE_NAME))
