"""The training data: prompt sources and their split, the built-in prompt worlds, SFT image pairs.

- ``prompts``: ``load_prompts`` (sources, validation, the deterministic train/test split),
  ``source_fingerprint``, ``PromptSampler`` (which prompts a step uses);
- ``images``: the input images of editing rows (``image``: path, URI or bytes), read, checked and decoded;
- ``readers``: the ``.txt`` / ``.jsonl`` / ``.parquet`` readers and ``PromptDataError``;
- ``objects``, ``ocr``, ``shapes``: the built-in prompt generators (``builtin:objects``,
  ``builtin:ocr``, ``builtin:shapes``; ``shapes`` also draws the world's scenes);
- ``shape_edits``: image-edit rows in the shapes world (``builtin:shape-edits[:N]``: instruction, source
  image, source and expected target scenes);
- ``image_pairs``: (prompt, image) pairs for supervised fine-tuning (``algorithm.sft_source``).

The loaders and the error are re-exported here; the shapes world's and OCR generator's own
names are imported from their modules.
"""

from .image_pairs import check_sft_source, load_image_pairs, shape_pairs
from .objects import generate_object_prompts
from .ocr import generate_ocr_prompts
from .prompts import (
    BUILTIN_SOURCES,
    PromptSampler,
    PromptSet,
    load_prompts,
    rows_digest,
    source_fingerprint,
    split_rows,
)
from .readers import PromptDataError, read_file
from .shapes import generate_shape_prompts

__all__ = [
    "BUILTIN_SOURCES", "PromptDataError", "PromptSampler", "PromptSet", "check_sft_source", "generate_object_prompts",
    "generate_ocr_prompts", "generate_shape_prompts", "load_image_pairs", "load_prompts", "read_file", "rows_digest",
    "shape_pairs", "source_fingerprint", "split_rows",
]
