"""How the runtime drives a qwen4_exp backbone as mlx-vlm 0.7.10 builds it (``models/qwen4_exp``).

The model runs as mlx-vlm runs it: ``forward`` is its own language model asked for the hidden state its drafter
reads (``return_hidden``: the last layer's output before the hyper-connection mixer, ``language.py:2076-2086``),
the mixer and ``lm_head`` make the logits (``readout``, ``project``). A pass is undone with mlx-vlm's own
speculative cache transaction (``speculative/cache_state.py``): its caches record, during a pass of a few tokens,
the recurrent states and causal windows after every position (the GatedDeltaNet's, the n-gram embedding's conv
and token history) and keep those of the accepted prefix on commit; its sparse-attention caches are trimmed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_ssm_mask
from mlx_vlm.models.qwen4_exp.language import Qwen4ExpDecoderLayer, _create_qwen4_exp_attention_mask
from mlx_vlm.speculative.cache_state import start_speculative_cache

from ...families.base import Family
from ...runtime.backbone import Backbone
from .head import Qwen4ExpHead


class UndoableCaches(list):
    """mlx-vlm's caches of one sequence, with a speculative transaction over each pass of at most ``max_pass``
    tokens (``Qwen4ExpBackbone.forward`` starts it, ``rollback`` commits the kept prefix)."""

    def __init__(self, caches: list, max_pass: int):
        super().__init__(caches)
        self.max_pass = max_pass
        self.transaction = None


class Qwen4ExpBackbone(Backbone):
    @classmethod
    def load(cls, path: Path, family: Family, lazy: bool = False) -> "Qwen4ExpBackbone":
        from mlx_vlm.utils import load_model

        path = Path(path)
        model = load_model(path, lazy=lazy)
        return cls(model, family, json.loads((path / "config.json").read_text()))

    @classmethod
    def shell(cls, path: Path, family: Family) -> "Qwen4ExpBackbone":
        """The model as mlx-vlm's ``load_model`` builds it before it loads weights (``utils.py:363-460``)."""
        from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

        path = Path(path)
        config = load_config(path)
        model_class, _ = get_model_and_args(config=config, model_path=path)
        for key in ("text_config", "vision_config", "audio_config"):
            config.setdefault(key, {})
        model_config = model_class.ModelConfig.from_dict(config)
        model_config = update_module_configs(model_config, model_class, config,
                                             ["text", "vision", "perceiver", "projector", "audio"])
        return cls(model_class.Model(model_config), family, config)

    def sanitize(self, weights):
        """What mlx-vlm's loader does to stored weights: the model's sanitize, then its language model's."""
        from mlx_vlm.utils import sanitize_weights

        weights = sanitize_weights(self.model, weights)
        return sanitize_weights(type(self.text), weights, self.args)

    @property
    def text(self) -> nn.Module:
        return self.model.language_model

    @property
    def args(self):
        return self.text.args

    def is_recurrent(self, layer: nn.Module) -> bool:
        return layer.is_linear

    # a token's path: the embedding repeated on every hyper-connection stream, the layers, no final norm (the
    # head reads the streams), the mixer, lm_head

    def lift(self, embedded: mx.array) -> mx.array:
        return mx.tile(embedded, (1, 1, self.args.hc_count))

    def run_layer(self, layer: nn.Module, x: mx.array, tokens: mx.array, cache=None) -> mx.array:
        """One layer over a whole sequence from its first token (the layerwise check's cacheless pass)."""
        positions = self.text.get_rope_index(tokens, None, None, None)[0]
        return layer(x, tokens, mask=self.layer_mask(layer, x), cache=cache, position_ids=positions)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        return _create_qwen3_5_ssm_mask(x, None) if layer.is_linear else _create_qwen4_exp_attention_mask(x, None)

    def close(self, x: mx.array) -> mx.array:
        return x

    def readout(self, hidden: mx.array) -> mx.array:
        return self.norm(hidden)

    def __call__(self, tokens: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.text(tokens, cache=cache).logits

    def forward(self, tokens: mx.array, cache: list) -> Tuple[Optional[mx.array], mx.array]:
        if isinstance(cache, UndoableCaches) and tokens.shape[1] <= cache.max_pass:
            if cache.transaction is not None:
                cache.transaction.commit(cache.transaction.length)
            cache.transaction = start_speculative_cache(cache, tokens.shape[1])
        out = self.text(tokens, cache=cache, return_hidden=True, skip_logits=True)
        return None, out.hidden_states[0]

    def new_layer(self, index: int) -> nn.Module:
        return Qwen4ExpDecoderLayer(self.args, index)

    # caches

    def make_cache(self) -> list:
        return self.text.make_cache()

    def rollback_cache(self, max_pass: int) -> list:
        return UndoableCaches(self.make_cache(), max_pass)

    def rollback(self, cache: list, keep: int, length: int) -> None:
        if not isinstance(cache, UndoableCaches) or cache.transaction is None:
            raise ValueError("the last pass was not recorded (longer than max_pass, or not an undoable cache)")
        cache.transaction.commit(keep)
        cache.transaction = None

    def attention_cache(self, cache: list):
        return cache[self.text.model.fa_idx]

    def make_head(self, num_layers: int) -> nn.Module:
        return Qwen4ExpHead(self.args, num_layers)
