"""The part every backbone adapter over an mlx-vlm model shares (the families whose backbone only mlx-vlm loads).

The model is loaded, built and sanitized by mlx-vlm's own loader (``mlx_vlm.utils``); ``forward`` is its language
model asked for the hidden state its drafter reads (``return_hidden``); a pass is undone with mlx-vlm's speculative
cache transaction (``speculative/cache_state.py``), which records, during a pass of a few tokens, what each of its
cache kinds needs to keep only an accepted prefix. A family's adapter adds the token's path (``lift``,
``run_layer``, ``close``, ``readout``), its layer class and its head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..families.base import Family
from .backbone import Backbone


class UndoableCaches(list):
    """mlx-vlm's caches of one sequence, with a speculative transaction over each pass of at most ``max_pass``
    tokens (``VlmBackbone.forward`` starts it, ``rollback`` commits the kept prefix)."""

    def __init__(self, caches: list, max_pass: int):
        super().__init__(caches)
        self.max_pass = max_pass
        self.transaction = None


class VlmBackbone(Backbone):
    # which of the language model's ``return_hidden`` states the head drafts from
    hidden_state_index = 0
    # mlx-vlm's recurrent caches record a speculative pass as a state per position (``ArraysCache.update_recurrent``)
    pads_prefill = False

    @classmethod
    def load(cls, path: Path, family: Family, lazy: bool = False) -> "VlmBackbone":
        from mlx_vlm.utils import load_model

        path = Path(path)
        return cls(load_model(path, lazy=lazy), family, json.loads((path / "config.json").read_text()))

    @classmethod
    def shell(cls, path: Path, family: Family) -> "VlmBackbone":
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

    def __call__(self, tokens: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.text(tokens, cache=cache).logits

    def forward(self, tokens: mx.array, cache: list) -> Tuple[Optional[mx.array], mx.array]:
        if isinstance(cache, UndoableCaches) and tokens.shape[1] <= cache.max_pass:
            from mlx_vlm.speculative.cache_state import start_speculative_cache

            if cache.transaction is not None:
                cache.transaction.commit(cache.transaction.length)
            cache.transaction = start_speculative_cache(cache, tokens.shape[1])
        out = self.text(tokens, cache=cache, return_hidden=True, skip_logits=True)
        return None, out.hidden_states[self.hidden_state_index]

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
