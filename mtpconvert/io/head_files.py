"""Where a converted folder keeps its MTP head, and whether its head files agree, from headers alone.

The head is in one place: the sidecar (config's ``mlx_lm_extra_tensors.mtp_file``, else root
``mtp.safetensors``) or the model shards (``model*.safetensors``, what mlx-lm's loader globs). Every
other name of the sidecar (``mtp/weights.safetensors``, read by vllm-mlx; root ``mtp.safetensors`` when
config names another file) must hold the same bytes, and config's ``mtp_tensor_count`` must count the
sidecar's tensors. Every file is checked by the folder rule (``io.files.contained``) before it is read.
:func:`head_problems` lists what disagrees. Used by ``io.checkpoint.open_checkpoint`` (convert and add-mtp
reading a converted folder), verify, and ``runtime.decoding.locate`` (smoke, bench, the runtime loader).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ConvertError, LayoutError, SafetensorsError
from ..families import FAMILIES, family_for
from .files import contained, contained_glob, same_bytes
from .header import Header, TensorInfo, read_header

# A converted folder keeps its MTP head beside the index, in a file the index does not list
# (the sidecar layout, plan.head.place_head); config's mlx_lm_extra_tensors.mtp_file may name it.
MTP_FILE = "mtp.safetensors"
SIDECAR_LINK = "mtp/weights.safetensors"  # the same bytes, where vllm-mlx reads them (plan.head.MTP_LINK)
SIDECAR_PREFIX = "mtp."  # the sidecar's key prefix (plan.head.SIDECAR_PREFIX)
# a head inside the model shards is named by its family's head prefix (language_model.mtp. for Qwen3.5)
IN_MODEL_PREFIXES = tuple(dict.fromkeys(family.head_prefix for family in FAMILIES))
HEAD_PREFIXES = (SIDECAR_PREFIX, *IN_MODEL_PREFIXES)
EXTRA = "mlx_lm_extra_tensors"


def sidecar_prefixes(config: dict) -> Tuple[str, ...]:
    """The key prefixes a sidecar's head may have: its family's (``Family.sidecar_prefix``, which may depend on the
    config) first, then every family's."""
    try:
        own: Tuple[str, ...] = (family_for(config).sidecar_prefix,)
    except ConvertError:  # no family takes the config: the shared prefixes only
        own = ()
    return tuple(dict.fromkeys(own + HEAD_PREFIXES))


@dataclass
class HeadTensors:
    """The MTP head's tensors: ``tensors`` maps the head-local name (``fc.weight``,
    ``layers.0.self_attn.q_proj.scales``...) to where it is stored."""

    source: str  # "sidecar" | "in-model"
    prefix: str  # key prefix inside the files
    tensors: Dict[str, TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _head_in(headers: Sequence[Header], prefixes: Sequence[str]) -> Optional[Tuple[str, Dict[str, TensorInfo]]]:
    for prefix in prefixes:
        found: Dict[str, TensorInfo] = {}
        for header in headers:
            found.update({k[len(prefix):]: t for k, t in header.tensors.items() if k.startswith(prefix)})
        if found:
            return prefix, found
    return None


def sidecar_name(config: dict, path: Path) -> Tuple[str, bool]:
    """(the sidecar's name, whether config names it); a malformed ``mlx_lm_extra_tensors`` is refused."""
    extra = config.get(EXTRA)
    if extra is None:
        return MTP_FILE, False
    if not isinstance(extra, dict):
        raise LayoutError(f"{EXTRA} must be a JSON object, not {extra!r}", file=path / "config.json", key=EXTRA,
                          code="mtp-file")
    named = extra.get("mtp_file")
    if named is None:
        return MTP_FILE, False
    if not isinstance(named, str) or not named:
        raise LayoutError(f"mtp_file must name a file, not {named!r}", file=path / "config.json",
                          key=f"{EXTRA}.mtp_file", code="mtp-file")
    return named, True


def head_problems(path: Path, headers: Optional[Sequence[Header]], config: dict,
                  ) -> Tuple[Optional[HeadTensors], List[ConvertError]]:
    """The head (None when the folder has none) and every way the folder's head files disagree:
    the named sidecar missing or holding no head, ``mtp_tensor_count`` off, another name of the
    sidecar with other bytes, the head in the sidecar and in the shards at once. A file that cannot
    be opened or read ends the search: it is the last problem listed and the head is None."""
    path = Path(path)
    problems: List[ConvertError] = []
    try:
        name, named = sidecar_name(config, path)
        cfg = path / "config.json"
        sidecar: Optional[HeadTensors] = None
        sidecar_header: Optional[Header] = None
        if os.path.lexists(path / name):
            what = f"the MTP file named by config.json ({EXTRA}.mtp_file)" if named else "MTP file"
            file = contained(path, name, what, file=cfg if named else None)
            sidecar_header = read_named_header(path, name, config)
            found = _head_in([sidecar_header], sidecar_prefixes(config))
            if found:
                sidecar = HeadTensors("sidecar", *found)
            elif named:
                problems.append(LayoutError(f"config.json names {name!r} as the MTP file ({EXTRA}.mtp_file), but "
                                            "it holds no MTP tensors", file=file, key=f"{EXTRA}.mtp_file",
                                            code="mtp-file"))
        elif named:
            problems.append(LayoutError(f"config.json names the MTP file {name!r} ({EXTRA}.mtp_file), which is "
                                        "missing", file=path / name, key=f"{EXTRA}.mtp_file", code="mtp-file"))
        extra = config.get(EXTRA) if isinstance(config.get(EXTRA), dict) else {}
        if "mtp_tensor_count" in extra:
            count = extra["mtp_tensor_count"]
            have = len(sidecar_header.tensors) if sidecar_header is not None else 0
            if not isinstance(count, int) or isinstance(count, bool) or count != have:
                problems.append(LayoutError(
                    f"config.json says the MTP file holds {count!r} tensors ({EXTRA}.mtp_tensor_count), "
                    f"{name} holds {have}", file=cfg, key=f"{EXTRA}.mtp_tensor_count", code="mtp-tensor-count"))
        aliases = [n for n in (SIDECAR_LINK, MTP_FILE) if n != name and os.path.lexists(path / n)]
        if sidecar_header is not None:
            for alias in aliases:
                if not same_bytes(path / name, contained(path, alias, "MTP file")):
                    what, key = _difference(sidecar_header, path / alias)
                    problems.append(LayoutError(
                        f"{alias} holds other bytes than {name} ({what}): runtimes reading one or the other would "
                        "get different heads (it must be a link to it or an exact copy)", file=path / alias, key=key,
                        code="mtp-link"))
        sidecar_files = {(path / n).resolve() for n in [name, *aliases]}
        if headers is None:
            headers = [read_header(Path(f)) for f in shard_files(path)]
        shards = [h for h in headers if Path(h.file).resolve() not in sidecar_files]
        found = _head_in(shards, IN_MODEL_PREFIXES)
        in_model = HeadTensors("in-model", *found) if found else None
        if sidecar is not None and in_model is not None:
            files = sorted({t.file.name for t in in_model.tensors.values()})
            problems.append(LayoutError(
                f"the MTP head is in two places: {name} and the model shards ({', '.join(files[:3])}); runtimes "
                "would read one or the other", file=path / name, key=in_model.prefix + next(iter(in_model.tensors)),
                code="mtp-two-places"))
        if sidecar is None and in_model is not None and not os.path.lexists(path / name):
            for alias in aliases:
                if _head_in([read_header(contained(path, alias, "MTP file"))], sidecar_prefixes(config)):
                    problems.append(LayoutError(
                        f"the MTP head is in two places: {alias} and the model shards; runtimes would read one or "
                        "the other", file=path / alias, code="mtp-two-places"))
        return sidecar or in_model, problems
    except ConvertError as e:
        return None, problems + [e]


def _difference(header: Header, other: Path) -> Tuple[str, Optional[str]]:
    """How ``other`` differs from the file of ``header``: its first tensor with other bytes, else in words."""
    try:
        theirs = read_header(other)
    except SafetensorsError as e:
        return f"not a safetensors file like it: {e.detail}", None
    mine = header.tensors
    if set(mine) != set(theirs.tensors):
        key = sorted(set(mine) ^ set(theirs.tensors))[0]
        return "other tensors", key
    with open(header.file, "rb") as a, open(other, "rb") as b:
        for key in sorted(mine, key=lambda k: mine[k].start):
            x, y = mine[key], theirs.tensors[key]
            if (x.dtype, x.shape) != (y.dtype, y.shape):
                return "a tensor of another dtype or shape", key
            a.seek(x.start)
            b.seek(y.start)
            if a.read(x.nbytes) != b.read(y.nbytes):
                return "a tensor with other values", key
    return "other header bytes", None


def read_named_header(root: Path, name: str, config: dict) -> Header:
    """The header of the MTP sidecar ``name``; when config.json named it (another name than the default),
    an error says so beside the file's own fault."""
    try:
        return read_header(root / name)
    except SafetensorsError as e:
        extra = config.get(EXTRA)
        if isinstance(extra, dict) and extra.get("mtp_file") == name and name != MTP_FILE:
            raise SafetensorsError(f"{e.detail}; config.json names it as the MTP file (mlx_lm_extra_tensors.mtp_file)",
                                   file=e.file, key=e.key, code=e.code) from None
        raise


def shard_files(path: Path) -> List[str]:
    """What mlx_lm's load_model reads, ``glob(model*.safetensors)``, each checked by the folder rule."""
    return [str(p) for p in contained_glob(Path(path), "model*.safetensors", "model shard")]
