"""mtplx 2.12.2 on mlx-lm 0.31.3 (``mtplx.runtime.load``), measured in
``interop/notes-mtplx-rapid-vllm.md`` (file/line references into its wheel there). What it reads:

* backbone: mlx-lm 0.31.3's loader, so ``mtp.`` keys in any ``model*.safetensors`` shift the backbone
  norms a second time (:func:`.mlx_lm._mlx_lm_old_backbone`);
* head file: ``config.mlx_lm_extra_tensors.mtp_file`` if set, and then only that path; else the first
  existing of ``mtp.safetensors``, ``mtp/weights.safetensors``, ``model-mtp.safetensors``; else the
  keys embedded in the model shards;
* head keys: ``mtp.X`` or ``language_model.mtp.X``. Bare ``X`` keys load 0 tensors and the head keeps
  its random init, with no error (it loads with ``strict=False``);
* no safetensors metadata; from the config, ``text_config.mtp_num_hidden_layers`` (0: nothing is
  injected) and the quantization blocks below;
* precision: a quantized head whose key set is one mtplx knows (dense: the layer linears, ``fc``
  float or not; MoE: every linear but ``fc`` and the router) stays quantized, bits/group from the
  per-module entries or the top level; any other is dequantized with the top-level bits/group alone
  (affine triplets only), a ``ValueError`` when those are not the head's.

Its verification label (:func:`mtplx_tier`): mtplx reports a Qwen folder whose head it can use
``verified`` only when the folder carries a valid ``mtplx_runtime.json`` whose evidence is not marked
as blocking, else ``family-compatible-unverified``; it drafts with the head either way.
``mtpconvert.verify.contract`` writes that file after a smoke that measured what it claims.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .folder import (MODEL_MTP, SIDECAR, SIDECAR_LINK, Folder, _glob_model, _has_bare_head, _is_moe, _mtp_layers,
                     _named_mtp_file, _text)
from .head import (ATTN, DEFAULT_DEQUANT, DENSE_MLP, SHARED, SWITCH, Bits, Head, _fmt_bits, _head,
                   _mlx_head_linears, _mlx_head_norms, _per_layer, _quant_mismatches, _without_biases)
from .mlx_lm import _old_mlx_lm_injector
from .report import PRECISION, RuntimeCompat, Verdict

NAME, VERSION = "mtplx", "2.12.2 (mlx-lm 0.31.3)"
MTPLX = (NAME, VERSION)
MTPLX_PREFIXES = ("mtp.", "language_model.mtp.")
MTPLX_SIDECARS = (SIDECAR, SIDECAR_LINK, MODEL_MTP)
# Where mtplx looks for a per-module quantization entry, in order (top level, then text_config).
MTPLX_QUANT_BLOCKS = ("mtplx_mtp_quantization", "quantization", "quantization_config")
MTPLX_ENTRY_PREFIXES = ("", "mtp.", "model.mtp.", "language_model.mtp.", "language_model.model.mtp.")


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


# --------------------------------------------------------------------------- its runtime contract
# mtplx 2.12.2, backends/registry.py and profiles.py (line numbers of its wheel).
CONTRACT_FILE = "mtplx_runtime.json"  # registry.py:18, read from the folder's root (:819-830)
# RuntimeContract.from_dict (registry.py:668-694): these keys, a known profile, mtp_depth_max > 0
CONTRACT_KEYS = ("mtplx_version", "arch_id", "mtp_depth_max", "recommended_profile", "exactness_baseline",
                 "verified_on")
DEFAULT_PROFILE = "sustained"  # profiles.py:16 DEFAULT_PROFILE_NAME: what mtplx recommends with no contract
PROFILES = ("stable", "performance-cold", "sustained", "turbo", "exact", "max-diagnostic")  # profiles.py:17
PROFILE_ALIASES = {"default": "sustained", "safe": "stable", "native-mtp-60": "performance-cold",  # profiles.py:946
                   "native_mtp_60": "performance-cold", "native_mtp_60_cold": "performance-cold",
                   "long_response_exact_staged": "stable", "max": "max-diagnostic", "auto": "sustained",
                   "sustained-max": "sustained", "sustained_max": "sustained"}
# _runtime_evidence_blocker (registry.py:976): a status in the set, or starting with a prefix + "_", withholds
# "verified" (registry.py:53-75); so does public_release_blocker: true
BLOCKING_STATUSES = frozenset({"candidate", "candidate_build_only_benchmark_pending", "candidate_build_only",
                               "failed", "fail", "failing", "pending", "blocked", "blocker", "needs_repair",
                               "needs_reverify", "unverified"})
BLOCKING_PREFIXES = ("candidate", "fail", "pending", "blocked", "blocker", "needs", "unverified")
BLOCKING_SPEED_VERDICTS = frozenset({"mtp_acceptance_collapsed", "no_mtp_depth_beat_ar",  # registry.py:76
                                     "no_quality_passed_mtp_depth_beat_ar"})
TIER_VERIFIED = "verified"
TIER_UNVERIFIED = "family-compatible-unverified"  # no contract (registry.py:1871)
TIER_CONTRACT_UNVERIFIED = "architecture-compatible-but-unverified"  # invalid or blocked contract (:1663, :1831)


def contract_error(data) -> Optional[str]:
    """Why ``RuntimeContract.from_dict`` would refuse ``data`` (None: it accepts it). Its optional fields
    (draft lm_head/sampler, mtp_contract, env overrides, generation mode) are not checked here."""
    if not isinstance(data, dict):
        return "not a JSON object"
    missing = [k for k in CONTRACT_KEYS if k not in data]
    if missing:
        return f"runtime contract missing required keys: {', '.join(missing)}"
    raw = str(data["recommended_profile"]).strip()
    if PROFILE_ALIASES.get(raw, raw) not in PROFILES:
        return f"unknown MTPLX profile {raw!r}"
    try:
        depth = int(data["mtp_depth_max"])
    except (TypeError, ValueError):
        return f"mtp_depth_max {data['mtp_depth_max']!r} is not an integer"
    if depth <= 0:
        return "runtime contract mtp_depth_max must be positive"
    for key in ("exactness_baseline", "verified_on"):
        if not isinstance(data[key], dict):
            return f"{key} is not a JSON object"
    return None


def _status_blocker(section, name: str) -> Optional[str]:
    if not isinstance(section, dict):
        return None
    if section.get("public_release_blocker") is True:
        return f"{name} is marked public_release_blocker"
    status = str(section.get("status") or "").lower().replace("-", "_")
    if status and (status in BLOCKING_STATUSES or status.startswith(tuple(p + "_" for p in BLOCKING_PREFIXES))):
        return f"{name} status is {section.get('status')}"
    return None


def contract_blocker(data: dict) -> Optional[str]:
    """What in a valid contract withholds "verified" (``_runtime_contract_blocker``, registry.py:909)."""
    speed = data.get("speed_evidence")
    blocker = _status_blocker(data["exactness_baseline"], "exactness_baseline") or _status_blocker(
        speed, "speed_evidence")
    if blocker is None and isinstance(speed, dict) and str(speed.get("verdict") or "").lower().replace(
            "-", "_") in BLOCKING_SPEED_VERDICTS:
        blocker = f"speed_evidence verdict is {speed.get('verdict')}"
    return blocker


def family_arch(config: dict) -> Optional[str]:
    """The arch id mtplx gives the folder's family (``Family.mtplx_arch``; its registry.py:226), None when it
    has none or no family takes the config."""
    from ..families import drafter_family, family_for

    try:
        return (drafter_family(config) or family_for(config)).mtplx_arch
    except Exception:  # noqa: BLE001 - a config no family takes has no arch id
        return None


def read_contract(folder: Folder) -> Tuple[Optional[dict], Optional[str]]:
    """(the folder's mtplx_runtime.json, or why it cannot be read), from the snapshot (``read_folder`` reads it
    with the manifests); a planned folder has none: the conversion writes it only after its smoke."""
    data = folder.manifests.get(CONTRACT_FILE)
    if data is None:
        return None, None
    return (None, "not valid JSON") if data.get("__unreadable__") else (data, None)


def mtplx_tier(folder: Folder) -> Tuple[str, str]:
    """(tier, why): the label mtplx 2.12.2's ``inspect-model`` gives a Qwen folder whose head it can use
    (``compatibility_for_inspection``, registry.py:1631-1722 and :1857-1890)."""
    data, unreadable = read_contract(folder)
    if data is None and unreadable is None:
        return TIER_UNVERIFIED, f"no {CONTRACT_FILE}"
    error = unreadable or contract_error(data)
    if error:
        return TIER_CONTRACT_UNVERIFIED, f"invalid {CONTRACT_FILE}: {error}"
    blocker = contract_blocker(data)
    if blocker:
        return TIER_CONTRACT_UNVERIFIED, f"{CONTRACT_FILE}: {blocker}"
    arch = family_arch(folder.config)
    if str(data["arch_id"]) != arch:
        return TIER_CONTRACT_UNVERIFIED, f"{CONTRACT_FILE} names arch_id {data['arch_id']!r}, not {arch!r}"
    return TIER_VERIFIED, f"{CONTRACT_FILE}, exactness baseline {data['exactness_baseline'].get('status', 'given')}"


def _tier_note(folder: Folder) -> str:
    tier, why = mtplx_tier(folder)
    return f"; mtplx labels it {tier}: {why}" + ("" if tier == TIER_VERIFIED else " (it drafts all the same)")


def compat(folder: Folder, layout: str) -> RuntimeCompat:
    bb, settled = _old_mlx_lm_injector(folder, layout, MTPLX)
    if settled:
        return settled
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
    return RuntimeCompat(*MTPLX, bb, Verdict(True, f"{len(head.tensors)} head tensors from {src}; {how}"
                                                   + _tier_note(folder)))
