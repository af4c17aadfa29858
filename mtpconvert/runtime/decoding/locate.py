"""Where a converted folder keeps its MTP head, from headers alone: the one locator of verify, smoke,
bench, layerwise and the runtime loader (the rules: ``io.head_files``).

:func:`locate_mtp` finds the head or raises the first way the folder's head files disagree;
:func:`readable_folder` checks every file the loader and the tokenizer read before any is opened.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ...errors import ConvertError, LayoutError
from ...io.checkpoint import SIDECAR_FILES, load_json
from ...io.files import contained, contained_glob
from ...io.head_files import (HEAD_PREFIXES, IN_MODEL_PREFIXES, MTP_FILE, HeadTensors, shard_files,  # noqa: F401
                              head_problems as _head_problems)
from ...io.header import Header, read_header


def head_problems(path: Path, headers: Optional[Sequence[Header]] = None, config: Optional[dict] = None,
                  ) -> Tuple[Optional[HeadTensors], List[ConvertError]]:
    """``io.head_files.head_problems``, reading config.json when ``config`` is not given."""
    path = Path(path)
    if config is None:
        try:
            config = load_json(path / "config.json", "config.json") if os.path.lexists(path / "config.json") else {}
        except ConvertError as e:
            return None, [e]
    return _head_problems(path, headers, config)


def locate_mtp(path: Path, headers: Optional[Sequence[Header]] = None,
               config: Optional[dict] = None) -> Optional[HeadTensors]:
    """Find the MTP head of a converted folder: the sidecar (config's ``mlx_lm_extra_tensors.mtp_file``,
    else root ``mtp.safetensors``; ``mtp.*`` keys, or ``language_model.mtp.*``), else
    ``language_model.mtp.*`` inside ``model*.safetensors`` (``headers``: theirs, when already read).
    Headers only; None when there is no head; the first of :func:`head_problems` raised."""
    head, problems = head_problems(path, headers, config)
    if problems:
        raise problems[0]
    return head


def readable_folder(path: Path) -> Optional[HeadTensors]:
    """Every file the runtime loader (``decoding.load``: mlx-lm's ``load_model``, then the head) and the
    tokenizer read, checked before any is opened: config.json (a JSON object), the tokenizer and
    generation files, each root ``*.safetensors`` with a header that fits its file, and the head
    (:func:`locate_mtp`). Returns the head."""
    path = Path(path)
    config = load_json(path / "config.json", "config.json")
    for name in SIDECAR_FILES:
        if os.path.lexists(path / name):
            file = contained(path, name)
            if name.endswith(".json"):
                try:
                    json.loads(file.read_text(encoding="utf-8"))
                except (ValueError, UnicodeDecodeError) as e:
                    raise LayoutError(f"{name} is not valid JSON ({e})", file=file, code="file-invalid") from None
    headers = [read_header(f) for f in contained_glob(path, "*.safetensors", "safetensors file")]
    shards = [h for h in headers if h.file.name.startswith("model")]
    head = locate_mtp(path, shards, config)
    if head is not None:
        _check_head_config(path, config, head)
    return head


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_head_config(path: Path, config: dict, head: HeadTensors) -> None:
    """What the loader builds the head from: config's MTP layer count (the head's own) and the
    quantization entries of its modules (a quantized entry needs scales, an unquantized one none)."""
    from ...families import family_for

    cfg = path / "config.json"
    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    family = family_for(config)
    key = ("text_config." if tc is not config else "") + family.mtp_count_key
    n = tc.get(family.mtp_count_key)
    layers, _ = family.head_layers(family.head_prefix + k for k in head.tensors)
    if not _is_int(n) or n != layers:
        raise LayoutError(f"config.json says {family.mtp_count_key}={n!r}, the head has {layers} layer(s)",
                          file=cfg, key=key, code="mtp-count")
    quant = config.get("quantization")
    if quant is None:
        return
    if not isinstance(quant, dict) or not _is_int(quant.get("bits")) or not _is_int(quant.get("group_size")):
        raise LayoutError("the quantization block must be a JSON object with integer bits and group_size",
                          file=cfg, key="quantization", code="quant-config-invalid")
    for entry, spec in quant.items():
        prefix = next((p for p in HEAD_PREFIXES if isinstance(entry, str) and entry.startswith(p)), None)
        if prefix is None:
            continue
        module = entry[len(prefix):]
        if module + ".weight" not in head.tensors:
            continue
        scales = module + ".scales" in head.tensors
        if (spec is not False) != scales:
            raise LayoutError(f"config.json says {entry} is {'not ' if spec is False else ''}quantized, but the head "
                              f"holds {'scales' if scales else 'no scales'} for it", file=cfg,
                              key=f"quantization.{entry}", code="quant-config-mismatch")
