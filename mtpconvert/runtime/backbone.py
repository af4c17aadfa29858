"""The one way the runtime reaches a model: its family's backbone adapter.

Decoding, the smokes, the layerwise check and the batched engine need a few things of a model: its
input embedding, its layers and which of them keep recurrent state, the final norm, the output
projection, its caches (the library's own, undoable ones, per-row ones), the mask each layer kind
takes, a new empty layer, and a head of the family's design. ``Backbone`` names them by role. A token
goes ``embed`` -> ``lift`` (the first layer's input) -> ``run_layer`` for each layer -> ``close`` (the
*hidden* state: what the head reads and ``logits`` takes) -> ``readout`` (what the output projection
reads) -> ``project``; ``forward`` runs the same over a cache in one call. Each
family subclasses it in ``families/<name>/backbone.py`` for the model its library builds (mlx-lm's or
mlx-vlm's), so nothing outside the family reaches into a model's attributes or guesses by them.

``TextModelBackbone`` serves the layouts mlx-lm builds: the parts found at the family's module paths
(``Family.module_paths``; by default ``[language_model.]model.{embed_tokens, layers, norm}`` and
``lm_head``), layers built as ``LayerClass(args, layer_idx=i)``, and mlx-lm's own caches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..families.base import Family


def module_at(root: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path (``language_model.model.embed_tokens``; list items by index)."""
    node = root
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


class Backbone:
    """A loaded (or never-evaluated ``shell``) model by role; see the module doc. ``model`` is what the
    family's library built, whole: the object its own generate loop and caches take."""

    # whether the batched engine may prefill prompts of different lengths in one padded pass and undo each row's
    # padding (``row_cache``'s recurrent caches record a pass's inputs and replay the kept prefix, or the backbone
    # has none); a recurrent cache that keeps a state per position of a recorded pass makes that a state per prompt
    # token, and its prompts are prefilled one length at a time instead
    pads_prefill = True

    def __init__(self, model: nn.Module, family: Family, config: dict):
        self.model, self.family, self.config = model, family, config

    # ------------------------------------------------------------------ building one

    @classmethod
    def load(cls, path: Path, family: Family, lazy: bool = False) -> "Backbone":
        """The model of a converted folder, loaded by its library exactly as that library loads it."""
        raise NotImplementedError

    @classmethod
    def shell(cls, path: Path, family: Family) -> "Backbone":
        """The model built from a folder's config, as its library reads it, with lazy random parameters that are
        never evaluated (no memory): its sanitize, sizes and layer classes, for reading the folder a piece at a
        time."""
        raise NotImplementedError

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Stored weights as the library's loader hands them to the model."""
        return self.model.sanitize(weights)

    # ------------------------------------------------------------------ sizes

    @property
    def args(self):
        """The text model's arguments as its library parsed them (``hidden_size``, ``rms_norm_eps``, ...)."""
        raise NotImplementedError

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
        """The output projection is the input embedding's transpose."""
        return bool(getattr(self.args, "tie_word_embeddings", False))

    # ------------------------------------------------------------------ parts

    @property
    def embed_tokens(self) -> nn.Module:
        return module_at(self.model, self.family.module_paths.embed)

    @property
    def layers(self) -> List[nn.Module]:
        return module_at(self.model, self.family.module_paths.layers)

    @property
    def norm(self) -> nn.Module:
        return module_at(self.model, self.family.module_paths.norm)

    @property
    def lm_head(self) -> Optional[nn.Module]:
        return None if self.tied else module_at(self.model, self.family.module_paths.lm_head)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def is_recurrent(self, layer: nn.Module) -> bool:
        """The layer keeps a state every token overwrites (linear attention, Mamba), not a cache to trim."""
        return False

    def embed(self, tokens: mx.array) -> mx.array:
        """The token embedding, as the head reads it too."""
        return self.embed_tokens(tokens)

    def lift(self, embedded: mx.array) -> mx.array:
        """The first layer's input from the token embedding."""
        return embedded

    def run_layer(self, layer: nn.Module, x: mx.array, tokens: mx.array, cache=None) -> mx.array:
        """One layer over ``x`` (the states of ``tokens``), as the model's own forward runs it."""
        return layer(x, mask=self.layer_mask(layer, x), cache=cache)

    def close(self, x: mx.array) -> mx.array:
        """The hidden state from the last layer's output: the final norm."""
        return self.norm(x)

    def readout(self, hidden: mx.array) -> mx.array:
        """What the output projection reads of a hidden state."""
        return hidden

    def project(self, z: mx.array) -> mx.array:
        """The output projection (the tied embedding's transpose where there is no lm_head)."""
        if self.tied:
            return self.embed_tokens.as_linear(z)
        return self.lm_head(z)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits of hidden states (``close``'s, ``forward``'s second)."""
        return self.project(self.readout(hidden))

    def __call__(self, tokens: mx.array, cache: Optional[list] = None) -> mx.array:
        """The library's own forward: logits of every position."""
        return self.model(tokens, cache=cache)

    def forward(self, tokens: mx.array, cache: list) -> Tuple[Optional[mx.array], mx.array]:
        """(pre-norm, post-norm) states of every position; pre-norm is None where the family's capabilities
        say the head cannot be fed it (the library's own forward gives post-norm states only)."""
        raise NotImplementedError

    def layer_mask(self, layer: nn.Module, x: mx.array):
        """The mask ``layer`` takes over ``x`` with no cache, as the model's own forward builds it."""
        raise NotImplementedError

    def new_layer(self, index: int) -> nn.Module:
        """An empty layer of the kind the model builds at ``index`` (an index past the backbone builds the
        block a nextn head holds)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ caches

    def make_cache(self) -> list:
        """The library's own caches for one sequence."""
        raise NotImplementedError

    def rollback_cache(self, max_pass: int) -> list:
        """Caches for a speculative decode: a pass of up to ``max_pass`` tokens can be undone in every layer
        (``runtime.decoding.rollback``)."""
        raise NotImplementedError

    def rollback(self, cache: list, keep: int, length: int) -> None:
        """Keep the first ``keep`` tokens of the last ``length``-token pass in every cache of ``rollback_cache``."""
        from .decoding.rollback import rollback

        rollback(cache, keep, length)

    def row_cache(self, max_pass: int, rows: int) -> list:
        """Caches for ``rows`` rows of the batched engine, each of its own length (``runtime.decoding.rowcache``)."""
        raise ValueError(f"batched MTP decoding does not run the {self.family.name} backbone: its adapter has no "
                         f"per-row caches")

    def enable_rollback(self) -> None:
        """Give every recurrent layer its recording twin, whose pass can be undone (idempotent)."""

    def attention_cache(self, cache: list):
        """The cache of one attention layer: its offset is the tokens the model has seen."""
        return cache[0]

    # ------------------------------------------------------------------ the head

    def make_head(self, num_layers: int) -> nn.Module:
        """An empty head of the family's design (``HeadDesign.forward``), ``num_layers`` decoder layers deep."""
        raise NotImplementedError

    def layer_weights(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """One module's tensors (full keys, as ``sanitize`` gave them) under the names that module holds, when the
        layerwise check loads it: as given, but for a family whose ``sanitize`` leaves a fusion to load time."""
        return weights

    def head_weights(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """The head's stored tensors (head-local names, experts stacked) under the names ``make_head``'s module
        holds them: as stored, but for a head built from a library's modules that renames or fuses at load."""
        return weights


class TextModelBackbone(Backbone):
    """A model mlx-lm builds from its ``models/<module>.py`` (see the module doc)."""

    @classmethod
    def load(cls, path: Path, family: Family, lazy: bool = False) -> "TextModelBackbone":
        from mlx_lm.utils import load_model

        model, config = load_model(Path(path), lazy=lazy)
        return cls(model, family, config)

    @classmethod
    def shell(cls, path: Path, family: Family) -> "TextModelBackbone":
        from mlx_lm.utils import _get_classes, load_config

        config = load_config(Path(path))
        model_class, args_class = _get_classes(config)
        return cls(model_class(args_class.from_dict(config)), family, config)

    @property
    def text(self) -> nn.Module:
        """mlx-lm's text model (``.model``, ``.args``, ``lm_head``): the whole model, or its ``language_model``."""
        prefix = self.family.text_prefix.rstrip(".")
        return module_at(self.model, prefix) if prefix else self.model

    @property
    def args(self):
        return self.text.args

    def forward(self, tokens: mx.array, cache: list) -> Tuple[Optional[mx.array], mx.array]:
        return None, self.text.model(tokens, cache)

    def layer_mask(self, layer: nn.Module, x: mx.array):
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(x, None, return_array=True)

    def new_layer(self, index: int) -> nn.Module:
        return type(self.layers[0])(self.args, layer_idx=index)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def rollback_cache(self, max_pass: int) -> list:
        return self.make_cache()  # attention caches trim: KVCache, or GLM-5's CacheList of two

    def row_cache(self, max_pass: int, rows: int) -> list:
        """Per-row twins of the library's own caches (``rowcache.row_caches_like``): attention layers only
        (KVCache, GLM-5's CacheList of two); a recurrent layer's family gives its own."""
        from .decoding.rowcache import row_caches_like

        try:
            return row_caches_like(self.make_cache(), rows)
        except ValueError as e:
            raise ValueError(f"batched MTP decoding does not run the {self.family.name} backbone: {e}") from e
