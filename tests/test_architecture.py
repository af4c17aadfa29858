"""The package's shape: families found by model_type, imports without cycles, modules of a readable size."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

from mtpconvert.cli import run
from mtpconvert.errors import ConfigError
from mtpconvert.families import FAMILIES, family_for

PACKAGE = Path(__file__).resolve().parents[1] / "mtpconvert"
MAX_LINES, MAX_CLI_LINES = 450, 300
MAX_FUNCTION_LINES = 100


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph():
    """module -> the package modules it imports (a ``from . import x`` of a submodule counts as that submodule)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert graph["mtpconvert.runtime.smoke.decode"], "the graph reader found no imports"
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > (MAX_CLI_LINES if p.parent.name == "cli" else MAX_LINES)}
    assert long == {}


def long_functions(tree: ast.AST, limit: int = MAX_FUNCTION_LINES) -> dict:
    """``{qualified name: lines}`` of every function or method in ``tree`` longer than ``limit`` lines
    (from its ``def`` to its last line, decorators left out)."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    found[name[:-1]] = n
            visit(child, name)

    visit(tree, "")
    return found


def test_no_function_is_too_long():
    long = {f"{p.relative_to(PACKAGE)}:{name}": n for p in PACKAGE.rglob("*.py")
            for name, n in long_functions(ast.parse(p.read_text())).items()}
    assert long == {}


def test_long_functions_finds_a_long_method_and_a_nested_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    source = f"class A:\n  def m(self):\n{body}\n\ndef f():\n  def g():\n{body}\n  return g\n"
    assert long_functions(ast.parse(source), limit=3) == {"A.m": 4, "f": 6, "f.g": 4}


def test_every_model_type_belongs_to_one_family_and_loads_in_mlx_lm():
    seen = {}
    for family in FAMILIES:
        for model_type, module in family.model_types.items():
            assert model_type not in seen, f"{model_type} claimed by {seen[model_type]} and {family.name}"
            seen[model_type] = family.name
            importlib.import_module(f"mlx_lm.models.{module}")  # the backbone's loader exists in mlx-lm
            found = family_for({"model_type": model_type, "num_hidden_layers": 2})
            assert found.name == family.name and found.head == family.head


def test_an_unknown_or_unsupported_model_type_is_named():
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        family_for({"model_type": "llama"})
    with pytest.raises(ConfigError, match="unsupported model_type 'deepseek_v3'") as e:
        family_for({"model_type": "deepseek_v3"})
    assert "nextn" in e.value.hint
    with pytest.raises(ConfigError, match="num_hidden_layers") as e:  # where GLM's nextn layer is
        family_for({"model_type": "glm4_moe_lite"})


def test_families_lists_the_qwen3_5_family(capsys):
    assert run(["families", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    (qwen,) = [f for f in listed if f["family"] == "qwen3_5"]
    assert set(qwen["model_types"]) == {"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}
    assert qwen["mlx_lm_modules"] == ["qwen3_5", "qwen3_5_moe"]
    assert qwen["head"]["hidden_state"] == "post_norm" and qwen["head"]["norms_zero_centred"] is True
    assert {"mlx-vlm", "mtplx", "rapid-mlx", "vllm-mlx"} <= set(qwen["head_runtimes"])
    assert run(["families"]) == 0
    assert "qwen3_5" in capsys.readouterr().out


def test_a_familys_runtimes_are_the_compat_tables_runtimes():
    from mtpconvert.compat import RUNTIMES
    from mtpconvert.options import MTP_LAYOUTS

    for family in FAMILIES:
        assert set(family.head_runtimes) <= set(family.backbone_runtimes) <= set(RUNTIMES)
        assert set(family.mtp_layouts) <= set(MTP_LAYOUTS)
