"""diffusionrl: RL fine-tuning of flow-matching image models (README.md, docs/architecture.md).

One thing happens at import, before any submodule can import diffusers: transformers 5, without
torchvision (which this project does not need), answers ``from transformers import
CLIPImageProcessor`` (diffusers' IP-adapter loader does that, and ``SiglipImageProcessor``, on
every pipeline import) with the Pillow processor and a warning per class, two lines on every run
that ask the user to install or import something they never asked for. Those two records, and only
those, are dropped by a filter on the logger that writes them, so transformers is not imported here
and its other warnings still show.
"""

from __future__ import annotations

import logging


def _not_the_pil_fallback_notice(record: logging.LogRecord) -> bool:
    return "requires torchvision (not installed); falling back to" not in str(record.msg)


logging.getLogger("transformers.utils.import_utils").addFilter(_not_the_pil_fallback_notice)
