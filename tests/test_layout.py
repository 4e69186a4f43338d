"""The layout's rules, checked on the source: modules import one another without a cycle, no
source file grows past 1,000 lines, attngrad.torch reaches its compiled tiles through
PyTorch's extension machinery alone (no ctypes, no library file names, no compiler run by
hand), no function below the public entry points takes more than 8 parameters (a Triton
kernel 30, its arguments packed), and attngrad.torch's files lie in their layers, each
importing only those below:

    regime, tuning,          the shared rules: where a call runs (the one reader of torch's
    precision, layout        private state), tuning as data, the dtypes taken, how inputs of
                             any rank fold
    masks/                   masks in every form, and what is made from them
    op/                      the call, the ops and their contract, autograd, dispatch
    backends/<name>/         one package per backend, none importing another
    arguments, distributed/  the public arguments folded into a call; the sharded entry points
    entry points             functional, mha, sdpa_mode (with recomputation), nested, eager_plans:
                             anything above

so there is no cycle between packages either."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "attngrad"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_targets(nodes, package: list, with_stem: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of what each import among `nodes` names, relative ones resolved
    against `package`: `from X import y` gives X.y (y may be a module), and X too if
    `with_stem`."""
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = node.module or ""
            if node.level:
                stem = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found += [(node.lineno, stem)] if with_stem else []
            found += [(node.lineno, f"{stem}.{alias.name}") for alias in node.names]
    return found


def _imports(path: Path) -> set[str]:
    """The attngrad modules `path` imports at module level (not inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = _import_targets(ast.parse(path.read_text()).body, package.split("."), with_stem=True)
    return {m for _, m in found if m.startswith("attngrad")}


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


TORCH = PACKAGE / "torch"
ENTRY_POINTS = {"__init__", "functional", "mha", "sdpa_mode", "recomputation", "nested", "eager_plans"}
SHARED = {"precision", "layout", "regime", "tuning", "arguments"}
BELOW = {  # what each layer may import from attngrad.torch, beside itself
    "regime": set(),
    "tuning": set(),
    "precision": set(),
    "layout": {"precision"},
    "masks": {"regime", "tuning", "precision", "layout"},
    "op": {"regime", "tuning", "precision", "layout", "masks"},
    "backend": {"regime", "tuning", "precision", "layout", "masks", "op"},
    "arguments": {"regime", "tuning", "precision", "layout", "masks", "op"},
    "distributed": {"regime", "tuning", "precision", "layout", "masks", "op", "arguments"},
}


def _layer(parts: list) -> str:
    """The layer of module attngrad.torch.<parts>: a backend's package is "backends.<name>"."""
    parts = parts[:-1] if parts and parts[-1] == "__init__" else parts
    if not parts or parts[0] in ENTRY_POINTS:
        return "entry"
    if parts[0] == "backends":
        return "backends" if len(parts) == 1 else f"backends.{parts[1]}"
    return parts[0]


def _torch_imports(path: Path, root: Path) -> list:
    """(line, the imported module's parts below attngrad.torch) of every import of attngrad.torch,
    at any depth."""
    package = ["attngrad", "torch", *path.relative_to(root).parts[:-1]]
    found = _import_targets(ast.walk(ast.parse(path.read_text())), package, with_stem=False)
    return [(line, name.split(".")[2:]) for line, name in found if name.split(".")[:2] == ["attngrad", "torch"]]


def layout_violations(root: Path = TORCH) -> list:
    """Every broken rule, one line each."""
    broken = []
    for path in sorted(root.glob("*.py")):
        if path.stem not in ENTRY_POINTS | SHARED:
            broken.append(f"{path.name}: a module at the top that is no entry point or shared rule")
    for path in sorted(root.rglob("*.py")):
        own = _layer(list(path.relative_to(root).with_suffix("").parts))
        if own in ("entry", "backends") or not (own in BELOW or own.startswith("backends.")):
            continue
        allowed = BELOW["backend" if own.startswith("backends.") else own] | {own}
        for line, target in _torch_imports(path, root):
            other = _layer(target)
            if other not in allowed and not (other == "backends" and own.startswith("backends.")):
                broken.append(f"{path.relative_to(root)}:{line}: the {own} layer imports {'.'.join(target)} "
                              f"({other})")
    return broken


def test_every_module_lies_in_its_layer_and_imports_only_those_below():
    assert layout_violations() == []


@pytest.mark.parametrize("module, line", [
    ("op/dispatch.py", "from ..backends import triton"),  # an upward import
    ("masks/blocks.py", "from ..op import call"),  # the op's call holds masks: a cycle
    ("backends/triton/launch.py", "from ..cpu_tiles import native"),  # a backend on another
])
def test_a_broken_rule_is_found(tmp_path, module, line):
    """The check on a copy of the package with one rule broken names the file and the import."""
    copy = tmp_path / "torch"
    shutil.copytree(TORCH, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}\n")
    assert any(v.startswith(module) for v in layout_violations(copy))


def test_a_stray_module_at_the_top_is_found(tmp_path):
    copy = tmp_path / "torch"
    shutil.copytree(TORCH, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    (copy / "helpers.py").write_text("")
    assert layout_violations(copy) == ["helpers.py: a module at the top that is no entry point or shared rule"]


# The public entry points, whose options users pass by keyword as PyTorch's own take them:
# attngrad.torch's, and the NumPy reference's twins of scaled_dot_product_attention and
# MultiheadAttention.forward, where its options are declared once (the flavors pass them on).
LONG_SIGNATURES = {
    "torch/functional.py": {"attention", "scaled_dot_product_attention"},
    "torch/mha.py": {"__init__", "forward"},
    "torch/distributed/ring.py": {"ring_attention"},
    "torch/distributed/ulysses.py": {"all_to_all_attention"},
    "reference/sdpa.py": {"sdpa_forward"},
    "reference/mha.py": {"mha_forward"},
}
MAX_PARAMETERS = 8
# A @triton.jit kernel or helper takes its arguments packed (tuples of pointers, of strides, of
# sizes, one set of constexprs: `attngrad.torch.backends.triton.kernels`), at most this many.
MAX_KERNEL_PARAMETERS = 30


def _is_jit(node) -> bool:
    return any(ast.unparse(d).endswith("jit") or ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def long_signatures(root: Path = PACKAGE) -> list[str]:
    """Functions and methods under `root` with more than MAX_PARAMETERS parameters (self and
    cls not counted, *args and **kwargs one each), outside the entry points; Triton's
    @triton.jit functions with more than MAX_KERNEL_PARAMETERS."""
    found = []
    for path in sorted(root.rglob("*.py")):
        exempt = LONG_SIGNATURES.get(path.relative_to(root).as_posix(), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in exempt:
                continue
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
            count = len(names) - (names[:1] in (["self"], ["cls"]))
            if count > (MAX_KERNEL_PARAMETERS if _is_jit(node) else MAX_PARAMETERS):
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {count} parameters")
    return found


def test_no_function_below_the_entry_points_takes_more_than_8_parameters():
    """The call goes down whole (`AttentionCall`, a pass's inputs as one mapping), not unpacked
    into long parameter lists; a Triton kernel takes at most 30, packed."""
    assert long_signatures() == []


def test_a_long_signature_is_found(tmp_path):
    copy = tmp_path / "attngrad"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    target = copy / "torch" / "op" / "call.py"
    target.write_text(target.read_text() + "\n\ndef unpacked(q, k, v, mask, bias, causal, scale, softcap, dropout_p):\n"
                      "    pass\n")
    assert long_signatures(copy) == [f"torch/op/call.py:{len(target.read_text().splitlines()) - 1} unpacked: 9 parameters"]


def test_a_kernel_with_its_arguments_unpacked_is_found(tmp_path):
    """A forward with its pointers, strides, sizes and tile sizes one argument each: 33."""
    copy = tmp_path / "attngrad"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    target = copy / "torch" / "backends" / "triton" / "kernels.py"
    strides = ", ".join(f"s{name}{axis}" for name in "qkvo" for axis in range(4))
    params = f"Q, K, V, O, M, INV, {strides}, H, G, Lq, Lk, D, DV, causal, BM, BN, BD, BDV"
    target.write_text(target.read_text() + f"\n\n@triton.jit\ndef unpacked({params}):\n    pass\n")
    line = len(target.read_text().splitlines()) - 1
    assert long_signatures(copy) == [f"torch/backends/triton/kernels.py:{line} unpacked: 33 parameters"]
