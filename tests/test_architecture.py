"""The code's shape, checked: short engine functions, no import hidden in a function,
no reach into another package's private names, and the one-way layers contract."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

from prefixstore import cli

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
