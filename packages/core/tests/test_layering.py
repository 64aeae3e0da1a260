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


# -- core's three layers, as folders -------------------------------------------------------

FOLDERS = ("api", "net", "data", "engines", "worker", "orchestration", "tools")
"""weightsync_core's folders from the bottom up. Layer 1, the engine layer (no Ray): ``api``
(the interface, config, options, registry), ``net``, ``data``, ``engines``, ``worker``;
layer 2: ``orchestration`` (on Ray); layer 3: the tools. A module imports only from its own
folder and those below it; only the orchestration folder and the tools import Ray."""

TOOLS = {"plan", "bench", "testing", "cli"}
"""The tools' modules and packages at the top of ``weightsync_core``."""

PLACED = {"spi": "engines", "verl_compat": "engines", "_old_paths": "api"}
"""Public modules at the top of ``weightsync_core`` and the folder they rank with: the
backend surface and verl's compatibility layer re-export the engine layer."""

FACE = "weightsync_core"
"""The package itself: it exports names of every layer, those above the engines lazily (its
import is checked to need no Ray below)."""

ENGINE_LAYER = FOLDERS.index("worker")
"""The highest folder of layer 1."""


def _folder(module: str) -> int:
    """The index in :data:`FOLDERS` of a ``weightsync_core`` module's folder.

    Raises:
        AssertionError: a module at the top of the package that is not placed (a new module
            goes into the folder of its layer, or into :data:`PLACED` with its reason).
    """
    top = module.split(".")[1]
    folder = "tools" if top in TOOLS else PLACED.get(top, top)
    assert folder in FOLDERS, (
        f"{module} is in no layer's folder: move it into one of {FOLDERS[:-1]} (or make it "
        "a tool), or place it in PLACED with the reason")
    return FOLDERS.index(folder)


def _core_modules() -> dict[str, Path]:
    root = Path(weightsync_core.__file__).resolve().parent
    return {_module_name(path.relative_to(root.parent)): path for path in root.rglob("*.py")}


def _layer_violations() -> list[str]:
    violations = []
    for module, path in sorted(_core_modules().items()):
        if module == FACE:
            continue
        folder = _folder(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, path.name == "__init__.py"):
            if folder <= ENGINE_LAYER and (name == "ray" or name.startswith("ray.")):
                violations.append(
                    f"{path}:{line} ({FOLDERS[folder]}, engine layer) imports {name}")
            elif name.startswith(FACE + ".") and _folder(name) > folder:
                violations.append(f"{path}:{line} ({FOLDERS[folder]}) imports {name} "
                                  f"({FOLDERS[_folder(name)]}, above it)")
    return sorted(set(violations))


def test_each_folder_imports_only_the_folders_below_it_and_the_engine_layer_no_ray():
    violations = _layer_violations()
    assert not violations, (
        f"weightsync_core's folders, bottom up {FOLDERS} (layer 1, no Ray: up to "
        f"{FOLDERS[ENGINE_LAYER]}), import upwards (type-only and function-level imports "
        "count):\n" + "\n".join(violations)
    )


def test_the_top_of_the_package_holds_only_public_modules_and_folders():
    root = Path(weightsync_core.__file__).resolve().parent
    modules = {path.stem for path in root.glob("*.py")} - {"__init__"}
    assert modules <= TOOLS | set(PLACED), sorted(modules - TOOLS - set(PLACED))
    folders = {path.name for path in root.iterdir()
               if path.is_dir() and (path / "__init__.py").is_file()}
    assert folders == set(FOLDERS[:-1]) | (TOOLS - {"cli"}), sorted(folders)


def test_the_layer_check_sees_an_import_from_a_folder_above(tmp_path, monkeypatch):
    fake = {**_core_modules(), "weightsync_core.net.wire": tmp_path / "wire.py"}
    (tmp_path / "wire.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from weightsync_core.data.bucketing import WeightsSource\n")
    monkeypatch.setattr(f"{__name__}._core_modules", lambda: fake)
    assert any("wire.py:3 (net) imports weightsync_core.data.bucketing (data, above it)" in v
               for v in _layer_violations())


def test_the_layer_check_sees_an_engine_module_importing_ray(tmp_path, monkeypatch):
    fake = {**_core_modules(), "weightsync_core.net.wire": tmp_path / "wire.py"}
    (tmp_path / "wire.py").write_text("def f():\n    import ray.util\n")
    monkeypatch.setattr(f"{__name__}._core_modules", lambda: fake)
    assert any("wire.py:2 (net, engine layer) imports ray.util" in v for v in _layer_violations())


_WITHOUT_RAY = """
import importlib, importlib.abc, importlib.metadata, sys

class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is not installed here (blocked by the test)")

sys.meta_path.insert(0, NoRay())
import weightsync_core, weightsync_core.spi, weightsync_core.verl_compat
from weightsync_core import CheckpointEngineConfig, CheckpointEngineRegistry
for point in importlib.metadata.entry_points(group="weightsync.backends"):
    try:
        importlib.import_module(point.module)
    except ImportError as exc:
        if "ray" in str(exc):
            raise
        print("skipped", point.name, exc)  # a native library missing here (torch_npu)
    else:
        print("imported", point.name)
CheckpointEngineConfig(backend="gloo", engine_kwargs={"gloo": {"senders": 1}})
assert "ray" not in sys.modules
"""


def test_the_engine_layer_and_every_installed_backend_import_where_ray_cannot():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_RAY], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "imported gloo" in done.stdout and "imported naive" in done.stdout


# -- no import circles --------------------------------------------------------------------

def _import_graph(roots: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules of these source roots it imports anywhere in its body (at the
    top, inside functions, or for type checking only)."""
    paths = {}
    for root in roots:
        for path in root.rglob("*.py"):
            paths[_module_name(path.relative_to(root))] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for _, name in _imported(tree, module, path.name == "__init__.py"):
            while name and name not in paths:  # an imported name: its module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while (top := stack.pop()) != module:
                group.append(top)
            if group:
                found.append(sorted([module, *group]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_package_has_an_import_circle():
    circles = _circles(_import_graph(_source_roots()))
    assert not circles, "import circles (type-only and function-level imports count):\n" + \
        "\n".join(" <-> ".join(circle) for circle in circles)


def test_the_circle_check_finds_a_type_only_circle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    (package / "c.py").write_text("from pkg import a\n")
    assert _circles(_import_graph([tmp_path])) == [["pkg.a", "pkg.b"]]


# -- packages use each other's public API only --------------------------------------------

CORE_PUBLIC = ("weightsync_core", "weightsync_core.spi", "weightsync_core.verl_compat",
               "weightsync_core.cli", "weightsync_core.plan", "weightsync_core.bench",
               "weightsync_core.testing", "weightsync_core.data.shards",
               "weightsync_core.data.quantization")
"""The modules of core other packages import (and the modules inside the packages)."""


def _package_of(module: str) -> str:
    return module.split(".")[0]


def _foreign_import_violations(roots: list[Path]) -> list[str]:
    violations = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            module = _module_name(path.relative_to(root))
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom | ast.Import) or (
                        isinstance(node, ast.ImportFrom) and node.level):
                    continue
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [alias.name for alias in node.names])
                imported = [alias.name for alias in node.names] if isinstance(
                    node, ast.ImportFrom) else []
                for name in names:
                    if not name.startswith("weightsync_") or \
                            _package_of(name) == _package_of(module):
                        continue
                    where = f"{path}:{node.lineno}"
                    if any(part.startswith("_") for part in name.split(".")) or any(
                            item.startswith("_") for item in imported):
                        violations.append(f"{where} imports an underscore name of {name}")
                    if _package_of(name) == "weightsync_core" and not any(
                            name == public or (name.startswith(public + ".")
                                               and public != "weightsync_core")
                            for public in CORE_PUBLIC):
                        violations.append(f"{where} imports core's internal module {name}")
    return violations


def test_packages_import_only_each_others_public_api():
    roots = [root for root in _source_roots() if root.parent.name != "core"]
    repository = Path(__file__).resolve().parents[3]
    roots += sorted(path.resolve() for path in repository.glob("packages/*/tests")
                    if path.parent.name != "core")
    violations = _foreign_import_violations(roots)
    assert not violations, (
        f"imports of another package's internals (core's public modules: {CORE_PUBLIC}):\n"
        + "\n".join(violations))


def test_the_public_api_check_sees_internal_and_underscore_imports(tmp_path):
    (tmp_path / "weightsync_demo.py").write_text(
        "from weightsync_core.api.registry import BackendState\n"
        "from weightsync_core import _ORCHESTRATION\n"
        "from weightsync_core.bench.measure import median_seconds\n"
        "import weightsync_core.spi\n")
    found = _foreign_import_violations([tmp_path])
    assert [v.split(":", 1)[1] for v in found] == [
        "1 imports core's internal module weightsync_core.api.registry",
        "2 imports an underscore name of weightsync_core"]


def test_the_docs_three_layers_are_the_tree():
    """The concepts page's table of core's three layers names exactly the folders of each
    layer (its first column says the layer, its second the folders), and every folder it
    names is one of the package's."""
    import re

    page = Path(__file__).resolve().parents[3] / "docs" / "concepts" / "index.md"
    rows = [line.split("|")[1:3] for line in page.read_text().splitlines()
            if re.match(r"\| [123]\. ", line)]
    documented = [re.findall(r"`([a-z_]+)/?`", folders) for _, folders in rows]
    expected = [list(FOLDERS[:ENGINE_LAYER + 1]), ["orchestration"], sorted(TOOLS)]
    assert [sorted(names) if layer == 2 else names
            for layer, names in enumerate(documented)] == expected, documented
    package = Path(weightsync_core.__file__).resolve().parent
    for folder in FOLDERS[:-1]:
        assert (package / folder / "__init__.py").is_file(), folder
    for tool in TOOLS:
        assert (package / tool).is_dir() or (package / f"{tool}.py").is_file(), tool
