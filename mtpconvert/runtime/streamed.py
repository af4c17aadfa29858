"""The layerwise smoke fed one output shard at a time, while the conversion writes them.

``pull-and-quantize --stream --upload-repo`` uploads each finished output shard and frees its
data; the post-hoc layerwise check (``runtime.layerwise``) would need every shard at the end.
This runs the same ``TeacherForcedPass`` as the shards arrive, so a shard can go as soon as the
check has run the layers it holds:

- on each shard: open its tensors lazily; copy the tensors the check reads only at the end (the
  final norm, ``lm_head`` — or the embedding when tied — and an in-model MTP head) into a small
  file under ``SMOKE_DIR``; embed the prompts once the embedding is open; run every layer whose
  tensors are all open, in order;
- a shard is *released* (``feed`` returns it) once no layer still to run and no pending
  embedding reads it. With layers written in order (``plan.build`` orders items by layer number
  within each source shard) that is the shard before the one just finished: a layer cut by a
  shard boundary waits for the next shard.
- ``finish``: the final norm, the head (from the ``mtp.safetensors`` sidecar, which stays on disk,
  or from the copies) and ``lm_head`` in vocabulary blocks, from the copies.

The numbers are the post-hoc check's on the same folder: the same pass over the same bytes
(tests/test_streamed_smoke.py). Resident between shards: the activations only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set

from ..errors import LayoutError
from ..io.header import read_header
from .layerwise import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MIN_ACCEPTANCE,
    DEFAULT_MIN_MLP_GAIN,
    DEFAULT_VOCAB_BLOCK_BYTES,
    LayerwiseResult,
    TeacherForcedPass,
    _Folder,
    locate_mtp,
    prompt_token_ids,
    require_head,
    unit_of,
)

SMOKE_DIR = ".mtpconvert-smoke"  # inside the partial folder (hidden: never uploaded); removed by finish/close
COPY_CHUNK_BYTES = 64 << 20


def shards_by_unit(weight_map: Dict[str, str]) -> Dict[str, Set[str]]:
    """For each unit (``runtime.layerwise.unit_of``), the output shards holding its tensors."""
    units: Dict[str, Set[str]] = {}
    for key, shard in weight_map.items():
        units.setdefault(unit_of(key), set()).add(shard)
    return units


def late_units(tied: bool) -> Set[str]:
    """Units the check reads only after the last layer: copied out of their shards as they arrive."""
    return {"norm", "mtp", "embed_tokens" if tied else "lm_head"}


def copy_tensors(src: Path, keys: Sequence[str], dest: Path, chunk: int = COPY_CHUNK_BYTES) -> None:
    """A standalone safetensors file with ``keys`` of ``src``: their bytes copied a chunk at a time."""
    tensors = read_header(src).tensors
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for k in keys:
        t = tensors[k]
        header[k] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # data starts 8-byte aligned, as safetensors writes it
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        fout.write(len(body).to_bytes(8, "little") + body)
        for k in keys:
            fin.seek(tensors[k].start)
            left = tensors[k].nbytes
            while left:
                data = fin.read(min(chunk, left))
                if not data:
                    raise LayoutError(f"{src.name} ends inside tensor {k}", file=src, key=k)
                fout.write(data)
                left -= len(data)


class StreamedLayerwise:
    """Feed finished output shards (``feed``) in any order; ``finish`` gives the ``LayerwiseResult``.

    ``weight_map``: every model shard's keys (the index's ``weight_map``). The folder (config,
    tokenizer) is the parent of the first shard fed. Shards the check no longer needs are
    returned by ``feed``; the caller may delete them.
    """

    def __init__(self, weight_map: Dict[str, str], *, prompts: Optional[Sequence[str]] = None,
                 token_ids: Optional[Sequence[Sequence[int]]] = None,
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, hidden: str = "post-norm",
                 min_acceptance: float = DEFAULT_MIN_ACCEPTANCE, exact: Optional[bool] = None,
                 compute_dtype: Optional[str] = None, vocab_block_bytes: int = DEFAULT_VOCAB_BLOCK_BYTES,
                 progress: Optional[Callable[[str], None]] = None,
                 min_mlp_gain: Optional[float] = DEFAULT_MIN_MLP_GAIN):
        self.units = shards_by_unit(weight_map)
        self.prompt_args = (prompts, token_ids, max_prompt_tokens)
        self.pass_args = dict(hidden=hidden, min_acceptance=min_acceptance, exact=exact,
                              compute_dtype=compute_dtype, progress=progress, min_mlp_gain=min_mlp_gain)
        self.vocab_block_bytes = vocab_block_bytes
        self.folder: Optional[_Folder] = None
        self.run: Optional[TeacherForcedPass] = None
        self.files: Dict[str, Path] = {}  # shard fed -> its path
        self.released: Set[str] = set()
        self.copies: List[Path] = []
        self.most_held = 0  # most fed shards the check needed at once (after each feed)
        self.failed = False  # feed raised: the check, not the conversion, stopped the run

    # -- what the check still waits for
    def _open(self, root: Path) -> None:
        shutil.rmtree(root / SMOKE_DIR, ignore_errors=True)  # a failed run's copies: made again from the shards
        self.folder = _Folder(root, files=[])
        prompts, token_ids, max_tokens = self.prompt_args
        ids = prompt_token_ids(root, prompts, token_ids, max_tokens)
        self.run = TeacherForcedPass(self.folder, ids, **self.pass_args)
        self.late = late_units(self.folder.args.tie_word_embeddings)

    def needed(self) -> Set[str]:
        """Shards holding a layer still to run, or the embedding before the prompts are embedded."""
        run = self.run
        need = set() if run.embedded else set(self.units.get("embed_tokens", ()))
        for i in range(run.next_layer, run.layers):
            need |= self.units.get(f"layer {i}", set())
        return need

    def _ready(self, unit: str) -> bool:
        return self.units.get(unit, set()) <= set(self.files)

    # -- the caller's
    def feed(self, shard: str, path: Path) -> List[str]:
        """Open ``path``, run what it completes; return the fed shards the check no longer needs."""
        try:
            return self._feed(shard, Path(path))
        except BaseException:
            self.failed = True
            raise

    def _feed(self, shard: str, path: Path) -> List[str]:
        if self.folder is None:
            self._open(path.parent)
        tensors = read_header(path).tensors
        for k, t in tensors.items():
            if "conv1d.weight" in k and t.shape[-1] != 1:  # sanitize would shift norms folder-wide
                raise LayoutError("conv1d weight in the raw layout: not a converted folder", file=path, key=k)
        files = [path]
        late = [k for k in tensors if unit_of(k) in self.late]
        if late:  # read after the last layer, when this shard may be gone
            copy = path.parent / SMOKE_DIR / shard
            copy_tensors(path, late, copy)
            self.copies.append(copy)
            files.append(copy)
        self.folder.add(files)
        self.files[shard] = path
        run = self.run
        if not run.embedded and self._ready("embed_tokens"):
            run.embed()
        while run.embedded and run.next_layer < run.layers and self._ready(f"layer {run.next_layer}"):
            run.run_layer()
        need = self.needed()
        done = [s for s in self.files if s not in self.released and s not in need]
        for s in done:
            self.folder.forget(self.files[s])
            self.released.add(s)
        self.most_held = max(self.most_held, len(self.files) - len(self.released))
        return done

    def finish(self) -> LayerwiseResult:
        """The head and lm_head after the last layer; the copies are removed."""
        if self.folder is None:
            raise LayoutError("the streamed smoke was fed no model shard")
        try:
            root = self.folder.path
            head = require_head(root, self.folder.config,
                                locate_mtp(root, [read_header(c) for c in self.copies]))
            return self.run.finish(head, self.vocab_block_bytes)
        finally:
            self.close()

    def close(self) -> None:
        if self.folder is not None:
            self.folder.close()
            shutil.rmtree(self.folder.path / SMOKE_DIR, ignore_errors=True)
