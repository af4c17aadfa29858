"""What made an output folder: the command, its options as given, the source, the versions.

The record lives in the index metadata (``metadata.mtpconvert``) beside what the plan writes
there; the model card and its reproduce command are built from it, so the card states what
ran, never a reconstruction. ``command_args`` turns a record back into the command's argv.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata as dist_metadata
from pathlib import Path
from typing import Dict, List, Optional

from .errors import OptionsError
from .options import DEFAULT_MAX_SHARD_BYTES, ConvertOptions

LIBRARIES = ("mlx", "mlx-lm", "safetensors", "huggingface-hub", "transformers")
GB = 1 << 30


def library_versions() -> Dict[str, str]:
    """Installed versions of the libraries that decide the output bytes (absent ones left out)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = dist_metadata.version(name)
        except dist_metadata.PackageNotFoundError:
            pass
    return versions


def options_record(options: ConvertOptions) -> dict:
    """The conversion options as the user gave them (before defaults are resolved)."""
    q = options.quant
    return {"bits": q.bits, "group_size": q.group_size, "q_mode": q.mode, "dtype": options.dtype,
            "mtp": "keep" if q.mtp == "bits" else q.mtp, "mtp_bits": q.mtp_bits, "keep_vision": options.keep_vision,
            "max_shard_gb": options.max_shard_bytes / GB,  # exact: a power-of-two division
            "mtp_layout": options.mtp_layout}


def conversion_record(command: str, options: ConvertOptions, **source) -> dict:
    """The metadata a conversion adds to its index: ``command`` ran with ``options`` on ``source``.

    ``source``: ``source_repo`` / ``source_revision`` (a Hub release) and/or ``source_folder``
    (the name, never the path, of a local source folder).
    """
    return {"command": command, "options": options_record(options), "libraries": library_versions(),
            **{k: v for k, v in source.items() if v is not None}}


def checked_repo_id(repo_id: Optional[str], option: str = "--base-model") -> Optional[str]:
    """A Hub repo id as given to ``option``, refused when it cannot be one (a path, a bare name)."""
    if repo_id is None:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise OptionsError(f"{option} must be a Hub repo id like Qwen/Qwen3.5-27B, got {repo_id!r}") from None
    if repo_id.count("/") != 1:
        raise OptionsError(f"{option} must be a Hub repo id like Qwen/Qwen3.5-27B (owner/name), got {repo_id!r}")
    return repo_id


def option_args(options: dict) -> List[str]:
    """The command-line options that give ``options`` (defaults left out, so the command reads as typed)."""
    args: List[str] = []
    for flag, key in (("--bits", "bits"), ("--group-size", "group_size"), ("--dtype", "dtype"),
                      ("--mtp-bits", "mtp_bits")):
        if options.get(key) is not None:
            args += [flag, str(options[key])]
    if options.get("q_mode", "affine") != "affine":
        args += ["--q-mode", options["q_mode"]]
    if options.get("mtp", "keep") != "keep":
        args += ["--mtp", options["mtp"]]
    if options.get("mtp_layout", "sidecar") != "sidecar":
        args += ["--mtp-layout", options["mtp_layout"]]
    if options.get("keep_vision"):
        args.append("--keep-vision")
    shard_gb = options.get("max_shard_gb", DEFAULT_MAX_SHARD_BYTES / GB)
    if shard_gb != DEFAULT_MAX_SHARD_BYTES / GB:
        args += ["--max-shard-size", repr(shard_gb)]  # repr: the float that gives the same byte limit
    return args


def command_args(record: dict, out_name: str) -> Optional[List[str]]:
    """The argv (after ``mtpconvert``) of the command a record describes; None when it names none."""
    options = record.get("options", {})
    if record.get("command") == "pull-and-quantize" and record.get("source_repo"):
        revision = ["--revision", record["source_revision"]] if record.get("source_revision") else []
        stream = record.get("stream") or {}  # recorded when --stream ran with --raw-window or a non-default
        streamed = (["--stream", "--raw-window", repr(stream["raw_window_gb"])] if "raw_window_gb" in stream
                    else ["--stream", "--prefetch-shards", str(stream["prefetch_shards"])] if stream else [])
        return ["pull-and-quantize", record["source_repo"], out_name, *revision, *option_args(options), *streamed]
    if record.get("command") == "convert":
        source = record.get("source_folder") or (record.get("source_repo") or "SOURCE").split("/")[-1]
        base = ["--base-model", record["source_repo"]] if record.get("source_repo") else []
        return ["convert", source, out_name, *option_args(options), *base]
    if record.get("command") == "add-mtp":
        source = record.get("source_repo") or record.get("source_folder") or "SOURCE"
        revision = ["--revision", record["source_revision"]] if record.get("source_revision") else []
        return ["add-mtp", source, out_name, *revision, *option_args(options)]
    return None


def record_graft(folder: Path, record: dict) -> None:
    """Add what add-mtp ran (``record``) to the folder's index, beside the graft's own note; atomic."""
    from .io.checkpoint import INDEX_NAME

    path = Path(folder) / INDEX_NAME
    index = json.loads(path.read_text())
    ours = index.setdefault("metadata", {}).setdefault("mtpconvert", {})
    ours["mtp_grafted"] = {**ours.get("mtp_grafted", {}), **record}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".index-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=2)
    os.replace(tmp, path)
