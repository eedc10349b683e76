"""How the served image model calls its pipeline (``request_limits.BoundedDiffusers``): the input image's size,
the pipelines that only edit or guide by true CFG, a pipeline call that encodes the input image at the output's
area (``area_bound_call``), the true-CFG arguments, PNG bytes.

Shipped beside ``request_limits.py`` as the registered model's code (``request_limits.save_model``), so, as that
module, it imports only the standard library (torch, which diffusers needs, inside ``area_bound_call``)."""

from __future__ import annotations

from typing import Any


def reference_size(height: int, width: int, area: int, multiple: int = 16) -> tuple[int, int]:
    """Where an editing model's input image is encoded: its aspect at ``area`` pixels, in whole
    ``multiple``-pixel patches (``models/flux_kontext.FluxKontextAdapter.reference_size``, as trained)."""
    aspect = width / height
    w = round((area * aspect) ** 0.5) // multiple * multiple
    h = round((area / aspect) ** 0.5) // multiple * multiple
    return max(h, multiple), max(w, multiple)


# Pipelines that only edit: their ``__call__`` reads the input image's size first (no prompt-only generation).
IMAGE_REQUIRED = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
# Pipelines whose guidance is true CFG (``true_cfg_scale``)
TRUE_CFG = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
# FLUX.1's pipelines take a ``true_cfg_scale`` too, besides the distilled ``guidance_scale``: it is their guidance
# where the transformer has no guidance embedding (FLUX.1 [schnell], the shapes edit model), as the adapter samples
FLUX_TRUE_CFG = ("FluxPipeline", "FluxKontextPipeline")
VAE_AREA = "VAE_IMAGE_SIZE"  # QwenImageEditPlusPipeline's module constant: the area its input image is encoded at
# QwenImageEditPipeline's size rule: its __call__ calls it once, as calculate_dimensions(1024 * 1024, aspect), for
# the size its input image is resized to (the VL encoder and the VAE both take that image)
AREA_RULE = "calculate_dimensions"


def area_bound_call(pipeline, area: int):
    """``pipeline.__call__`` with the input image encoded at ``area`` pixels (at its aspect), for a pipeline that
    encodes it at a fixed area whatever the output's size (QwenImageEditPlusPipeline: its module's
    ``VAE_IMAGE_SIZE``, 1024^2; QwenImageEditPipeline: ``calculate_dimensions(1024 * 1024, ...)`` in the call);
    None for one whose request sizes it (Kontext: resized to ``reference_size`` beforehand).

    The LoRA was trained with the input image at the output's area (``models/qwen_image_edit.py``: the
    sampling resolution's), so the served edit encodes it there too. This is the stock function (its code,
    defaults and closure, under ``torch.no_grad`` as the method is) over a copy of its module's globals in which
    ``VAE_IMAGE_SIZE`` is ``area``, or (the first release's pipeline, which has no such constant) in which
    ``calculate_dimensions`` sizes for ``area`` whatever area it is asked: nothing is patched, so the module,
    other pipelines and concurrent requests keep the stock value. The input image goes to it as sent (the
    pipeline resizes it once, as the adapter does)."""
    import functools
    import inspect
    import types

    import torch

    fn = inspect.unwrap(type(pipeline).__call__)  # the function under torch.no_grad's wrapper
    names = fn.__code__.co_names
    if VAE_AREA in names:  # the Plus pipeline also calls calculate_dimensions, for its VL image's fixed 384^2
        bound = {VAE_AREA: int(area)}
    elif AREA_RULE in names:
        rule = fn.__globals__[AREA_RULE]
        bound = {AREA_RULE: lambda _fixed_area, ratio: rule(int(area), ratio)}
    else:
        return None
    call = types.FunctionType(fn.__code__, {**fn.__globals__, **bound}, fn.__name__, fn.__defaults__, fn.__closure__)
    call.__kwdefaults__ = fn.__kwdefaults__
    return functools.partial(torch.no_grad()(call), pipeline)


def takes_true_cfg(pipeline) -> bool:
    """Whether ``pipeline`` guides by true CFG (``TRUE_CFG``, or a ``FLUX_TRUE_CFG`` one without a guidance
    embedding), so that ``true_cfg`` maps the request's guidance."""
    name = type(pipeline).__name__
    if name in TRUE_CFG:
        return True
    config = getattr(getattr(pipeline, "transformer", None), "config", None)
    return name in FLUX_TRUE_CFG and config is not None and not config.get("guidance_embeds", True)


def true_cfg(kwargs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The guidance arguments of a true-CFG pipeline (``takes_true_cfg``: Qwen-Image's ``true_cfg_scale``; its
    ``guidance_scale`` is a guidance-distilled model's, which it ignores): the ``guidance_scale`` param as
    ``true_cfg_scale``, and above 1 the ``negative_prompt`` param as it is, "" included (the pipeline guides
    only when given a negative prompt; the adapter always gives one: ``QwenImageAdapter.pipeline_kwargs``)."""
    if "guidance_scale" not in params:
        return kwargs  # the pipeline's own default
    out = {k: v for k, v in kwargs.items() if k not in ("guidance_scale", "negative_prompt")}
    out["true_cfg_scale"] = float(params["guidance_scale"])
    if out["true_cfg_scale"] > 1:
        out["negative_prompt"] = params.get("negative_prompt") or ""
    return out


def png(image) -> bytes:
    """PNG bytes of the pipeline's PIL image. The served code's own encoder, not ``video.png_bytes``: this module
    ships in the registered model without the diffusionrl package."""
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
