"""The import graph of the package: one-way layers and no circle; and docs/architecture.md, which
describes them, names only what exists.

Every ``import`` counts, also the ones inside functions (a lazy import still ties the two modules
together), except those under ``if TYPE_CHECKING:``, which never run. Layers, from the bottom:
``comm``/``topology``/``options``/``overlap`` and ``compress/``, ``fused/`` → ``optim/`` → ``titan/``;
only ``titan/`` imports torchtitan; inside ``titan/``, :data:`TITAN_FOLDERS`.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titan_commopt"
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


def test_only_the_titan_plugin_imports_torchtitan():
    importers = sorted(m for m, deps in _graph().items() if "torchtitan" in deps)
    assert importers and all(m.startswith(f"{NAME}.titan") for m in importers), importers


def test_layers_import_one_way():
    lower = ("optim", "compress", "fused", "comm", "topology", "options", "overlap")
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in lower:
            upward = [d for d in deps if d.startswith(f"{NAME}.titan")]
            assert not upward, f"{module} imports titan/: {upward}"
        if len(parts) > 1 and parts[1] in ("compress", "fused", "comm", "topology", "options", "overlap"):
            assert not [d for d in deps if d.startswith(f"{NAME}.optim")], module


# The folders of titan/, each with the folders it may import (a line's folder never another line's).
TITAN_FOLDERS = {
    "platform": set(),
    "config": {"platform"},
    "common": {"platform", "config"},
    "tt022": {"platform", "config", "common"},
    "tt03": {"platform", "config", "common"},
    "tt03_toml": {"platform", "config", "common", "tt03"},
    "v03": {"tt03"},
}


def test_the_torchtitan_lines_stay_apart():
    """A folder per torchtitan line (``titan/tt022``: 0.2.2; ``titan/tt03``, ``titan/tt03_toml``: 0.3):
    neither line's folders import the other's; ``titan/common`` (what both run alike), ``titan/config``
    and ``titan/platform`` import no line's folder and nothing above them."""
    titan = f"{NAME}.titan."
    assert {p.name for p in (PACKAGE / "titan").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(TITAN_FOLDERS)
    for module, deps in _graph().items():
        if not module.startswith(titan):
            continue
        folder = module[len(titan):].split(".")[0]
        if folder not in TITAN_FOLDERS:
            continue  # titan/__init__.py, line.py
        for dep in deps:
            if dep.startswith(titan) and dep[len(titan):].split(".")[0] in TITAN_FOLDERS:
                into = dep[len(titan):].split(".")[0]
                assert into == folder or into in TITAN_FOLDERS[folder], f"{module} imports {dep}"


# ---- docs/architecture.md names only what exists ---------------------------------------------------
_ROOTS = (ROOT, PACKAGE, PACKAGE / "titan")  # the doc names paths from the repo, the package or titan/
_NOT_PATHS = ("comm/", "commopt/")  # TensorBoard tags
_FILE = re.compile(r"[\w./-]+\.(py|md|toml|sh)")


def _named_paths(text: str) -> set[str]:
    """The repo paths the doc names: backticked paths (``a/b.py``, ``a/b/``, ``a/b.py::test``,
    ``a/b.name``: a module and a name it defines) and the entries of its tree of the package."""
    out = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split("::")[0]
        if re.fullmatch(r"[\w./-]+", token) and ("/" in token or _FILE.fullmatch(token)) and not token.startswith(_NOT_PATHS):
            out.add(token)
    tree = text[text.index("```\ntitan_commopt/") + 4:]
    for line in tree[:tree.index("\n```")].splitlines():
        indent = len(line) - len(line.lstrip())
        if indent < 8:  # an entry; deeper lines continue a description
            out.update(re.split(r" {2}", re.split(r" {3,}", line.strip())[0]))
    return out


def _exists(path: str) -> bool:
    if "/" not in path.rstrip("/") and not path.endswith("/"):  # a file named alone: somewhere in the package
        return any(PACKAGE.rglob(path))
    module, dot, name = path.rpartition(".")
    if dot and not _FILE.fullmatch(path) and "/" in module:  # a/b.name
        files = [r / f"{module}.py" for r in _ROOTS if (r / f"{module}.py").is_file()]
        return any(re.search(rf"^\s*(def|class) {name}\b|^{name} *[:=]", f.read_text(), re.M) for f in files)
    return any((r / path.rstrip("/")).exists() for r in _ROOTS)


def test_every_path_the_architecture_doc_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = _named_paths(text)
    assert {"titan/common/container.py", "tt022/", "common/build.route_clipping"} <= named  # the parse finds them
    assert not _exists("titan/common/no_such.py") and not _exists("common/build.no_such_name")
    assert sorted(p for p in named if not _exists(p)) == []
