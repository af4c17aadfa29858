"""Which MTP runtimes can use a folder, and how: a table computed from headers alone.

``compat(folder)`` is a pure function of a :class:`Folder` snapshot (``config.json``, the index,
every safetensors *header* at the root and under ``mtp/``, and the ``manifest.json`` files next
to the head files); no tensor data is read. For each runtime it answers two questions:

* ``backbone_exact``: does the runtime load the backbone exactly as written?  (The known trap:
  mlx-lm 0.30.7-0.31.x adds +1 to every backbone RMSNorm a second time when any key of a
  ``model*.safetensors`` file contains ``mtp.``; mtplx and vllm-mlx run on mlx-lm 0.31 and
  inherit it, rapid-mlx undoes it.)  ``None`` where the folder has no backbone (a drafter).
* ``head_usable``: does it find the MTP head and read it with the right norms, expert layout and
  quantization?  The reason says where it found the head, or why not.

Every rule was checked by running the runtime on converted fixtures: stock mlx-lm, mlx-vlm 0.7.10
and the mlx-lm PR #990 branch in ``docs/interop.md``; mtplx 2.12.2, rapid-mlx 0.16.10 and
vllm-mlx 0.6.0 in ``interop/notes-mtplx-rapid-vllm.md`` (file/line references there).
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

PRECISION = "precision"  # Verdict.cause: the head's quantization (the --mtp choice) is what decides


@dataclass
class Verdict:
    ok: Optional[bool]  # None: the question does not apply (a drafter folder has no backbone)
    reason: str
    cause: str = ""  # "precision" when only the head's quantization stands in the way


@dataclass
class RuntimeCompat:
    runtime: str
    versions: str
    backbone_exact: Verdict
    head_usable: Verdict
    verified: bool = True  # rule checked by running the runtime (interop/), not only read from its code


@dataclass
class CompatReport:
    folder: str
    layout: str  # sidecar | sidecar:<file> | in-model | drafter | none | mixed:<place>+<place>...
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


MANIFESTS = ("manifest.json", "mtp/manifest.json")  # vllm-mlx reads the one next to its head file


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError:
        return {"__unreadable__": True}
    return value if isinstance(value, dict) else {"__unreadable__": True}


def read_folder(path: Path) -> Folder:
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("mtp/*.safetensors"))
    named = _named_mtp_file(config)
    if named:
        f = (path / named).resolve()
        if f.is_file() and path.resolve() in f.parents and f not in [x.resolve() for x in files]:
            files.append(f)
    headers = {}
    for f in files:
        rel = (f.parent.resolve() / f.name).relative_to(path.resolve()).as_posix()  # keep link names
        headers[rel] = read_header(f)
    index = None
    if (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
    manifests = {m: _read_json(path / m) for m in MANIFESTS if (path / m).is_file()}
    return Folder(config=config, headers=headers, index=index, manifests=manifests, path=str(path))


def check_folder(path: Path) -> CompatReport:
    return compat(read_folder(path))


def planned_folder(plan) -> Folder:
    """The folder ``plan`` will write, as the rules see it (headers from the plan's output specs):
    the compat table of a conversion before any data is read."""
    from .execute.run import index_json, shard_order
    from .io.shard_writer import shard_header
    from .plan.build import MTP_FILE, MTP_LINK, MTP_MANIFEST, MTP_MANIFEST_BODY

    headers = {shard: shard_header([spec for item in items for spec in item.outputs()], {"format": "mlx"})
               for shard, items in shard_order(plan).items()}
    manifests = {}
    if MTP_FILE in headers:
        headers[MTP_LINK] = headers[MTP_FILE]
        manifests[MTP_MANIFEST] = dict(MTP_MANIFEST_BODY)
    return Folder(config=plan.config, headers=headers, index=index_json(plan), manifests=manifests, path="(planned)")


def runtime_table(path: Path) -> Optional[CompatReport]:
    """``check_folder``, or None where the folder cannot be read (verify reports why on its own)."""
    try:
        return check_folder(Path(path))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- folder facts

NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
BARE_HEAD_STARTS = ("fc.", "pre_fc_norm", "layers.", "norm.")  # head keys with no prefix at all
DRAFTER_TYPE = "qwen3_5_mtp"  # mlx-vlm's separate drafter folder
SIDECAR = "mtp.safetensors"
SIDECAR_LINK = "mtp/weights.safetensors"
MODEL_MTP = "model-mtp.safetensors"


def _tensors(header: dict) -> Dict[str, dict]:
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _metadata(header: dict) -> dict:
    m = header.get("__metadata__")
    return m if isinstance(m, dict) else {}


def _text(config: dict) -> dict:
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def _mtp_layers(config: dict) -> int:
    tc = _text(config)
    return int(tc.get("mtp_num_hidden_layers") or tc.get("num_nextn_predict_layers")
               or config.get("num_nextn_predict_layers") or 0)


def _is_drafter(config: dict) -> bool:
    return DRAFTER_TYPE in (config.get("model_type"), _text(config).get("model_type"))


def _named_mtp_file(config: dict) -> Optional[str]:
    extra = config.get("mlx_lm_extra_tensors")
    named = extra.get("mtp_file") if isinstance(extra, dict) else None
    return named if isinstance(named, str) and named else None


def _root(folder: Folder) -> List[str]:
    return [n for n in folder.headers if "/" not in n]


def _glob_model(folder: Folder) -> List[str]:
    """The files mlx-lm's ``load_model`` reads: ``glob(model_path / "model*.safetensors")``."""
    return sorted(n for n in _root(folder) if fnmatch.fnmatchcase(n, "model*.safetensors"))


def _backbone_shards(folder: Folder) -> List[str]:
    """The model shards proper: the glob less the head-only ``model-mtp.safetensors``."""
    return [n for n in _glob_model(folder) if n != MODEL_MTP]


def _keys_with(folder: Folder, files: List[str], pred: Callable[[str], bool]) -> List[Tuple[str, str]]:
    return [(f, k) for f in files for k in _tensors(folder.headers[f]) if pred(k)]


def _conv_raw(folder: Folder, files: List[str]) -> bool:
    """A raw (PyTorch-layout) checkpoint: some ``conv1d.weight`` is ``[C, 1, K]`` with K > 1."""
    for f in files:
        for k, v in _tensors(folder.headers[f]).items():
            if "conv1d.weight" in k and (v.get("shape") or [1])[-1] != 1:
                return True
    return False


def _is_bare_head_key(key: str) -> bool:
    return key.startswith(BARE_HEAD_STARTS)


@dataclass
class Head:
    """Head tensors one runtime would read, by canonical name (``fc.weight``, ``layers.0....``)."""

    files: List[str]
    tensors: Dict[str, dict]
    mlx_format: bool  # every file carries safetensors metadata format=mlx

    @property
    def quantized(self) -> List[str]:
        return sorted(k[: -len(".scales")] for k in self.tensors if k.endswith(".scales"))

    @property
    def linears(self) -> List[str]:
        """Modules with a matrix (or stacked matrices): quantized ones, and float weights of rank >= 2."""
        float_mats = [k[: -len(".weight")] for k, v in self.tensors.items()
                      if k.endswith(".weight") and len(v.get("shape") or []) >= 2]
        return sorted(set(float_mats) | set(self.quantized))

    def layers(self) -> set:
        return {int(m.group(1)) for k in self.tensors if (m := re.match(r"^layers\.(\d+)\.", k))}


def _head(folder: Folder, files: List[str], prefixes: Tuple[str, ...], bare: bool = False) -> Optional[Head]:
    """The head tensors in ``files`` under one of ``prefixes`` (stripped); with ``bare``, also
    unprefixed head keys (``fc.weight``, ``layers.0....``)."""
    tensors, used = {}, []
    for f in files:
        if f not in folder.headers:
            continue
        hit = False
        for k, v in _tensors(folder.headers[f]).items():
            p = next((p for p in prefixes if k.startswith(p)), None)
            if p is not None:
                tensors[k[len(p):]] = v
                hit = True
            elif bare and _is_bare_head_key(k):
                tensors[k] = v
                hit = True
        if hit:
            used.append(f)
    if not tensors:
        return None
    fmt = all(_metadata(folder.headers[f]).get("format") == "mlx" for f in used)
    return Head(used, tensors, fmt)


def _has_bare_head(folder: Folder, file: str) -> bool:
    return any(_is_bare_head_key(k) for k in _tensors(folder.headers.get(file, {})))


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


Bits = Tuple[int, int]  # (bits, group_size)


def _bits(head: Head, module: str, tc: dict) -> Optional[Bits]:
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


def _top(q: dict) -> Optional[Bits]:
    if "bits" in q and "group_size" in q:
        return int(q["bits"]), int(q["group_size"])
    return None


def _entry_bits(entry, q: dict) -> Optional[Bits]:
    """What a per-path quantization entry makes of a module: None = not quantized."""
    if entry is False:
        return None
    if isinstance(entry, dict):
        top = _top(q) or (None, None)
        return int(entry.get("bits", top[0])), int(entry.get("group_size", top[1]))
    return _top(q)


def _fmt_bits(b: Optional[Bits]) -> str:
    return f"{b[0]}-bit/g{b[1]}" if b else "unquantized"


def _quant_mismatches(head: Head, tc: dict, expect: Callable[[str], Optional[Bits]]) -> List[str]:
    """Quantized head modules the runtime would build with other (bits, group) than written."""
    bad = []
    for m in head.quantized:
        have = _bits(head, m, tc)
        want = expect(m)
        if have is not None and have != want:
            bad.append(f"{m} is {_fmt_bits(have)} but would be read as {_fmt_bits(want)}")
    return bad


def _without_biases(head: Head) -> List[str]:
    """Quantized modules stored without biases (mxfp4/nvfp4/mxfp8): not an affine triplet."""
    return [m for m in head.quantized if m + ".biases" not in head.tensors]


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


# --------------------------------------------------------------------------- the canonical MLX head

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
          "mlp.shared_expert_gate")
SWITCH = ("mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj")
ROUTER = "mlp.gate"
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
HEAD_NORMS = ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm")


def _per_layer(names, n: int) -> List[str]:
    return [f"layers.{i}.{name}" for i in range(n) for name in names]


def _mlx_head_linears(moe: bool, n: int) -> List[str]:
    """Linear modules of the MLX head (MoE experts stacked as switch_mlp): what rapid-mlx builds."""
    mlp = (ROUTER,) + SHARED + SWITCH if moe else DENSE_MLP
    return ["fc"] + _per_layer(ATTN + mlp, n)


def _mlx_head_norms(n: int) -> List[str]:
    return list(HEAD_NORMS) + _per_layer(LAYER_NORMS, n)


def _missing_weights(head: Head, moe: bool, n: int) -> List[str]:
    need = [m + ".weight" for m in _mlx_head_linears(moe, n) + _mlx_head_norms(n)]
    return [k for k in need if k not in head.tensors]


def _is_moe(config: dict) -> bool:
    return int(_text(config).get("num_experts", 0) or 0) > 0


# --------------------------------------------------------------------------- layout


def _places(folder: Folder) -> List[str]:
    """Where head tensors sit: ``in-model`` (keys with ``mtp.`` in the model shards) and each
    other file holding head keys (prefixed or bare)."""
    places = ["in-model"] if _keys_with(folder, _backbone_shards(folder), lambda k: "mtp." in k) else []
    shards = set(_backbone_shards(folder))
    for name in sorted(folder.headers):
        keys = _tensors(folder.headers[name])
        if name not in shards and any("mtp." in k or _is_bare_head_key(k) for k in keys):
            places.append(name)
    return places


def layout_of(folder: Folder) -> str:
    """``sidecar``: the head in root mtp.safetensors (with or without the same header again at
    mtp/weights.safetensors); ``sidecar:<file>``: one other head file; ``in-model``; ``drafter``
    (mlx-vlm's drafter folder); ``none``; ``mixed:<a>+<b>``: the head in more than one place."""
    if _is_drafter(folder.config):
        return "drafter"
    places = _places(folder)
    if SIDECAR in places and SIDECAR_LINK in places and folder.headers[SIDECAR] == folder.headers[SIDECAR_LINK]:
        places.remove(SIDECAR_LINK)  # the link vllm-mlx reads: one head, two names
    if not places:
        return "none"
    if len(places) > 1:
        return "mixed:" + "+".join(places)
    if places == ["in-model"]:
        return "in-model"
    return "sidecar" if places == [SIDECAR] else "sidecar:" + places[0]


# --------------------------------------------------------------------------- shared verdicts

NO_BACKBONE = Verdict(None, "drafter folder (model_type qwen3_5_mtp): the head only, no backbone")


def _no_head(layout: str) -> Optional[Verdict]:
    if layout == "none":
        return Verdict(False, "the folder has no MTP tensors")
    return None


def _drafter_head(runtime: str) -> Verdict:
    return Verdict(False, f"drafter folder (model_type qwen3_5_mtp): {runtime} reads the head from the model "
                          "folder it serves, not from a separate drafter")


def _no_mtp_layers(folder: Folder) -> Optional[Verdict]:
    if _mtp_layers(folder.config) == 0:
        return Verdict(False, "config declares no MTP layers (mtp_num_hidden_layers is 0): nothing is injected")
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


NO_DECODING = Verdict(False, "stock mlx-lm has no MTP decoding (sanitize drops every mtp.* key)")


# --------------------------------------------------------------------------- stock mlx-lm


def _mlx_lm_old(folder: Folder, layout: str) -> RuntimeCompat:
    bb = NO_BACKBONE if layout == "drafter" else _mlx_lm_old_backbone(folder)
    return RuntimeCompat("mlx-lm<0.32", "0.30.7-0.31.3", bb, NO_DECODING)


def _mlx_lm_new(folder: Folder, layout: str) -> RuntimeCompat:
    if layout == "drafter":
        bb = NO_BACKBONE
    elif _glob_model(folder):
        bb = Verdict(True, "mtp.* keys are dropped before the norm-shift decision, which looks only at conv1d")
    else:
        bb = Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)")
    return RuntimeCompat("mlx-lm>=0.32", "0.32.x", bb, NO_DECODING)


# --------------------------------------------------------------------------- mlx-vlm 0.7.10

VLM = ("mlx-vlm", "0.7.10")


def _mlx_vlm_files(folder: Folder) -> Tuple[List[str], bool]:
    wm = (folder.index or {}).get("weight_map") or {}
    listed = sorted({f for f in wm.values() if f in folder.headers})
    if listed:
        return listed, True
    return sorted(n for n in _root(folder) if not n.endswith("consolidated.safetensors")), False


def _mlx_vlm_backbone(folder: Folder) -> Verdict:
    # mtp.* keys are dropped first; then a norm is shifted when the checkpoint is raw
    # (conv1d [C,1,K]) or when its key does not start with "language_model." (HF naming).
    files, from_index = _mlx_vlm_files(folder)
    if not files:
        return Verdict(False, "no safetensors file to load")
    raw = _conv_raw(folder, files)
    hf_named = [k for f, k in _keys_with(folder, files, lambda k: "mtp." not in k and k.endswith(NORM_SUFFIXES)
                                         and not k.startswith("language_model."))]
    if not raw and hf_named:
        return Verdict(False, f"norm {hf_named[0]} is not under language_model.: mlx-vlm shifts it +1 although "
                              "the folder is already MLX (conv1d [C,K,1])")
    return Verdict(True, "reads " + ("the index's files" if from_index else "every root *.safetensors")
                   + "; drops mtp.* keys before its norm-shift decision")


def _mlx_vlm_head_problem(folder: Folder, head: Head, entry: Callable[[str, dict], object],
                          names: str) -> Optional[Verdict]:
    """What stops mlx-vlm from using a head it found; ``entry(module, q)`` = its per-path entry,
    ``names`` says how those entries are named."""
    n = _mtp_layers(folder.config) or 1
    if head.layers() and head.layers() != set(range(n)):
        return Verdict(False, f"head has layers {sorted(head.layers())}, config mtp_num_hidden_layers={n}")
    q = folder.config.get("mtplx_mtp_quantization") or _quant(folder.config)
    if head.quantized:
        if not _top(q):
            return Verdict(False, "quantized head but no quantization block in config.json", PRECISION)
        bad = _quant_mismatches(head, _text(folder.config), lambda m: _entry_bits(entry(m, q), q))
        if bad:
            return Verdict(False, f"{bad[0]} (mlx-vlm reads per-path entries named {names})", PRECISION)
    return None


def _mlx_vlm_drafter(folder: Folder) -> RuntimeCompat:
    files, _ = _mlx_vlm_files(folder)
    head = _head(folder, files, ("mtp.",), bare=True)
    if head is None:
        return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(False, "drafter folder without head tensors"))
    if _keys_with(folder, files, lambda k: k.startswith("mtp.")):
        return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(False, (
            "drafter keys keep the mtp. prefix: mlx-vlm's drafter takes them for raw HF keys and adds +1 to the "
            "(already shifted) norms")))
    if _moe_expert_layout(head) == "per-expert":
        return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(False, "per-expert MTP experts: the drafter wants stacked "
                                                               "switch_mlp (or fused experts)"))
    problem = _mlx_vlm_head_problem(folder, head, lambda m, q: q.get(m), "<module>, unprefixed")
    if problem:
        return RuntimeCompat(*VLM, NO_BACKBONE, problem)
    return RuntimeCompat(*VLM, NO_BACKBONE, Verdict(True, (
        f"drafter folder: {len(head.tensors)} unprefixed head tensors in {_files_str(head.files)}; use it as "
        "--draft-model DIR --draft-kind mtp next to its target")))


def _mlx_vlm(folder: Folder, layout: str) -> RuntimeCompat:
    if layout == "drafter":
        return _mlx_vlm_drafter(folder)
    bb = _mlx_vlm_backbone(folder)
    nh = _no_head(layout)
    if nh:
        return RuntimeCompat(*VLM, bb, nh)
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
        return RuntimeCompat(*VLM, bb, Verdict(False, why))
    where = _files_str(head.files)
    raw_folder = _conv_raw(folder, _root(folder))
    if not head.mlx_format and not raw_folder:
        return RuntimeCompat(*VLM, bb, Verdict(False, (
            f"{where} has no safetensors metadata format=mlx: mlx-vlm takes the head for a raw HF one and adds +1 "
            "to its (already shifted) norms")))
    if head.mlx_format and _moe_expert_layout(head) in ("per-expert", "fused"):
        return RuntimeCompat(*VLM, bb, Verdict(False, (
            f"{_moe_expert_layout(head)} MTP experts in an MLX-format head: mlx-vlm loads MLX heads as-is, and its "
            "MoE layer wants stacked switch_mlp")))
    problem = _mlx_vlm_head_problem(folder, head, lambda m, q: q.get("mtp." + m, q.get(m)),
                                    "mtp.<module>; language_model.mtp.* ones are not seen")
    if problem:
        return RuntimeCompat(*VLM, bb, problem)
    how = "index weight_map" if listed else "root *.safetensors scan"
    return RuntimeCompat(*VLM, bb, Verdict(True, (
        f"{len(head.tensors)} mtp.* tensors in {where} (via {how}); "
        + ("format=mlx: used as written" if head.mlx_format else "raw HF head: norms +1 once")
        + (f"; {len(head.quantized)} quantized modules" if head.quantized else "")
        + "; drafts from the post-norm hidden state")))


# --------------------------------------------------------------------------- mlx-lm PR #990 branch

PR990 = ("mlx-lm-pr990", "AirRunner/mlx-lm feat/mtp-native (0.31.3 base)")


def _pr990_head_problem(folder: Folder, files: List[str], tc: dict) -> Optional[Verdict]:
    head = _head(folder, files, ("language_model.mtp.", "mtp."))
    if head is None:
        hits = _keys_with(folder, files, lambda k: "mtp." in k)
        return Verdict(False, f"mtp keys under a prefix the branch does not map (e.g. {hits[0][1]})")
    if _is_moe(folder.config):
        layout = _moe_expert_layout(head)
        if layout == "stacked":
            return Verdict(False, "stacked switch_mlp MTP experts: the branch's sanitize stacks "
                                  "experts.{e}.{proj}.weight itself and raises KeyError on a stacked head")
        if layout == "per-expert" and any(_EXPERT_RE.match(k) and not k.endswith(".weight") for k in head.tensors):
            return Verdict(False, "quantized per-expert MTP experts: the branch stacks only .weight (scales/biases "
                                  "are left over)", PRECISION)
    q = _quant(folder.config)
    if head.quantized:
        bad = _quant_mismatches(head, tc, lambda m: _entry_bits(q.get("language_model.mtp." + m), q))
        if bad:
            return Verdict(False, bad[0] + " (the branch reads per-path entries named language_model.mtp.<module>)",
                           PRECISION)
    return None


def _pr990(folder: Folder, layout: str) -> RuntimeCompat:
    tc = _text(folder.config)
    if layout == "drafter":
        return RuntimeCompat(*PR990, NO_BACKBONE, _drafter_head("the branch"))
    files = _glob_model(folder)
    n = _mtp_layers(folder.config)
    hits = _keys_with(folder, files, lambda k: "mtp." in k)
    if not files:
        v = Verdict(False, "no model*.safetensors file")
        return RuntimeCompat(*PR990, v, v)
    if n > 0 and not hits:
        v = Verdict(False, "refuses to load: mtp_num_hidden_layers > 0 but no mtp key in model*.safetensors "
                           "(ValueError; KeyError for MoE, whose expert stacking runs first) -- the branch reads "
                           "the head only from the model shards")
        return RuntimeCompat(*PR990, v, v)
    bb = Verdict(True, "norm shift decided by conv1d only; the head is loaded with the model")
    if n == 0:
        return RuntimeCompat(*PR990, bb, Verdict(False, "mtp_num_hidden_layers is 0: no head is built "
                                                        "(mtp.* keys dropped)"))
    # The head is part of the model: whatever stops it from loading stops the whole model.
    problem = _pr990_head_problem(folder, files, tc)
    if problem:
        v = Verdict(False, "the model does not load: " + problem.reason, problem.cause)
        return RuntimeCompat(*PR990, v, v)
    head = _head(folder, files, ("language_model.mtp.", "mtp."))
    return RuntimeCompat(*PR990, bb, Verdict(True, (
        f"{len(head.tensors)} head tensors in {_files_str(head.files)} (in-model)"
        + (f"; {len(head.quantized)} quantized modules" if head.quantized else "")
        + "; drafts from the pre-norm hidden state")))


# --------------------------------------------------------------------------- mtplx 2.12.2

MTPLX = ("mtplx", "2.12.2 (mlx-lm 0.31.3)")
MTPLX_PREFIXES = ("mtp.", "language_model.mtp.")
MTPLX_SIDECARS = (SIDECAR, SIDECAR_LINK, MODEL_MTP)
# Where mtplx looks for a per-module quantization entry, in order (top level, then text_config).
MTPLX_QUANT_BLOCKS = ("mtplx_mtp_quantization", "quantization", "quantization_config")
MTPLX_ENTRY_PREFIXES = ("", "mtp.", "model.mtp.", "language_model.mtp.", "language_model.model.mtp.")
DEFAULT_DEQUANT = (4, 64)  # mtplx and vllm-mlx dequantize with these when the config has no bits


def _mtplx_file(folder: Folder) -> Tuple[List[str], str, Optional[str]]:
    """(files, description, error): the one place mtplx reads the head from."""
    named = _named_mtp_file(folder.config)
    if named:
        if named not in folder.headers:
            return [], named, (f"config mlx_lm_extra_tensors.mtp_file = {named!r} but there is no such file "
                               "(mtplx then looks nowhere else)")
        return [named], f"{named} (mlx_lm_extra_tensors.mtp_file)", None
    side = next((s for s in MTPLX_SIDECARS if s in folder.headers), None)
    if side:
        return [side], side, None
    return _glob_model(folder), "the model shards (embedded)", None


def _mtplx_known_sets(moe: bool, n: int) -> List[frozenset]:
    """Quantized-module sets mtplx keeps quantized (its key-set templates, expanded to n layers):
    dense: the layer linears, with or without fc; MoE (stacked): every linear but fc and the router."""
    if not moe:
        layer = frozenset(_per_layer(ATTN + DENSE_MLP, n))
        return [layer, layer | {"fc"}]
    return [frozenset(_per_layer(ATTN + SHARED + SWITCH, n))]


def _mtplx_known_key_set(head: Head, moe: bool, n: int) -> bool:
    """The head's keys are exactly a canonical MLX head with one of the known quantized sets."""
    for qset in _mtplx_known_sets(moe, n):
        want = {m + ".weight" for m in _mlx_head_linears(moe, n) + _mlx_head_norms(n)}
        want |= {m + s for m in qset for s in (".scales", ".biases")}
        if set(head.tensors) == want:
            return True
    return False


def _mtplx_top_bits(config: dict) -> Bits:
    tc = _text(config)
    q = tc.get("quantization") or tc.get("quantization_config") or config.get("quantization") \
        or config.get("quantization_config") or {}
    return (int(q.get("bits", 4)), int(q.get("group_size", 64))) if q else DEFAULT_DEQUANT


def _mtplx_module_bits(config: dict, module: str) -> Optional[Bits]:
    for owner in (config, _text(config)):
        for block in MTPLX_QUANT_BLOCKS:
            q = owner.get(block)
            if not isinstance(q, dict):
                continue
            for prefix in MTPLX_ENTRY_PREFIXES:
                e = q.get(prefix + module)
                if isinstance(e, dict) and e.get("bits") and e.get("group_size"):
                    return int(e["bits"]), int(e["group_size"])
    return None


def _mtplx_precision(folder: Folder, head: Head) -> Tuple[Optional[Verdict], str]:
    """(refusal or None, how the head is used)."""
    tc, n, moe = _text(folder.config), max(_mtp_layers(folder.config), 1), _is_moe(folder.config)
    if not head.quantized:
        return None, "float head"
    top = _mtplx_top_bits(folder.config)
    if _mtplx_known_key_set(head, moe, n):
        bad = _quant_mismatches(head, tc, lambda m: _mtplx_module_bits(folder.config, m) or top)
        if bad:
            return Verdict(False, bad[0] + " (mtplx keeps this key set quantized, bits from per-module entries "
                                           "mtp.<module> or the top level)", PRECISION), ""
        return None, "kept quantized (a key set mtplx knows)"
    nobias = _without_biases(head)
    if nobias:
        return Verdict(False, f"{nobias[0]} has no biases: mtplx dequantizes only affine triplets, so the packed "
                              "weight would be read as a float one", PRECISION), ""
    bad = _quant_mismatches(head, tc, lambda m: top)
    if bad:
        return Verdict(False, bad[0] + ": outside mtplx's known key sets the head is dequantized with the top-level "
                                       "bits/group only -> ValueError: [dequantize] ...", PRECISION), ""
    return None, f"dequantized with the top-level {_fmt_bits(top)}"


def _mtplx(folder: Folder, layout: str) -> RuntimeCompat:
    if layout == "drafter":
        return RuntimeCompat(*MTPLX, NO_BACKBONE, _drafter_head("mtplx"))
    bb = _mlx_lm_old_backbone(folder, "mlx-lm 0.31.3 (mtplx's)")
    stop = _no_head(layout) or _no_mtp_layers(folder)
    if stop:
        return RuntimeCompat(*MTPLX, bb, stop)
    files, src, error = _mtplx_file(folder)
    if error:
        return RuntimeCompat(*MTPLX, bb, Verdict(False, error))
    head = _head(folder, files, MTPLX_PREFIXES)
    if head is None:
        why = (f"{src} holds head keys without an mtp. prefix: mtplx loads 0 tensors and keeps a random head, "
               "silently" if any(_has_bare_head(folder, f) for f in files) else f"no mtp.* keys in {src}")
        return RuntimeCompat(*MTPLX, bb, Verdict(False, why))
    refusal, how = _mtplx_precision(folder, head)
    if refusal:
        return RuntimeCompat(*MTPLX, bb, refusal)
    return RuntimeCompat(*MTPLX, bb, Verdict(True, f"{len(head.tensors)} head tensors from {src}; {how}"))


# --------------------------------------------------------------------------- rapid-mlx 0.16.10

RAPID = ("rapid-mlx", "0.16.10")
# The "model" folder of --speculative-config: the first of these that exists is the head file,
# whatever it holds (it does not go on to the next).
RAPID_SIDECARS = (SIDECAR, MODEL_MTP, "mtp/model.safetensors", "model.safetensors")


def _rapid_backbone(folder: Folder) -> Verdict:
    if not _glob_model(folder):
        return Verdict(False, "no model*.safetensors file (mlx-lm globs only that pattern)")
    return Verdict(True, "rapid-mlx undoes mlx-lm 0.31's spurious +1 on already-MLX norms: exact even with mtp. "
                         "keys in the shards")


def _rapid_precision(head: Head, tc: dict, src: str) -> Optional[Verdict]:
    """rapid-mlx infers bits/group from fc and quantizes every linear alike."""
    if not head.quantized:
        return None
    if "fc" not in head.quantized:
        return Verdict(False, f"{src}: float fc with {len(head.quantized)} quantized modules is refused (rapid-mlx "
                              "infers the head's bits from fc; mtpconvert keeps fc float)", PRECISION)
    fc = _bits(head, "fc", tc)
    floats = [m for m in head.linears if m not in head.quantized]
    if floats:
        return Verdict(False, f"{src}: {floats[0]} is float beside a quantized fc (rapid-mlx quantizes every linear "
                              "like fc)", PRECISION)
    bad = _quant_mismatches(head, tc, lambda m: fc)
    if bad:
        return Verdict(False, f"{src}: {bad[0]} (bits taken from fc)", PRECISION)
    return None


def _rapid_mlx(folder: Folder, layout: str) -> RuntimeCompat:
    bb = NO_BACKBONE if layout == "drafter" else _rapid_backbone(folder)
    # a drafter folder is only the "model" of --speculative-config; the layer count comes from the served model
    stop = _no_head(layout) or (None if layout == "drafter" else _no_mtp_layers(folder))
    if stop:
        return RuntimeCompat(*RAPID, bb, stop)
    src = next((s for s in RAPID_SIDECARS if s in folder.headers), None)
    if src is None:
        return RuntimeCompat(*RAPID, bb, Verdict(False, (
            "no head file: rapid-mlx reads the head only from " + ", ".join(RAPID_SIDECARS)
            + ("; in-model keys are not read" if layout == "in-model" else ""))))
    head = _head(folder, [src], ("mtp.",), bare=True)  # "mtp." stripped when present
    n, moe = max(_mtp_layers(folder.config), 1), _is_moe(folder.config)
    missing = _missing_weights(head, moe, n) if head else ["fc.weight"]
    if missing:
        lm = _keys_with(folder, [src], lambda k: k.startswith("language_model.mtp."))
        why = ("keys are language_model.mtp.*, which it does not strip" if lm
               else f"e.g. {missing[0]}" + (" (MoE experts must be stacked switch_mlp)" if moe else ""))
        return RuntimeCompat(*RAPID, bb, Verdict(False, (
            f"{src} (its first candidate file) lacks {len(missing)} required head tensor(s): {why} -- boot refused")))
    refusal = _rapid_precision(head, _text(folder.config), src)
    if refusal:
        return RuntimeCompat(*RAPID, bb, refusal)
    where = f"{len(head.tensors)} head tensors from {src}"
    if layout == "drafter":
        where += " (as the --speculative-config model folder)"
    return RuntimeCompat(*RAPID, bb, Verdict(True, where + ("; quantized like fc" if head.quantized else "")))


# --------------------------------------------------------------------------- vllm-mlx 0.6.0

VLLM = ("vllm-mlx", "0.6.0 (mlx-lm 0.31.3)")
VLLM_FILES = ((SIDECAR_LINK, "mtp/manifest.json"), (MODEL_MTP, "manifest.json"))  # (head file, its manifest)
VLLM_PREFIXES = ("mtp.", "language_model.mtp.")
VLLM_LOOP_BUG = ("vllm-mlx 0.6.0's MTP loop never runs with the mlx-lm it pins (scheduler.py:827: "
                 "BatchGenerator lacks _step → '[MTP] disabled')")


def _vllm_top_bits(config: dict) -> Bits:
    q = _text(config).get("quantization", config.get("quantization", {}))
    return (int(q.get("bits", 4)), int(q.get("group_size", 64))) if q else DEFAULT_DEQUANT


def _vllm_manifest_guards(manifest: Optional[dict]) -> bool:
    """Only this pair keeps vllm-mlx from adding +1 to head norms whose mean is < 0.5."""
    m = manifest or {}
    return m.get("artifact_schema_version") == 1 and m.get("rmsnorm_weight_format") == "mlx_gamma"


def _vllm_load_failure(folder: Folder, head: Head) -> Optional[Verdict]:
    """Dequantizing the head happens while the model loads: a failure stops the whole server."""
    top = _vllm_top_bits(folder.config)
    bad = _quant_mismatches(head, _text(folder.config), lambda m: top)
    if not bad:
        return None
    return Verdict(False, f"ValueError: [dequantize] Shape of scales and biases does not match ... while loading "
                          f"the model (server exits, even without --enable-mtp): {bad[0]}; vllm-mlx dequantizes "
                          "with the top-level bits/group only", PRECISION)


def _vllm_mlx(folder: Folder, layout: str) -> RuntimeCompat:
    if layout == "drafter":
        return RuntimeCompat(*VLLM, NO_BACKBONE, _drafter_head("vllm-mlx"))
    bb = _mlx_lm_old_backbone(folder, "mlx-lm 0.31.3 (vllm-mlx's)")
    stop = _no_head(layout) or _no_mtp_layers(folder)
    if stop:
        return RuntimeCompat(*VLLM, bb, stop)
    found = next(((f, m) for f, m in VLLM_FILES if f in folder.headers), None)
    if found is None:
        return RuntimeCompat(*VLLM, bb, Verdict(False, (
            f"no {SIDECAR_LINK} or root {MODEL_MTP}: vllm-mlx reads the head only there (not root {SIDECAR}, "
            "not the model shards)")))
    src, manifest = found
    head = _head(folder, [src], VLLM_PREFIXES)
    if head is None:
        why = ("head keys without an mtp. prefix: vllm-mlx loads 0 tensors and keeps a random head, silently"
               if _has_bare_head(folder, src) else "no mtp.* keys")
        return RuntimeCompat(*VLLM, bb, Verdict(False, f"{src}: {why}"))
    nobias = _without_biases(head)
    if nobias:
        return RuntimeCompat(*VLLM, bb, Verdict(False, (
            f"{nobias[0]} has no biases: vllm-mlx dequantizes only affine triplets, so the packed weight would be "
            "read as a float one"), PRECISION))
    failure = _vllm_load_failure(folder, head)
    if failure:
        return RuntimeCompat(*VLLM, failure, failure)
    norms = (f"{manifest} declares mlx_gamma: norms kept as stored" if _vllm_manifest_guards(
        folder.manifests.get(manifest)) else
        f"unguarded: no {manifest} with artifact_schema_version 1 and rmsnorm_weight_format mlx_gamma, so any "
        "head norm with mean < 0.5 gets +1 (MLX norms sit near 1: not triggered unless a trained gamma is small)")
    quant = f"; dequantized with the top-level {_fmt_bits(_vllm_top_bits(folder.config))}" if head.quantized else ""
    return RuntimeCompat(*VLLM, bb, Verdict(True, (
        f"head injected ({len(head.tensors)} tensors from {src}{quant}; {norms}); {VLLM_LOOP_BUG}")))


# --------------------------------------------------------------------------- the table

_RULES = {"mlx-lm<0.32": _mlx_lm_old, "mlx-lm>=0.32": _mlx_lm_new, "mlx-vlm": _mlx_vlm, "mtplx": _mtplx,
          "rapid-mlx": _rapid_mlx, "vllm-mlx": _vllm_mlx, "mlx-lm-pr990": _pr990}


def compat(folder: Folder) -> CompatReport:
    """Per-runtime compatibility of a folder, from its config and headers only."""
    layout = layout_of(folder)
    return CompatReport(folder=folder.path, layout=layout, runtimes=[_RULES[r](folder, layout) for r in RUNTIMES])


def precision_warnings(report: CompatReport, choice: str) -> List[str]:
    """One line per runtime that cannot use the head because of its quantization (``choice``
    names the option, e.g. ``--mtp match``)."""
    lines = []
    for r in report.runtimes:
        v = r.head_usable if r.head_usable.cause == PRECISION else r.backbone_exact
        if v.cause == PRECISION:
            lines.append(f"{choice}: {r.runtime} cannot use this head: {v.reason}")
    return lines


def _mark(ok: Optional[bool], yes: str, no: str) -> str:
    return "n/a" if ok is None else yes if ok else no


def why(r: RuntimeCompat) -> str:
    """The head's reason, after the backbone's when the backbone is wrong (once when they are one)."""
    bb, hd = r.backbone_exact, r.head_usable
    if bb.ok is not False or bb.reason == hd.reason:
        return hd.reason
    return f"backbone: {bb.reason}; head: {hd.reason}"


def render(report: CompatReport) -> str:
    """A plain-text table (one line per runtime)."""
    lines = [f"{report.folder or '(folder)'}  layout: {report.layout}",
             f"{'runtime':<14} {'backbone':<9} {'head':<6} reason"]
    for r in report.runtimes:
        lines.append(f"{r.runtime:<14} {_mark(r.backbone_exact.ok, 'exact', 'WRONG'):<9} "
                     f"{'yes' if r.head_usable.ok else 'no':<6} {why(r)}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m mtpconvert.compat DIR [--json]
    import sys

    args = [a for a in sys.argv[1:] if a != "--json"]
    for a in args:
        rep = check_folder(Path(a))
        print(json.dumps(rep.to_json(), indent=2) if "--json" in sys.argv else render(rep))
