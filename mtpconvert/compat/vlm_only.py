"""What every runtime does with the folder of a family whose backbone only mlx-vlm loads (mlx-lm has no module
for its model type): mlx-lm refuses the model type, and so do mtplx, rapid-mlx, vllm-mlx and the PR #990 branch,
which load models through mlx-lm; mlx-vlm loads the files its loader reads and drafts through its splitter by two
routes (``--draft-model OUT``, ``--draft-model OUT/mtp``), whose verdicts the family gives.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from . import mlx_lm, mlx_vlm, mtplx, pr990, rapid_mlx, vllm_mlx
from .folder import Folder
from .report import RuntimeCompat, Verdict


def loader_files(folder: Folder) -> List[str]:
    """The files mlx-vlm's loader reads: those the index names, else every root ``*.safetensors`` but
    ``consolidated.safetensors``."""
    weight_map = (folder.index or {}).get("weight_map") or {}
    if weight_map:
        return sorted(set(weight_map.values()))
    return sorted(f for f in folder.headers if "/" not in f and not f.endswith("consolidated.safetensors"))


def splitter_files(folder: Folder, prefixes: Sequence[str], under: str = "") -> List[str]:
    """The files mlx-vlm's MTP splitter reads in the folder ``under`` (the root, or ``mtp/``): those the root's
    index names for keys starting with ``prefixes``, else every ``*.safetensors`` there (``mtp/`` has no index)."""
    weight_map = ((folder.index or {}).get("weight_map") or {}) if not under else {}
    listed = sorted({f for k, f in weight_map.items() if k.startswith(tuple(prefixes))})
    return listed or sorted(f for f in folder.headers if f.startswith(under) and "/" not in f[len(under):])


def rows(model_type: str, backbone: Verdict, root: Verdict, drafter: Verdict) -> Dict[str, RuntimeCompat]:
    """runtime -> its row: mlx-vlm's backbone and its two drafting routes as given, the rest refused by name."""
    no_module = Verdict(False, f"mlx-lm has no {model_type} module (ValueError: Model type {model_type} not "
                               "supported)")

    def refused(who: str) -> Verdict:
        return Verdict(False, f"{who} loads models with mlx-lm, which has no {model_type} module: the folder is "
                              "refused")

    return {
        mlx_lm.OLD[0]: RuntimeCompat(*mlx_lm.OLD, no_module, mlx_lm.NO_DECODING),
        mlx_lm.NEW[0]: RuntimeCompat(*mlx_lm.NEW, no_module, mlx_lm.NO_DECODING),
        mlx_vlm.NAME: RuntimeCompat(*mlx_vlm.VLM, backbone, root),
        mlx_vlm.DRAFTER_ROUTE: RuntimeCompat(mlx_vlm.DRAFTER_ROUTE, mlx_vlm.VERSION, backbone, drafter),
        mtplx.NAME: RuntimeCompat(*mtplx.MTPLX, refused("mtplx"), refused("mtplx"), verified=False),
        rapid_mlx.NAME: RuntimeCompat(*rapid_mlx.RAPID, refused("rapid-mlx"), refused("rapid-mlx"), verified=False),
        vllm_mlx.NAME: RuntimeCompat(*vllm_mlx.VLLM, refused("vllm-mlx"), refused("vllm-mlx"), verified=False),
        pr990.NAME: RuntimeCompat(*pr990.PR990, refused("the PR #990 branch"), refused("the PR #990 branch"),
                                  verified=False),
    }
