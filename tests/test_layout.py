"""The house plan, checked from the source (AST only: fast, imports nothing, starts no process).

- ft_core has no import cycle (module-level imports; `if TYPE_CHECKING:` blocks do not count), and
  its rooms import one way only (ROOM_MAY_IMPORT); the engine never imports the integrations;
- no ft_core module is over MAX_LINES lines (generated protobuf code excepted);
- ft_lightning and ft_core/tools import only the engine's public API (PUBLIC_API below);
- no function-level imports, except to keep an optional dependency optional (OPTIONAL_IMPORTS).

docs/architecture.md explains the rooms and which way their imports go.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600

# The engine's public API: what integrations (ft_lightning) and tools (ft_core/tools) may import.
# A module maps to the names it offers them: None means every name that does not start with "_".
PUBLIC_API: dict[str, frozenset[str] | None] = {
    "ft_core": None,  # the top-level names of ft_core/__init__.py (its lazy _EXPORTS)
    "ft_core.manager": None,
    "ft_core.ddp": None,
    "ft_core.optim": None,
    "ft_core.data": None,
    "ft_core.local_sgd": None,
    "ft_core.errors": None,
    "ft_core.settings": None,
    "ft_core.futures": None,
    # an integration's reduction whose input it cannot rebuild keeps a copy, so a redo can send it again
    "ft_core.managed_work": frozenset({"allreduce_kept"}),
    "ft_core.net": None,
    "ft_core.metrics": None,  # per-group Prometheus metrics from the Manager's events
    "ft_core.process_groups": None,  # the package, not its modules
    "ft_core.checkpointing": None,  # the package, not its modules
    "ft_core.control.lighthouse": None,
    "ft_core.control.lighthouse_client": None,
    # the status CLI verifies the lighthouse's TLS with the job's CA, as every client does
    "ft_core.control.rpc": frozenset({"client_ssl_context", "tls_config"}),
}
# What ft_lightning may import from the tools (the demo drives the launcher).
TOOLS_API: dict[str, frozenset[str] | None] = {
    "ft_core.tools.launcher": None,
    "ft_core.tools.launch_command": None,
}

# Top-level packages that may be imported inside a function, to keep an optional dependency optional
# (or, for rich, to keep `import ft_core` and the servers cheap).
OPTIONAL_IMPORTS = {
    "lightning": "Lightning integration",
    "pytorch_lightning": "Lightning integration",
    "accelerate": "Accelerate integration",
    "yaml": "comes with accelerate",
    "matplotlib": "demo report plots",
    "grpc_tools": "proto generation",
    "rich": "console output of the CLI; kept out of library import time",
}
# (file, module) pairs that may be imported inside a function.
OPTIONAL_IMPORTS_AT = {
    # backend classes exist only in torch builds with that backend (NCCL: CUDA, XCCL: XPU)
    ("ft_core/process_groups/child.py", "torch._C._distributed_c10d"): "backend-only torch classes",
    # about 1 s of import time that a process without DTensors never pays (restart to first commit)
    ("ft_core/checkpointing/dtensor_wire.py", "torch.distributed.tensor"): "import time",
    ("ft_core/diloco.py", "torch.distributed.tensor"): "import time",
    ("ft_core/process_groups/backends.py", "torch._C._distributed_c10d"): "backend-only torch classes",
    # `ftl accelerate config` stays importable without torch; only `launch` needs it
    ("ft_lightning/accelerate/cli.py", "torch.distributed.elastic.multiprocessing.errors"): "torch kept optional",
    ("ft_lightning/accelerate/cli.py", "torch.distributed.elastic.multiprocessing"): "torch kept optional",
    ("ft_lightning/accelerate/cli.py", "torch.distributed.elastic.multiprocessing.subprocess_handler"):
        "torch kept optional",
    # runs at interpreter start-up from a .pth file; logging (~4 ms) is needed only on the failure path
    ("ft_lightning/_registration.py", "logging"): "start-up cost",
    # some Python distributions strip pydoc_data (the demo corpus then comes from stdlib sources)
    ("ft_lightning/demo/train.py", "pydoc_data.topics"): "optional part of the stdlib",
}
GENERATED = ("ft_pb2.py", "ft_pb2_grpc.py", "ft_pb2.pyi")

# Rooms of ft_core and the rooms each may import (docs/architecture.md draws them).
STEP_PROTOCOL = {"ft_core.manager", "ft_core.manager_config", "ft_core.manager_wiring", "ft_core.step_rules", "ft_core.managed_work",
                 "ft_core.futures", "ft_core.ddp", "ft_core.optim", "ft_core.data", "ft_core.metrics",
                 "ft_core.local_sgd", "ft_core.diloco", "ft_core.healing", "ft_core.buffers", "ft_core.stores",
                 "ft_core.redo", "ft_core.redo_log"}
SHARED_LEAVES = {"ft_core.errors", "ft_core.settings", "ft_core.net", "ft_core.cancels"}
OUTSIDE_THE_ROOMS = {"ft_core", "ft_core.__main__",  # the lazy package and `python -m ft_core` (the CLI)
                     "ft_core.lighthouse", "ft_core.manager_server", "ft_core.process_group"}  # deprecated aliases
ROOM_MAY_IMPORT = {
    "step protocol": {"step protocol", "control", "process_groups", "checkpointing", "shared"},
    "control": {"control", "proto", "shared"},
    "proto": {"proto"},
    "process_groups": {"process_groups", "shared"},
    "checkpointing": {"checkpointing", "shared"},
    "shared": {"shared"},
    "tools": {"tools", "step protocol", "control", "process_groups", "checkpointing", "shared"},  # API: see above
}
# Single modules a room may reach in another room: the job's TLS contexts and retry backoff.
ROOM_EXCEPTIONS = {("checkpointing", "ft_core.control.rpc")}


@dataclass(frozen=True)
class Import:
    """One import statement, resolved: `module` is imported; `names` are taken from it ("from m import a")."""

    where: str  # path:line
    module: str
    names: tuple[str, ...]
    in_function: bool
    type_checking: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if p.name not in GENERATED)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> list[Import]:
    """Every import in `path`, with whether it sits in a function and whether under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    rel = path.relative_to(ROOT).as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            where = f"{rel}:{getattr(child, 'lineno', 0)}"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(where, alias.name, (), in_function, type_checking))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                found.append(Import(where, module, tuple(a.name for a in child.names), in_function, type_checking))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, type_checking)
            elif isinstance(child, ast.If) and is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_checking)
            else:
                visit(child, in_function, type_checking)

    visit(tree, False, False)
    return found


def targets(imp: Import, known: set[str]) -> Iterator[str]:
    """The modules of `known` an import loads: `from pkg import mod` loads pkg.mod, `from pkg import name` pkg."""
    if imp.names:
        plain = False
        for item in imp.names:
            if f"{imp.module}.{item}" in known:
                yield f"{imp.module}.{item}"
            else:
                plain = True
        if plain and imp.module in known:
            yield imp.module
    elif imp.module in known:
        yield imp.module


def import_graph(package: str) -> dict[str, set[str]]:
    files = source_files(package)
    known = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {name: set() for name in known}
    for path in files:
        for imp in imports_of(path):
            if not imp.in_function and not imp.type_checking:
                graph[module_name(path)].update(t for t in targets(imp, known) if t != module_name(path))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = walk(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return None


def room_of(module: str) -> str | None:
    """The room of an ft_core module (None for the package itself, the CLI entry and deprecated aliases)."""
    if module in OUTSIDE_THE_ROOMS:
        return None
    if module in STEP_PROTOCOL:
        return "step protocol"
    if module in SHARED_LEAVES:
        return "shared"
    if module.startswith("ft_core.control.proto"):
        return "proto"
    for room in ("control", "process_groups", "checkpointing", "tools"):
        if module == f"ft_core.{room}" or module.startswith(f"ft_core.{room}."):
            return room
    raise AssertionError(f"{module} is in no room: add it to a room in tests/test_layout.py and docs/architecture.md")


def ft_core_top_level_names() -> set[str]:
    """ft_core/__init__.py's public names: its `_EXPORTS` keys (read from the source, not imported)."""
    tree = ast.parse((ROOT / "ft_core" / "__init__.py").read_text())
    names = {"__version__"}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return names


def api_problems(imp: Import, api: dict[str, frozenset[str] | None], top_level: set[str]) -> list[str]:
    """Why `imp` (of an ft_core module) reaches past `api`; empty when it does not."""
    module, names = imp.module, imp.names
    if module == "ft_core" and names:  # `from ft_core import X`: a top-level name or a public module
        problems = []
        for item in names:
            if f"ft_core.{item}" in api:
                continue
            if item.startswith("_") or item not in top_level:
                problems.append(f"{imp.where}: ft_core.{item} is not in ft_core's public API")
        return problems
    if module not in api:
        return [f"{imp.where}: {module} is not in ft_core's public API (import from the package or a public module)"]
    allowed = api[module]
    return [f"{imp.where}: {module}.{item} is not in ft_core's public API" for item in names
            if item.startswith("_") or (allowed is not None and item not in allowed)]


def engine_imports(package: str, *, skip_prefix: str | None = None) -> Iterator[Import]:
    for path in source_files(package):
        for imp in imports_of(path):
            if imp.module == "ft_core" or imp.module.startswith("ft_core."):
                if skip_prefix is None or not imp.module.startswith(skip_prefix):
                    yield imp


# ---------------------------------------------------------------------------------------- tests

def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_ft_core_has_no_import_cycle():
    cycle = find_cycle(import_graph("ft_core"))
    assert cycle is None, "import cycle in ft_core: " + " -> ".join(cycle or [])


def test_imports_go_one_way_between_rooms():
    problems = []
    for module, imported in sorted(import_graph("ft_core").items()):
        room = room_of(module)
        if room is None:
            continue
        for target in sorted(imported):
            other = room_of(target)
            if other is None or other in ROOM_MAY_IMPORT[room] or (room, target) in ROOM_EXCEPTIONS:
                continue
            problems.append(f"{module} ({room}) imports {target} ({other}); {room} may import only "
                            f"{sorted(ROOM_MAY_IMPORT[room])}")
    assert not problems, "\n".join(problems)


def test_the_engine_never_imports_the_integrations():
    problems = [f"{imp.where}: {imp.module}" for path in source_files("ft_core") for imp in imports_of(path)
                if imp.module.split(".")[0] in ("ft_lightning", "lightning", "pytorch_lightning", "accelerate")]
    assert not problems, "ft_core must not import Lightning, Accelerate or ft_lightning:\n" + "\n".join(problems)


def test_no_ft_core_module_is_over_the_size_limit():
    too_long = {p.relative_to(ROOT).as_posix(): n for p in source_files("ft_core")
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"split these modules (over {MAX_LINES} lines): {too_long}"


def test_ft_lightning_imports_only_the_public_api_of_ft_core():
    api = {**PUBLIC_API, **TOOLS_API}
    top_level = ft_core_top_level_names()
    problems = [p for imp in engine_imports("ft_lightning") for p in api_problems(imp, api, top_level)]
    assert not problems, "\n".join(problems)


def test_tools_import_only_the_public_api_and_other_tools():
    top_level = ft_core_top_level_names()
    problems = [p for imp in engine_imports("ft_core/tools", skip_prefix="ft_core.tools")
                for p in api_problems(imp, PUBLIC_API, top_level)]
    assert not problems, "\n".join(problems)


def test_imports_are_at_module_level_unless_they_keep_a_dependency_optional():
    problems = []
    for package in ("ft_core", "ft_lightning"):
        for path in source_files(package):
            rel = path.relative_to(ROOT).as_posix()
            for imp in imports_of(path):
                if not imp.in_function:
                    continue
                top = imp.module.split(".")[0]
                if top in OPTIONAL_IMPORTS or (rel, imp.module) in OPTIONAL_IMPORTS_AT:
                    continue
                problems.append(f"{imp.where}: import of {imp.module} inside a function; move it to the top "
                                "of the module (or, for an optional dependency, add it to OPTIONAL_IMPORTS)")
    assert not problems, "\n".join(problems)


def test_the_public_api_names_real_modules():
    known = {module_name(p) for p in source_files("ft_core")}
    missing = sorted(m for m in {**PUBLIC_API, **TOOLS_API} if m not in known)
    assert not missing, f"PUBLIC_API names modules that do not exist: {missing}"


def test_the_training_path_does_not_import_dtensor_until_a_dtensor_exists():
    """torch.distributed.tensor costs about a second of start-up (restart to first commit); only a process
    that holds DTensors pays it (ft_core/checkpointing/dtensor_wire.py imports it on the first one)."""
    code = ("import sys, ft_core.manager, ft_core.ddp, ft_core.data, ft_core.local_sgd, ft_core.checkpointing;"
            "print('torch.distributed.tensor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "an engine module imports torch.distributed.tensor at module level"
