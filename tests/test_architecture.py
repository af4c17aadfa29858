"""The package's shape: families found by model_type, imports without cycles, modules of a readable size."""

from __future__ import annotations

import ast
import importlib
import re
import importlib.util
import json
from pathlib import Path

import pytest

from mtpconvert.cli import run
from mtpconvert.errors import ConfigError
from mtpconvert.families import FAMILIES, family_for
from mtpconvert.families.base import resolve

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


def test_every_model_type_belongs_to_one_family_and_its_backbone_module_exists():
    seen = {}
    for family in FAMILIES:
        for model_type, module in family.model_types.items():
            assert model_type not in seen, f"{model_type} claimed by {seen[model_type]} and {family.name}"
            seen[model_type] = family.name
            library = family.backbone_library.replace("-", "_")
            if library != "mlx_lm" and importlib.util.find_spec(library) is None:
                continue  # an optional extra (pip install mtpconvert[vlm]); its own tests run with it installed
            importlib.import_module(f"{library}.models.{module}")  # the backbone's loader exists in its library
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
    assert qwen["backbone_modules"] == ["mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_5_moe"]
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


# ---------------------------------------------------------------- a family is one place


def _model_type_names():
    from mtpconvert.families import UNSUPPORTED

    names = set(UNSUPPORTED)
    for family in FAMILIES:
        names |= set(family.model_types) | {f"{t}_mtp" for t in family.model_types}
        if family.drafter_folder_type:
            names.add(family.drafter_folder_type)
    return names


def _outside_families():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "families"]


def test_no_model_type_is_named_outside_families():
    """Code, comments and docstrings outside families/ ask the family; none names a model type."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(_model_type_names(), key=len, reverse=True))) + r")\b")
    hits = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}" for p in _outside_families()
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_the_model_type_scan_finds_a_name():
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, _model_type_names())) + r")\b")
    assert pattern.search('if config["model_type"] == "glm_moe_dsa":')
    assert not pattern.search("RecordingGatedDeltaNet, patches/qwen3_5_norm_shift.py")


def test_no_family_module_is_imported_outside_families():
    """Only the registry (``mtpconvert.families``) and the vocabulary (``families.base``) are imported elsewhere;
    a family's own modules are reached through its ``Family`` (its adapter and runtime table by reference)."""
    graph = import_graph()
    allowed = {"mtpconvert.families", "mtpconvert.families.base"}
    hits = {name: sorted(d for d in deps if d.startswith("mtpconvert.families") and d not in allowed)
            for name, deps in graph.items() if not name.startswith("mtpconvert.families")}
    assert {k: v for k, v in hits.items() if v} == {}


def test_every_family_reference_resolves_to_its_parts():
    from mtpconvert.runtime.backbone import Backbone

    for family in FAMILIES:
        adapter = family.backbone_class()
        assert issubclass(adapter, Backbone) and adapter.__module__.startswith("mtpconvert.families."), family.name
        if family.capabilities.batched:  # the batched engine needs per-row caches of every layer kind
            assert adapter.row_cache is not Backbone.row_cache, family.name
        if family.capabilities.pre_norm_hidden:  # the library's own forward gives post-norm states only
            assert adapter.forward is not Backbone.forward, family.name
        assert callable(resolve(family.compat)), family.name


# the runtime stack: what a decode, a smoke or a bench needs, and what planning, verifying and converting don't
RUNTIME_STACK = ("transformers", "torch", "mlx_lm", "mlx_vlm", "mtpconvert.runtime.decoding",
                 "mtpconvert.runtime.measure", "mtpconvert.runtime.backbone")
IMPORTS_PROBE = """
import json, sys
from mtpconvert.cli import run
try:
    run(json.loads(sys.argv[1]))
except SystemExit:
    pass
stack = json.loads(sys.argv[2])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in stack or m.startswith(tuple(stack))
                        or (m.startswith("mtpconvert.families.") and m.endswith((".backbone", ".compat"))))))
"""


@pytest.mark.parametrize("command", [["families", "--json"], ["verify", "{src}", "--json"],
                                     ["convert", "{src}", "{out}", "--dry-run"],
                                     ["convert", "{src}", "{out}", "--bits", "4", "--no-smoke"]])
def test_planning_verifying_and_converting_import_no_runtime(tmp_path, command):
    """In a fresh interpreter: these commands never import the runtime stack (the decoding smoke's mlx-lm and
    transformers cost seconds and hundreds of MB on every conversion)."""
    import subprocess
    import sys

    from mtpconvert.fixture import fixture_path

    args = [a.format(src=fixture_path("dense"), out=tmp_path / "out") for a in command]
    done = subprocess.run([sys.executable, "-c", IMPORTS_PROBE, json.dumps(args), json.dumps(RUNTIME_STACK)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    if "--no-smoke" in command:
        assert (tmp_path / "out" / "config.json").is_file()  # the probe ran the whole conversion
