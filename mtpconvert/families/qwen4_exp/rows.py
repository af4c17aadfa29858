"""Per-row caches of a qwen4_exp model for the batched engine (``runtime.decoding.batched``): rows of different
lengths, each pass undone per row.

mlx-vlm's QSA attention (``models/qwen4_exp/language.py``) reads a batch as its left-padded ``BatchQSAKVCache``
holds it: every row ends at the same physical position, ``left_padding`` says where each row begins, and its indexer
counts a row's blocks from there (``block_starts = left_padding + block * compress_ratio``), places each query at
``index_offset + i`` and masks what lies before the row (``build_mask``). So the rows here are right-aligned too
(``runtime.vlm_rows.RightAlignedRows``), row r holding at ``[pad_r, size)`` its keys and values, the indexer's raw
keys and the positions they were rotated at (each row's own, from 0: the adapter passes them), and a row is cut by
shifting it right. The indexer's pooled blocks are never kept (``index_block_keys`` reads None): every pass pools them
again from the raw keys, the values mlx-vlm's own cache would hold, with nothing pooled to take back when a row is cut.

What mlx-vlm's left-padded batch does otherwise than a row alone is its one-token pass: a batch with a padded row
asks its layers for the string mask ``"left_padded_decode"`` (``qwen3_5/language.py``
``_create_qwen3_5_attention_mask``), into which the QSA attention cannot fold the mask of the blocks its indexer
selected (``Qwen4ExpBatchInvariantForward._qsa_attention`` and ``Qwen4ExpAttention`` combine it with None, "causal"
or an array only), and the ragged dense attention it leads to reads every key of the row: once a row's indexer
selects blocks, its padded one-token step attends to keys the row alone would not. ``attention_mask`` gives the
layers of a one-token pass over padded rows the rows' key validity instead, an array, with which the QSA mask is
combined (the adapter's ``forward`` and the head pass it). On the CPU, MLX's attention over a row's keys with
positions masked before them equals the attention over that row alone, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...runtime.vlm_rows import RightAlignedRows


class QSARows(RightAlignedRows):
    """One QSA attention layer's caches for B rows (module doc), read as mlx-vlm's layers read ``BatchQSAKVCache``."""

    # keys and values [B, kv_heads, size, head_dim]; the indexer's raw keys [B, size, index_head_dim] and the
    # (text) positions they were rotated at [B, size]
    ARRAYS = (("keys", 2), ("values", 2), ("index_keys", 1), ("index_position_ids", 1))

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self.pad, dtype=mx.int32)

    @property
    def index_offset(self) -> int:
        """The position the pass's first query takes in every row (the common end)."""
        return self.size

    # the indexer's pooled blocks, which mlx-vlm caches between passes of unpadded rows: never kept (module doc)
    @property
    def index_block_keys(self):
        return None

    @index_block_keys.setter
    def index_block_keys(self, _value) -> None:
        pass

    @property
    def index_block_ratio(self):
        return None

    @index_block_ratio.setter
    def index_block_ratio(self, _value) -> None:
        pass

    def clear_index_blocks(self) -> None:
        pass

    def positions(self, length: int) -> mx.array:
        """The positions of a pass of ``length`` tokens in every row: each row's own [B, length]."""
        return mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(length, dtype=mx.int32)[None]

    def attention_mask(self, length: int):
        """The mask a pass of ``length`` tokens gives its attention layers: mlx-vlm's own where no row is padded
        (None for one token: dense attention, or the indexer's mask) or the pass is longer (``"causal"``: the
        indexer's mask then marks each row's keys from its first); for one token over padded rows, the rows' key
        validity [B, 1, 1, size + 1] (module doc)."""
        if length > 1:
            return "causal"
        if not any(self.pad):
            return None
        return mx.concatenate([self.validity(), mx.ones((len(self.pad), 1), dtype=mx.bool_)], axis=1)[:, None, None]

    # what the layers write

    def update_indexer(self, keys: mx.array, position_ids: mx.array):
        if position_ids.ndim != 2:
            raise ValueError(f"per-row QSA caches hold text positions [B, L], got {position_ids.shape}")
        return self.append("index_keys", keys, 1), self.append("index_position_ids", position_ids, 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.size += keys.shape[2]
        return self.append("keys", keys, 2), self.append("values", values, 2)


def is_rows(cache: Optional[list]) -> bool:
    return cache is not None and any(isinstance(c, QSARows) for c in cache)
