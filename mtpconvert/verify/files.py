"""verify: the files MTP runtimes read agree with each other and with what verify measures.

The head's files (``io.head_files.head_problems``: one head location, every name of the sidecar the
same bytes, config's ``mtp_file`` / ``mtp_tensor_count`` true of the file), the manifest vllm-mlx reads
next to its head file, and the runtime compatibility table (``compat``), whose failure to read a file is a
finding, never a table that silently goes missing. ``report``: a ``verify.Report``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from ..errors import ConvertError
from ..families.base import MTP
from ..io.checkpoint import Checkpoint
from ..io.reader import TensorReader
from ..io.files import contained
from ..io.head_files import head_problems
from ..plan.head import MTP_DRAFTER_CONFIG
from ..progress import Counter, Progress

from .report import ERROR, WARNING


def check_head_files(ckpt: Checkpoint, report) -> None:
    """The head's files agree (``io.head_files.head_problems``, the rules of the locator smoke, bench and the
    loader use): one head location, every name of the sidecar the same bytes, config's ``mtp_file`` and
    ``mtp_tensor_count`` true of the file."""
    shards = [ckpt.headers[name] for name in ckpt.shards if name.startswith("model")]
    _, problems = head_problems(ckpt.root, shards, ckpt.config)
    for e in problems:
        report.add(e.code, ERROR, e.detail, e.key, e.file)


# rmsnorm_weight_format of a head manifest -> the centre of the norms it describes (compat.vllm_mlx: vllm-mlx
# keeps head norms as stored only under mlx_gamma; zero-centred formats say +1 is still to be added)
MANIFEST_FORMATS = {"mlx_gamma": "shifted"}
MANIFEST_NEXT_TO = {"mtp/manifest.json": "mtp/weights.safetensors", "manifest.json": "model-mtp.safetensors"}


def _manifest_norms(fmt: str) -> Optional[str]:
    if fmt in MANIFEST_FORMATS:
        return MANIFEST_FORMATS[fmt]
    low = fmt.lower()
    return "zero-centred" if any(w in low for w in ("zero", "centered", "centred")) else None


def _read_json(root: Path, name: str, what: str, invalid_code: str, report, rule_what: str = ""):
    """``root/name`` parsed, through the folder rule (``rule_what`` names it there, default ``what``); None, and a
    finding naming the file, when it cannot be."""
    try:
        return json.loads(contained(root, name, rule_what or what).read_text(encoding="utf-8"))
    except ConvertError as e:
        report.add(e.code, ERROR, e.detail, e.key, e.file)
    except (ValueError, UnicodeDecodeError) as e:
        report.add(invalid_code, ERROR, f"the {what} is not valid JSON ({e})", file=root / name)
    return None


def check_manifests(root: Path, report) -> None:
    """The manifest vllm-mlx reads next to its head file says how the head's norms are stored: it must be
    a JSON object, and its ``rmsnorm_weight_format`` must match the norms verify measured."""
    for name, head_file in MANIFEST_NEXT_TO.items():
        path = root / name
        if not os.path.lexists(path) or (name == "manifest.json" and not os.path.lexists(root / head_file)):
            continue
        manifest = _read_json(root, name, "head manifest", "manifest-invalid", report, "manifest")
        if manifest is None:
            continue
        if not isinstance(manifest, dict):
            report.add("manifest-invalid", ERROR, "the head manifest must be a JSON object", file=path)
            continue
        fmt = manifest.get("rmsnorm_weight_format")
        if fmt is None:
            continue
        if not isinstance(fmt, str):
            report.add("manifest-invalid", ERROR, f"rmsnorm_weight_format must be a string, not {fmt!r}",
                       "rmsnorm_weight_format", path)
            continue
        claimed, measured = _manifest_norms(fmt), report.norms.get(MTP)
        if claimed is None:
            report.add("manifest-norms", WARNING, f"unknown rmsnorm_weight_format {fmt!r}: vllm-mlx keeps head norms "
                       "as stored only under mlx_gamma", "rmsnorm_weight_format", path)
        elif measured is not None and claimed != measured:
            report.add("manifest-norms", ERROR,
                       f"the manifest says the head norms are {fmt} ({claimed}), but they measure {measured} "
                       f"(mean {report.norm_means.get(MTP)})", "rmsnorm_weight_format", path)
        if fmt == "mlx_gamma" and manifest.get("artifact_schema_version") != 1:
            report.add("manifest-norms", WARNING, "vllm-mlx reads rmsnorm_weight_format only with "
                       f"artifact_schema_version 1, not {manifest.get('artifact_schema_version')!r}",
                       "artifact_schema_version", path)


def check_drafter_config(root: Path, config: dict, report) -> None:
    """``mtp/config.json`` makes ``mtp/`` the drafter folder mlx-vlm's ``--draft-model`` takes: it must be what the
    family writes there (``Family.drafter_config``): for Qwen the model's own config (one of mlx-vlm's own drafter
    type would shift the head's norms again), for GLM its ``<model_type>_mtp`` drafter over the model's config; another
    model's would build another head. A warning: only that route is affected, and the table's mlx-vlm-drafter
    row says it cannot be used."""
    from ..families import family_for

    name = MTP_DRAFTER_CONFIG
    if not os.path.lexists(root / name):
        return
    drafter = _read_json(root, name, "drafter config", "drafter-config", report)
    try:
        expected = family_for(config).drafter_config(config)
    except ConvertError:
        expected = config  # a config no family takes is reported by the config checks
    if drafter is not None and drafter != expected:
        differs = sorted(k for k in set(drafter) | set(expected) if drafter.get(k) != expected.get(k)) \
            if isinstance(drafter, dict) else []
        report.add("drafter-config", WARNING, f"{name} is not the drafter config config.json implies: "
                   "--draft-model OUT/mtp would build the drafter from another config (the model folder's own "
                   "routes are unaffected)" + (f" (differs at {', '.join(differs[:3])})" if differs else ""),
                   differs[0] if differs else None, root / name)


def add_runtime_table(path: Path, report) -> None:
    """Which MTP runtimes can use the folder (headers only). Its verdicts are information; a file the
    runtimes would read that cannot be read is a finding, never a table that silently goes missing, and
    a head in more than one place is an error (the runtimes would not read the same one)."""
    from ..compat import check_folder

    try:
        table = check_folder(path)
    except (ConvertError, OSError, ValueError) as e:
        file = getattr(e, "file", None) or getattr(e, "filename", None)
        if file and any(f.file == str(file) and f.severity == ERROR for f in report.findings):
            return  # named already: the head files' check opened the same file first
        detail = getattr(e, "detail", None) or getattr(e, "strerror", None) or str(e)
        report.add("runtime-files", ERROR, f"the files MTP runtimes read cannot be read: {detail}",
                   getattr(e, "key", None), file)
        return
    report.mtp_layout, report.runtimes = table.layout, table.runtimes
    if table.layout.startswith("mixed:") and not any(f.code == "mtp-two-places" for f in report.findings):
        places = table.layout[len("mixed:"):].split("+")
        report.add("mtp-two-places", ERROR, f"the MTP head is in more than one place ({', '.join(places)}): "
                   "runtimes would read different heads", file=path / next(p for p in places if p != "in-model"))


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def check_finite(ckpt: Checkpoint, report, progress: Optional[Progress] = None) -> None:
    """Read each float tensor once (one shard mapped at a time) and name any holding NaN or Inf;
    ``progress`` counts the tensors read (stage "verify --deep")."""
    reader = TensorReader()
    try:
        by_file: Dict[Path, List[str]] = defaultdict(list)
        for key, info in ckpt.tensors.items():
            if info.dtype in FLOAT_DTYPES:
                by_file[info.file].append(key)
        count = Counter(progress, "verify --deep", sum(map(len, by_file.values())), "tensors")
        for file in sorted(by_file):
            count.at(Path(file).name)
            for key in sorted(by_file[file]):
                arr = reader.read(ckpt.tensors[key])
                nan, inf = (int(mx.sum(f(arr)).item()) for f in (mx.isnan, mx.isinf))
                if nan or inf:
                    report.add("non-finite", ERROR, f"{nan} NaN and {inf} Inf values", key, file)
                count.add()
            reader.release(file)
    finally:
        reader.close()
