"""The Hugging Face Hub token, read from the environment: a leaf module (no project or torch imports),
so data readers, rewards and model loaders take it from one place."""

from __future__ import annotations

import os


def hf_token() -> str | None:
    """The Hugging Face token from the environment (never logged; see tracking for redaction).

    Returns:
        `str` or `None`: ``$HF_TOKEN``, else ``$HUGGING_FACE_HUB_TOKEN``, else `None` (anonymous access).
    """
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
