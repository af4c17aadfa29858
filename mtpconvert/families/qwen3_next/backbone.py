"""How the runtime drives a Qwen3-Next backbone (``mlx_lm.models.qwen3_next``): Qwen3.5's, with its fused-projection
GatedDeltaNet."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from ...runtime.decoding.rollback import RecordingGatedDelta
from ..qwen3_5.backbone import Qwen35Backbone


class RecordingNextGatedDeltaNet(RecordingGatedDelta, Qwen3NextGatedDeltaNet):
    """Qwen3-Next's GatedDeltaNet (fused in_proj_qkvz / in_proj_ba, mlx-lm's own reordering)."""

    def _project(self, inputs: mx.array):
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(inputs), self.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a


class Qwen3NextBackbone(Qwen35Backbone):
    recording = {Qwen3NextGatedDeltaNet: RecordingNextGatedDeltaNet}
