"""The glm5_next nextn head, built from mlx-vlm 0.7.10's own modules with the parameters of its
``Glm5NextMTPDraftModel`` (``speculative/drafters/glm5_next_mtp/glm5_next_mtp.py:21-191``), so the tensors it
loads are the ones that drafter reads:

    e   = embed(t+1), zero at position 0                       (the drafter's DeepSeek-MTP convention)
    x   = eh_proj(concat[enorm(e), hnorm(h_t)])                 [H]
    x   = mtp_block(x)                                         sparse attention (own indexer), MoE, own cache
    logits(t+2) = lm_head(shared_head_norm(x))                  (the backbone's lm_head)

``h_t`` is the backbone's post-norm hidden (the mean of its hyper-connection streams, then the final norm); the
head's output state is what a chained draft reads next. Its stored tensors (``language_model.model.layers.{N}.X``
in the sidecar) become its parameters as mlx-vlm's splitter and drafter make them (``head_weights``).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import CacheList, KVCache, PoolingCache
from mlx_vlm.speculative.drafters.glm5_next_mtp.glm5_next_mtp import Glm5NextMTPBlock, Glm5NextMTPDraftModel
from mlx_vlm.speculative.drafters.glm5_next_mtp.split import Glm5NextMTPSplitter


def head_weights(text_config, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """The head's stored tensors (names after ``layers.{N}.``) under its parameters' names: mlx-vlm's splitter's
    renaming, then its drafter's sanitize (``q_a_proj`` + ``kv_a_proj_with_mqa`` and the shared expert's
    ``gate_proj`` + ``up_proj`` concatenated; quantized ones with their scales and biases)."""
    prefix = f"layers.{text_config.num_hidden_layers}."
    renamed = Glm5NextMTPSplitter().rename({prefix + k: v for k, v in weights.items()},
                                           {"num_hidden_layers": text_config.num_hidden_layers})
    return Glm5NextMTPDraftModel.sanitize(SimpleNamespace(args=text_config), renamed)


class Glm5NextHead(nn.Module):
    def __init__(self, text_config):
        super().__init__()
        n, H, eps = text_config.num_hidden_layers, text_config.hidden_size, text_config.rms_norm_eps
        self.text_config = text_config
        # the nextn layer as the drafter builds it: one more sparse-attention layer with its own indexer and a MoE
        layer_config = replace(text_config, num_hidden_layers=n + 1,
                               layer_types=[*text_config.layer_types, "deepseek_sparse_attention"],
                               mlp_layer_types=[*text_config.mlp_layer_types, "sparse"],
                               indexer_types=[*text_config.indexer_types, "full"])
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.mtp_block = Glm5NextMTPBlock(layer_config, n)
        self.shared_head_norm = nn.RMSNorm(H, eps=eps)

    @property
    def layers(self) -> list:
        """One decoder layer (speculative decoding counts these; the MLP-gain check swaps its ``mlp``)."""
        return [self.mtp_block]

    def make_cache(self) -> List[CacheList]:
        kpool = self.mtp_block.self_attn.indexer.index_kpool
        return [CacheList(KVCache(), KVCache(), PoolingCache(kpool), KVCache())]

    def row_cache(self, rows: int) -> list:
        """The batched engine's per-row twin of ``make_cache`` (``rows.SparseRows``)."""
        from .rows import SparseRows

        return [SparseRows(rows, self.mtp_block.self_attn.indexer.index_kpool)]

    def readout(self, state: mx.array) -> mx.array:
        """What the output projection reads of a head state: the state itself (``shared_head_norm`` is applied)."""
        return state

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: Optional[list] = None,
                 step: int = 0) -> mx.array:
        """hidden: the backbone's post-norm states h_t [B, L, H]; next_embeddings: embed(t+1) [B, L, H]. Returns the
        head's state after ``shared_head_norm``."""
        c = cache[0] if cache is not None else None
        start = c[0].offset if c is not None else 0  # per row (an array) in the batched engine's row caches
        positions = mx.arange(next_embeddings.shape[1]) + (start[:, None] if isinstance(start, mx.array) else start)
        e = mx.where((positions == 0)[..., None], 0, next_embeddings)
        x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(hidden)], axis=-1))
        return self.shared_head_norm(self.mtp_block(x, c))
