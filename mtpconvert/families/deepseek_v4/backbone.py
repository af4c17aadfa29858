"""How the runtime drives a deepseek_v4 backbone as mlx-vlm 0.7.10 builds it (``models/deepseek_v4``).

The model runs as mlx-vlm runs it: ``forward`` is its own language model asked for the hidden state its drafter
reads (``return_hidden``: the hc streams after the last layer, before ``hc_head`` and ``norm``,
``language.py:1140-1163``); ``hc_head``, ``norm`` and ``lm_head`` make the logits (``readout``, ``project``), through
mlx-vlm's own projection helper, whose short blocks reduce as single tokens do (so a verify pass scores its tokens
as one-token decoding does). A pass is undone with mlx-vlm's speculative cache transaction
(``speculative/cache_state.py``): its rotating caches replay the accepted keys, its pooling caches (the compressed
attention's and the indexer's) restore their windows and keep the accepted ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import CacheList, PoolingCache, RotatingKVCache
from mlx_vlm.models.deepseek_v4.language import DeepseekV4Block, SparseCompressedAttention
from mlx_vlm.models.linear import linear
from mlx_vlm.speculative.cache_state import start_speculative_cache

from ...families.base import Family
from ...runtime.backbone import Backbone
from .head import DeepseekV4Head


class UndoableCaches(list):
    """mlx-vlm's caches of one sequence, with a speculative transaction over each pass of at most ``max_pass``
    tokens (``DeepseekV4Backbone.forward`` starts it, ``rollback`` commits the kept prefix)."""

    def __init__(self, caches: list, max_pass: int):
        super().__init__(caches)
        self.max_pass = max_pass
        self.transaction = None


class DeepseekV4Backbone(Backbone):
    @classmethod
    def load(cls, path: Path, family: Family, lazy: bool = False) -> "DeepseekV4Backbone":
        from mlx_vlm.utils import load_model

        path = Path(path)
        return cls(load_model(path, lazy=lazy), family, json.loads((path / "config.json").read_text()))

    @classmethod
    def shell(cls, path: Path, family: Family) -> "DeepseekV4Backbone":
        """The model as mlx-vlm's ``load_model`` builds it before it loads weights (``utils.py:363-460``)."""
        from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

        path = Path(path)
        config = load_config(path)
        model_class, _ = get_model_and_args(config=config, model_path=path)
        built = {"text_config": {}, "vision_config": {}, "audio_config": {}, **config}  # as the loader fills it in
        model_config = model_class.ModelConfig.from_dict(built)
        model_config = update_module_configs(model_config, model_class, built,
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

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def rms_norm_eps(self) -> float:
        return self.args.rms_norm_eps

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def tied(self) -> bool:
        return False

    # a token's path: the embedding copied onto every hyper-connection stream, the blocks, no close (the head reads
    # the streams), hc_head and norm, lm_head

    def lift(self, embedded: mx.array) -> mx.array:
        B, L, D = embedded.shape
        return mx.contiguous(mx.broadcast_to(embedded[:, :, None, :], (B, L, self.args.hc_mult, D)))

    def run_layer(self, layer: nn.Module, x: mx.array, tokens: mx.array, cache=None) -> mx.array:
        """One block over a whole sequence from its first token, with a fresh cache of its kind where none is given:
        a compressed attention without one lets every query see every pooled window."""
        cache = cache if cache is not None else self._layer_cache(layer)
        return layer(x, self.layer_mask(layer, x), cache, tokens, causal=True)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        return create_attention_mask(x[:, :, 0, :], None, window_size=self.args.sliding_window, return_array=True)

    def close(self, x: mx.array) -> mx.array:
        return x

    def readout(self, hidden: mx.array) -> mx.array:
        """hc_head then the final norm, over [B, L, hc, H] (a [B, hc, H] row is one position)."""
        if hidden.ndim == 3:
            return self.readout(hidden[:, None])[:, 0]
        return self.text.model.norm(self.text.model.hc_head(hidden))

    def project(self, z: mx.array) -> mx.array:
        return linear(self.text.lm_head, z)

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
        return DeepseekV4Block(self.args, index)

    # caches

    def _layer_cache(self, layer: nn.Module):
        """A fresh cache of one block's kind (``LanguageModel.make_cache``, ``language.py:1274-1295``)."""
        local = RotatingKVCache(max_size=self.args.sliding_window)
        ratio = layer.attn.compress_ratio
        if ratio == 0:
            return local
        pools = (PoolingCache(ratio), PoolingCache(ratio)) if isinstance(layer.attn, SparseCompressedAttention) \
            else (PoolingCache(ratio),)
        return CacheList(local, *pools)

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
        """The first block's sliding-window cache: its offset is the tokens the model has seen."""
        first = cache[0]
        return first[0] if isinstance(first, CacheList) else first

    def make_head(self, num_layers: int) -> nn.Module:
        return DeepseekV4Head(self.args)
