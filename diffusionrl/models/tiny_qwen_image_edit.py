"""``builtin:tiny-qwen-image-edit``: a small Qwen-Image-Edit pipeline (diffusers ``QwenImageEditPlusPipeline``)
built in code, no download, no torchvision.

The parts of ``builtin:tiny-qwen-image`` (``models/tiny_qwen_image.py``: the QwenImage transformer, the causal
video VAE, the scheduler with Qwen-Image's dynamic shift) at their own seeds, and what editing adds:
- Qwen2_5_VLForConditionalGeneration whose one-block vision tower now runs: the input image goes through it
  (14-px patches, 2x2 merged, temporal patch 2) and its tokens take the ``<|image_pad|>`` positions of the
  prompt; the config's image, video and vision start/end token ids are the tiny tokenizer's.
- The tokenizer: the byte-level BPE of ``build_qwen_tokenizer`` with the vision markers as special tokens and
  the edit template's pieces as added tokens, so the template's prefix is 64 tokens, as with the real
  tokenizer (the pipeline drops exactly 64 leading positions; ``check_template_prefix``).
- The processor: transformers' ``Qwen2VLProcessor`` with the PIL image processor (``Qwen2VLImageProcessorPil``)
  and no video processor. Stock ``Qwen2VLProcessor`` refuses ``video_processor=None`` where torchvision is not
  installed (``ProcessorMixin.check_argument_for_proper_class`` looks the video processor's base class up in
  ``VIDEO_PROCESSOR_MAPPING``, a torchvision dummy); ``ImageOnlyQwen2VLProcessor`` accepts None there and is
  otherwise the stock class (the pipeline never passes videos). It saves and loads its tokenizer and image
  processor only, so ``models.save_builtin`` writes a folder that ``QwenImageEditPlusPipeline.from_pretrained``
  loads without torchvision (``model_index.json`` names this module's ``ImageOnlyQwen2VLProcessor``).

``builtin:tiny-qwen-image-edit-v1`` is the same components in Qwen-Image-Edit's first release's pipeline
(``QwenImageEditPipeline``): the same weights, so the two pipelines' differences (the template, the size the VL
encoder sees the image at) are all that tells their edits apart. Both templates' system prefix is the same 64
tokens.
"""

from __future__ import annotations

import functools
import os

import torch

from .tiny import TINY_SEED, decoder_text_config, frozen
from .tiny_qwen_image import SPECIAL, build_qwen_tokenizer, build_tiny_qwen_image_components, check_template_prefix

TINY_QWEN_IMAGE_EDIT_REF = "builtin:tiny-qwen-image-edit"
TINY_QWEN_IMAGE_EDIT_V1_REF = "builtin:tiny-qwen-image-edit-v1"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# QwenImageEditPlusPipeline's template prefix cut into the real tokenizer's pre-tokens (one token each there):
# the words, punctuation and "'s" pieces; "\n" is one byte symbol already.
EDIT_TEMPLATE_WORDS = ["system", "user", "Describe", "color", "'s", "),", " (", ",", ".", " Generate"] + [
    " " + w for w in ("the key features of input image shape size texture objects background then explain how "
                      "user text instruction should alter or modify a new that meets requirements while maintaining "
                      "consistency with original where appropriate").split()]


@functools.cache
def image_only_processor_class():
    """``Qwen2VLProcessor`` accepting ``video_processor=None`` without torchvision (see the module docstring),
    built on first use (transformers is imported then); the module's ``ImageOnlyQwen2VLProcessor``, which is
    where diffusers' ``from_pretrained`` finds it (``model_index.json`` names this module and class).

    Saved as its tokenizer's files and its image processor's ``preprocessor_config.json``, and loaded from
    them (``from_pretrained``), so a saved pipeline folder loads without building a video processor."""
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return type(None)
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs):
            os.makedirs(save_directory, exist_ok=True)
            self.tokenizer.save_pretrained(save_directory)
            self.image_processor.save_pretrained(save_directory)
            return [str(save_directory)]

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
            where = {k: kwargs[k] for k in ("cache_dir", "local_files_only", "revision", "token") if k in kwargs}
            return cls(image_processor=Qwen2VLImageProcessorPil.from_pretrained(pretrained_model_name_or_path, **where),
                       tokenizer=Qwen2Tokenizer.from_pretrained(pretrained_model_name_or_path, **where),
                       video_processor=None)

    ImageOnlyQwen2VLProcessor.__module__ = __name__
    ImageOnlyQwen2VLProcessor.__qualname__ = "ImageOnlyQwen2VLProcessor"
    return ImageOnlyQwen2VLProcessor


def __getattr__(name: str):
    """Lazy module attributes: the processor class, and its base ``ProcessorMixin``, which diffusers looks up
    in a component's module to pick its load method (as if imported here)."""
    if name == "ImageOnlyQwen2VLProcessor":
        return image_only_processor_class()
    if name == "ProcessorMixin":
        from transformers import ProcessorMixin

        return ProcessorMixin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_tiny_qwen_image_edit_components() -> dict:
    """All components of a tiny Qwen-Image-Edit pipeline, in eval mode, fp32, CPU."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_qwen_tokenizer(EDIT_TEMPLATE_WORDS, SPECIAL + VISION_TOKENS)
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(VISION_TOKENS)))
    components = build_tiny_qwen_image_components()  # transformer, VAE, scheduler (their seeds); new text encoder
    torch.manual_seed(TINY_SEED + 24)
    components["text_encoder"] = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=decoder_text_config(len(tok), 32, 2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        **ids,
    ))
    processor = image_only_processor_class()(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok,
                                             video_processor=None)
    return frozen({**components, "tokenizer": tok, "processor": processor})


def _tiny_edit_pipeline(pipeline_class: str):
    """The tiny components in diffusers' ``pipeline_class``, its template prefix checked."""
    import diffusers

    pipe = getattr(diffusers, pipeline_class)(**build_tiny_qwen_image_edit_components())
    check_template_prefix(pipe)
    return pipe


def build_tiny_qwen_image_edit_pipeline():
    return _tiny_edit_pipeline("QwenImageEditPlusPipeline")


def build_tiny_qwen_image_edit_v1_pipeline():
    return _tiny_edit_pipeline("QwenImageEditPipeline")
