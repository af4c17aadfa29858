"""How the runtime drives a GLM backbone as mlx-lm builds it (``glm4_moe_lite``, ``glm_moe_dsa``, ``glm4_moe``):
attention layers only, mlx-lm's own forward and caches (KVCache, or GLM-5's CacheList with its indexer keys),
and the nextn head, whose block is the backbone's decoder layer at the nextn index."""

from __future__ import annotations

import mlx.nn as nn

from ...runtime.backbone import TextModelBackbone
from ...runtime.decoding.heads import NextNHead


class GlmBackbone(TextModelBackbone):
    def make_head(self, num_layers: int) -> nn.Module:
        # the decoder layer at the nextn layer's index: mlx-lm then builds its MoE block
        return NextNHead(self.new_layer(self.args.num_hidden_layers), self.hidden_size, self.rms_norm_eps,
                         self.vocab_size, own_vocab="lm_head" not in self.family.head.shares,
                         new_cache=lambda: self.make_cache()[-1])
