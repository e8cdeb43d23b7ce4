"""The layout's promises, checked by walking every import (module level and inside functions alike):
the core imports no plugin, no two modules import each other round a circle, and the plugin API
(`outrider.api`) names what the example third-party plugin imports; and the package ships every source the
CPU kernels are compiled from."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"outrider": ROOT / "core", "outrider.plugins": ROOT / "plugins"}


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The Outrider modules `name` imports, anywhere in the file: `from a.b import c` counts as a.b.c where
    that is a module, else as a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_core_imports_no_plugin():
    offenders = sorted(f"{name} imports {target}" for name, targets in GRAPH.items()
                       if not name.startswith("outrider.plugins") for target in targets
                       if target.startswith("outrider.plugins"))
    assert not offenders, "the core reaches plugins only through the registry:\n" + "\n".join(offenders)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_circles():
    assert _circles(GRAPH) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_plugin_api_names_resolve():
    api = importlib.import_module("outrider.api")
    missing = [name for name in [*api.__all__, *api._TESTING] if not hasattr(api, name)]
    assert not missing


def test_the_example_plugin_imports_only_the_plugin_api():
    example = ROOT / "examples" / "outrider-suffix"
    if not example.is_dir():
        pytest.skip("no example plugin in this checkout")
    offenders = []
    for path in example.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(example)}: {name}" for name in names
                          if name.split(".")[0] == "outrider" and name != "outrider.api"]
    assert not offenders


def test_the_plugin_api_names_what_the_guide_tells_authors_to_use():
    """Every `outrider.api.NAME` docs/plugins.md mentions resolves, and its Python blocks import only it."""
    import re

    guide = (ROOT / "docs" / "plugins.md").read_text()
    api = importlib.import_module("outrider.api")
    named = set(re.findall(r"outrider\.api\.(\w+)", guide))
    assert named and not [name for name in named if not hasattr(api, name)]
    imported = re.findall(r"^from (outrider[\w.]*) import", guide, re.M)
    assert imported and set(imported) == {"outrider.api"}


def test_the_package_ships_every_kernel_source():
    """The kernels are compiled on the user's machine from the files the package carries: every source and
    header under core/native must match a pattern of pyproject's package-data."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["outrider.native"]
    native = ROOT / "core" / "native"
    files = [path.relative_to(native).as_posix() for path in native.rglob("*") if path.suffix in (".cpp", ".h")]
    assert "kernels/bindings.cpp" in files and "probes/int8_product_rate.cpp" in files
    assert [name for name in files if not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)] == []
