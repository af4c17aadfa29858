"""The model families mtpconvert converts: one package each, one registry by config ``model_type``.

A new family is one package here (``families/<name>/``: its rules in ``__init__``, its backbone adapter,
its runtime table) that builds a ``Family`` (``families/base.py``), added to ``FAMILIES``; the plan,
verify, compat, the hub and the runtime find it through ``family_for``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..errors import ConfigError
from .base import Family, config_model_type, text_config
from .deepseek_v4 import FAMILY as DEEPSEEK_V4
from .qwen3_5 import FAMILY as QWEN3_5
from .glm import FAMILIES as GLM_FAMILIES
from .glm5_next import FAMILY as GLM5_NEXT
from .qwen3_next import FAMILY as QWEN3_NEXT
from .nemotron_h import FAMILY as NEMOTRON_H
from .qwen4_exp import FAMILY as QWEN4_EXP

FAMILIES: Tuple[Family, ...] = (QWEN3_5, QWEN3_NEXT, QWEN4_EXP, *GLM_FAMILIES, GLM5_NEXT, DEEPSEEK_V4, NEMOTRON_H)

# model types seen in releases with an MTP head that no family here converts yet
UNSUPPORTED: Dict[str, str] = {
    "deepseek_v3": ("its nextn head is the GLM design (families/glm/), but DeepSeek-V3's attention, router and "
                    "head layer count are not yet a family here"),
}
UNSUPPORTED.update({family.drafter_folder_type: (
    "mlx-vlm's drafter folder (`mlx_vlm.convert --mtp`): the MTP head alone, no model to convert; `mtpconvert "
    "verify DIR` reads it; convert the model's own release instead") for family in FAMILIES if family.drafter_folder_type})


def family_for(config: dict) -> Family:
    """The family whose rules apply to this config.json; a ConfigError names the model_type otherwise."""
    wanted = config_model_type(config)
    tc = text_config(config)
    for t in (config.get("model_type"), tc.get("model_type")):
        if t in UNSUPPORTED:
            raise ConfigError(f"unsupported model_type {t!r}", file="config.json", hint=UNSUPPORTED[t])
    for family in FAMILIES:
        if wanted in family.model_types:
            return family.bind(family, config) if family.bind is not None else family
    known = sorted(t for family in FAMILIES for t in family.model_types)
    raise ConfigError(f"unknown model_type {config.get('model_type')!r}; expected one of {known}",
                      file="config.json", key="model_type")


def model_spec(config: dict):
    """config.json validated by its family's rules: the numbers the converter needs."""
    return family_for(config).spec(config)


def drafter_family(config: dict) -> Optional[Family]:
    """The family whose head a head-only drafter folder holds (its config's model_type is that family's
    ``drafter_folder_type``, the model's own config under ``text_config``); None for any other config."""
    if not isinstance(config, dict):
        return None
    return next((f for f in FAMILIES if f.drafter_folder_type and config.get("model_type") == f.drafter_folder_type),
                None)
