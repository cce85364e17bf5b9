"""The import graph of the package: one-way layers and no circle.

Every ``import`` counts, also the ones inside functions (a lazy import still ties the two modules
together: the byte formulas once imported the families' internals that way while the families
imported the formulas back), except those under ``if TYPE_CHECKING:``, which never run. Layers, from the bottom: ``comm``/``topology``/``options``/``overlap``
and ``compress/``, ``kernels`` → ``optim/`` → ``titan/``; only ``titan/`` imports torchtitan.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titan_commopt"
NAME = PACKAGE.name


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of this package (and ``torchtitan``) that ``module`` imports, anywhere in its code."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # imports under ``if TYPE_CHECKING:`` never run
        id(inner) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # "from pkg import sub": the submodule when it is one, else the package itself
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "torchtitan":
                found.add("torchtitan")
            elif name.split(".")[0] == NAME:
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (as a path), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == "torchtitan":
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_circle():
    # A package's __init__ importing its own submodules is how a package exposes them, not a circle.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in _graph().items()}
    assert _cycle(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_only_the_titan_adapter_imports_torchtitan():
    importers = sorted(m for m, deps in _graph().items() if "torchtitan" in deps)
    assert importers and all(m.startswith(f"{NAME}.titan") for m in importers), importers


def test_layers_import_one_way():
    lower = ("optim", "compress", "kernels", "comm", "topology", "options", "overlap")
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in lower:
            upward = [d for d in deps if d.startswith(f"{NAME}.titan")]
            assert not upward, f"{module} imports the adapter: {upward}"
        if len(parts) > 1 and parts[1] in ("compress", "kernels", "comm", "topology", "options", "overlap"):
            assert not [d for d in deps if d.startswith(f"{NAME}.optim")], module


def test_the_torchtitan_lines_stay_apart():
    """One adapter per torchtitan line (``titan/adapter``: 0.2.2, ``titan/v03``: 0.3): the 0.2.2 adapter
    never imports the 0.3 one (0.3 reuses 0.2.2's line-agnostic container, clipping and metrics), and
    ``titan/shared`` (what both read the same way) imports neither."""
    adapter, v03, shared = (f"{NAME}.titan.{p}" for p in ("adapter", "v03", "shared"))
    for module, deps in _graph().items():
        if module.startswith(adapter):
            assert not [d for d in deps if d.startswith(v03)], module
        if module.startswith(shared):
            assert not [d for d in deps if d.startswith((adapter, v03))], module
