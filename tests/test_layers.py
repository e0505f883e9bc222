"""The layers of DESIGN.md, held by the imports themselves: the library never imports a tool, and no module
imports another that (directly or not) imports it back.

The static check reads every ``import`` statement of the package (function-level ones too) with ``ast``, so
it names the offending module; the dynamic one imports the whole library in a fresh interpreter and looks at
what got loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flash_attention"
TOOLS = "flash_attention.tools"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
LIBRARY = sorted(m for m in MODULES if not m.startswith(TOOLS) and m != "flash_attention.__main__")


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package's modules an import statement of ``importer`` loads (a name that is a submodule counts
    as that module, any other name as its package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "flash_attention"]
    if node.level:
        base = importer.split(".")
        is_pkg = MODULES[importer].name == "__init__.py"
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "flash_attention":
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(t for t in _resolve(name, node) if t in MODULES and t != name)
        graph[name] = edges
    return graph


def test_the_library_never_imports_a_tool():
    graph = _graph()
    upward = sorted((m, t) for m in LIBRARY for t in graph[m] if t.startswith(TOOLS))
    assert upward == [], f"library modules importing tools: {upward}"


def test_no_import_cycle():
    graph = _graph()
    # Tarjan's strongly connected components: a cycle is a component of more than one module.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
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
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_the_graph_sees_real_edges():
    # A check that cannot fail is a defect: the graph must contain the arrows we know exist.
    graph = _graph()
    assert "flash_attention.ops" in graph["flash_attention.ops.dispatch"]
    assert "flash_attention.ops.select" in graph["flash_attention.ops.forward"]
    assert "flash_attention.ops.winners" in graph["flash_attention.ops.select"]
    assert any(t.startswith(TOOLS) for t in graph["flash_attention.__main__"])


def test_importing_the_library_loads_no_tool():
    # One fresh interpreter imports every library module in turn; a tool loaded by an import is blamed on it.
    code = (
        "import importlib, sys\n"
        f"for name in {LIBRARY!r}:\n"
        "    importlib.import_module(name)\n"
        f"    tools = sorted(m for m in sys.modules if m.startswith({TOOLS!r}))\n"
        "    if tools:\n"
        "        print(name, tools)\n"
        "        break\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"importing {proc.stdout.strip()}"
    assert len(LIBRARY) > 20


#: The package's floors (docs/architecture.md, "Layout of the code"): a module imports only modules of its
#: own floor or below. The root's helpers (dropout, sinks) and the spec sit at the bottom with the configs.
FLOORS = {
    "spec": 0,
    "dropout": 0,
    "sinks": 0,
    "configs": 0,
    "jit": 1,
    "ops": 2,
    "fallback": 2,
    "torch_ops": 3,
    "api": 4,
    "nn": 5,
    "integrations": 6,
}


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_every_import_looks_down_the_floors():
    graph = _graph()
    upward = sorted(
        (m, t)
        for m in LIBRARY
        for t in graph[m]
        if _floor(m) is not None and _floor(t) is not None and _floor(t) > _floor(m)
    )
    assert upward == [], f"imports up the floors: {upward}"
    # (and the floors name every subpackage and root module of the library but the root's own __init__)
    tops = {m.split(".")[1] for m in LIBRARY if m.count(".") >= 1}
    assert tops <= set(FLOORS) | {"tools"}, sorted(tops - set(FLOORS))
