"""Execution: stream a plan's items, a row block at a time, through their steps into output shards."""

from .run import ConvertResult, execute

__all__ = ["ConvertResult", "execute"]
