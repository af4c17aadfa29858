"""The package and the dev code (tests, tools, benchmarks, interop) as packages: they import each other by package
name, run as ``python -m`` from the repository root, edit no ``sys.path``, and import without cycles."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from tests.test_architecture import cycles

ROOT = Path(__file__).resolve().parents[1]
TREES = ("mtpconvert", "tests", "tools", "benchmarks", "interop")
MAX_PATH_EDITS = 2
FIXTURE_TRAINING_BASE = ("corpus", "heads", "training", "folders")  # what every fixture-trainer variant imports

_EDITING_METHODS = {"insert", "append", "extend", "remove", "pop", "clear", "setdefault", "update", "__setitem__",
                    "__delitem__"}


def modules(root: Path = ROOT) -> dict:
    """Dotted module name -> file, for every .py file of the trees (``tools/a/__init__.py`` is ``tools.a``)."""
    out = {}
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_sys(node, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _is_search_state(node) -> bool:
    """``sys.path`` or ``sys.modules``, or a subscript of one."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return _is_sys(node, "path") or _is_sys(node, "modules")


def _patches_import_state(call: ast.Call) -> bool:
    """pytest's monkeypatch on sys.path or sys.modules: ``syspath_prepend``, ``setitem(sys.modules, ...)``,
    ``setattr(sys, "path", ...)`` and the like."""
    func, args = call.func, call.args
    if func.attr == "syspath_prepend":
        return True
    if func.attr not in ("setitem", "delitem", "setattr", "delattr") or not args:
        return False
    names_one = (isinstance(args[0], ast.Name) and args[0].id == "sys" and len(args) > 1
                 and isinstance(args[1], ast.Constant) and args[1].value in ("path", "modules"))
    return names_one or _is_search_state(args[0])


def _edits_in(tree: ast.AST) -> list:
    """(line, what) of each change to sys.path or sys.modules in an AST."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            edits = node.func.attr in _EDITING_METHODS and _is_search_state(node.func.value)
            if edits or _patches_import_state(node):
                found.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            found += [(node.lineno, ast.unparse(t)) for t in targets if _is_search_state(t)]
    return found


def path_edits(source: str, where: str) -> list:
    """``where:line what`` for each change to sys.path or sys.modules in ``source``: in its code, and in the code
    of its string literals that parse as Python (a child process's script), where comments and prose do not count.
    An f-string is read with each replacement field as a name."""
    tree = ast.parse(source)
    found = _edits_in(tree)
    inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inner:
            text = node.value
        else:
            continue
        if "sys." not in text:
            continue
        try:
            script = ast.parse(textwrap.dedent(text))
        except SyntaxError:
            continue
        found += [(node.lineno + line - 1, f"{what} (in a string)") for line, what in _edits_in(script)]
    return [f"{where}:{line} {what}" for line, what in sorted(found)]


def tree_path_edits(root: Path = ROOT) -> list:
    return [edit for path in modules(root).values()
            for edit in path_edits(path.read_text(), str(path.relative_to(root)))]


def import_graph(root: Path = ROOT) -> dict:
    """module -> the modules of the trees it imports, anywhere in its code (function bodies too).

    Absolute names resolve from the repository root, as ``python -m`` and pytest (``pythonpath``) run them;
    ``from a import b`` counts as the module ``a.b`` where there is one, else as ``a``. A bare name that no tree
    holds, but a file beside the importer does, counts as that file too: a script run from its folder, or a
    folder put on sys.path, imports it so. That edge may be a third-party package of the same name instead (the
    probes import ``mlx_lm``); an edge too many can only make the cycle check stricter.
    """
    known = modules(root)
    tops = {m.split(".")[0] for m in known}

    def resolve(dotted: str, package: str):
        """The module of the trees that ``import dotted`` in ``package`` loads: the longest prefix of the name
        that is one, from the root; for a name no tree holds, from the importer's folder (its package)."""
        parts, floor = dotted.split("."), 0
        if parts[0] not in tops:
            parts, floor = package.split(".") + parts, len(package.split("."))
        return next((".".join(parts[:n]) for n in range(len(parts), floor, -1) if ".".join(parts[:n]) in known), None)

    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(parent + ([node.module] if node.module else []))
                    found = [target + "." + a.name if target + "." + a.name in known else target for a in node.names]
                else:
                    found = [resolve(f"{node.module}.{a.name}", package) for a in node.names]
                deps.update(f for f in found if f)
            elif isinstance(node, ast.Import):
                deps.update(f for f in (resolve(a.name, package) for a in node.names) if f)
        graph[name] = {d for d in deps if d in known and d != name}
    return graph


def test_no_dev_code_edits_sys_path():
    edits = tree_path_edits()
    assert len(edits) <= MAX_PATH_EDITS, "\n".join(edits)


def test_the_edit_counter_sees_each_kind_of_edit_and_only_edits():
    # written with SYS for sys: this literal is code, and the tree scan would count its edits as this file's
    source = '''
import SYS
SYS.path.insert(0, "x")                     # 1
SYS.path.append("y")                        # 2
SYS.path[:0] = ["z"]                        # 3
SYS.path[:] = [p for p in SYS.path if p]    # 4
SYS.modules["m"] = object()                 # 5
SYS.modules.setdefault("n", SYS.modules[__name__])  # 6
del SYS.modules["m"]                        # 7
monkeypatch.syspath_prepend("w")            # 8
monkeypatch.setitem(SYS.modules, "k", 1)    # 9
CHILD = f"""
import SYS
SYS.path.insert(0, {str(SYS.prefix)!r})
"""                                         # 10, in a child's script
# SYS.path.insert(0, "a comment")
DOC = "SYS.path.insert is named here in prose, which is not code"
main = SYS.modules.get("__main__")
env = {"PYTHONPATH": ":".join(SYS.path)}
'''.replace("SYS", "sys")
    edits = path_edits(source, "f.py")
    assert len(edits) == 10, edits
    assert edits[-1] == "f.py:14 sys.path.insert (in a string)"


def test_every_dev_folder_of_modules_is_a_package():
    folders = {p.parent for tree in TREES[1:] for p in (ROOT / tree).rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []


def test_the_package_and_the_dev_code_import_without_cycles():
    graph = import_graph()
    assert "tools.fixture_training.qwen3_5" in graph["tools.fixture_training.qwen3_next"], "no imports read"
    assert "interop.run" in graph["tests.test_interop"] and "tests.checkpoints" in graph["tools.conversion_digests"]
    assert cycles(graph) == []


def test_fixture_trainer_variants_import_their_base_never_the_reverse():
    graph = import_graph()
    base = {f"tools.fixture_training.{m}" for m in FIXTURE_TRAINING_BASE}
    variants = {m for m in graph if m.startswith("tools.fixture_training.") and m not in base
                and not m.endswith("__main__")}
    assert {m: sorted(graph[m] & variants) for m in base if graph[m] & variants} == {}
    assert not {d for d in graph["tools.fixture_training.qwen3_5"] if d.startswith(("tools.fixture_training.qwen3_next",
                                                                                    "tools.fixture_training.glm"))}


def test_the_graph_reader_sees_a_cycle_through_imports_beside_the_importer(tmp_path):
    """Two scripts in one folder, each importing the other by its bare name (one inside a function), as the
    fixture trainers once did: a cycle. Relative imports and ``from package import module`` resolve too."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "trainer.py").write_text("import numpy\n\ndef variant():\n    import trainer_next\n")
    (tmp_path / "tools" / "trainer_next.py").write_text("import trainer as base\n")
    (tmp_path / "tools" / "pkg").mkdir()
    (tmp_path / "tools" / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "tools" / "pkg" / "a.py").write_text("from tools import pkg\n")
    graph = import_graph(tmp_path)
    assert graph["tools.trainer"] == {"tools.trainer_next"} and graph["tools.trainer_next"] == {"tools.trainer"}
    assert cycles(graph) == [["tools.pkg", "tools.pkg.a"], ["tools.trainer", "tools.trainer_next"]]
