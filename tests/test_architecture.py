"""The code's shape, checked: short engine functions, no import hidden in a function,
no reach into another package's private names, and the one-way layers contract."""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import shutil
import subprocess
from pathlib import Path

import attrs
import pytest

from prefixstore import cli
from prefixstore.gpu import tiers

PKG = Path(__file__).resolve().parent.parent / "prefixstore"
MAX_ENGINE_FUNCTION_LINES = 70


def _modules(under: Path = PKG) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def _package(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_engine_functions_are_short():
    long = []
    for path in _modules(PKG / "engine"):
        for fn in _functions(ast.parse(path.read_text())):
            n = fn.end_lineno - fn.lineno + 1
            if n > MAX_ENGINE_FUNCTION_LINES:
                long.append(f"{path.relative_to(PKG)}:{fn.lineno} {fn.name} ({n} lines)")
    assert not long, "engine functions over 70 lines:\n" + "\n".join(long)


def test_no_project_import_inside_a_function():
    """The command line included: each command is a module that ``prefixstore.cli``
    imports at its top, so the layers contract sees every import."""
    hidden = []
    for path in _modules():
        for fn in _functions(ast.parse(path.read_text())):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefixstore"):
                    hidden.append(f"{path.relative_to(PKG)}:{node.lineno} from {node.module}")
                elif isinstance(node, ast.Import) and any(a.name.startswith("prefixstore") for a in node.names):
                    hidden.append(f"{path.relative_to(PKG)}:{node.lineno} import")
    assert not hidden, "imports inside functions:\n" + "\n".join(hidden)


def test_each_command_is_a_module_of_the_cli_package_imported_at_its_top():
    """``prefixstore.cli`` lists its command modules, each in the package, none found by
    name at run time (``importlib``), and no command module is left in a lower layer."""
    modules = {mod.NAME: mod.__name__ for mod in cli.COMMANDS}
    assert all(name.startswith("prefixstore.cli.") for name in modules.values()), modules
    parser_commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert sorted(parser_commands) == sorted(modules)
    dynamic = [f"{p.relative_to(PKG)}:{n.lineno}" for p in _modules(PKG / "cli")
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, (ast.Import, ast.ImportFrom))
               and "importlib" in ((n.module or "") if isinstance(n, ast.ImportFrom) else " ".join(a.name for a in n.names))]
    assert not dynamic, dynamic
    outside = [str(p.relative_to(PKG)) for p in _modules() if p.name.startswith("cmd_") or p.name.endswith("_cmd.py")]
    assert not outside, outside


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_defined(trees: dict[Path, ast.AST]) -> dict[str, set[str]]:
    """Per package: the private names its modules define (``self._x = ...``, ``def _x``,
    ``class _X``, module-level ``_x = ...``)."""
    out: dict[str, set[str]] = {}
    for path, tree in trees.items():
        names = out.setdefault(_package(path), set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                names.add(node.id)
    return out


def test_no_private_name_used_across_packages():
    """A module uses private names of its own package only: no ``obj._name`` (on
    anything but ``self`` / ``cls``) where only another package defines ``_name``, and
    no ``from prefixstore.P.m import _name`` from another package ``P``."""
    trees = {path: ast.parse(path.read_text()) for path in _modules()}
    defined = _private_names_defined(trees)
    reach = []
    for path, tree in trees.items():
        pkg = _package(path)
        foreign = set().union(*(v for k, v in defined.items() if k != pkg)) - defined.get(pkg, set())
        for node in ast.walk(tree):
            where = f"{path.relative_to(PKG)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefixstore."):
                other = node.module.split(".")[1]
                if other != pkg:
                    reach += [f"{where} imports {a.name} from {node.module}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and node.attr in foreign:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    reach.append(f"{where} .{node.attr}")
    assert not reach, "private names used across packages:\n" + "\n".join(sorted(reach))


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is installed by .ci/run")
def test_layers_contract():
    root = PKG.parent
    out = subprocess.run(["lint-imports"], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# -- components, not a god object ---------------------------------------------------------------


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names the classes of one module define: methods, class attributes and
    fields, and what their methods assign on ``self`` / ``cls``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
                names.add(node.target.id)
    return names


def foreign_private_reads(under: Path = PKG) -> list[str]:
    """Every ``obj._name`` in ``under`` on anything but ``self`` / ``cls`` where ``_name``
    is not a private name of a class the same module defines: a read of another
    module's (or another object's) private state."""
    found = []
    for path in _modules(under):
        tree = ast.parse(path.read_text())
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    found.append(f"{path.relative_to(PKG)}:{node.lineno} .{node.attr}")
    return found


OUTSIDE_PRIVATE_OK = {
    "engine/guard.py": {"_is_owned"},  # RLock: whether this thread holds the engine lock (an assertion)
    "gpu/wire.py": {"_Options", "_devices", "_timeout"},  # torch's gloo options have no public constructor
    "gpu/rank_server.py": {"_exit"},  # os._exit: a rank process dies without cleanup
    "fuzz/fiu.py": {"_exit"},
    "fuzz/soak.py": {"_exit"},
    "cli/reference.py": {"_action_groups", "_group_actions", "_HelpAction"},
    "adapters/sglang_pages.py": {"_base"},  # torch: a view's base tensor (no public reader)  # argparse: no public reader of a parser's groups
}
"""Private names of the standard library and torch read on purpose, per module."""


def test_no_module_reads_another_objects_private_names():
    """A module reads private names of its own classes only: no ``eng._lock``, no
    ``transfers._slots`` from another module (the engine's state is components with
    declared, public fields)."""
    reads = [r for r in foreign_private_reads()
             if r.split(" .")[1] not in OUTSIDE_PRIVATE_OK.get(r.split(":")[0], set())]
    assert not reads, f"{len(reads)} reads of another object's private names:\n" + "\n".join(reads)


def test_engine_flows_take_components_not_the_engine():
    """No function below the public API takes the engine, or all of its parts
    (``lifecycle.Parts``): each flow takes the components it uses (``engine/flows.py``)."""
    taking = []
    for path in _modules(PKG / "engine"):
        for fn in _functions(ast.parse(path.read_text())):
            args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            for a in args:
                note = ast.unparse(a.annotation) if a.annotation is not None else ""
                if a.arg == "eng" or note.strip("'\"") in ("Engine", "Parts"):
                    taking.append(f"{path.relative_to(PKG)}:{fn.lineno} {fn.name}({a.arg}: {note})")
    assert not taking, "functions taking the engine:\n" + "\n".join(taking)


def _engine_classes():
    """Every class an engine module defines (not those it imports)."""
    for path in _modules(PKG / "engine"):
        mod = importlib.import_module("prefixstore.engine" + ("" if path.stem == "__init__" else f".{path.stem}"))
        for cls in vars(mod).values():
            if inspect.isclass(cls) and cls.__module__ == mod.__name__:
                yield cls


def undeclared_state() -> list[str]:
    """Engine classes whose instances may hold state their class does not declare: not
    attrs classes with slots (an instance ``__dict__``), or with a field of no type.
    Exceptions, enums, named tuples and protocols hold none of the engine's state."""
    found = []
    for cls in _engine_classes():
        if issubclass(cls, (BaseException, tuple, enum.Enum)) or getattr(cls, "_is_protocol", False):
            continue
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not attrs.has(cls):
            found.append(f"{where}: not an attrs class")
        elif cls.__dictoffset__:
            found.append(f"{where}: its instances have a __dict__ (no slots)")
        else:
            found += [f"{where}.{f.name}: no type" for f in attrs.fields(cls) if f.type is None]
    return found


def test_engine_state_is_declared():
    """The engine's state is its components' declared fields: every class of the engine
    is an attrs class with slots and typed fields, so an attribute nobody declared
    cannot be assigned (AttributeError) and each is read where its class says."""
    found = undeclared_state()
    assert not found, "engine classes with undeclared state:\n" + "\n".join(found)


# -- no import cycle inside the engine ------------------------------------------------------------


def engine_import_graph(under: Path = PKG / "engine") -> dict[str, set[str]]:
    """Module -> the engine modules it imports, ``TYPE_CHECKING`` imports included."""
    graph: dict[str, set[str]] = {}
    for path in _modules(under):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "prefixstore.engine":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefixstore.engine."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("prefixstore.engine.")}
        graph[path.stem] = deps - {path.stem}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_the_engine():
    cycles = import_cycles(engine_import_graph())
    assert not cycles, "engine modules importing each other in a cycle:\n" + "\n".join(
        f"{len(c)}: {', '.join(c)}" for c in cycles)


# -- tiers by capability --------------------------------------------------------------------------


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            out.add(id(node.value))  # attribute docstrings
    return out


def backing_names_outside_tiers(names: set[str]) -> list[str]:
    """Each string constant naming a backing (``names``) outside ``gpu/tiers/``, but for
    docstrings and the keys of a report (a dict key, a subscript)."""
    found = []
    for path in _modules():
        if (PKG / "gpu" / "tiers") in path.parents:
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                skip |= {id(k) for k in node.keys if k is not None}
            elif isinstance(node, ast.Subscript):
                skip.add(id(node.slice))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip:
                found.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value!r}")
    return found


def test_no_backing_is_named_outside_the_tier_registry():
    """Lifecycle, recovery, audit, repair, tiering and the calibration probe branch on
    what a backing declares (``gpu/tier.py`` ``Capability``), never on its name."""
    named = backing_names_outside_tiers(set(tiers.TIERS))
    assert not named, "backing names outside gpu/tiers:\n" + "\n".join(named)
