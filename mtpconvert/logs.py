"""Warnings the commands know to be harmless, kept out of their output.

A Qwen3-Next output config carries ``rope_parameters.mrope_section`` (mlx-vlm's drafter config needs
it, docs/transforms.md); transformers' config parser, which the tokenizer loads run, logs it as an
unrecognised key for a default RoPE on every load. The commands silence that one message, and only
for their own process: a library user's logging is left alone.

A run stopped by Ctrl-C or an error abandons the downloads in flight: their daemon threads end with the
process, and meanwhile huggingface_hub's retry loop logs the closed connection ("Retrying in 1s")
after the run's own last line. What an abandoned thread logs through huggingface_hub is dropped.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Iterable

ROPE_LOGGER = "transformers.modeling_rope_utils"


class _MropeSection(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Unrecognized keys in `rope_parameters`" in message and "mrope_section" in message)


def quiet_known_warnings() -> None:
    """Install the filter (idempotent)."""
    logger = logging.getLogger(ROPE_LOGGER)
    if not any(isinstance(f, _MropeSection) for f in logger.filters):
        logger.addFilter(_MropeSection())


class _AbandonedThreads(logging.Filter):
    """Runs in the logging thread: matched by the thread object, not its ident, which a later thread
    may reuse once an abandoned one has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        return threading.current_thread() not in self.threads


_ABANDONED = _AbandonedThreads()


def mute_abandoned(threads: Iterable[threading.Thread]) -> None:
    """Drop what ``threads`` log through huggingface_hub from now on (they were abandoned mid-request)."""
    from huggingface_hub.utils import logging as hub_logging

    _ABANDONED.threads.update(threads)
    for handler in hub_logging.get_logger().handlers:  # configures the library's handler if nothing has yet
        if _ABANDONED not in handler.filters:
            handler.addFilter(_ABANDONED)
