"""First-party backends use core only through ``weightsync_core.spi``, its backend surface."""

import ast
from pathlib import Path

import pytest

import weightsync_core
from weightsync_core import spi

PACKAGES = Path(__file__).resolve().parents[2]
BACKEND_SOURCES = sorted(PACKAGES.glob("backend-*/src"))
CORE_SOURCES = Path(weightsync_core.__file__).parent

pytestmark = pytest.mark.skipif(
    not BACKEND_SOURCES, reason="the first-party backends' sources are not beside core here"
)


def _modules(root: Path) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(root.rglob("*.py"))]


def _core_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a ``weightsync_core`` module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, module) for module in modules
                  if module.split(".")[0] == "weightsync_core"]
    return found


def _private_core_methods() -> set[str]:
    """Names of the underscore methods of core's engine classes (not dunders)."""
    trees = [tree for _, tree in _modules(CORE_SOURCES / "engines")]
    trees.append(ast.parse((CORE_SOURCES / "api" / "engine.py").read_text()))
    return {node.name for tree in trees for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name)}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_exported_name_is_there():
    assert all(hasattr(spi, name) for name in spi.__all__)


def test_backends_import_only_the_backend_surface():
    wrong = [
        f"{path.relative_to(PACKAGES)}:{line} imports {module}"
        for root in BACKEND_SOURCES for path, tree in _modules(root)
        for line, module in _core_imports(tree) if module != "weightsync_core.spi"
    ]
    assert not wrong, "backends must import core through weightsync_core.spi:\n" + "\n".join(
        wrong)


def test_backends_override_only_public_hooks():
    private = _private_core_methods()
    wrong = [
        f"{path.relative_to(PACKAGES)}:{method.lineno} {node.name}.{method.name}"
        for root in BACKEND_SOURCES for path, tree in _modules(root)
        for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
        for method in node.body
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) and method.name in private
    ]
    assert not wrong, "backends override core's private methods:\n" + "\n".join(wrong)
