"""Warnings the commands know to be harmless, kept out of their output.

A Qwen3-Next output config carries ``rope_parameters.mrope_section`` (mlx-vlm's drafter config needs
it, docs/transforms.md); transformers' config parser, which the tokenizer loads run, logs it as an
unrecognised key for a default RoPE on every load. The commands silence that one message, and only
for their own process: a library user's logging is left alone.
"""

from __future__ import annotations

import logging

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
