"""Layer-by-layer MTP acceptance check: the smoke test for models that do not fit in memory.

``mtpconvert smoke`` loads the whole model and decodes; a 27B-397B conversion on a 16 GB
runner cannot. This check streams the folder one decoder layer at a time over a short batch
of real text and measures the head **teacher-forced**:

    backbone   x_0 = embed(tokens); x_i = layer_i(x_{i-1}); h = norm(x_n)     (all prompts, all positions)
    head       s_t = mtp(h_t, embed(token_{t+1}))   (fresh KV cache over the whole sequence)
    compare    argmax lm_head(mtp.norm(s_t))  ==  argmax lm_head(h_{t+1})    for t = 0 .. L-2

that is, the head's guess for token t+2 against the backbone's greedy prediction of the same
token given the true t+1. That is exactly the question the first draft of every greedy decode
step asks, so on a correct head it is the greedy acceptance, and on a broken head (norms not
shifted, experts out of order, wrong hidden state) it collapses.

What is resident when (everything else stays on disk):

1. headers of every shard, and the folder's tensors as *lazy* ``mx.load`` arrays (``mx.load``
   reads a tensor's bytes only when that array is evaluated, straight into its buffer);
2. the embedding rows of the prompts' distinct tokens, copied out of the file (a quantized
   table is gathered row-wise and dequantized by mlx's own ``QuantizedEmbedding``), never the
   table;
3. one decoder layer at a time: built from mlx-lm's own class (``DecoderLayer`` of
   ``qwen3_5`` / ``qwen3_5_moe``), quantized from config.json exactly as
   ``mlx_lm.utils.load_model`` does, filled with only its tensors (after mlx-lm's ``sanitize``),
   run over every prompt, then dropped (``mx.clear_cache`` returns its buffers);
4. the MTP head's first layer with ``fc`` and its norms (located by ``locate_mtp``: a root
   ``mtp.safetensors`` sidecar or ``language_model.mtp.*`` inside the shards);
5. ``lm_head`` (or the tied embedding) a block of vocabulary rows at a time, for the backbone's
   and the head's states together, keeping a running argmax.

Activations are the prompts' hidden states (``tokens x hidden``, a few MB for a 27B model).

``exact=True`` runs every layer with the stock modules, so the predictions are the ones the
fully loaded model makes (the tests check this bit for bit). mlx's CPU backend multiplies
quantized matrices by many rows slowly (~0.1 GFLOP/s here against ~1-2 for a float GEMM), so
``exact=None`` (the default) runs on the CPU with every affine-quantized ``Linear`` (and every
``lm_head`` block) as a ``BlockLinear``: dequantized a block of rows at a time and multiplied in
floating point, the same predictions up to rounding (float32 where this machine's float32 GEMM
is faster, see ``fast_float_dtype``). On the CPU, unquantized MoE experts stay as stored and run
in float32 a bounded group of experts at a time, because mlx's CPU ``gather_mm`` is float32-only
(``runtime.experts.bound_float_experts``: bit-identical to casting the whole stack, as the
full-model loader does with ``load.float32_experts_on_cpu``). See docs/smoke.md for measured memory and time.
"""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from ..errors import LayoutError
from ..io.header import TensorInfo, read_header
from ..io.reader import TensorReader
from .experts import bound_float_experts
from .locate import HEAD_PREFIXES, MTP_FILE, HeadTensors, locate_mtp, shard_files
from .mlp_gain import DEFAULT_MIN_MLP_GAIN, PairedGain, matches, mlp_removed, paired_gain
from .mtp import MTPHead, stack_experts

# Teacher-forced acceptance on the prompt text is not decoding acceptance: correct text-fixture heads
# score 39-40% here on DEFAULT_PROMPTS (docs/runtime.md), so this check keeps its own floor.
DEFAULT_MIN_ACCEPTANCE = 0.30

# Root sidecar first (the layout the converter is moving to), then in-model keys.

# Written for this check (not from any corpus): plain prose, code and a list, so that a head is
# scored on the kinds of text it will draft for. Each prompt is cut to ``max_prompt_tokens``.
DEFAULT_PROMPTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small "
    "oil lamp, a notebook and a thermos of tea, and he wrote down the colour of the sky, the height "
    "of the waves and the names of the ships that passed. After forty years the notebooks filled a "
    "whole shelf, and the town's children came to read them on rainy afternoons, looking for the "
    "day they were born and the weather their parents had seen that morning.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    i = j = 0\n"
    "    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
    "            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\n"
    "def test_merge_sorted():\n    assert merge_sorted([1, 4, 9], [2, 3, 10]) == [1, 2, 3, 4, 9, 10]\n",
    "How to repot a houseplant, step by step:\n1. Water the plant a day before, so the roots hold "
    "together.\n2. Choose a pot one size larger, with a drainage hole.\n3. Put a layer of fresh soil "
    "at the bottom.\n4. Turn the old pot over, support the stem between two fingers and tap the rim "
    "until the plant slides out.\n5. Loosen the outer roots gently and set the plant in the new pot "
    "at the same depth as before.\n6. Fill the sides with soil, press lightly and water well.",
)
DEFAULT_MAX_PROMPT_TOKENS = 96
# lm_head rows read per block: bounded in stored bytes (and again after dequantization).
DEFAULT_VOCAB_BLOCK_BYTES = 128 << 20


# --------------------------------------------------------------------------------------------
# where the head lives


# --------------------------------------------------------------------------------------------
# full or layerwise: a pure decision the caller feeds with measured numbers


def weight_files(path: Path) -> List[Path]:
    """Every weight file the full smoke would load: the shards and the MTP sidecar."""
    path = Path(path)
    return [Path(f) for f in shard_files(path)] + ([path / MTP_FILE] if (path / MTP_FILE).is_file() else [])


def folder_weight_bytes(path: Path) -> int:
    """Bytes of every weight file the full smoke would load (shards and the MTP sidecar)."""
    return sum(os.path.getsize(f) for f in weight_files(path))


_LAYER_KEY = re.compile(r"language_model\.model\.layers\.(\d+)\.")


def unit_of(key: str) -> str:
    """What the check holds a converted tensor for: ``layer N``, ``mtp`` (the head),
    ``embed_tokens``, ``lm_head``, ``norm`` (the final one) or ``other``."""
    m = _LAYER_KEY.match(key)
    if m:
        return f"layer {m.group(1)}"
    if key.startswith(HEAD_PREFIXES):
        return "mtp"
    if ".embed_tokens." in key:
        return "embed_tokens"
    if ".lm_head." in key:
        return "lm_head"
    if key == "language_model.model.norm.weight":
        return "norm"
    return "other"


def stored_bytes_by_unit(path: Path) -> Dict[str, int]:
    """Stored bytes of each unit the layerwise check holds at once (``unit_of``; the final norm
    counts as ``other``; ``mtp`` is the whole head, of which the check holds the first layer). Headers
    only. The check's peak is about the largest layer or head plus ~0.3 GB of activations and runtime."""
    units: Dict[str, int] = {}
    for f in weight_files(Path(path)):
        for k, t in read_header(Path(f)).tensors.items():
            unit = unit_of(k)
            unit = "other" if unit == "norm" else unit
            units[unit] = units.get(unit, 0) + t.nbytes
    return units


def available_memory_bytes() -> Optional[int]:
    """Memory this process can still use: MemAvailable, capped by a cgroup v2 limit (Linux);
    physical memory elsewhere. None when unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def smoke_mode(weight_bytes: int, available_bytes: Optional[int], *, full_runs_here: bool = True,
               headroom: float = 0.25, reserve_bytes: int = 1 << 30) -> str:
    """"full" when the whole model (plus ``headroom`` of it for the decode's caches and
    temporaries, plus ``reserve_bytes``) fits in ``available_bytes``, else "layerwise".
    ``full_runs_here=False`` (e.g. bf16 MoE experts on mlx's CPU backend) forces "layerwise",
    which can run them in float32 one layer at a time."""
    if not full_runs_here or available_bytes is None:
        return "layerwise"
    return "full" if weight_bytes * (1 + headroom) + reserve_bytes <= available_bytes else "layerwise"


# --------------------------------------------------------------------------------------------
# result


@dataclass
class LayerwiseResult:
    path: str
    hidden: str
    head_source: str
    exact: bool
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE
    compute_dtype: str = ""
    min_mlp_gain: Optional[float] = DEFAULT_MIN_MLP_GAIN  # None: reported, not gated
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
        """The head's acceptance with its MLP minus without it, over the same positions (``runtime.mlp_gain``)."""
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


# --------------------------------------------------------------------------------------------
# shared pieces (also used by the full-model reference)


# Rows of a weight matrix turned to floating point at once by BlockLinear.
LINEAR_BLOCK_BYTES = 64 << 20


class BlockLinear(nn.Module):
    """``nn.Linear``'s forward in ``dtype`` for a quantized (affine) or float ``Linear``, a block
    of output rows at a time: each block is dequantized (or cast), multiplied and evaluated before
    the next, so a layer's resident memory stays its stored weights plus one block of
    ``LINEAR_BLOCK_BYTES``, however large its matrices are."""

    def __init__(self, m: nn.Module, dtype, block_bytes: Optional[int] = None):
        super().__init__()
        self.quantized = isinstance(m, nn.QuantizedLinear)
        for k in ("weight", "scales", "biases", "bias"):
            if m.get(k) is not None:
                setattr(self, k, m[k])
        if self.quantized:
            self.group_size, self.bits, self.mode = m.group_size, m.bits, m.mode
            in_dims = m["weight"].shape[1] * 32 // m.bits
        else:
            in_dims = m["weight"].shape[1]
        self.dtype = dtype
        self.rows = max(1, (block_bytes or LINEAR_BLOCK_BYTES) // (in_dims * dtype.size))

    def _block(self, a: int, b: int) -> mx.array:
        if self.quantized:
            biases = self.get("biases")
            return mx.dequantize(self["weight"][a:b], self["scales"][a:b], biases[a:b] if biases is not None else None,
                                 group_size=self.group_size, bits=self.bits, mode=self.mode, dtype=self.dtype)
        return self["weight"][a:b].astype(self.dtype)

    def __call__(self, x):
        x = x.astype(self.dtype)
        out = self["weight"].shape[0]
        parts = []
        for a in range(0, out, self.rows):
            y = x @ self._block(a, min(out, a + self.rows)).T
            mx.eval(y)
            parts.append(y)
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return y + self["bias"].astype(self.dtype) if "bias" in self else y


def dequantize_linears(module: nn.Module, dtype) -> int:
    """Swap every affine ``QuantizedLinear`` under ``module``, and every float ``Linear`` whose
    weight is not ``dtype``, for a ``BlockLinear`` computing in ``dtype``. Returns the count."""
    n = 0

    def swap(m):
        nonlocal n
        if (isinstance(m, nn.QuantizedLinear) and m.mode == "affine") or (
                type(m) is nn.Linear and m["weight"].dtype != dtype):
            n += 1
            return BlockLinear(m, dtype)
        return m

    module.update_modules(tree_map(swap, module.leaf_modules(), is_leaf=nn.Module.is_module))
    return n


def fast_float_dtype(model_dtype=mx.bfloat16, size: int = 384):
    """The float type whose GEMM is faster here: float32 when it beats ``model_dtype`` by 1.5x.

    mlx's Linux CPU wheel (mlx[cpu]) links the reference BLAS: float32 GEMM ran at ~1 GFLOP/s on
    this project's machine and bfloat16 (mlx's own loop) at ~2; with an optimized BLAS preloaded
    (``LD_PRELOAD=.../openblas-pthread/libblas.so.3``) float32 runs at ~25-40. Measured once
    (~0.1 s with the reference BLAS)."""
    if model_dtype == mx.float32:
        return mx.float32
    global _FAST_DTYPE
    if _FAST_DTYPE is None:
        a = mx.random.normal((size, size), key=mx.random.key(0))
        times = {}
        for dt in (mx.float32, model_dtype):
            x, w = a.astype(dt), a.astype(dt)
            mx.eval(x @ w)
            t = time.perf_counter()
            for _ in range(2):
                mx.eval(x @ w)
            times[dt] = time.perf_counter() - t
        _FAST_DTYPE = mx.float32 if times[mx.float32] * 1.5 < times[model_dtype] else model_dtype
    return _FAST_DTYPE


_FAST_DTYPE = None


def _param_bytes(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _quant_predicate(prefixes: Sequence[str], quant: dict, weights: Dict[str, mx.array]):
    """mlx_lm.utils.load_model's class predicate, for a module whose full path is prefix + p.
    ``prefixes``: the key prefix of the stored tensors first, then other names the per-path
    quantization entries may use (the MTP head's sidecar keys are ``mtp.*``, config may say
    ``language_model.mtp.*``)."""
    from mlx_lm.utils import infer_quant_config

    try:
        from mlx_lm.utils import _takes_global_scale
    except ImportError:  # older mlx-lm: no nvfp4 global scales
        _takes_global_scale = None

    def predicate(p, m):
        for prefix in prefixes:
            if prefix + p in quant:
                return quant[prefix + p]
        full = prefixes[0] + p
        if not hasattr(m, "to_quantized") or f"{full}.scales" not in weights:
            return False
        params = infer_quant_config(full, m, weights)
        if _takes_global_scale is not None and f"{full}.global_scale" in weights and _takes_global_scale(m):
            params["global_scale"] = True
        return params

    return predicate


def _quantize(module: nn.Module, prefixes: Sequence[str], quant: Optional[dict], weights: Dict[str, mx.array]):
    if quant:
        nn.quantize(module, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"),
                    class_predicate=_quant_predicate(prefixes, quant, weights))


class _Holder(nn.Module):
    """A parent for one loose module, so that ``nn.quantize`` sees it at path ``name``."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        setattr(self, name, module)


# --------------------------------------------------------------------------------------------
# the streaming model


class _Folder:
    """A converted folder opened for streaming: config, mlx-lm classes, headers, lazy tensors."""

    def __init__(self, path: Path, files: Optional[Sequence[Path]] = None):
        """``files``: the weight files to open now (None: every ``model*.safetensors``); ``add`` opens more."""
        from mlx_lm.utils import _get_classes, load_config

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise LayoutError("not a converted model folder: no config.json", file=self.path)
        self.config = load_config(self.path)
        if files is None:
            files = shard_files(self.path)
            if not files:
                raise LayoutError("no model*.safetensors in the folder", file=self.path)
        model_class, args_class = _get_classes(self.config)
        # A shell of the whole model: its parameters are lazy random arrays that are never
        # evaluated (no memory); it gives mlx-lm's sanitize, argument parsing and layer classes.
        self.shell = model_class(args_class.from_dict(self.config))
        self.args = self.shell.language_model.args
        self.quant = self.config.get("quantization")
        self.headers = []
        self.infos: Dict[str, TensorInfo] = {}
        self.weights: Dict[str, mx.array] = {}
        self.in_memory: Set[str] = set()  # keys of ``weights`` read into memory by ``hold``: their file may go
        self.reader = TensorReader()
        self.read_bytes = 0
        self.add(files)

    def add(self, files: Sequence[Path]) -> None:
        """Open more weight files: their headers, and every tensor *lazily* (nothing read), sanitized
        exactly as load_model does (one ``sanitize`` call over all of ``files``). A key already open is
        replaced (a copy of a tensor supersedes the shard it came from). Entries of ``weights`` are
        popped as they are consumed, so an evaluated tensor dies with its module."""
        lazy: Dict[str, mx.array] = {}
        for f in files:
            header = read_header(Path(f))
            self.headers.append(header)
            self.infos.update(header.tensors)
            lazy.update(mx.load(str(f)))
        self.weights.update(self.shell.sanitize(lazy))

    def hold(self, keys: Sequence[str]) -> None:
        """Read the tensors ``keys`` into memory now, so that their file may be deleted before they are used
        (``forget`` keeps them; rows are then read from memory)."""
        arrays = [self.weights[k] for k in keys if k in self.weights]
        mx.eval(*arrays)
        self.in_memory.update(k for k in keys if k in self.weights)

    def forget(self, file: Path) -> None:
        """Drop the lazy tensors still open from ``file`` (about to be deleted): none may be read after.
        Tensors read into memory (``hold``) stay."""
        for k in [k for k, t in self.infos.items() if t.file == Path(file) and k not in self.in_memory]:
            self.weights.pop(k, None)

    # -- rows of the big shared tensors, straight from the file

    def _info(self, key: str) -> TensorInfo:
        if key not in self.infos:
            raise LayoutError(f"tensor {key} not found", file=self.path,
                              hint="the layerwise check reads converted MLX folders (language_model.* keys)")
        return self.infos[key]

    def gather_rows(self, key: str, rows: np.ndarray) -> mx.array:
        info = self._info(key)
        if key in self.in_memory:
            picked = self.weights[key][mx.array(rows)]
            mx.eval(picked)
            self.read_bytes += picked.nbytes
            return picked
        view = self.reader.view_rows(info, 0, info.shape[0])
        picked = np.take(view, rows, axis=0)
        del view
        self.reader.drop_rows(info, 0, info.shape[0])
        self.read_bytes += picked.nbytes
        arr = mx.array(picked)
        return arr.view(mx.bfloat16) if info.dtype == "BF16" else arr

    def read_rows(self, key: str, start: int, stop: int) -> mx.array:
        info = self._info(key)
        arr = self.weights[key][start:stop] if key in self.in_memory else self.reader.read_rows(info, start, stop)
        self.read_bytes += arr.nbytes
        return arr

    def _module_keys(self, stem: str) -> List[str]:
        return [k for k in self.infos if k.startswith(stem + ".")]

    def close(self):
        self.reader.close()


class _Embedding:
    """The prompts' rows of the input embedding, through mlx's own (Quantized)Embedding."""

    def __init__(self, folder: _Folder, token_ids: Sequence[Sequence[int]]):
        stem = "language_model.model.embed_tokens"
        uniq = np.unique(np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids]))
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= folder._info(stem + ".weight").shape[0]):
            raise ValueError(f"token ids outside the embedding (0..{folder._info(stem + '.weight').shape[0] - 1})")
        holder = _Holder("embed_tokens", folder.shell.language_model.model.embed_tokens)
        _quantize(holder, ("language_model.model.",), folder.quant, folder.weights)
        self.module = holder.embed_tokens
        self.module.update({k.rsplit(".", 1)[1]: folder.gather_rows(k, uniq) for k in folder._module_keys(stem)})
        mx.eval(self.module.parameters())
        self.index = {int(t): i for i, t in enumerate(uniq)}

    def __call__(self, ids: Sequence[int]) -> mx.array:
        local = mx.array([[self.index[int(t)] for t in ids]])
        return self.module(local)

    @property
    def nbytes(self) -> int:
        return _param_bytes(self.module)


def _run_lm_head_blocks(folder: _Folder, states: List[List[mx.array]], exact: bool, dtype, block_bytes: int,
                        progress: Callable[[str], None]) -> Tuple[List[List[List[int]]], int]:
    """Running argmax of lm_head over vocabulary blocks, for every state array in ``states``
    (``states[p][j]``: prompt p's j-th [1, L, H] array). Returns argmax ids, and the largest block's bytes."""
    lm = folder.shell.language_model
    tied = folder.args.tie_word_embeddings
    stem = "language_model.model.embed_tokens" if tied else "language_model.lm_head"
    name = "embed_tokens" if tied else "lm_head"
    holder = _Holder(name, lm.model.embed_tokens if tied else lm.lm_head)
    _quantize(holder, ("language_model.model.",) if tied else ("language_model.",), folder.quant, folder.weights)
    module = getattr(holder, name)
    keys = folder._module_keys(stem)
    if not keys:
        raise LayoutError(f"no {stem}.* tensors", file=folder.path)
    vocab = folder._info(stem + ".weight").shape[0]
    row_bytes = sum(folder._info(k).nbytes for k in keys) // vocab
    quantized = isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    dequant = quantized and not exact and module.mode == "affine"
    deq_row_bytes = folder.args.hidden_size * dtype.size if dequant else 0
    rows = max(1, min(vocab, block_bytes // max(row_bytes, deq_row_bytes, 1)))
    best = [[None for _ in s] for s in states]
    largest = 0
    for start in range(0, vocab, rows):
        stop = min(vocab, start + rows)
        progress(f"lm_head rows {start}-{stop} of {vocab}")
        module.update({k.rsplit(".", 1)[1]: folder.read_rows(k, start, stop) for k in keys})
        mx.eval(module.parameters())
        if dequant:
            w = mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                              bits=module.bits, mode=module.mode, dtype=dtype)
            mx.eval(w)
            fn = lambda x: x.astype(dtype) @ w.T  # noqa: E731  (nn.Linear's forward)
        elif tied:
            fn = module.as_linear
        else:
            fn = module
        largest = max(largest, _param_bytes(module) + (w.nbytes if dequant else 0))
        for p, arrs in enumerate(states):
            for j, x in enumerate(arrs):
                logits = fn(x)
                val, idx = logits.max(axis=-1), logits.argmax(axis=-1) + start
                if best[p][j] is None:
                    best[p][j] = (val, idx)
                else:
                    bv, bi = best[p][j]
                    take = val > bv  # strict: ties keep the lower id, as one argmax over all rows does
                    best[p][j] = (mx.where(take, val, bv), mx.where(take, idx, bi))
                mx.eval(*best[p][j])
        w = None
        fn = None
        mx.clear_cache()
    return [[b[1].reshape(-1).tolist() for b in row] for row in best], largest


def _load_layer(folder: _Folder, i: int) -> nn.Module:
    """Decoder layer i: mlx-lm's class, quantized as load_model would, filled with its tensors only."""
    prefix = f"language_model.model.layers.{i}."
    layer = type(folder.shell.language_model.model.layers[i])(folder.args, layer_idx=i)
    weights = {k: folder.weights.pop(k) for k in [k for k in folder.weights if k.startswith(prefix)]}
    _quantize(layer, (prefix,), folder.quant, weights)
    layer.load_weights([(k[len(prefix):], v) for k, v in weights.items()], strict=True)
    del weights  # the module now holds the only references
    mx.eval(layer.parameters())
    folder.read_bytes += sum(folder.infos[k].nbytes for k in folder._module_keys(prefix[:-1]))
    layer.eval()
    return layer


def _finish_layer(module: nn.Module, exact: bool, dtype) -> None:
    bound_float_experts(module)  # float experts stay as stored: float32 a group at a time, not the stack
    if not exact:
        dequantize_linears(module, dtype)
        if dtype == mx.float32:  # vectors too (norms, A_log, dt_bias): matrices are promoted per call
            module.update(tree_map(lambda v: v.astype(mx.float32) if v.ndim <= 1 and
                                   mx.issubdtype(v.dtype, mx.floating) else v, module.parameters()))


def _load_head(folder: _Folder, head_tensors: HeadTensors) -> MTPHead:
    """The head's fc, norms and first layer (the one every first draft uses), as runtime.load builds it."""
    files = sorted({t.file for t in head_tensors.tensors.values()})
    wanted = {k for k in head_tensors.tensors if not k.startswith("layers.") or k.startswith("layers.0.")}
    weights = {}
    for f in files:
        lazy = mx.load(str(f))
        for k in wanted:
            full = head_tensors.prefix + k
            if full in lazy and head_tensors.tensors[k].file == f:
                weights[k] = lazy[full]
        del lazy
    weights = stack_experts(weights)
    head = MTPHead(folder.args, 1)
    prefixes = (head_tensors.prefix,) + tuple(p for p in HEAD_PREFIXES if p != head_tensors.prefix)
    _quantize(head, prefixes, folder.quant, {head_tensors.prefix + k: v for k, v in weights.items()})
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise LayoutError(f"MTP weights do not fit the MTP head: {e}", file=folder.path) from e
    del weights
    mx.eval(head.parameters())
    folder.read_bytes += sum(head_tensors.tensors[k].nbytes for k in wanted)
    head.eval()
    return head


def head_states(head: MTPHead, hidden: mx.array, next_embeddings: mx.array) -> Tuple[mx.array, mx.array]:
    """The head's first-layer states over every position (fresh KV cache), intact and with that
    layer's MLP removed (``runtime.mlp_gain``): the second costs one more pass of one layer."""
    intact = head(hidden, next_embeddings, cache=head.make_cache())
    mx.eval(intact)
    with mlp_removed(head.layers[0]):
        removed = head(hidden, next_embeddings, cache=head.make_cache())
        mx.eval(removed)
    return intact, removed


def _default_exact() -> bool:
    return mx.default_device() != mx.cpu


def encode(path: Path, prompts: Optional[Sequence[str]] = None,
           max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> List[List[int]]:
    """The prompts (default ``DEFAULT_PROMPTS``) through the folder's tokenizer, each cut to
    ``max_prompt_tokens``."""
    from .smoke import encode_prompts

    return [ids[:max_prompt_tokens] for ids in encode_prompts(Path(path), list(prompts or DEFAULT_PROMPTS))]


def require_head(path: Path, config: dict, head_tensors: Optional[HeadTensors]) -> HeadTensors:
    """The head the check scores, or a LayoutError saying why there is none."""
    tc = config.get("text_config", config)
    if head_tensors is None or not int(tc.get("mtp_num_hidden_layers", 0) or 0):
        raise LayoutError(
            "no MTP head: " + ("no mtp.safetensors and no language_model.mtp.* tensors" if head_tensors is None
                               else "config says mtp_num_hidden_layers=0"),
            file=path,
            hint="convert the original release with `mtpconvert convert` (stock mlx_lm.convert drops mtp.*)",
        )
    return head_tensors


def prompt_token_ids(path: Path, prompts: Optional[Sequence[str]], token_ids: Optional[Sequence[Sequence[int]]],
                     max_prompt_tokens: int) -> List[List[int]]:
    """``token_ids`` as lists of ints, else ``prompts`` through the folder's tokenizer; prompts
    shorter than two tokens are dropped (nothing to compare)."""
    if token_ids is None:
        token_ids = encode(path, prompts, max_prompt_tokens)
    token_ids = [list(map(int, ids)) for ids in token_ids if len(ids) >= 2]
    if not token_ids:
        raise ValueError("no prompt has two tokens or more")
    return token_ids


class TeacherForcedPass:
    """The check's computation in the order its inputs are needed, so that a caller may hand the
    folder over piece by piece (``runtime.streamed``): ``embed`` once the embedding is open,
    ``run_layer`` for layer 0, 1, ... as each one's tensors are open, ``finish`` with the final
    norm, the head and ``lm_head``. Between calls only the activations are resident."""

    def __init__(self, folder: _Folder, token_ids: List[List[int]], *, hidden: str = "post-norm",
                 min_acceptance: float = DEFAULT_MIN_ACCEPTANCE, exact: Optional[bool] = None,
                 compute_dtype: Optional[str] = None, progress: Optional[Callable[[str], None]] = None,
                 min_mlp_gain: Optional[float] = DEFAULT_MIN_MLP_GAIN):
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
        return self.folder.args.num_hidden_layers

    @property
    def embedded(self) -> bool:
        return self.xs is not None

    def embed(self) -> None:
        t0 = time.perf_counter()
        self.progress("embedding rows")
        emb = _Embedding(self.folder, self.token_ids)
        xs = [emb(ids) for ids in self.token_ids]
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
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        t0 = time.perf_counter()
        i = self.next_layer
        self.progress(f"layer {i + 1}/{self.layers}")
        layer = _load_layer(self.folder, i)
        _finish_layer(layer, self.exact, self.dtype)
        self.result.stages.append((f"layer {i}", _param_bytes(layer)))
        for p, x in enumerate(self.xs):
            # as Qwen3_5TextModel.__call__ with cache=None
            mask = create_ssm_mask(x, None) if layer.is_linear else create_attention_mask(x, None)
            self.xs[p] = layer(x, mask=mask, cache=None)
            mx.eval(self.xs[p])
        del layer
        gc.collect()
        mx.clear_cache()
        self.next_layer += 1
        self.result.seconds += time.perf_counter() - t0

    def finish(self, head_tensors: HeadTensors, vocab_block_bytes: int = DEFAULT_VOCAB_BLOCK_BYTES) -> LayerwiseResult:
        """The final norm, the head over every position, then lm_head's running argmax; the result."""
        t0 = time.perf_counter()
        folder, result = self.folder, self.result
        if self.next_layer != self.layers:
            raise LayoutError(f"layer {self.next_layer} of {self.layers} was never run: its tensors are missing",
                              file=folder.path)
        result.head_source = head_tensors.source
        norm = folder.shell.language_model.model.norm
        norm.load_weights([("weight", folder.weights.pop("language_model.model.norm.weight"))], strict=True)
        hs = [norm(x) for x in self.xs]
        mx.eval(hs)

        self.progress("MTP head")
        head = _load_head(folder, head_tensors)
        _finish_layer(head, self.exact, self.dtype)
        result.stages.append(("mtp head (fc, norms, layer 0)", _param_bytes(head)))
        feed = hs if self.hidden == "post-norm" else self.xs
        states = []
        for p in range(len(self.token_ids)):
            states.append(head_states(head, feed[p][:, :-1], self.nexts[p]))
        del head, feed
        self.xs = self.nexts = None
        gc.collect()
        mx.clear_cache()

        ids, block = _run_lm_head_blocks(folder, [[h, *s] for h, s in zip(hs, states)], self.exact, self.dtype,
                                         vocab_block_bytes, self.progress)
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


def layerwise_acceptance(
    path: Path,
    prompts: Optional[Sequence[str]] = None,
    token_ids: Optional[Sequence[Sequence[int]]] = None,
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    hidden: str = "post-norm",
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
    exact: Optional[bool] = None,
    vocab_block_bytes: int = DEFAULT_VOCAB_BLOCK_BYTES,
    compute_dtype: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
    min_mlp_gain: Optional[float] = DEFAULT_MIN_MLP_GAIN,
) -> LayerwiseResult:
    """Teacher-forced greedy MTP acceptance of ``path``, one layer resident at a time.

    ``token_ids`` (lists of ids) replaces tokenizing ``prompts``; ``exact`` is described in the
    module docstring (None: stock quantized kernels off the CPU, dequantized Linears on it).
    ``compute_dtype`` (only without ``exact``): "float32" runs the activations and the dequantized
    matmuls in float32; None picks it on the CPU when its float32 GEMM is faster
    (``fast_float_dtype``), else keeps the model's dtype. ``min_mlp_gain``: the floor of the head's
    MLP gain (``runtime.mlp_gain``; None: reported, not gated).
    """
    if hidden not in ("post-norm", "pre-norm"):
        raise ValueError(f"hidden must be post-norm or pre-norm, not {hidden!r}")
    t0 = time.perf_counter()
    path = Path(path)
    folder = _Folder(path)
    try:
        head_tensors = require_head(path, folder.config, locate_mtp(path, folder.headers))
        ids = prompt_token_ids(path, prompts, token_ids, max_prompt_tokens)
        run = TeacherForcedPass(folder, ids, hidden=hidden, min_acceptance=min_acceptance, exact=exact,
                                compute_dtype=compute_dtype, progress=progress, min_mlp_gain=min_mlp_gain)
        run.embed()
        while run.next_layer < run.layers:
            run.run_layer()
        result = run.finish(head_tensors, vocab_block_bytes)
        result.seconds = time.perf_counter() - t0
        return result
    finally:
        folder.close()
        mx.clear_cache()


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


# --------------------------------------------------------------------------------------------
# the same teacher-forced computation on a fully loaded model (reference for the tests, and a
# cheaper check than decoding when the model fits)


def teacher_forced_full(m, token_ids: Sequence[Sequence[int]], hidden: str = "post-norm",
                        min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
                        min_mlp_gain: Optional[float] = DEFAULT_MIN_MLP_GAIN) -> LayerwiseResult:
    """``m``: a ``runtime.load.MTPModel``. Uses the stock forward of mlx-lm's text model."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    result = LayerwiseResult("", hidden, "loaded", True, min_acceptance, min_mlp_gain=min_mlp_gain)
    inner = m.lm.model
    for ids in token_ids:
        if len(ids) < 2:
            continue
        tokens = mx.array([list(ids)])
        x = inner.embed_tokens(tokens)
        for layer in inner.layers:  # Qwen3_5TextModel.__call__ without the final norm
            mask = create_ssm_mask(x, None) if layer.is_linear else create_attention_mask(x, None)
            x = layer(x, mask=mask, cache=None)
        h = inner.norm(x)
        feed = h if hidden == "post-norm" else x
        s, s0 = head_states(m.head, feed[:, :-1], m.embed(tokens[:, 1:]))
        bb = mx.argmax(m.logits(h), axis=-1).reshape(-1).tolist()[1:]
        hd = mx.argmax(m.logits(s), axis=-1).reshape(-1).tolist()
        result.prompt_tokens.append(len(ids))
        result.backbone_next.append(bb)
        result.head_next.append(hd)
        result.head_next_without_mlp.append(mx.argmax(m.logits(s0), axis=-1).reshape(-1).tolist())
        result.per_prompt.append(agreement(bb, hd))
    return result


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Layer-by-layer teacher-forced MTP acceptance of a converted folder.")
    ap.add_argument("path", type=Path)
    ap.add_argument("--prompt", "-p", action="append", help="prompt text (repeatable)")
    ap.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS)
    ap.add_argument("--min-acceptance", type=float, default=DEFAULT_MIN_ACCEPTANCE)
    ap.add_argument("--min-mlp-gain", type=float, default=DEFAULT_MIN_MLP_GAIN,
                    help="floor of the head's acceptance with its MLP minus without it (docs/runtime.md)")
    ap.add_argument("--mtp-hidden", choices=["post-norm", "pre-norm"], default="post-norm")
    ap.add_argument("--exact", action="store_true", default=None,
                    help="stock quantized kernels everywhere (bit-identical to the loaded model; slow on the CPU)")
    ap.add_argument("--compute-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="activations and dequantized matmuls (default: float32 where its GEMM is faster)")
    ap.add_argument("--vocab-block-mb", type=float, default=DEFAULT_VOCAB_BLOCK_BYTES / 2**20)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}",
                                                                   file=sys.stderr, flush=True))
    r = layerwise_acceptance(args.path, args.prompt, max_prompt_tokens=args.max_prompt_tokens,
                             hidden=args.mtp_hidden, min_acceptance=args.min_acceptance, exact=args.exact,
                             compute_dtype=args.compute_dtype, vocab_block_bytes=int(args.vocab_block_mb * 2**20), progress=say,
                             min_mlp_gain=args.min_mlp_gain)
    print(json.dumps(r.to_json()))
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
