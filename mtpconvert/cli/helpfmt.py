"""Help pages without noise: a flag shows no type (typer would print `<bool>` beside every flag)."""

from __future__ import annotations

from typing import Any, List

from typer.core import TyperCommand, TyperGroup


def _without_flag_types(params: List[Any]) -> List[Any]:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # the help table prints a metavar in place of the type; a flag takes no value
    return params


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> List[Any]:
        return _without_flag_types(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> List[Any]:
        return _without_flag_types(super().get_params(ctx))
