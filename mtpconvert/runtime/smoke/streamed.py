"""The layerwise smoke fed one output shard at a time, while the conversion writes them.

``pull-and-quantize --stream --upload-repo`` uploads each finished output shard and frees its
data; the post-hoc layerwise check (``runtime.smoke.layerwise``) would need every shard at the end.
This runs the same ``TeacherForcedPass`` as the shards arrive, so a shard can go as soon as the
check has read what it needs of it:

- on each shard: open its tensors lazily; read the final norm and ``lm_head`` (or the embedding
  when tied), which the check uses only after the last layer, into memory; copy an in-model MTP
  head (up to GBs) into a small file under ``SMOKE_DIR``; embed the prompts once the embedding is
  open; run every layer whose tensors are all open, in order; then read into memory what the
  shard holds of the layer still in progress, when that is all the check still needs of it;
- a shard is *released* (``feed`` returns it) once no layer still to run and no pending
  embedding reads it from the file. With layers written in order (``plan.build`` orders items by
  layer number within each source shard) that is every shard fed, each as it is fed: a layer
  larger than a shard (Qwen3.5-122B-A10B's and 397B-A17B's MoE layers) is gathered in memory, not held
  on disk.
- ``finish``: the final norm, the head (from the ``mtp.safetensors`` sidecar, which stays on disk,
  or from the copy) and ``lm_head`` in vocabulary blocks, from memory.

The numbers are the post-hoc check's on the same folder: the same pass over the same bytes
(tests/test_streamed_smoke.py). Resident between shards: the activations, the final norm,
``lm_head`` (0.3-1.4 GB for Qwen3.5/3.6 at 4-8 bits) and the part of the layer in progress that
has arrived (at most that layer, which running it holds anyway).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ...errors import LayoutError
from ...io.header import read_header
from ..decoding.locate import locate_mtp
from .layerwise import DEFAULT_MAX_PROMPT_TOKENS, prompt_token_ids, require_head
from .floors import LAYERWISE_MIN_ACCEPTANCE, MIN_MLP_GAIN
from .shards import _Folder
from ...families.base import Family
from .sizing import unit_of
from .teacher_forced import DEFAULT_VOCAB_BLOCK_BYTES, LayerwiseResult, TeacherForcedPass

SMOKE_DIR = ".mtpconvert-smoke"  # inside the partial folder (hidden: never uploaded); removed by finish/close
COPY_CHUNK_BYTES = 64 << 20


def shards_by_unit(weight_map: Dict[str, str], family: Family) -> Dict[str, Set[str]]:
    """For each unit (``runtime.smoke.sizing.unit_of``), the output shards holding its tensors."""
    units: Dict[str, Set[str]] = {}
    for key, shard in weight_map.items():
        units.setdefault(unit_of(key, family), set()).add(shard)
    return units


def late_units(tied: bool) -> Set[str]:
    """Units the check reads only after the last layer, when their shards may be gone."""
    return {"norm", "mtp", "embed_tokens" if tied else "lm_head"}


HEAD_COPY_UNITS = {"mtp"}  # of the late units, copied to disk (an in-model head: GBs); the rest is read into memory


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
    tokenizer) is the parent of the first shard fed. Shards the check no longer reads from are
    returned by ``feed`` (what it reads later is in memory by then, or for an in-model head in a
    copy); the caller may delete them or free their data.
    """

    def __init__(self, weight_map: Dict[str, str], family: Family, *, prompts: Optional[Sequence[str]] = None,
                 token_ids: Optional[Sequence[Sequence[int]]] = None,
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, hidden: str = "post-norm",
                 min_acceptance: float = LAYERWISE_MIN_ACCEPTANCE, exact: Optional[bool] = None,
                 compute_dtype: Optional[str] = None, vocab_block_bytes: int = DEFAULT_VOCAB_BLOCK_BYTES,
                 progress: Optional[Callable[[str], None]] = None,
                 min_mlp_gain: Optional[float] = MIN_MLP_GAIN):
        self.family = family
        self.units = shards_by_unit(weight_map, family)
        self.prompt_args = (prompts, token_ids, max_prompt_tokens)
        self.pass_args = dict(hidden=hidden, min_acceptance=min_acceptance, exact=exact,
                              compute_dtype=compute_dtype, progress=progress, min_mlp_gain=min_mlp_gain)
        self.vocab_block_bytes = vocab_block_bytes
        self.folder: Optional[_Folder] = None
        self.run: Optional[TeacherForcedPass] = None
        self.keys: Dict[str, List[str]] = {}  # shard -> its keys
        for key, shard in weight_map.items():
            self.keys.setdefault(shard, []).append(key)
        self.files: Dict[str, Path] = {}  # shard fed -> its path
        self.released: Set[str] = set()
        self.in_memory: Set[Tuple[str, str]] = set()  # (unit, shard): those tensors are read (folder.hold)
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
        self.late = late_units(self.folder.shell.tied)

    def _pending(self) -> Set[str]:
        """Units still to be read: the embedding before the prompts are embedded, and each layer still to run."""
        run = self.run
        return ({"embed_tokens"} if not run.embedded else set()) | {f"layer {i}" for i in
                                                                   range(run.next_layer, run.layers)}

    def needed(self) -> Set[str]:
        """Shards the check still reads from: holding a pending unit's tensors that are not in memory."""
        return {s for unit in self._pending() for s in self.units.get(unit, ()) if (unit, s) not in self.in_memory}

    def _hold_layer_in_progress(self) -> None:
        """Read into memory the tensors of the layer in progress from each fed shard that holds nothing else
        still pending, so the shard can go: the check holds at most that layer (which running it holds anyway)
        instead of every shard it spans. A shard holding a later layer too (shards fed out of order) stays."""
        run = self.run
        if run.next_layer >= run.layers:
            return
        unit = f"layer {run.next_layer}"
        pending = self._pending()
        for s in sorted(self.units.get(unit, set()) & set(self.files)):
            if (unit, s) in self.in_memory:
                continue
            if {unit_of(k, self.family) for k in self.keys[s]} & pending == {unit}:
                self.folder.hold([k for k in self.keys[s] if unit_of(k, self.family) == unit])
                self.in_memory.add((unit, s))

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
        head = [k for k in tensors if unit_of(k, self.family) in self.late & HEAD_COPY_UNITS]
        if head:  # read after the last layer, when this shard may be gone
            copy = path.parent / SMOKE_DIR / shard
            copy_tensors(path, head, copy)
            self.copies.append(copy)
            files.append(copy)
        self.folder.add(files)
        self.folder.hold([k for k in tensors if unit_of(k, self.family) in self.late - HEAD_COPY_UNITS])
        self.files[shard] = path
        run = self.run
        if not run.embedded and self._ready("embed_tokens"):
            run.embed()
        while run.embedded and run.next_layer < run.layers and self._ready(f"layer {run.next_layer}"):
            run.run_layer()
        self._hold_layer_in_progress()
        need = self.needed()
        done = [s for s in self.files if s not in self.released and s not in need]
        for s in done:
            self.folder.forget(self.files[s])
            self.released.add(s)
        self.most_held = max(self.most_held, len(self.files) - len(self.released))
        return done

    def finish(self) -> LayerwiseResult:
        """The head and lm_head after the last layer; the head's copy is removed."""
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
