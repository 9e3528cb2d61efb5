"""Arrows point down: no import circle among Proxima's modules, and the allocator core
stays pure (no torch, no vLLM). Read from the source with ``ast`` (nothing is imported),
every ``import`` counted wherever it stands -- a function-level import is an arrow too."""

from __future__ import annotations

import ast
from pathlib import Path

import proxima

ROOT = Path(proxima.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The Proxima modules ``name`` imports (``from package import module`` names the
    module; ``from module import thing`` the module), and every external top-level
    package, prefixed with ``ext:``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in known else mod
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "proxima":
                out.add("ext:" + target.split(".")[0])
                continue
            while target and target not in known:        # a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: {t for t in _imports(name, path, known) if not t.startswith("ext:")}
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), plus any
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph.get(v, ()):
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(import_graph()) == []


def test_the_allocator_core_imports_neither_torch_nor_vllm():
    modules = _modules()
    known = set(modules)
    for name, path in modules.items():
        if name == "proxima.allocator" or name.startswith("proxima.allocator."):
            external = {t[4:] for t in _imports(name, path, known) if t.startswith("ext:")}
            assert not external & {"torch", "vllm", "triton"}, (name, external)
            inside = {t for t in _imports(name, path, known) if not t.startswith("ext:")}
            assert all(t.startswith("proxima.allocator") for t in inside), (name, inside)


def _package_imports(package: str) -> dict[str, tuple[set[str], set[str]]]:
    """Every module of ``package``: (the Proxima modules it imports, its external packages)."""
    modules = _modules()
    known = set(modules)
    out = {}
    for name, path in modules.items():
        if name == package or name.startswith(package + "."):
            found = _imports(name, path, known)
            out[name] = ({t for t in found if not t.startswith("ext:")},
                         {t[4:] for t in found if t.startswith("ext:")})
    return out


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_layers_point_down():
    # proxima.vllm is the adapter layer (everything that touches vLLM); below it the
    # allocator core and the kernels import nothing of Proxima's outside themselves, and
    # proxima.memory imports neither vLLM nor the adapter layer
    for package in ("proxima.allocator", "proxima.kernels"):
        modules = _package_imports(package)
        assert modules, package
        for name, (inside, _) in modules.items():
            assert all(_inside(t, package) for t in inside), (name, inside)
    modules = _package_imports("proxima.memory")
    assert modules
    for name, (inside, external) in modules.items():
        assert "vllm" not in external, name
        assert not any(_inside(t, "proxima.vllm") for t in inside), (name, inside)


def test_the_adapter_layer_imports_the_real_vllm():
    # inside proxima/vllm/, ``import vllm`` must be vLLM itself: absolute imports only, so
    # that the package's own name never shadows it
    modules = _package_imports("proxima.vllm")
    assert any("vllm" in external for _, external in modules.values())
    for name in modules:
        tree = ast.parse(_modules()[name].read_text())
        relative = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert relative == [], (name, relative)


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    # the test's own reading, on a module written for it
    known = {"proxima.a", "proxima.b", "proxima.pkg", "proxima.pkg.c"}
    src = tmp_path / "m.py"
    src.write_text("import os\n"
                   "def f():\n    from proxima import b\n    import torch\n"
                   "from proxima.pkg.c import thing\n"
                   "from .pkg import c\n")
    assert _imports("proxima.a", src, known) == {"proxima.b", "proxima.pkg.c", "ext:os",
                                                 "ext:torch"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
