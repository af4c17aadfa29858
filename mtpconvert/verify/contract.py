"""``mtplx_runtime.json``: the runtime contract mtplx reads, written from what the smoke measured.

mtplx 2.12.2 labels a Qwen folder ``family-compatible-unverified`` unless it carries this file, and
``verified`` when the file is valid (``compat.mtplx.contract_error``) and marks nothing as blocking
(its issue #492; ``compat.mtplx.mtplx_tier``). It drafts with the head either way. The file is
written into the folder being committed (the partial folder, before the rename) once the checks
passed, and only when the smoke measured what ``exactness_baseline.status: passed`` says:

* the full smoke ran (greedy draft/verify decoding next to plain greedy, the whole model loaded):
  a layerwise smoke is teacher-forced, it never decodes, so it measures acceptance, not exactness;
* every prompt's MTP output was token-identical to plain greedy (a divergence is reported, not
  failed, by the smoke; here it means no file);
* acceptance and the head's MLP gain reached the default floors (``upload`` runs the smoke with a
  floor of 0: a head that drafts nothing is exact, and no "verified" should rest on that).

Otherwise no file is written (mtplx then keeps its own label), and a stale one is removed from the
folder being built. ``upload`` writes none: it never writes into the folder it is given (a folder
``convert`` made already has its file). The fields, and where each comes from:

* ``mtplx_version``: the mtplx release whose contract format this follows (2.12.2); mtplx did not run;
* ``arch_id``: mtplx's arch id for the folder's family (``Family.mtplx_arch``); a family mtplx has none for
  gets no file;
* ``mtp_depth_max``: the deepest draft chain the smoke decoded at with output identical to plain
  greedy: depth 3 (mtplx's default serving depth, which it caps at this value: commands/public.py
  ``_model_contract_depth``) where the smoke's depth-3 decode matched, else 1;
* ``recommended_profile``: mtplx's default profile (``sustained``), the one it recommends with no file;
  not a measurement: profiles were not measured;
* ``exactness_baseline``: the smoke's numbers (prompts, tokens, acceptance, MLP gain, the hidden state
  fed to the head);
* ``verified_on``: mtpconvert's version, its MLX runtime (not mtplx), the mlx / mlx-lm versions, the
  device and the time.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Tuple

from ..runtime.smoke.floors import DECODING_MIN_ACCEPTANCE, MIN_MLP_GAIN
from ..compat.mtplx import CONTRACT_FILE, DEFAULT_PROFILE, contract_error, family_arch

MTPLX_VERSION = "2.12.2"  # the release whose RuntimeContract this file satisfies (interop-measured)

def _verified_on() -> dict:
    from .. import __version__
    from ..provenance import library_versions

    libs = library_versions()
    on = {"tool": f"mtpconvert {__version__}",
          "runtime": "mtpconvert's MLX runtime (greedy draft/verify decoding); mtplx did not run",
          "mlx": libs.get("mlx"), "mlx_lm": libs.get("mlx-lm"),
          "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
          "hardware": platform.platform(), "machine_arch": platform.machine()}
    try:
        import mlx.core as mx

        on["device"] = str(mx.default_device())
    except Exception:  # noqa: BLE001
        pass
    return {k: v for k, v in on.items() if v is not None}


def build(config: dict, record) -> Tuple[Optional[dict], str]:
    """(the contract, or None; why, in words) from a folder's config and its ``checks.GateRecord``."""
    arch = family_arch(config)
    result = record.smoke
    if arch is None:
        return None, "mtplx has no arch id for this model family"
    if result is None:
        return None, "no smoke ran"
    if record.smoke_mode != "full":
        return None, f"the {record.smoke_mode} smoke is teacher-forced: it measures acceptance, not exact decoding"
    if not result.identical:
        return None, (f"greedy MTP output differed from plain greedy on prompt(s) {result.mismatched_prompts} "
                      "(reported by the smoke, not failed): no exactness baseline to claim")
    gain = result.mlp_gain
    if result.acceptance < DECODING_MIN_ACCEPTANCE or (gain is not None and gain < MIN_MLP_GAIN):
        shown = "not measured" if gain is None else f"{gain:+.1%}"
        return None, (f"acceptance {result.acceptance:.1%} / MLP gain {shown}: below the default floors "
                      f"({DECODING_MIN_ACCEPTANCE:.0%}, {MIN_MLP_GAIN:+.0%})")
    baseline = {
        "status": "passed",
        "check": "mtpconvert smoke, full: greedy MTP draft/verify decoding next to plain greedy decoding, "
                 "whole model loaded",
        "identical_to_plain_greedy": True,
        "prompts": len(result.per_prompt),
        "generated_tokens": result.plain.emitted,
        "depth": result.mtp.depth or 1,
        **_deep(result),
        "mtp_hidden": result.hidden,
        "acceptance": round(result.acceptance, 4),
        "proposed": sum(result.mtp.proposed),
        "accepted": sum(result.mtp.accepted),
        "min_acceptance": result.min_acceptance,
    }
    if gain is not None:
        baseline["mlp_gain"] = round(gain, 4)
    contract = {
        "mtplx_version": MTPLX_VERSION,
        "arch_id": arch,
        "mtp_depth_max": baseline.get("deep_depth", baseline["depth"]),
        "recommended_profile": DEFAULT_PROFILE,
        "exactness_baseline": baseline,
        "verified_on": _verified_on(),
        "notes": (f"Written by mtpconvert from its own smoke test, in the format mtplx {MTPLX_VERSION} reads; "
                  "mtplx did not run. recommended_profile is mtplx's default, not a measurement; mtp_depth_max "
                  "is the deepest draft chain the smoke decoded at with output identical to plain greedy."),
    }
    error = contract_error(contract)
    if error:  # never write a file mtplx would refuse
        raise AssertionError(f"{CONTRACT_FILE} would be invalid: {error}")
    return contract, (f"mtplx will label the folder verified (depth {contract['mtp_depth_max']}, exact greedy "
                      "output)")


def _deep(result) -> dict:
    """The smoke's deeper decode, where it ran and its output was plain greedy's on every prompt."""
    deep = getattr(result, "deep", None)
    if deep is None or not deep.depth or getattr(result, "deep_mismatches", None):
        return {}
    return {"deep_depth": deep.depth, "deep_acceptance_by_depth": [round(a, 4) for a in deep.acceptance_by_depth]}


def write(folder: Path, record, *, has_mtp: bool = True) -> Optional[str]:
    """Write ``folder/mtplx_runtime.json`` from ``record`` (a ``checks.GateRecord`` whose checks passed) where
    the smoke measured exact decoding, else remove one already there (a partial folder's leftover, or the copy
    ``add-mtp`` linked from a folder without this head: either describes other bytes); return a one-line note.
    Only for a folder the command builds, before it is committed. None: nothing to say (no head, no file)."""
    folder = Path(folder)
    path = folder / CONTRACT_FILE
    exists = os.path.lexists(path)
    if not has_mtp:
        if exists:
            path.unlink()
            return f"{CONTRACT_FILE}: removed (the folder has no MTP head)"
        return None
    config = json.loads((folder / "config.json").read_text())
    contract, why = build(config, record)
    if exists:
        path.unlink()
    if contract is None:
        return f"{CONTRACT_FILE}: not written ({why}){'; the earlier one was removed' if exists else ''}"
    tmp = folder / f".{CONTRACT_FILE}.tmp"
    tmp.write_text(json.dumps(contract, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return f"{CONTRACT_FILE}: written: {why}"
