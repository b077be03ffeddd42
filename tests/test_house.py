"""The package's shape: no import cycle between xlaopt's modules, lazy imports included; a
small top level; checkpoint and data doing their file I/O through xlaopt.io, not each other; no
module over 500 lines and no function over 80 (issue 27).

The import graph is read from the source with `ast` (no module is imported): every `import` and
`from ... import` anywhere in a module, inside functions too, relative ones resolved. An edge goes
to the submodule a name is when it is one (`from xlaopt.analysis import hlo`), else to the package
`__init__` that holds the name (`from xlaopt.checkpoint import CheckpointManager`), and to every
package `__init__` Python runs on the way (`import xlaopt.checkpoint.layout` runs
`xlaopt/checkpoint/__init__.py` first) unless the importer sits inside that package, where it is
already running.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder -> the dotted package it installs as (pyproject.toml's package-dir).
PACKAGES = {"xlaopt": "xlaopt", "models": "xlaopt.models", "passes": "xlaopt.passes"}
MAX_TOP_LEVEL = 15


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([dotted, *parts])] = path
    return out


def _package_of(name: str, path: pathlib.Path) -> str:
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path).split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else source)
    own = _package_of(name, path)
    edges = set()
    for target in targets:
        if not target.startswith("xlaopt."):
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # the target and the packages Python runs to reach it
            dotted = ".".join(parts[:i])
            inside = own == dotted or own.startswith(dotted + ".")
            if dotted in modules and not inside:
                edges.add(dotted)
    return edges


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle, as [a, b, ..., a], per strongly connected group of modules (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [find_cycle({m: graph[m] & set(group) for m in group}) for group in groups]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_graph_reader_sees_lazy_relative_and_package_imports(tmp_path):
    graph = import_graph()
    # lazy (function-level) imports are edges: the CLI imports its subcommands inside functions
    assert "xlaopt.analysis.analyze" in graph["xlaopt.cli.analyze"]
    # `from xlaopt.checkpoint import X` is an import of the package's __init__
    assert "xlaopt.checkpoint" in graph["xlaopt.runtime.train"]
    # `from xlaopt.analysis import hlo` is an import of the submodule
    assert "xlaopt.analysis.hlo" in graph["xlaopt.analysis.schedule"]
    # models/ installs as xlaopt.models
    assert "xlaopt.models.registry" in graph["xlaopt.models.decoder"]
    # relative imports, and the package __init__ Python runs on the way to a submodule
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "m.py").write_text("from . import n\nfrom ..other import X\n\ndef f():\n    import xlaopt.data.store\n")
    modules = {"xlaopt.p.sub.m": None, "xlaopt.p.sub.n": None, "xlaopt.p.other": None, "xlaopt.p": None,
               "xlaopt.p.sub": None, "xlaopt.data": None, "xlaopt.data.store": None}
    assert _imports("xlaopt.p.sub.m", pkg / "sub" / "m.py", modules) == {
        "xlaopt.p.sub.n", "xlaopt.p.other", "xlaopt.data", "xlaopt.data.store"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "e"}, "e": set()}) == [["a", "b", "a"],
                                                                                          ["c", "d", "c"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycle: " + "; ".join(" -> ".join(c) for c in found)


def test_checkpoint_and_data_share_io_and_never_import_each_other():
    graph = import_graph()
    packages = {"checkpoint": "xlaopt.checkpoint", "data": "xlaopt.data", "io": "xlaopt.io"}
    for module, edges in graph.items():
        for a, b in (("checkpoint", "data"), ("data", "checkpoint"), ("io", "checkpoint"), ("io", "data")):
            if _inside(module, packages[a]):
                assert not any(_inside(e, packages[b]) for e in edges), (module, sorted(edges))
    assert any(_inside(e, "xlaopt.io") for e in graph["xlaopt.data.shard_reader"])
    assert any(_inside(e, "xlaopt.io") for e in graph["xlaopt.checkpoint.reader"])


def test_analysis_never_imports_planning():
    """Analysis prices programs; planning searches layouts with those prices, so it sits above."""
    upward = {module: sorted(e for e in edges if _inside(e, "xlaopt.planning"))
              for module, edges in import_graph().items() if _inside(module, "xlaopt.analysis")}
    assert not any(upward.values()), {m: e for m, e in upward.items() if e}


def test_small_top_level():
    top = sorted(p.stem for p in (ROOT / "xlaopt").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules directly in xlaopt/ (at most {MAX_TOP_LEVEL}): {top}"


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def oversized(roots=tuple(PACKAGES)) -> list[str]:
    """Modules over MAX_MODULE_LINES and functions (methods and nested ones too) over
    MAX_FUNCTION_LINES, decorators and docstrings counted, under the source folders."""
    found = []
    for folder in roots:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text, rel = path.read_text(), path.relative_to(ROOT).as_posix()
            if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
                found.append(f"{rel}: {lines} lines")
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    if (lines := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_module_over_500_lines_and_no_function_over_80():
    found = oversized()
    assert not found, (f"split along a seam (modules at most {MAX_MODULE_LINES} lines, functions at most "
                       f"{MAX_FUNCTION_LINES}):\n" + "\n".join(found))
