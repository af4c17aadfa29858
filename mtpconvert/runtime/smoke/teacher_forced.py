"""The layerwise check's teacher-forced computation and its result (``runtime.smoke.layerwise``
says what it measures and why).

``TeacherForcedPass`` runs it on a folder read one layer at a time (``runtime.smoke.shards``), in
the order its inputs are needed; ``teacher_forced_full`` runs the same computation on a fully loaded
model. Both give a ``LayerwiseResult``: per prompt, the backbone's and the head's argmax at every
position, the head's again with its MLP removed (``runtime.smoke.mlp_gain``), and what was resident.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...errors import LayoutError
from ..backbone import module_at
from ..decoding.locate import HeadTensors
from .compute import _finish_layer, fast_float_dtype
from .floors import LAYERWISE_MIN_ACCEPTANCE, MIN_MLP_GAIN
from .mlp_gain import PairedGain, matches, mlp_removed, paired_gain
from .shards import _Embedding, _Folder, _load_head, _load_layer, _load_module, _param_bytes, _run_lm_head_blocks

# lm_head rows read per block: bounded in stored bytes (and again after dequantization).
DEFAULT_VOCAB_BLOCK_BYTES = 128 << 20


@dataclass
class LayerwiseResult:
    path: str
    hidden: str
    head_source: str
    exact: bool
    min_acceptance: float = LAYERWISE_MIN_ACCEPTANCE
    compute_dtype: str = ""
    min_mlp_gain: Optional[float] = MIN_MLP_GAIN  # None: reported, not gated
    per_prompt: List[Tuple[int, int]] = field(default_factory=list)  # (agreed, compared)
    backbone_next: List[List[int]] = field(default_factory=list)  # backbone argmax at positions 1..L-1
    head_next: List[List[int]] = field(default_factory=list)  # head argmax at positions 0..L-2
    head_next_without_mlp: List[List[int]] = field(default_factory=list)  # the same, head layer's MLP removed
    prompt_tokens: List[int] = field(default_factory=list)
    stages: List[Tuple[str, int]] = field(default_factory=list)  # (stage, weight bytes resident)
    seconds: float = 0.0
    read_bytes: int = 0
    peak_mlx_bytes: int = 0
    peak_rss_bytes: int = 0

    @property
    def agreed(self) -> int:
        return sum(a for a, _ in self.per_prompt)

    @property
    def compared(self) -> int:
        return sum(n for _, n in self.per_prompt)

    @property
    def acceptance(self) -> float:
        return self.agreed / self.compared if self.compared else 0.0

    @property
    def mlp_gain_paired(self) -> PairedGain:
        """The head's acceptance with its MLP minus without it, over the same positions
        (``runtime.smoke.mlp_gain``)."""
        intact, removed = [], []
        for bb, hd, hd0 in zip(self.backbone_next, self.head_next, self.head_next_without_mlp):
            intact += matches(bb, hd)
            removed += matches(bb, hd0)
        return paired_gain(intact, removed)

    @property
    def mlp_gain(self) -> float:
        return self.mlp_gain_paired.gain

    @property
    def mlp_ok(self) -> bool:
        return self.min_mlp_gain is None or self.mlp_gain >= self.min_mlp_gain

    @property
    def acceptance_ok(self) -> bool:
        return self.compared > 0 and self.acceptance >= self.min_acceptance

    @property
    def ok(self) -> bool:
        return self.acceptance_ok and self.mlp_ok

    @property
    def largest_stage_bytes(self) -> int:
        return max((b for _, b in self.stages), default=0)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "check": "layerwise-teacher-forced",
            "hidden": self.hidden,
            "head_source": self.head_source,
            "exact": self.exact,
            "compute_dtype": self.compute_dtype,
            "acceptance": round(self.acceptance, 4),
            "agreed": self.agreed,
            "compared": self.compared,
            "per_prompt": [round(a / n, 4) if n else None for a, n in self.per_prompt],
            "prompt_tokens": self.prompt_tokens,
            "min_acceptance": self.min_acceptance,
            **self.mlp_gain_paired.to_json(),
            "min_mlp_gain": self.min_mlp_gain,
            "ok": self.ok,
            "seconds": round(self.seconds, 2),
            "read_bytes": self.read_bytes,
            "largest_stage_bytes": self.largest_stage_bytes,
            "peak_mlx_bytes": self.peak_mlx_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def agreement(backbone_next: Sequence[int], head_next: Sequence[int]) -> Tuple[int, int]:
    """(agreed, compared): head_next[t] (token t+2 from h_t, token t+1) against backbone_next[t]
    (the backbone's argmax at position t+1)."""
    n = min(len(backbone_next), len(head_next))
    return sum(int(a == b) for a, b in zip(backbone_next[:n], head_next[:n])), n


def head_states(head: nn.Module, hidden: mx.array, next_embeddings: mx.array) -> Tuple[mx.array, mx.array]:
    """The head's first-layer states over every position (fresh KV cache), intact and with that
    layer's MLP removed (``runtime.smoke.mlp_gain``): the second costs one more pass of one layer."""
    intact = head(hidden, next_embeddings, cache=head.make_cache())
    mx.eval(intact)
    with mlp_removed(head.layers[0]):
        removed = head(hidden, next_embeddings, cache=head.make_cache())
        mx.eval(removed)
    return intact, removed


def _default_exact() -> bool:
    return mx.default_device() != mx.cpu


class TeacherForcedPass:
    """The check's computation in the order its inputs are needed, so that a caller may hand the
    folder over piece by piece (``runtime.smoke.streamed``): ``embed`` once the embedding is open,
    ``run_layer`` for layer 0, 1, ... as each one's tensors are open, ``finish`` with the final
    norm, the head and ``lm_head``. Between calls only the activations are resident."""

    def __init__(self, folder: _Folder, token_ids: List[List[int]], *, hidden: str = "post-norm",
                 min_acceptance: float = LAYERWISE_MIN_ACCEPTANCE, exact: Optional[bool] = None,
                 compute_dtype: Optional[str] = None, progress: Optional[Callable[[str], None]] = None,
                 min_mlp_gain: Optional[float] = MIN_MLP_GAIN):
        if hidden not in ("post-norm", "pre-norm"):
            raise ValueError(f"hidden must be post-norm or pre-norm, not {hidden!r}")
        self.folder, self.token_ids, self.hidden = folder, token_ids, hidden
        self.exact = _default_exact() if exact is None else exact
        self.compute_dtype = compute_dtype
        self.progress = progress or (lambda msg: None)
        self.result = LayerwiseResult(str(folder.path), hidden, "", self.exact, min_acceptance,
                                      min_mlp_gain=min_mlp_gain, prompt_tokens=[len(t) for t in token_ids])
        self.next_layer = 0  # the layer run_layer runs next
        self.xs: Optional[List[mx.array]] = None  # hidden states after layer next_layer - 1
        self.nexts: Optional[List[mx.array]] = None  # embed(token t+1), the head's second input
        self.dtype = None
        mx.reset_peak_memory()

    @property
    def layers(self) -> int:
        return self.folder.shell.num_layers

    @property
    def embedded(self) -> bool:
        return self.xs is not None

    def embed(self) -> None:
        t0 = time.perf_counter()
        self.progress("embedding rows")
        emb = _Embedding(self.folder, self.token_ids)
        xs = [self.folder.shell.lift(emb(ids)) for ids in self.token_ids]
        nexts = [emb(ids[1:]) for ids in self.token_ids]
        dtype = xs[0].dtype
        if not self.exact:
            if self.compute_dtype is not None:
                dtype = getattr(mx, self.compute_dtype)
            elif mx.default_device() == mx.cpu:
                dtype = fast_float_dtype(dtype)
            xs, nexts = [x.astype(dtype) for x in xs], [x.astype(dtype) for x in nexts]
        self.result.compute_dtype = str(dtype).replace("mlx.core.", "")
        mx.eval(xs, nexts)
        self.result.stages.append(("embed_tokens rows", emb.nbytes))
        self.xs, self.nexts, self.dtype = xs, nexts, dtype
        self.result.seconds += time.perf_counter() - t0

    def run_layer(self) -> None:
        t0 = time.perf_counter()
        i = self.next_layer
        self.progress(f"layer {i + 1}/{self.layers}")
        layer = _load_layer(self.folder, i)
        _finish_layer(layer, self.exact, self.dtype)
        self.result.stages.append((f"layer {i}", _param_bytes(layer)))
        for p, (x, ids) in enumerate(zip(self.xs, self.token_ids)):
            self.xs[p] = self.folder.shell.run_layer(layer, x, mx.array([list(ids)]))
            mx.eval(self.xs[p])
        del layer
        gc.collect()
        mx.clear_cache()
        self.next_layer += 1
        self.result.seconds += time.perf_counter() - t0

    def finish(self, head_tensors: HeadTensors, vocab_block_bytes: int = DEFAULT_VOCAB_BLOCK_BYTES) -> LayerwiseResult:
        """The final norm (``close``), the head over every position, then lm_head's running argmax over what
        the output projection reads of each (``readout``); the result."""
        t0 = time.perf_counter()
        folder, result = self.folder, self.result
        if self.next_layer != self.layers:
            raise LayoutError(f"layer {self.next_layer} of {self.layers} was never run: its tensors are missing",
                              file=folder.path)
        result.head_source = head_tensors.source
        final = [_load_module(folder, path, module_at(folder.shell.model, path))
                 for path in (folder.paths.norm, *folder.paths.readout)]
        for module in final:
            _finish_layer(module, self.exact, self.dtype)
        hs = [folder.shell.close(x) for x in self.xs]
        outs = [folder.shell.readout(h) for h in hs]
        mx.eval(hs, outs)

        self.progress("MTP head")
        vocab = folder.add_head_vocab(head_tensors)
        if vocab is not None:  # a nextn head with its own embedding: embed(t+1) through it
            emb = _Embedding(folder, self.token_ids, stem=vocab[0])
            self.nexts = [emb(ids[1:]).astype(self.dtype) for ids in self.token_ids]
            mx.eval(self.nexts)
            result.stages.append(("head embedding rows", emb.nbytes))
            del emb
        head = _load_head(folder, head_tensors)
        _finish_layer(head, self.exact, self.dtype)
        result.stages.append(("mtp head (fc, norms, layer 0)", _param_bytes(head)))
        feed = hs if self.hidden == "post-norm" else self.xs
        states = []
        for p in range(len(self.token_ids)):
            states.append(tuple(head.readout(s) for s in head_states(head, feed[p][:, :-1], self.nexts[p])))
        mx.eval(states)
        del head, feed, final
        self.xs = self.nexts = None
        gc.collect()
        mx.clear_cache()

        if vocab is None:
            ids, block = _run_lm_head_blocks(folder, [[z, *s] for z, s in zip(outs, states)], self.exact, self.dtype,
                                             vocab_block_bytes, self.progress)
        else:  # the backbone's states through lm_head, the head's through its own shared_head.head
            bb, block = _run_lm_head_blocks(folder, [[z] for z in outs], self.exact, self.dtype, vocab_block_bytes,
                                            self.progress)
            hd, head_block = _run_lm_head_blocks(folder, [list(s) for s in states], self.exact, self.dtype,
                                                 vocab_block_bytes, self.progress, stem=vocab[1])
            ids, block = [b + h for b, h in zip(bb, hd)], max(block, head_block)
        result.stages.append(("lm_head block", block))
        for bb, hd, hd0 in ids:
            result.backbone_next.append(bb[1:])
            result.head_next.append(hd)
            result.head_next_without_mlp.append(hd0)
            result.per_prompt.append(agreement(bb[1:], hd))
        result.read_bytes = folder.read_bytes
        result.seconds += time.perf_counter() - t0
        result.peak_mlx_bytes = mx.get_peak_memory()
        result.peak_rss_bytes = peak_rss_bytes()
        return result


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


# --------------------------------------------------------------------------------------------
# the same teacher-forced computation on a fully loaded model (reference for the tests, and a
# cheaper check than decoding when the model fits)


def teacher_forced_full(m, token_ids: Sequence[Sequence[int]], hidden: str = "post-norm",
                        min_acceptance: float = LAYERWISE_MIN_ACCEPTANCE,
                        min_mlp_gain: Optional[float] = MIN_MLP_GAIN) -> LayerwiseResult:
    """``m``: a ``runtime.decoding.load.MTPModel``. Uses the stock forward of mlx-lm's text model."""
    result = LayerwiseResult("", hidden, "loaded", True, min_acceptance, min_mlp_gain=min_mlp_gain)
    backbone = m.backbone
    for ids in token_ids:
        if len(ids) < 2:
            continue
        tokens = mx.array([list(ids)])
        x = backbone.lift(backbone.embed(tokens))
        for layer in backbone.layers:  # the model's own forward without the final norm
            x = backbone.run_layer(layer, x, tokens)
        h = backbone.close(x)
        feed = h if hidden == "post-norm" else x
        s, s0 = head_states(m.head, feed[:, :-1], m.embed(tokens[:, 1:]))
        bb = mx.argmax(m.logits(h), axis=-1).reshape(-1).tolist()[1:]
        hd = mx.argmax(m.draft_logits(s), axis=-1).reshape(-1).tolist()
        result.prompt_tokens.append(len(ids))
        result.backbone_next.append(bb)
        result.head_next.append(hd)
        result.head_next_without_mlp.append(mx.argmax(m.draft_logits(s0), axis=-1).reshape(-1).tolist())
        result.per_prompt.append(agreement(bb, hd))
    return result
