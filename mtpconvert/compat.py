"""Which MTP runtimes can use a folder, and how: a table computed from headers alone.

``compat(folder)`` is a pure function of a :class:`Folder` snapshot (``config.json``, the index,
every safetensors *header* at the root and under ``mtp/``, and ``mtp/manifest.json``); no tensor
data is read. For each runtime it answers two questions:

* ``backbone_exact``: does the runtime load the backbone exactly as written?  (The known trap:
  mlx-lm 0.30.7-0.31.x adds +1 to every backbone RMSNorm a second time when any key of a
  ``model*.safetensors`` file contains ``mtp.``; mtplx, rapid-mlx and vllm-mlx pin
  ``mlx-lm<0.32``.)
* ``head_usable``: does it find the MTP head and read it with the right norms, expert layout and
  quantization?  The reason says where it found the head, or why not.

The rules for stock mlx-lm, mlx-vlm 0.7.10 and the mlx-lm PR #990 branch were read from their
code and checked by running them on converted fixtures (``interop/``, ``docs/interop.md``).
The rules for mtplx, rapid-mlx and vllm-mlx are kept together in one marked block below
(``_mtplx``, ``_rapid_mlx``, ``_vllm_mlx``) so they can be corrected in one place.
"""

from __future__ import annotations

import fnmatch
import json
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

# --------------------------------------------------------------------------- data model

RUNTIMES = ("mlx-lm<0.32", "mlx-lm>=0.32", "mlx-vlm", "mtplx", "rapid-mlx", "vllm-mlx", "mlx-lm-pr990")

MAX_HEADER = 100 * 1024 * 1024  # a safetensors header is JSON; refuse absurd lengths


@dataclass
class Verdict:
    ok: bool
    reason: str


@dataclass
class RuntimeCompat:
    runtime: str
    versions: str
    backbone_exact: Verdict
    head_usable: Verdict
    verified: bool  # rule checked by running the runtime (interop/), not only read from its code


@dataclass
class CompatReport:
    folder: str
    layout: str  # in-model | sidecar:<file> | none | mixed:<...>
    runtimes: List[RuntimeCompat] = field(default_factory=list)

    def get(self, runtime: str) -> RuntimeCompat:
        for r in self.runtimes:
            if r.runtime == runtime:
                return r
        raise KeyError(runtime)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Folder:
    """What the rules look at. ``headers`` maps a path relative to the folder (``model-00001-of-
    00002.safetensors``, ``mtp.safetensors``, ``mtp/weights.safetensors``) to its parsed header
    (tensor name -> {dtype, shape, data_offsets}, plus ``__metadata__``)."""

    config: dict
    headers: Dict[str, dict]
    index: Optional[dict] = None
    manifests: Dict[str, dict] = field(default_factory=dict)  # e.g. {"mtp/manifest.json": {...}}
    path: str = ""


# --------------------------------------------------------------------------- reading (I/O)


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"{path}: header length {n} is not plausible")
        data = f.read(n)
        if len(data) != n:
            raise ValueError(f"{path}: truncated header")
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    return header


def read_folder(path: Path) -> Folder:
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    headers = {}
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("mtp/*.safetensors"))
    extra = config.get("mlx_lm_extra_tensors")
    named = extra.get("mtp_file") if isinstance(extra, dict) else None
    if isinstance(named, str) and named:
        f = (path / named).resolve()
        if f.is_file() and path.resolve() in f.parents and f not in [x.resolve() for x in files]:
            files.append(f)
    for f in files:
        headers[f.resolve().relative_to(path.resolve()).as_posix()] = read_header(f)
    index = None
    if (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
    manifests = {}
    for m in sorted(path.glob("mtp/*.json")):
        try:
            manifests[m.relative_to(path).as_posix()] = json.loads(m.read_text())
        except ValueError:
            manifests[m.relative_to(path).as_posix()] = {"__unreadable__": True}
    return Folder(config=config, headers=headers, index=index, manifests=manifests, path=str(path))


def check_folder(path: Path) -> CompatReport:
    return compat(read_folder(path))


# --------------------------------------------------------------------------- folder facts

NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def _tensors(header: dict) -> Dict[str, dict]:
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _metadata(header: dict) -> dict:
    m = header.get("__metadata__")
    return m if isinstance(m, dict) else {}


def _text(config: dict) -> dict:
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def _mtp_layers(config: dict) -> int:
    return int(_text(config).get("mtp_num_hidden_layers", 0) or 0)


def _root(folder: Folder) -> List[str]:
    return [n for n in folder.headers if "/" not in n]


def _glob_model(folder: Folder) -> List[str]:
    """The files mlx-lm's ``load_model`` reads: ``glob(model_path / "model*.safetensors")``."""
    return sorted(n for n in _root(folder) if fnmatch.fnmatchcase(n, "model*.safetensors"))


def _keys_with(folder: Folder, files: List[str], pred: Callable[[str], bool]) -> List[Tuple[str, str]]:
    return [(f, k) for f in files for k in _tensors(folder.headers[f]) if pred(k)]


def _conv_raw(folder: Folder, files: List[str]) -> bool:
    """A raw (PyTorch-layout) checkpoint: some ``conv1d.weight`` is ``[C, 1, K]`` with K > 1."""
    for f in files:
        for k, v in _tensors(folder.headers[f]).items():
            if "conv1d.weight" in k and (v.get("shape") or [1])[-1] != 1:
                return True
    return False


@dataclass
class Head:
    """Head tensors one runtime would read, by canonical name (``fc.weight``, ``layers.0....``)."""

    files: List[str]
    tensors: Dict[str, dict]
    mlx_format: bool  # every file carries safetensors metadata format=mlx

    @property
    def quantized(self) -> List[str]:
        return sorted(k[: -len(".scales")] for k in self.tensors if k.endswith(".scales"))

    def layers(self) -> set:
        return {int(m.group(1)) for k in self.tensors if (m := re.match(r"^layers\.(\d+)\.", k))}


def _head(folder: Folder, files: List[str], prefixes: Tuple[str, ...], bare: bool = False) -> Optional[Head]:
    tensors, used = {}, []
    for f in files:
        if f not in folder.headers:
            continue
        hit = False
        for k, v in _tensors(folder.headers[f]).items():
            for p in prefixes:
                if k.startswith(p):
                    tensors[k[len(p):]] = v
                    hit = True
                    break
            else:
                if bare and (k.startswith("fc.") or k.startswith("pre_fc_norm") or k.startswith("layers.")
                             or k.startswith("norm.")):
                    tensors[k] = v
                    hit = True
        if hit:
            used.append(f)
    if not tensors:
        return None
    fmt = all(_metadata(folder.headers[f]).get("format") == "mlx" for f in used)
    return Head(used, tensors, fmt)


def _in_dims(name: str, tc: dict) -> Optional[int]:
    """Input features of a head module (needed to tell bits from packed shapes)."""
    h = tc.get("hidden_size")
    if name == "fc":
        return 2 * h if h else None
    last = name.rsplit(".", 1)[-1]
    if last in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "gate", "shared_expert_gate"):
        return h
    if last == "o_proj":
        n, d = tc.get("num_attention_heads"), tc.get("head_dim")
        return n * d if n and d else None
    if last == "down_proj":
        if ".switch_mlp." in name or ".experts." in name:
            return tc.get("moe_intermediate_size")
        if ".shared_expert." in name:
            return tc.get("shared_expert_intermediate_size")
        return tc.get("intermediate_size")
    return None


def _bits(head: Head, module: str, tc: dict) -> Optional[Tuple[int, int]]:
    """(bits, group_size) a quantized head module was written with, from its shapes."""
    w, s = head.tensors.get(module + ".weight"), head.tensors.get(module + ".scales")
    ind = _in_dims(module, tc)
    if not w or not s or not ind:
        return None
    wc, sc = (w.get("shape") or [0])[-1], (s.get("shape") or [0])[-1]
    if not wc or not sc or (wc * 32) % ind or ind % sc:
        return None
    return (wc * 32) // ind, ind // sc


def _quant(config: dict) -> dict:
    q = config.get("quantization") or config.get("quantization_config") or _text(config).get("quantization_config")
    return q if isinstance(q, dict) else {}


def _top(q: dict) -> Optional[Tuple[int, int]]:
    if "bits" in q and "group_size" in q:
        return int(q["bits"]), int(q["group_size"])
    return None


def _entry_bits(entry, q: dict) -> Optional[Tuple[int, int]]:
    """What a per-path quantization entry makes of a module: None = not quantized."""
    if entry is False:
        return None
    if isinstance(entry, dict):
        top = _top(q) or (None, None)
        return int(entry.get("bits", top[0])), int(entry.get("group_size", top[1]))
    return _top(q)


def _quant_mismatches(head: Head, tc: dict, expect: Callable[[str], Optional[Tuple[int, int]]]) -> List[str]:
    """Quantized head modules the runtime would build with other (bits, group) than written."""
    bad = []
    for m in head.quantized:
        have = _bits(head, m, tc)
        want = expect(m)
        if have is not None and have != want:
            bad.append(f"{m} is {have[0]}-bit/g{have[1]} but would be read as "
                       + (f"{want[0]}-bit/g{want[1]}" if want else "unquantized"))
    return bad


def _moe_expert_layout(head: Head) -> str:
    """stacked | per-expert | fused | none (dense) for the head's MoE layers."""
    keys = head.tensors
    if any(".mlp.switch_mlp." in k for k in keys):
        return "stacked"
    if any(".mlp.experts.gate_up_proj" in k for k in keys):
        return "fused"
    if any(_EXPERT_RE.match(k) for k in keys):
        return "per-expert"
    return "none"


def _files_str(files: List[str]) -> str:
    return ", ".join(files[:3]) + (f" (+{len(files) - 3})" if len(files) > 3 else "")


def layout_of(folder: Folder) -> str:
    in_model = _keys_with(folder, _glob_model(folder), lambda k: "mtp." in k)
    side = [n for n in folder.headers if n not in _glob_model(folder)
            and any(k.startswith("mtp.") or k.startswith("fc.") for k in _tensors(folder.headers[n]))]
    if in_model and side:
        return "mixed:in-model+" + ",".join(side)
    if in_model:
        return "in-model" if not any(f for f, _ in in_model if "mtp" in f) else "sidecar:" + in_model[0][0]
    if side:
        return "sidecar:" + ",".join(side)
    return "none"


# --------------------------------------------------------------------------- verified rules


def _no_head(folder: Folder) -> Optional[Verdict]:
    if _mtp_layers(folder.config) == 0 and not any("mtp" in n or any("mtp." in k for k in _tensors(h))
                                                   for n, h in folder.headers.items()):
        return Verdict(False, "the folder has no MTP head (mtp_num_hidden_layers is 0, no mtp tensors)")
    return None


def _mlx_lm_old_backbone(folder: Folder, who: str = "mlx-lm 0.30.7-0.31.x") -> Verdict:
    files = _glob_model(folder)
    if not files:
        return Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)")
    hits = _keys_with(folder, files, lambda k: "mtp." in k)
    if hits and not _conv_raw(folder, files):
        where = sorted({f for f, _ in hits})
        return Verdict(False, f"{len(hits)} key(s) containing 'mtp.' in {_files_str(where)}: {who} then adds +1 "
                              "to every backbone RMSNorm a second time (silently wrong model)")
    if hits:
        return Verdict(True, "raw checkpoint (conv1d [C,1,K]): the one norm shift it applies is the right one")
    return Verdict(True, f"no 'mtp.' key in {_files_str(files)}: norms loaded as written")


def _mlx_lm_old(folder: Folder) -> RuntimeCompat:
    return RuntimeCompat("mlx-lm<0.32", "0.30.7-0.31.3", _mlx_lm_old_backbone(folder),
                         Verdict(False, "stock mlx-lm has no MTP decoding (sanitize drops every mtp.* key)"), True)


def _mlx_lm_new(folder: Folder) -> RuntimeCompat:
    files = _glob_model(folder)
    bb = (Verdict(True, "mtp.* keys are dropped before the norm-shift decision, which looks only at conv1d")
          if files else Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)"))
    return RuntimeCompat("mlx-lm>=0.32", "0.32.x", bb,
                         Verdict(False, "stock mlx-lm has no MTP decoding (sanitize drops every mtp.* key)"), True)


def _mlx_vlm_files(folder: Folder) -> Tuple[List[str], bool]:
    wm = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for f in wm.values() if f in folder.headers})
    if listed:
        return listed, True
    return sorted(n for n in _root(folder) if not n.endswith("consolidated.safetensors")), False


def _mlx_vlm(folder: Folder) -> RuntimeCompat:
    tc = _text(folder.config)
    files, from_index = _mlx_vlm_files(folder)
    # backbone: mtp.* keys are dropped first; then a norm is shifted when the checkpoint is raw
    # (conv1d [C,1,K]) or when its key does not start with "language_model." (HF naming).
    if not files:
        bb = Verdict(False, "no safetensors file to load")
    else:
        raw = _conv_raw(folder, files)
        hf_named = [k for f, k in _keys_with(folder, files, lambda k: "mtp." not in k and k.endswith(NORM_SUFFIXES)
                                             and not k.startswith("language_model."))]
        if not raw and hf_named:
            bb = Verdict(False, f"norm {hf_named[0]} is not under language_model.: mlx-vlm shifts it +1 although "
                                "the folder is already MLX (conv1d [C,K,1])")
        else:
            bb = Verdict(True, "reads " + ("the index's files" if from_index else "every root *.safetensors")
                         + "; drops mtp.* keys before its norm-shift decision")
    nh = _no_head(folder)
    if nh:
        return RuntimeCompat("mlx-vlm", "0.7.10", bb, nh, True)
    # head: keys starting with "mtp." -- the index's weight_map first, else every root file
    wm = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for k, f in wm.items() if k.startswith("mtp.") and f in folder.headers})
    head = _head(folder, listed, ("mtp.",)) if listed else None
    if head is None:
        head = _head(folder, sorted(n for n in _root(folder) if not n.endswith("consolidated.safetensors")),
                     ("mtp.",))
    if head is None:
        inm = _keys_with(folder, _root(folder), lambda k: k.startswith("language_model.mtp."))
        why = ("in-model language_model.mtp.* keys are not found: mlx-vlm selects only keys that start with 'mtp.'"
               if inm else "no key starting with 'mtp.' in the index or any root *.safetensors")
        return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(False, why), True)
    where = _files_str(head.files)
    raw_folder = _conv_raw(folder, _root(folder))
    if not head.mlx_format and not raw_folder:
        return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(False, (
            f"{where} has no safetensors metadata format=mlx: mlx-vlm takes the head for a raw HF one and adds +1 "
            "to its (already shifted) norms")), True)
    if head.mlx_format:
        layout = _moe_expert_layout(head)
        if layout in ("per-expert", "fused"):
            return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(False, (
                f"{layout} MTP experts in an MLX-format head: mlx-vlm loads MLX heads as-is, and its MoE layer "
                "wants stacked switch_mlp")), True)
    n = _mtp_layers(folder.config) or 1
    if head.layers() and head.layers() != set(range(n)):
        return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(False, (
            f"head has layers {sorted(head.layers())}, config mtp_num_hidden_layers={n}")), True)
    q = folder.config.get("mtplx_mtp_quantization") or _quant(folder.config)
    if head.quantized:
        if not _top(q):
            return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(False, "quantized head but no quantization "
                                                                  "block in config.json"), True)
        bad = _quant_mismatches(head, tc, lambda m: _entry_bits(q.get("mtp." + m, q.get(m)), q))
        if bad:
            return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(False, (
                bad[0] + " (mlx-vlm reads per-path entries named mtp.<module>; language_model.mtp.* ones are not "
                "seen)")), True)
    how = "index weight_map" if listed else "root *.safetensors scan"
    return RuntimeCompat("mlx-vlm", "0.7.10", bb, Verdict(True, (
        f"{len(head.tensors)} mtp.* tensors in {where} (via {how}); "
        + ("format=mlx: used as written" if head.mlx_format else "raw HF head: norms +1 once")
        + (f"; {len(head.quantized)} quantized modules" if head.quantized else "")
        + "; drafts from the post-norm hidden state")), True)


def _pr990_head_problem(folder: Folder, files: List[str], tc: dict) -> Optional[str]:
    head = _head(folder, files, ("language_model.mtp.", "mtp."))
    if head is None:
        hits = _keys_with(folder, files, lambda k: "mtp." in k)
        return f"mtp keys under a prefix the branch does not map (e.g. {hits[0][1]})"
    if int(tc.get("num_experts", 0) or 0) > 0:
        layout = _moe_expert_layout(head)
        if layout == "stacked":
            return ("stacked switch_mlp MTP experts: the branch's sanitize stacks experts.{e}.{proj}.weight "
                    "itself and raises KeyError on a stacked head")
        if layout == "per-expert" and any(_EXPERT_RE.match(k) and not k.endswith(".weight") for k in head.tensors):
            return "quantized per-expert MTP experts: the branch stacks only .weight (scales/biases are left over)"
    q = _quant(folder.config)
    if head.quantized:
        bad = _quant_mismatches(head, tc, lambda m: _entry_bits(q.get("language_model.mtp." + m), q))
        if bad:
            return bad[0] + " (the branch reads per-path entries named language_model.mtp.<module>)"
    return None


def _pr990(folder: Folder) -> RuntimeCompat:
    tc = _text(folder.config)
    files = _glob_model(folder)
    n = _mtp_layers(folder.config)
    hits = _keys_with(folder, files, lambda k: "mtp." in k)
    name = "mlx-lm-pr990"
    ver = "AirRunner/mlx-lm feat/mtp-native (0.31.3 base)"
    if not files:
        v = Verdict(False, "no model*.safetensors file")
        return RuntimeCompat(name, ver, v, v, True)
    if n > 0 and not hits:
        v = Verdict(False, "refuses to load: mtp_num_hidden_layers > 0 but no mtp key in model*.safetensors "
                           "(ValueError; KeyError for MoE, whose expert stacking runs first) -- the branch reads "
                           "the head only from the model shards")
        return RuntimeCompat(name, ver, v, v, True)
    bb = Verdict(True, "norm shift decided by conv1d only; the head is loaded with the model")
    if n == 0:
        return RuntimeCompat(name, ver, bb, Verdict(False, "mtp_num_hidden_layers is 0: no head is built "
                                                           "(mtp.* keys dropped)"), True)
    # The head is part of the model: whatever stops it from loading stops the whole model.
    problem = _pr990_head_problem(folder, files, tc)
    if problem:
        v = Verdict(False, "the model does not load: " + problem)
        return RuntimeCompat(name, ver, v, v, True)
    head = _head(folder, files, ("language_model.mtp.", "mtp."))
    return RuntimeCompat(name, ver, bb, Verdict(True, (
        f"{len(head.tensors)} head tensors in {_files_str(head.files)} (in-model)"
        + (f"; {len(head.quantized)} quantized modules" if head.quantized else "")
        + "; drafts from the pre-norm hidden state")), True)


# --------------------------------------------------------------------------- UNVERIFIED CONTRACT
# mtplx 2.12.2, rapid-mlx 0.16.10, vllm-mlx 0.6.0: rules taken from the contract the other
# interop helper is verifying (interop/probes/mtplx.py, rapid_mlx.py, vllm_mlx.py). Correct them
# HERE. All three pin mlx-lm<0.32 (their package metadata), so their backbone is assumed to go
# through mlx-lm 0.31.x's loader and share its double-shift hazard.

MTPLX_SIDECARS = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
MTPLX_KNOWN_QUANTIZED = re.compile(  # head modules mtplx takes quantized ("known key sets")
    r"^layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|"
    r"mlp\.switch_mlp\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)$")
RAPID_SIDECARS = ("mtp.safetensors", "model-mtp.safetensors", "mtp/model.safetensors", "model.safetensors")
VLLM_SIDECAR, VLLM_MANIFEST, VLLM_ROOT_SIDECAR = "mtp/weights.safetensors", "mtp/manifest.json", "model-mtp.safetensors"


def _mtplx(folder: Folder) -> RuntimeCompat:
    bb = _mlx_lm_old_backbone(folder, "mlx-lm 0.31.x (mtplx pins mlx-lm<0.32)")
    nh = _no_head(folder)
    if nh:
        return RuntimeCompat("mtplx", "2.12.2", bb, nh, False)
    extra = folder.config.get("mlx_lm_extra_tensors")
    named = extra.get("mtp_file") if isinstance(extra, dict) else None
    if named:
        if named not in folder.headers:
            return RuntimeCompat("mtplx", "2.12.2", bb, Verdict(False, (
                f"config mlx_lm_extra_tensors.mtp_file = {named!r} but there is no such file")), False)
        head, src = _head(folder, [named], ("mtp.", "language_model.mtp."), bare=True), f"{named} (mtp_file)"
    else:
        side = next((s for s in MTPLX_SIDECARS if s in folder.headers), None)
        if side:
            head, src = _head(folder, [side], ("mtp.", "language_model.mtp."), bare=True), side
        else:
            head, src = _head(folder, _glob_model(folder), ("language_model.mtp.", "mtp.")), "in-model"
    if head is None:
        return RuntimeCompat("mtplx", "2.12.2", bb, Verdict(False, f"no MTP tensors in {src}"), False)
    odd = [m for m in head.quantized if not MTPLX_KNOWN_QUANTIZED.match(m)]
    if odd:
        return RuntimeCompat("mtplx", "2.12.2", bb, Verdict(False, (
            f"quantized head module {odd[0]} is outside the key sets mtplx takes quantized")), False)
    return RuntimeCompat("mtplx", "2.12.2", bb, Verdict(True, f"{len(head.tensors)} head tensors from {src}"), False)


def _rapid_mlx(folder: Folder) -> RuntimeCompat:
    tc = _text(folder.config)
    bb = _mlx_lm_old_backbone(folder, "mlx-lm 0.31.x (rapid-mlx pins mlx-lm<0.32)")
    nh = _no_head(folder)
    if nh:
        return RuntimeCompat("rapid-mlx", "0.16.10", bb, nh, False)
    head, src = None, None
    for s in RAPID_SIDECARS:
        if s in folder.headers:
            head = _head(folder, [s], ("mtp.",), bare=(s != "model.safetensors"))
            if head is not None:
                src = s
                break
    if head is None:
        inm = _keys_with(folder, _glob_model(folder), lambda k: "mtp." in k)
        return RuntimeCompat("rapid-mlx", "0.16.10", bb, Verdict(False, (
            "rapid-mlx reads the head only from a sidecar (" + ", ".join(RAPID_SIDECARS) + ")"
            + ("; in-model mtp keys are not read" if inm else ""))), False)
    if head.quantized:
        fc = _bits(head, "fc", tc) if "fc" in head.quantized else None
        if fc is None:
            return RuntimeCompat("rapid-mlx", "0.16.10", bb, Verdict(False, (
                f"{src}: float fc with {len(head.quantized)} quantized layers is refused (rapid-mlx infers the "
                "head's bits from fc; mtpconvert never quantizes fc)")), False)
        bad = _quant_mismatches(head, tc, lambda m: fc)
        if bad:
            return RuntimeCompat("rapid-mlx", "0.16.10", bb, Verdict(False, bad[0] + " (bits taken from fc)"), False)
    return RuntimeCompat("rapid-mlx", "0.16.10", bb, Verdict(True, f"{len(head.tensors)} head tensors from {src}"),
                         False)


def _vllm_mlx(folder: Folder) -> RuntimeCompat:
    tc = _text(folder.config)
    bb = _mlx_lm_old_backbone(folder, "mlx-lm 0.31.x (vllm-mlx pins mlx-lm<0.32)")
    nh = _no_head(folder)
    if nh:
        return RuntimeCompat("vllm-mlx", "0.6.0", bb, nh, False)
    if VLLM_SIDECAR in folder.headers:
        manifest = folder.manifests.get(VLLM_MANIFEST)
        if manifest is None:
            return RuntimeCompat("vllm-mlx", "0.6.0", bb, Verdict(False, (
                f"{VLLM_SIDECAR} without {VLLM_MANIFEST}")), False)
        fmt = manifest.get("rmsnorm_weight_format")
        if fmt != "mlx_gamma":
            return RuntimeCompat("vllm-mlx", "0.6.0", bb, Verdict(False, (
                f"{VLLM_MANIFEST} rmsnorm_weight_format={fmt!r}, not 'mlx_gamma': the head's norms would be "
                "taken as zero-centred")), False)
        head, src = _head(folder, [VLLM_SIDECAR], ("mtp.",), bare=True), VLLM_SIDECAR
    elif VLLM_ROOT_SIDECAR in folder.headers:
        head, src = _head(folder, [VLLM_ROOT_SIDECAR], ("mtp.",), bare=True), VLLM_ROOT_SIDECAR
    else:
        return RuntimeCompat("vllm-mlx", "0.6.0", bb, Verdict(False, (
            f"vllm-mlx reads the head from {VLLM_SIDECAR} + {VLLM_MANIFEST} (or a root {VLLM_ROOT_SIDECAR}); "
            "none here")), False)
    if head is None:
        return RuntimeCompat("vllm-mlx", "0.6.0", bb, Verdict(False, f"no MTP tensors in {src}"), False)
    if head.quantized:
        top = _top(_quant(folder.config))
        bad = _quant_mismatches(head, tc, lambda m: top)
        if bad:
            return RuntimeCompat("vllm-mlx", "0.6.0", bb, Verdict(False, (
                bad[0] + " (vllm-mlx dequantizes the head with the top-level bits/group_size only)")), False)
    return RuntimeCompat("vllm-mlx", "0.6.0", bb, Verdict(True, f"{len(head.tensors)} head tensors from {src}"),
                         False)


# --------------------------------------------------------------------------- the table

_RULES = {"mlx-lm<0.32": _mlx_lm_old, "mlx-lm>=0.32": _mlx_lm_new, "mlx-vlm": _mlx_vlm, "mtplx": _mtplx,
          "rapid-mlx": _rapid_mlx, "vllm-mlx": _vllm_mlx, "mlx-lm-pr990": _pr990}


def compat(folder: Folder) -> CompatReport:
    """Per-runtime compatibility of a folder, from its config and headers only."""
    return CompatReport(folder=folder.path, layout=layout_of(folder), runtimes=[_RULES[r](folder) for r in RUNTIMES])


def render(report: CompatReport) -> str:
    """A plain-text table (one line per runtime)."""
    lines = [f"{report.folder or '(folder)'}  layout: {report.layout}",
             f"{'runtime':<14} {'backbone':<9} {'head':<6} reason"]
    for r in report.runtimes:
        mark = "" if r.verified else " (contract, unverified)"
        lines.append(f"{r.runtime:<14} {'exact' if r.backbone_exact.ok else 'WRONG':<9} "
                     f"{'yes' if r.head_usable.ok else 'no':<6} "
                     f"{r.backbone_exact.reason if not r.backbone_exact.ok else r.head_usable.reason}{mark}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m mtpconvert.compat DIR [--json]
    import sys

    args = [a for a in sys.argv[1:] if a != "--json"]
    for a in args:
        rep = check_folder(Path(a))
        print(json.dumps(rep.to_json(), indent=2) if "--json" in sys.argv else render(rep))
