"""Per-row caches of a glm5_next model for the batched engine (``runtime.decoding.batched``): rows of different
lengths, each pass undone per row.

mlx-vlm's glm5_next layers read their caches as a batch whose rows all end at the same position (its own batches are
left-padded): the sparse attention's indexer takes a row's first key as its first valid one, pools keys in windows
of ``index_kpool`` from there, and places every query at ``keys - queries + i``. So the rows here are right-aligned
too, row r holding its tokens at ``[pad_r, size)``, and no position is ever needed otherwise (the attention and
its indexer have no RoPE: a row's keys may sit anywhere as long as their order is kept).

``SparseRows``  one sparse-attention layer (the backbone's, or the head's): the MLA latents; where the layer has
    an indexer of its own, the indexer's raw keys and gates, whose pools are computed afresh from them at every
    pass (``_compress_pools`` of every complete window from ``pad_r``: the values mlx-vlm's ``PoolingCache`` computes
    window by window, with nothing pooled to take back when a row is cut), and its key validity (``pad_r`` on);
    mlx-vlm's projected-key cache is never matched (``size`` -1), so a long pass projects the latents it reads.
    A row is cut (``trim_rows``) by shifting it right by what it drops beyond the batch's common cut: its dropped
    positions become its padding, as mlx-vlm's ``BatchKVCache.finalize`` rolls a ragged tail.
A linear-attention layer keeps mlx-vlm's ``ArraysCache`` (``runtime.vlm_rows.RowArraysCache``).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ...runtime.vlm_rows import RightAlignedRows


class SparseRows(RightAlignedRows):
    """One sparse-attention layer's caches for B rows (module doc), indexed as the layer indexes mlx-vlm's
    ``CacheList``: [latents, validity, pools, projected] with an indexer of its own, [latents, projected] without."""

    # the latents [B, 1, size, kv_lora_rank]; the indexer's raw keys [B, size, index_head_dim] and gates
    ARRAYS = (("latent", 2), ("index_keys", 1), ("index_gates", 1))

    def __init__(self, rows: int, index_kpool: Optional[int]):
        super().__init__(rows)
        self.kpool = index_kpool
        self.caches = [_Latents(self), _Validity(self), _Pools(self), _NoProjection()] if index_kpool else \
            [_Latents(self), _NoProjection()]

    def __getitem__(self, i):
        return self.caches[i]

    def pool_counts(self) -> List[int]:
        return [(self.size - p) // self.kpool for p in self.pad]


class _Latents:
    """The layer's latent cache: written first in a pass, it advances the rows."""

    def __init__(self, owner: SparseRows):
        self.owner = owner

    @property
    def offset(self):
        return self.owner.offset

    def update_and_fetch(self, latent: mx.array, _values: mx.array):
        o = self.owner
        o.size += latent.shape[2]
        return o.append("latent", latent, 2), _values


class _Validity:
    """The indexer's key-validity cache: a row's keys are valid from its padding on."""

    def __init__(self, owner: SparseRows):
        self.owner = owner

    def update_and_fetch(self, _query_valid: mx.array, _values: mx.array):
        # every query of a pass is a row's token (the engine passes no padding mask)
        return self.owner.validity()[:, None, :, None], _values


class _Pools:
    """The indexer's pooled keys, computed from every row's complete windows at each pass (module doc)."""

    def __init__(self, owner: SparseRows):
        self.owner = owner

    @property
    def offset(self) -> mx.array:
        return mx.array(self.owner.pool_counts())

    def accumulate_windows(self, keys: mx.array, gates: mx.array, _offset):
        o = self.owner
        o.append("index_keys", keys, 1)
        o.append("index_gates", gates, 1)
        windows = max(o.pool_counts()) * o.kpool
        at = mx.minimum(mx.array(o.pad)[:, None] + mx.arange(windows)[None], max(o.size - 1, 0))[..., None]
        return (mx.take_along_axis(o.index_keys, at, axis=1), mx.take_along_axis(o.index_gates, at, axis=1), None)

    def update_and_fetch(self, pooled: mx.array) -> mx.array:
        return pooled


class _NoProjection:
    """mlx-vlm's projected-key cache, never matched: a long pass projects the latents it reads."""

    def size(self) -> int:
        return -1
