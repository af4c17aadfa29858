"""Check any folder (raw HF, ours, another converter's or runtime's MLX layout) from its headers.

Only headers and the small norm vectors are read, so a 397B folder takes seconds. Every problem
becomes a ``Finding`` with a stable ``code`` (for CI and tests); the folder passes when no finding is
an error. The checks: the tensors against their family's slots, norms and quantization
(``tensors``), the files MTP runtimes read and the runtime table (``files``), layouts other
converters publish (``foreign``); ``contract`` writes the runtime contract file mtplx reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import ConvertError
from ..families import family_for
from ..io.checkpoint import open_checkpoint
from ..progress import Progress
from . import foreign
from .files import add_runtime_table, check_drafter_config, check_finite, check_head_files, check_manifests
from .report import ERROR, INFO, WARNING, Finding, Report
from .tensors import check_config, check_norms, check_sources, check_tensors

__all__ = ["ERROR", "INFO", "WARNING", "Finding", "Report", "verify"]


def verify(path: Path, deep: bool = False, progress: Optional[Progress] = None) -> Report:
    """Check a folder from its headers; ``deep`` also reads every float tensor for NaN/Inf (``progress``: the
    tensors read)."""
    report = Report(path=str(path))
    try:
        ckpt = open_checkpoint(Path(path), head_files=False)  # their problems: findings (_check_head_files)
    except ConvertError as e:
        report.add(e.code, ERROR, e.detail, e.key, e.file)
        return report
    report.tensors, report.shards = len(ckpt.tensors), len(ckpt.shards)
    drafter = foreign.is_drafter(ckpt.config)  # mlx-vlm's <out>-mtp: read as the head alone, like OUT/mtp
    ckpt, head_file = foreign.drafter_view(ckpt) if drafter else foreign.with_head_file(ckpt)
    try:
        family = family_for(ckpt.config)
        spec = family.spec(ckpt.config)
    except ConvertError as e:
        report.add(e.code, ERROR, e.detail, e.key, ckpt.root / "config.json")
        return report
    report.model_type, report.moe, report.vlm = spec.model_type, spec.is_moe, spec.nested
    report.mtp_layers_config = spec.mtp_layers
    try:
        report.layout = family.style_of(ckpt.tensors)
        raw = family.norms_zero_centred(ckpt.tensors)
        raw_conv = family.conv_layout_raw(ckpt.tensors)
    except ConvertError as e:
        report.add("layout", ERROR, e.detail, e.key, e.file)
        return report
    if head_file:  # the head where vllm-mlx's tools put it, outside the index: checked as the runtimes read it
        report.add("head-file", INFO, f"the MTP head is in {head_file}, which the index does not list", file=path)
    check_sources(ckpt, report)
    check_tensors(ckpt, family, spec, raw_conv, report)
    check_norms(ckpt, family, raw, report)
    check_config(ckpt, spec, report)
    if report.layout == "head-only":  # OUT/mtp: its config is the model's, naming files of the model folder
        if deep:
            check_finite(ckpt, report, progress)
        if drafter:  # mlx-vlm's drafter folder: its own config, its own runtime table
            add_runtime_table(Path(path), report)
            foreign.drafter_finding(report, Path(path))
        return report
    check_head_files(ckpt, report)
    check_manifests(ckpt.root, report)
    check_drafter_config(ckpt.root, ckpt.config, report)
    if deep:
        check_finite(ckpt, report, progress)
    add_runtime_table(Path(path), report)
    foreign.runtime_gaps(report)
    return report
