"""A converted folder read a piece at a time, for the layerwise check (``runtime.smoke.layerwise``).

``_Folder`` opens the shards' headers and their tensors as lazy ``mx.load`` arrays (a tensor is
read only when evaluated). From it come the prompts' rows of the input embedding (``_Embedding``,
never the table), one decoder layer (``_load_layer``), the MTP head's first layer with ``fc`` and
its norms (``_load_head``), and ``lm_head`` a block of vocabulary rows at a time with a running
argmax (``_run_lm_head_blocks``). Each module is the backbone library's own class, reached through the
family's adapter (``runtime.backbone``: a never-evaluated shell of the model), quantized from config.json
as ``mlx_lm.utils.load_model`` does and filled with only its tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...errors import LayoutError
from ...families import family_for
from ...io.checkpoint import load_json
from ...io.header import TensorInfo, read_header
from ...io.reader import TensorReader
from ..decoding.locate import HEAD_PREFIXES, HeadTensors, shard_files
from ..decoding.heads import stack_experts


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


def _parent(path: str) -> str:
    """The key prefix of a module's parent: what per-path quantization entries and a holder's path start with."""
    return path[: len(path) - len(path.rsplit(".", 1)[-1])]


class _Holder(nn.Module):
    """A parent for one loose module, so that ``nn.quantize`` sees it at path ``name``."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        setattr(self, name, module)


# a nextn head's own vocabulary tensors (GLM-4.x): streamed in row blocks, never held whole
HEAD_VOCAB = ("embed_tokens.", "shared_head.head.")


# --------------------------------------------------------------------------------------------
# the streaming model


class _Folder:
    """A converted folder opened for streaming: config, mlx-lm classes, headers, lazy tensors."""

    def __init__(self, path: Path, files: Optional[Sequence[Path]] = None):
        """``files``: the weight files to open now (None: every ``model*.safetensors``); ``add`` opens more."""
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise LayoutError("not a converted model folder: no config.json", file=self.path)
        self.family = family_for(load_json(self.path / "config.json", "config.json"))
        if files is None:
            files = shard_files(self.path)
            if not files:
                raise LayoutError("no model*.safetensors in the folder", file=self.path)
        # A shell of the whole model: its parameters are lazy random arrays that are never
        # evaluated (no memory); it gives the library's sanitize, the sizes and the layer classes.
        self.shell = self.family.backbone_class().shell(self.path, self.family)
        self.config = self.shell.config
        self.paths = self.family.module_paths  # where each part's tensors are stored
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

    def add_head_vocab(self, head_tensors: HeadTensors) -> Optional[Tuple[str, str]]:
        """Open a nextn head's own embedding and output projection lazily (nothing read) under their full keys;
        return their stems, or None when the head borrows the backbone's."""
        names = [k for k in head_tensors.tensors if k.startswith(HEAD_VOCAB)]
        if not names:
            return None
        for file in sorted({head_tensors.tensors[k].file for k in names}):
            lazy = mx.load(str(file))
            for k in names:
                if head_tensors.tensors[k].file == file:
                    self.infos[head_tensors.prefix + k] = head_tensors.tensors[k]
                    self.weights[head_tensors.prefix + k] = lazy[head_tensors.prefix + k]
        return head_tensors.prefix + "embed_tokens", head_tensors.prefix + "shared_head.head"

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
                              hint="the layerwise check reads converted MLX folders")
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

    def __init__(self, folder: _Folder, token_ids: Sequence[Sequence[int]], stem: Optional[str] = None):
        """``stem``: another embedding's key stem (a nextn head's own, opened with ``_Folder.add_head_vocab``)."""
        stem = stem or folder.paths.embed
        prefixes = (_parent(stem),)
        uniq = np.unique(np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids]))
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= folder._info(stem + ".weight").shape[0]):
            raise ValueError(f"token ids outside the embedding (0..{folder._info(stem + '.weight').shape[0] - 1})")
        vocab, hidden = folder._info(stem + ".weight").shape[0], folder.shell.hidden_size
        name = stem.rsplit(".", 1)[-1]  # the module's own name (embed_tokens; Nemotron-H's embeddings): per-path
        holder = _Holder(name, nn.Embedding(vocab, hidden))  # quantization entries and scales are keyed by it
        _quantize(holder, prefixes, folder.quant, folder.weights)
        self.module = getattr(holder, name)
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
                        progress: Callable[[str], None], stem: Optional[str] = None) -> Tuple[List[List[List[int]]], int]:
    """Running argmax of lm_head over vocabulary blocks, for every state array in ``states``
    (``states[p][j]``: prompt p's j-th [1, L, H] array). Returns argmax ids, and the largest block's bytes.
    ``stem``: another output projection's key stem (a nextn head's ``shared_head.head``)."""
    tied = stem is None and folder.shell.tied
    if stem is not None:
        vocab = folder._info(stem + ".weight").shape[0]
        module = nn.Linear(folder.shell.hidden_size, vocab, bias=False)
    else:
        stem = folder.paths.embed if tied else folder.paths.lm_head
        module = folder.shell.embed_tokens if tied else folder.shell.lm_head
    name = stem.rsplit(".", 1)[-1]
    holder = _Holder(name, module)
    prefixes = (_parent(stem),)
    _quantize(holder, prefixes, folder.quant, folder.weights)
    module = getattr(holder, name)
    keys = folder._module_keys(stem)
    if not keys:
        raise LayoutError(f"no {stem}.* tensors", file=folder.path)
    vocab = folder._info(stem + ".weight").shape[0]
    row_bytes = sum(folder._info(k).nbytes for k in keys) // vocab
    quantized = isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    dequant = quantized and not exact and module.mode == "affine"
    deq_row_bytes = folder.shell.hidden_size * dtype.size if dequant else 0
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
    """Decoder layer i: the library's class, quantized as load_model would, filled with its tensors only."""
    return _load_module(folder, folder.paths.layer(i), folder.shell.new_layer(i))


def _load_module(folder: _Folder, path: str, module: nn.Module) -> nn.Module:
    """``module`` (an empty one of the library's class) filled with the tensors stored under ``path``, quantized
    as load_model would."""
    prefix = path + "."
    weights = folder.shell.layer_weights({k: folder.weights.pop(k) for k in [k for k in folder.weights
                                                                            if k.startswith(prefix)]})
    _quantize(module, (prefix,), folder.quant, weights)
    module.load_weights([(k[len(prefix):], v) for k, v in weights.items()], strict=True)
    del weights  # the module now holds the only references
    mx.eval(module.parameters())
    folder.read_bytes += sum(folder.infos[k].nbytes for k in folder._module_keys(path))
    module.eval()
    return module


def _load_head(folder: _Folder, head_tensors: HeadTensors) -> nn.Module:
    """The head's fc, norms and first layer (the one every first draft uses), as runtime.decoding.load builds it;
    a head that is one layer whatever its keys (``Family.single_layer_head``: a nextn layer, or a prediction module
    whose blocks are ``layers.{j}``) whole."""
    files = sorted({t.file for t in head_tensors.tensors.values()})
    whole = folder.family.single_layer_head
    # a nextn head's own embedding and output projection are streamed in row blocks like the backbone's
    wanted = {k for k in head_tensors.tensors if (whole or not k.startswith("layers.") or k.startswith("layers.0."))
              and not k.startswith(HEAD_VOCAB)}
    weights = {}
    for f in files:
        lazy = mx.load(str(f))
        for k in wanted:
            full = head_tensors.prefix + k
            if full in lazy and head_tensors.tensors[k].file == f:
                weights[k] = lazy[full]
        del lazy
    weights = folder.shell.head_weights(stack_experts(weights, folder.family))
    head = folder.shell.make_head(1)
    for name in ("embed_tokens", "shared_head"):
        head.pop(name, None)  # read by row blocks (head_vocab), not held
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
