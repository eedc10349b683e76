"""Model-family adapters. ``load_adapter(cfg.model)`` picks the family of a reference
(``models/families.py``: a builtin name, or ``_class_name`` of the folder's or hub's ``model_index.json``)."""

from __future__ import annotations

from diffusionrl.hub import hf_token

from .base import FlowAdapter, module_digest, resolve_device
from .families import ADAPTERS, adapter_class, load_adapter, load_pipeline, pipeline_class_of, save_builtin
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinAdapter
from .flux_kontext import FluxKontextAdapter
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import QwenImageEditAdapter, QwenImageEditV1Adapter
from .sd3 import SD3Adapter
from .tiny import TINY_REF, build_tiny_sd3_pipeline, save_tiny_sd3
from .tiny_flux import TINY_FLUX_KONTEXT_REF, TINY_FLUX_REF, build_tiny_flux_kontext_pipeline, build_tiny_flux_pipeline
from .tiny_flux2 import TINY_FLUX2_KLEIN_REF, TINY_FLUX2_REF, build_tiny_flux2_klein_pipeline, build_tiny_flux2_pipeline
from .tiny_qwen_image import TINY_QWEN_IMAGE_REF, build_tiny_qwen_image_pipeline
from .tiny_qwen_image_edit import (
    TINY_QWEN_IMAGE_EDIT_REF,
    TINY_QWEN_IMAGE_EDIT_V1_REF,
    build_tiny_qwen_image_edit_pipeline,
    build_tiny_qwen_image_edit_v1_pipeline,
)
from .tiny_wan import TINY_WAN22_REF, TINY_WAN_REF, build_tiny_wan22_pipeline, build_tiny_wan_pipeline
from .tiny_zimage import TINY_ZIMAGE_REF, build_tiny_zimage_pipeline
from .wan import WanAdapter, WanExperts
from .zimage import ZImageAdapter

__all__ = [
    "ADAPTERS",
    "FlowAdapter",
    "Flux2Adapter",
    "Flux2KleinAdapter",
    "FluxAdapter",
    "FluxKontextAdapter",
    "QwenImageAdapter",
    "QwenImageEditAdapter",
    "QwenImageEditV1Adapter",
    "SD3Adapter",
    "TINY_FLUX2_KLEIN_REF",
    "TINY_FLUX2_REF",
    "TINY_FLUX_KONTEXT_REF",
    "TINY_FLUX_REF",
    "TINY_QWEN_IMAGE_EDIT_REF",
    "TINY_QWEN_IMAGE_EDIT_V1_REF",
    "TINY_QWEN_IMAGE_REF",
    "TINY_REF",
    "TINY_WAN22_REF",
    "TINY_WAN_REF",
    "TINY_ZIMAGE_REF",
    "WanAdapter",
    "WanExperts",
    "ZImageAdapter",
    "adapter_class",
    "build_tiny_flux2_klein_pipeline",
    "build_tiny_flux2_pipeline",
    "build_tiny_flux_kontext_pipeline",
    "build_tiny_flux_pipeline",
    "build_tiny_qwen_image_edit_pipeline",
    "build_tiny_qwen_image_edit_v1_pipeline",
    "build_tiny_qwen_image_pipeline",
    "build_tiny_sd3_pipeline",
    "build_tiny_wan22_pipeline",
    "build_tiny_wan_pipeline",
    "build_tiny_zimage_pipeline",
    "hf_token",
    "load_adapter",
    "load_pipeline",
    "module_digest",
    "pipeline_class_of",
    "resolve_device",
    "save_builtin",
    "save_tiny_sd3",
]
