"""The architecture held against the code: the import graph (one-way layers, no circle), the
new-family rule, and docs/architecture.md, which describes them, naming only what exists.

Every ``import`` counts, also the ones inside functions (a lazy import still ties the two modules
together), except those under ``if TYPE_CHECKING:``, which never run. Layers, from the bottom:
``comm``/``topology``/``options``/``overlap``, ``kernels`` and ``compress/`` → ``optim/`` → ``titan/``;
only ``titan/`` imports torchtitan; inside ``titan/``, :data:`TITAN_FOLDERS`. A new family is one
module plus one registry line (:func:`test_a_new_family_is_one_module`).
"""

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from titan_commopt import comm, optim
from titan_commopt.optim.base import CommOptimizer
from titan_commopt.optim.common import LR_SCALE_HELP, local
from titan_commopt.optim.family import Bytes, Family, PeriodicSyncs
from titan_commopt.optim.local.steps import LocalSteps, chunk_limit, column_chunks, trainable
from titan_commopt.options import ConfigError, option
from titan_commopt.topology import R

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
    lower = ("optim", "compress", "kernels", "comm", "topology", "options", "overlap")
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in lower:
            upward = [d for d in deps if d.startswith(f"{NAME}.titan")]
            assert not upward, f"{module} imports titan/: {upward}"
        if len(parts) > 1 and parts[1] in ("compress", "kernels", "comm", "topology", "options", "overlap"):
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


# ---- live fault tolerance: its glue written once ----------------------------------------------------------
# The Trainer methods fault tolerance routes (common/replica_group_training.ReplicaGroupSteps), which no
# line's Trainer defines again, and the modules that read the [fault_tolerance] settings from a config:
# each route's check before the process group, and 0.3's Trainer (0.2.2's takes the checked run's).
FT_ROUTED_METHODS = {"init_distributed", "batch_generator", "train_step", "close"}
FT_SETTINGS_READERS = {"titan.config.validate", "titan.tt03.preflight", "titan.tt03.replica_group_trainer"}


def _methods_defined(path: Path) -> set[str]:
    return {item.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, ast.FunctionDef)}


def _calls(path: Path, dotted: str) -> bool:
    return any(isinstance(node, ast.Call) and ast.unparse(node.func) == dotted
               for node in ast.walk(ast.parse(path.read_text())))


def test_the_fault_tolerance_glue_is_written_once():
    lines = [(m, p) for m, p in _modules().items() if m.split(".")[2:3] in (["tt022"], ["tt03"], ["tt03_toml"])]
    assert lines
    redefined = {m: sorted(_methods_defined(p) & FT_ROUTED_METHODS) for m, p in lines}
    assert {m: d for m, d in redefined.items() if d} == {}
    readers = {m.removeprefix(f"{NAME}.") for m, p in _modules().items() if _calls(p, "FtSettings.of")}
    assert readers == FT_SETTINGS_READERS
    assert not [m for m in _modules() if m.split(".")[-1] == "fault_tolerance"]  # named for what each does


# ---- docs/architecture.md names only what exists ---------------------------------------------------
_ROOTS = (ROOT, PACKAGE, PACKAGE / "optim", PACKAGE / "titan")  # paths from the repo, the package, optim/ or titan/
_NOT_PATHS = ("comm/", "commopt/", "validation_metrics/")  # TensorBoard tags
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


def test_test_modules_share_through_helpers_only():
    """A test module imports no other test module (what two of them share lives in a helper module:
    ``tests/titan_utils.py``, ``sim_utils.py``, ``tp_utils.py``, ``dist_utils.py``), so running or
    changing one file never runs or breaks another's module-level set-up."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name} imports {n}" for n in names
                          if re.match(r"(tests\.)?test_", n) and n.split(".")[-1] != path.stem]
    assert offenders == []


# ---- a new family is one module plus one registry line ------------------------------------------------
# A small periodic family, written as a family module would be: local SGD whose replicas average their
# parameters every K steps. Registered with the one line ``optim.register(FAMILY)``, it must appear
# wherever a user meets a family.
@dataclass
class ToyOptions:
    """``[commopt.toy]``."""

    K: int = option(4, "Steps between two parameter averages over R.", ge=1)
    momentum: bool = option(False, "Keep a momentum buffer (it shapes the state).")
    lr: float = option(-1.0, "Initial learning rate; negative = [optimizer] lr × lr_scale.")
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)


class ToyLocalSGD(LocalSteps, CommOptimizer):
    params_replica_local = True

    def __init__(self, named_params, topology, options, *, ledger=None):
        super().__init__(trainable(named_params), topology, options, dict(lr=options.hparams.lr), ledger=ledger)
        self.start_step_counter()
        self.K = options.options.K
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = self._step_t
                if options.options.momentum:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss, work = self.begin_local_step(closure, lambda group: [])
        if work is None:
            return loss
        for group, rows in work.groups:
            for xs, gs in column_chunks(rows, chunk_limit(rows[0][0].device)):
                torch._foreach_add_(xs, gs, alpha=-group["lr"])
        if work.n % self.K == 0 and self.topology.replicate_size > 1:
            comm.all_reduce_fused([local(p) for p, _ in work.grads], R, self.topology.replicate, ledger=self.ledger)
        return loss

    def steps_to_next_sync(self):
        return self.K - self._n % self.K


def _toy_r_bytes(shards, resolved, replicate_size):
    if replicate_size <= 1:
        return Bytes()
    sent = sum(s.numel * 4 for s in shards) / resolved.options.K  # one fp32 all-reduce every K steps
    return Bytes(sent, sent)


TOY = Family(
    key="toy", options=ToyOptions, presets={"ToySGD": {"K": 3}}, build=ToyLocalSGD, r_bytes=_toy_r_bytes,
    check=lambda cfg, hparams: [f"[commopt.toy] K = {cfg.K}: allowed is at most 1000"] if cfg.K > 1000 else [],
    state_shape=lambda resolved: {"momentum": resolved.options.momentum},
    periodic=lambda resolved: PeriodicSyncs(
        (resolved.options.K,), lambda subset: dataclasses.replace(resolved.options, K=1)),
    summary="local SGD, parameters averaged every K steps (a test's family)",
)


@pytest.fixture
def toy_family():
    optim.register(TOY)
    try:
        yield TOY
    finally:
        optim.unregister(TOY.key)
    assert "ToySGD" not in optim.available_names()


def _toy_checkpoint(dump, record: dict) -> None:
    """A checkpoint as the container writes it for 2 replicas: their state and the resolved record."""
    import torch.distributed.checkpoint as dcp

    state = {f"optimizer.replica{r}/commopt_resolved": json.dumps({**record, "replicas": 2}, sort_keys=True)
             for r in range(2)}
    state.update({f"optimizer.replica{r}/state.w.step": torch.tensor(2.0) for r in range(2)})
    state.update({"model.w": torch.ones(8), "lr_scheduler.last_epoch": torch.tensor(2),
                  "train_state.step": torch.tensor(2), "dataloader.world_size": torch.tensor(2)})
    state.update({f"dataloader.dp_rank_{r}": torch.zeros(4) for r in range(2)})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dump / "checkpoint" / "step-2")), no_dist=True)


def test_registering_a_taken_key_or_name_is_refused(toy_family):
    with pytest.raises(ValueError, match="'toy' is registered already"):
        optim.register(TOY)
    with pytest.raises(ValueError, match="DeMo"):
        optim.register(dataclasses.replace(TOY, key="toy2", presets={"DeMo": {}}))


@pytest.mark.both_lines
def test_a_new_family_is_one_module(toy_family, tmp_path):
    """The registry, validation, the comm report's burst, the options reference and the resume check
    take the family from the one registration; the torchtitan config classes (made once, at import)
    in a fresh process that registers it first (``_titan_sees_the_toy_family``)."""
    from types import SimpleNamespace

    from scripts import comm_report, options_reference
    from titan_commopt.titan.config.resume import resume_problem

    assert "ToySGD" in optim.available_names() and optim.family_of("ToySGD") is TOY
    resolved = optim.resolve("ToySGD")
    assert resolved.options.K == 3 and resolved.preset_keys() == ["K"]
    for bad, expected in [({"K": 0}, "[commopt.toy] K = 0"), ({"K": 5000}, "[commopt.toy] K = 5000"),
                          ({"KK": 1}, "[commopt.toy] unknown key 'KK'")]:
        with pytest.raises(ConfigError) as info:
            optim.resolve("ToySGD", bad)
        assert len(str(info.value).splitlines()) == 1 and expected in str(info.value), info.value

    model = torch.nn.Linear(4, 4)
    opt = optim.make("ToySGD", model.named_parameters(), K=2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert opt.steps_to_next_sync() == 1 and opt.state[model.weight]["step"].item() == 1

    # comm report: the mean is the sync's bytes over K, the largest step is the whole sync at step K
    (row,) = comm_report.report("cpu_tiny", 2, 1, ["ToySGD"])
    assert row["sync_at_update"] == 3 and row["R_sent"] > 0 and row["R_sent_sync"] == pytest.approx(3 * row["R_sent"])
    assert row["settings"] == dataclasses.asdict(resolved.options)

    page = options_reference.render()
    assert "## `[commopt.toy]`" in page and "| `K` | `4` |" in page and "`ToySGD`" in page

    # resume: another value of a state-shaping option is refused naming it
    _toy_checkpoint(tmp_path, optim.resolve("ToySGD").record())
    job = SimpleNamespace(job=SimpleNamespace(dump_folder=str(tmp_path)), optimizer=SimpleNamespace(name="ToySGD"),
                          checkpoint=SimpleNamespace(enable=True, folder="checkpoint", load_step=-1,
                                                     exclude_from_loading=[], initial_load_path=None))
    assert resume_problem(job, optim.resolve("ToySGD", {"K": 5}), 2) is None  # K does not shape the state
    problem = resume_problem(job, optim.resolve("ToySGD", {"momentum": True}), 2)
    assert problem is not None and "[commopt.toy] momentum = False in the checkpoint, True in this run" in problem

    done = subprocess.run([sys.executable, "-c", f"from tests.test_architecture import _titan_sees_the_toy_family; "
                           f"_titan_sees_the_toy_family({str(tmp_path)!r})"],
                          cwd=PACKAGE.parent, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["toml"] == {"K": 7, "user_set": ["K"]}, seen
    assert seen["toml_bad"] == ["[commopt.toy] K = 0: allowed is an integer >= 1"], seen
    if seen["line"] == "0.3":
        assert seen["override"] == 5 and seen["cli"] == 6, seen
        assert seen["override_bad"] == [2, 1], seen


def _titan_sees_the_toy_family(tmp: str) -> None:
    """Run in a fresh process: register the toy family before anything of ``titan/`` is imported (as
    the registry line does for a built-in family), then meet it as a user does on the installed
    torchtitan line: the TOML table ``[commopt.toy]`` and its validation; on 0.3 also the config
    fields (the command line) and ``@override``. Prints what it saw as JSON."""
    from pathlib import Path

    optim.register(TOY)
    import titan_commopt.titan
    from titan_commopt.train import check_config
    from tests.titan_utils import CONFIG

    base = CONFIG.read_text()
    base = base[: base.index("\n[commopt]")]

    def run(table: str):
        path = Path(tmp) / "toy.toml"
        path.write_text(base + "\n[commopt.toy]\n" + table + "\n")
        return check_config(["--job.config_file", str(path), "--optimizer.name", "ToySGD"])

    seen = {"line": titan_commopt.titan.LINE}
    resolved = run("K = 7").resolved
    seen["toml"] = {"K": resolved.options.K, "user_set": sorted(resolved.user_set)}
    try:
        run("K = 0")
    except ConfigError as error:
        seen["toml_bad"] = str(error).splitlines()
    if seen["line"] == "0.3":
        import contextlib
        import io

        from torchtitan.components.optimizer import default_adamw
        from torchtitan.config.manager import ConfigManager

        from titan_commopt.titan.tt03.overrides import commopt

        seen["override"] = commopt(default_adamw(), name="ToySGD", K=5).commopt.toy.K
        cfg = ConfigManager().parse_args(["--module", "titan_commopt.titan.tt03.configs", "--config", "cpu_debugmodel",
                                          "--optimizer.name", "ToySGD", "--optimizer.commopt.toy.K", "6"])
        seen["cli"] = cfg.optimizer.commopt.toy.K
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                commopt(default_adamw(), name="ToySGD", K=-1)
            except SystemExit as stop:
                lines = [line for line in err.getvalue().splitlines() if "[commopt.toy] K" in line]
                seen["override_bad"] = (stop.code, len(lines))
    print(json.dumps(seen))
