"""The conversion plan, from headers alone: every output tensor, its sources, and the steps that make it."""

from .build import build_plan
from .output import output_config
from .items import Plan, PlanItem, SourceRef

__all__ = ["Plan", "PlanItem", "SourceRef", "build_plan", "output_config"]
