"""The served image model's signature: prompt (and, for an editing model, an optional input image) ->
PNG bytes, this run's evaluation settings as the generation params' defaults, within ``request_limits.LIMITS``."""

from __future__ import annotations


def image_params(cfg, family=None) -> dict:
    """The served image model's generation params: this run's evaluation settings, which must lie
    within ``request_limits.LIMITS`` (a model whose own defaults it would refuse is not logged). The
    guidance scale is the stock pipeline's argument (``family.served_guidance``: Z-Image counts from 0)."""
    from .request_limits import check_params

    res = cfg.sampling.eval_resolution or cfg.sampling.resolution  # evaluation.eval_resolution
    guidance = float(cfg.eval.guidance_scale if family is None else family.served_guidance(cfg.eval.guidance_scale))
    params = {"num_inference_steps": cfg.eval.num_steps, "guidance_scale": guidance,
              "height": res, "width": res, "negative_prompt": cfg.sampling.negative_prompt}
    return check_params(params, where="the served model's defaults (eval.num_steps, eval.guidance_scale, "
                                      "sampling.eval_resolution, sampling.negative_prompt)")


def model_signature(cfg, family=None):
    """prompt -> PNG bytes; generation params default to this run's evaluation settings. ``ParamSpec``
    has no bounds: ``predict`` checks them (``request_limits``; the model's ``request_limits`` metadata)."""
    from mlflow.models import ModelSignature
    from mlflow.types import DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import ColSpec

    types = {int: DataType.integer, float: DataType.double, str: DataType.string}
    inputs = [ColSpec(type=DataType.string, name="prompt")]
    if getattr(family, "editing", False):  # the image to edit (encoded bytes; base64 in JSON)
        inputs.append(ColSpec(type=DataType.binary, name="image", required=False))
    return ModelSignature(
        inputs=Schema(inputs),
        outputs=Schema([ColSpec(type=DataType.binary, name="image")]),
        params=ParamSchema([ParamSpec(name=k, dtype=types[type(v)], default=v)
                            for k, v in image_params(cfg, family).items()]),
    )
