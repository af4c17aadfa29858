"""The conversion plan, from headers alone: every output tensor, its sources, and the steps that make it."""

from .build import Plan, PlanItem, SourceRef, build_plan, count_mtp_layers, detect_raw, detect_style, output_config

__all__ = ["Plan", "PlanItem", "SourceRef", "build_plan", "count_mtp_layers", "detect_raw", "detect_style",
           "output_config"]
