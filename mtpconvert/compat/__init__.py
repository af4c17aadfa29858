"""Which MTP runtimes can use a folder, and how: a table computed from headers alone.

``compat(folder)`` is a pure function of a :class:`Folder` snapshot (``config.json``, the index,
every safetensors *header* at the root and under ``mtp/``, and the ``manifest.json`` files next
to the head files); no tensor data is read. (One exception: mtplx's row also reads the folder's
``mtplx_runtime.json`` from ``Folder.path``, for the label mtplx gives it: :func:`.mtplx.read_contract`.) For each runtime it answers two questions:

* ``backbone_exact``: does the runtime load the backbone exactly as written?  (The known trap:
  mlx-lm 0.30.7-0.31.x adds +1 to every backbone RMSNorm a second time when any key of a
  ``model*.safetensors`` file contains ``mtp.``; mtplx and vllm-mlx run on mlx-lm 0.31 and
  inherit it, rapid-mlx undoes it.)  ``None`` where the folder has no backbone (a drafter).
* ``head_usable``: does it find the MTP head and read it with the right norms, expert layout and
  quantization?  The reason says where it found the head, or why not.

Every rule was checked by running the runtime on converted fixtures: stock mlx-lm, mlx-vlm 0.7.10
and the mlx-lm PR #990 branch in ``docs/interop.md``; mtplx 2.12.2, rapid-mlx 0.16.10 and
vllm-mlx 0.6.0 in ``interop/notes-mtplx-rapid-vllm.md`` (file/line references there).

One module per runtime contract, each saying what that runtime's loader reads and which version
it was measured on: :mod:`.mlx_lm` (both sides of 0.32), :mod:`.mlx_vlm`, :mod:`.mtplx`,
:mod:`.rapid_mlx`, :mod:`.vllm_mlx`, :mod:`.pr990`. Underneath them: :mod:`.folder` (the snapshot
and the facts the contracts ask of it), :mod:`.head` (the head as a runtime reads it) and
:mod:`.report` (the verdicts and the table). ``python -m mtpconvert.compat DIR [--json]`` prints it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Dict

from . import mlx_lm, mlx_vlm, mtplx, pr990, rapid_mlx, vllm_mlx
from .folder import (MODEL_MTP, SIDECAR, SIDECAR_LINK, Folder, fp8_files, layout_of, planned_folder,
                     read_folder, read_header)
from .head import Head
from .report import PRECISION, CompatReport, RuntimeCompat, Verdict, precision_warnings, render, why

__all__ = ["CONTRACTS", "MODEL_MTP", "PRECISION", "RUNTIMES", "SIDECAR", "SIDECAR_LINK", "CompatReport", "Contract",
           "Folder", "Head", "RuntimeCompat", "Verdict", "check_folder", "compat", "contract_rows", "layout_of",
           "planned_folder", "precision_warnings", "read_folder", "read_header", "render", "why"]

Contract = Callable[[Folder, str], RuntimeCompat]  # (folder, its layout_of) -> that runtime's row

# runtime -> its contract, in the table's order
CONTRACTS: Dict[str, Contract] = {
    mlx_lm.OLD[0]: mlx_lm.compat_old,
    mlx_lm.NEW[0]: mlx_lm.compat_new,
    mlx_vlm.NAME: mlx_vlm.compat,
    mlx_vlm.DRAFTER_ROUTE: mlx_vlm.compat_drafter_route,
    mtplx.NAME: mtplx.compat,
    rapid_mlx.NAME: rapid_mlx.compat,
    vllm_mlx.NAME: vllm_mlx.compat,
    pr990.NAME: pr990.compat,
}

# ("mlx-lm<0.32", "mlx-lm>=0.32", "mlx-vlm", "mlx-vlm-drafter", "mtplx", "rapid-mlx", "vllm-mlx", "mlx-lm-pr990")
RUNTIMES = tuple(CONTRACTS)



def contract_rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    """Each runtime's row by its contract above: the table of the family they were measured on, and of a
    folder no family takes. A family whose folders a runtime reads differently gives its own table
    (``Family.compat``)."""
    return {r: CONTRACTS[r](folder, layout) for r in RUNTIMES}


def _rows(folder: Folder, layout: str) -> Dict[str, RuntimeCompat]:
    from ..families import drafter_family, family_for

    try:
        family = drafter_family(folder.config) or family_for(folder.config)
    except Exception:  # noqa: BLE001 - a config no family takes is judged by the contracts as measured
        return contract_rows(folder, layout)
    return family.runtime_rows(folder, layout)


def compat(folder: Folder) -> CompatReport:
    """Per-runtime compatibility of a folder, from its config and headers only.

    A block-FP8 release is a source to convert: no runtime here was run on one, so each row says
    so (``verified`` False) instead of applying rules measured on MLX folders to its file names."""
    layout = layout_of(folder)
    by_runtime = _rows(folder, layout)
    rows = [by_runtime[r] for r in RUNTIMES]
    if files := fp8_files(folder):
        source = Verdict(False, f"block-FP8 source (F8_E4M3 weights with weight_scale_inv in {files[0]}"
                                f"{f' and {len(files) - 1} more' if len(files) > 1 else ''}): convert it first "
                                "(mtpconvert convert dequantizes it); not run in this runtime as it is")
        rows = [dataclasses.replace(row, backbone_exact=source, head_usable=source, verified=False) for row in rows]
        layout = "fp8-source"
    return CompatReport(folder=folder.path, layout=layout, runtimes=rows)


def check_folder(path: Path) -> CompatReport:
    return compat(read_folder(path))
