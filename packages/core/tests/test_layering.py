"""Layering: no production module imports the test support in ``weightsync_core.testing``.

The shipped code (engines, manager, command line, benchmarks, integrations) must work where
only the runtime is installed, and must not depend on fault-injecting test doubles. Every
module under every ``packages/*/src`` of the repository (and core's own installed sources,
where the tests run outside the repository) is parsed, not imported, so a backend that is
not installed here is checked too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import weightsync_core

TESTING = "weightsync_core.testing"

EXEMPT = {
    "weightsync_core/testing": "the test support itself",
    "weightsync_testbed/conformance.py": "its single job is test support: it places core's "
    "conformance suite (SyncHarness) on the testbed's hosts, for backends' test modules",
}
"""Modules (or packages) allowed to import ``weightsync_core.testing``, relative to their
``src`` folder, each with the reason."""


def _source_roots() -> list[Path]:
    repository = Path(__file__).resolve().parents[3]
    roots = {Path(weightsync_core.__file__).resolve().parent.parent}
    roots.update(path.resolve() for path in repository.glob("packages/*/src"))
    return sorted(roots)


def _exempt(relative: str) -> bool:
    return any(relative == entry or relative.startswith(entry + "/") for entry in EXEMPT)


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, imported name)`` of every import in ``tree``, relative ones resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                package = package[: len(package) - node.level + (1 if is_package else 0)]
                base = ".".join([*package, base] if base else package)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


def _violations(root: Path) -> list[str]:
    violations = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _exempt(relative.as_posix()):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module = _module_name(relative)
        lines = {line for line, name in _imported(tree, module, path.name == "__init__.py")
                 if name == TESTING or name.startswith(TESTING + ".")}
        violations += [f"{path}:{line} imports {TESTING}" for line in sorted(lines)]
    return violations


def test_the_sources_are_found():
    roots = _source_roots()
    assert any((root / "weightsync_core" / "cli.py").is_file() for root in roots)


def test_no_production_module_imports_the_testing_package():
    violations = [v for root in _source_roots() for v in _violations(root)]
    assert not violations, (
        "production modules import weightsync_core.testing (test support; exempt a module "
        "only if test support is its single job, in EXEMPT with the reason):\n"
        + "\n".join(violations)
    )


def test_the_check_sees_every_form_of_import():
    source = (
        "import weightsync_core.testing\n"
        "from weightsync_core.testing.harness import SyncHarness\n"
        "from weightsync_core import testing\n"
        "from .testing import suite\n"
        "import weightsync_core.testbed_like, json\n"
        "def f():\n"
        "    from ..core_sibling import testing\n"
        "    from .testing.weights import make_weights\n"
    )
    imports = _imported(ast.parse(source), "weightsync_core.cli", is_package=False)
    flagged = {line for line, name in imports
               if name == TESTING or name.startswith(TESTING + ".")}
    assert flagged == {1, 2, 3, 4, 8}
