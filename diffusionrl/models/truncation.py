"""Quieting the libraries while an adapter loads (``no_progress_bars``) and encodes (their per-call
prompt-truncation warnings).

diffusers warns on every ``encode_prompt`` call that truncates a prompt, quoting the whole cut-off
text (and transformers once per tokenizer); the adapter drops those records while it encodes and
says it once itself (``FlowAdapter.warn_truncated``).
"""

from __future__ import annotations

import contextlib
import logging

# diffusers' pipeline loggers start their truncation messages like this (SD3, FLUX, ...)
PIPELINE_PREFIX = "The following part of your input"
TOKENIZER_LOG = ("transformers.tokenization_utils_base", "Token indices sequence length is longer")


class DropTruncationWarnings(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix, self.dropped = prefix, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(self.prefix):
            self.dropped += 1
            return False
        return True


@contextlib.contextmanager
def truncation_warnings_dropped(pipeline_logger: str):
    """Drop the truncation records of ``pipeline_logger`` and of the tokenizers; yields the filters
    (logger name -> filter, with ``dropped`` counts)."""
    logs = {pipeline_logger: PIPELINE_PREFIX, TOKENIZER_LOG[0]: TOKENIZER_LOG[1]}
    filters = {name: DropTruncationWarnings(prefix) for name, prefix in logs.items()}
    for name, quiet in filters.items():
        logging.getLogger(name).addFilter(quiet)
    try:
        yield filters
    finally:
        for name, quiet in filters.items():
            logging.getLogger(name).removeFilter(quiet)


@contextlib.contextmanager
def no_progress_bars():
    """Inside: diffusers' and transformers' own tqdm bars are off ("Loading pipeline components",
    "Loading weights", "Writing model shards"): several bars per load or save, on every run, for
    steps that take milliseconds with the tiny models and say nothing a log line would not. Hub
    downloads (huggingface_hub's bars) keep theirs. The previous settings come back on exit."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    was = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for m, _ in was:
        m.disable_progress_bar()
    try:
        yield
    finally:
        for m, enabled in was:
            if enabled:
                m.enable_progress_bar()
