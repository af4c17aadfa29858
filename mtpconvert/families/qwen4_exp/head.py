"""The qwen4_exp MTP head, built from mlx-vlm 0.7.10's own qwen4_exp modules with the parameters of its
``Qwen4ExpMTPDraftModel`` (``speculative/drafters/qwen4_exp_mtp/qwen4_exp_mtp.py:31-62``), so the tensors it
loads are the ones that drafter reads:

    a   = fc_embedding(pre_fc_norm_embedding(embed(t+1)))                  [H]
    n   = pre_fc_norm_hidden(h_t)          one RMS norm over all hc streams [hc * H]
    x_k = a + fc_hidden(n_k)               for each stream k                [hc * H]
    y   = decoder_layer(x)                 sparse attention, MoE, hyper-connections, own KV cache
    logits(t+2) = lm_head(hyper_connection_mixer(y))                       (``readout``, then the target's lm_head)

``h_t`` is the backbone's state after its last layer and before its mixer; ``y`` is what a chained draft reads next.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_attention_mask
from mlx_vlm.models.qwen4_exp.language import QSAKVCache, Qwen4ExpDecoderLayer, Qwen4ExpGatedResidual, Qwen4ExpRMSNorm

from .rows import QSARows


class Qwen4ExpHead(nn.Module):
    def __init__(self, text_config, num_layers: int = 1):
        super().__init__()
        H, hc = text_config.hidden_size, text_config.hc_count
        self.hidden_size, self.hc_count = H, hc
        self.pre_fc_norm_embedding = Qwen4ExpRMSNorm(H, eps=text_config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen4ExpRMSNorm(hc * H, eps=text_config.rms_norm_eps)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        # one full (sparse) attention layer without n-gram embeddings, as the drafter builds it
        layer_config = replace(text_config, num_hidden_layers=1, layer_types=["qwen_sparse_attention"],
                               full_attention_interval=1, ple_layer_ids=[])
        self.layers = [Qwen4ExpDecoderLayer(layer_config, layer_idx=0) for _ in range(num_layers)]
        self.hyper_connection_mixer = Qwen4ExpGatedResidual(layer_config, use_combine=False)

    def make_cache(self) -> List[QSAKVCache]:
        return [QSAKVCache() for _ in self.layers]

    def row_cache(self, rows: int) -> list:
        """The batched engine's per-row twin of ``make_cache`` (``rows.QSARows``)."""
        return [QSARows(rows) for _ in self.layers]

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache: Optional[list] = None,
                 step: int = 0) -> mx.array:
        """hidden: the backbone's pre-mixer states [B, L, hc * H]; next_embeddings: embed(t+1) [B, L, H]. Returns
        the head's pre-mixer state (``readout`` gives what lm_head reads)."""
        a = self.fc_embedding(self.pre_fc_norm_embedding(next_embeddings))
        streams = self.pre_fc_norm_hidden(hidden).reshape(*hidden.shape[:-1], self.hc_count, self.hidden_size)
        x = (a[..., None, :] + self.fc_hidden(streams)).reshape(hidden.shape)
        idx = step % len(self.layers)
        c = cache[idx] if cache is not None else None
        if isinstance(c, QSARows):  # each row at its own positions, a padded row's one-token pass masked (rows.py)
            positions, mask = c.positions(x.shape[1]), c.attention_mask(x.shape[1])
        else:
            start = c.offset if c is not None else 0
            positions = (mx.arange(x.shape[1], dtype=mx.int32) + start)[None, :]
            mask = _create_qwen3_5_attention_mask(x, c)
        return self.layers[idx](x, None, mask=mask, cache=c, position_ids=positions)

    def readout(self, state: mx.array) -> mx.array:
        """What the output projection reads of a head state: its mixer over the hc streams."""
        return self.hyper_connection_mixer(state)
