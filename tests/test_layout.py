"""The layout's rules, checked on the source: modules import one another without a cycle, no
source file grows past 1,000 lines, and attngrad.torch reaches its compiled tiles through
PyTorch's extension machinery alone (no ctypes, no library file names, no compiler run by
hand)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "attngrad"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The attngrad modules `path` imports at module level (not inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found |= {f"{stem}.{alias.name}" for alias in node.names}  # `from . import x` imports a module
    return {m for m in found if m.startswith("attngrad")}


def test_no_import_cycle():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how packages work: not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_source_file_over_1000_lines():
    sources = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    long = {str(p.relative_to(SRC)): n for p in sources if (n := len(p.read_text().splitlines())) > 1000}
    assert not long, long


def test_the_tiles_come_through_pytorchs_extension_machinery():
    for path in (PACKAGE / "torch").rglob("*.py"):
        text = path.read_text()
        for word in ("ctypes", "libtorch_cpu", "subprocess"):
            assert word not in text, f"{path.relative_to(SRC)} names {word}"

