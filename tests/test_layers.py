"""The package's shape, read from its imports: every module sits on a layer, and imports only its
own layer or those below (SPEC.md, "Layers"); the "never" rules hold; no module imports the faces.

    base -> split | world -> runtime (reference, schedules, executor) -> runners -> check -> faces

split and world are peers: neither imports the other. Imports inside functions and under
``TYPE_CHECKING`` count too: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipecheck"

# The layers are the package's folders (and its public modules at the top); a new module sits on the
# layer of the folder it is put in.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("_core", "errors"),
    "split": ("_split", "losses", "policies"),
    "world": ("_world",),
    "runtime": ("_runtime", "_schedule", "schedules", "randomness"),
    "runners": ("_runners",),
    "check": ("_check", "strategies", "engines"),
    "faces": ("__init__", "__main__", "_cli", "plugin"),
}
RANK = {"base": 0, "split": 1, "world": 1, "runtime": 2, "runners": 3, "check": 4, "faces": 5}
PEERS = {frozenset({"split", "world"})}  # same rank, and neither may import the other
TOP_LEVEL_MODULES = 12  # .py files at pipecheck/'s top
MODULE_LINES = 500

# What a layer never knows about (SPEC.md): the splitter nothing of processes or verdicts, the runtime
# nothing of verdicts, numerics nothing of processes.
NEVER: dict[tuple[str, ...], tuple[str, ...]] = {
    LAYERS["split"] + LAYERS["base"]: ("torch.distributed", "multiprocessing", "_check"),
    ("_runtime", "_schedule"): ("_check",),
    ("_check.numerics", "_check.diagnose", "_check.report"): ("torch.distributed", "multiprocessing", "_world"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts)


def _layer_of(module: str) -> str:
    top = module.split(".")[0]
    for layer, members in LAYERS.items():
        if module in members or top in members:
            return layer
    raise KeyError(module)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it; pipecheck's own without the ``pipecheck.`` prefix."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "pipecheck":  # from pipecheck import losses, World, ...
                found.update(f"pipecheck.{alias.name}" for alias in node.names)
    own = {name.removeprefix("pipecheck.") for name in found if name.startswith("pipecheck.")}
    own = {name for name in own if name != "fixtures" and not name.startswith("fixtures.")}
    return {name for name in found if not name.startswith("pipecheck")} | own


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _own(name: str, modules: dict[str, Path]) -> bool:
    return name in modules or f"{name}.__init__" in modules or name.split(".")[0] in modules


def test_every_module_sits_on_a_layer() -> None:
    unplaced = []
    for module in _modules():
        try:
            _layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert unplaced == [], f"give these modules a layer in tests/test_layers.py: {unplaced}"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_go_down_or_sideways_never_up(module: str) -> None:
    modules = _modules()
    layer = _layer_of(module)
    wrong = []
    for name in sorted(_imports(modules[module])):
        if not _own(name, modules) or name.split(".")[0] == module.split(".")[0]:
            continue
        target = _layer_of(name)
        if RANK[target] > RANK[layer] or (target != layer and frozenset({layer, target}) in PEERS):
            wrong.append(f"{name} ({target})")
    assert wrong == [], f"{module} ({layer}) imports upwards or across: {wrong}"


@pytest.mark.parametrize("members,forbidden", [pytest.param(m, f, id=",".join(m[:2])) for m, f in NEVER.items()])
def test_what_a_layer_never_knows(members: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    modules = _modules()
    wrong = {module: sorted(name for name in _imports(path)
                            if any(name == f or name.startswith(f + ".") for f in forbidden))
             for module, path in modules.items()
             if any(module == m or module.startswith(m + ".") for m in members)}
    assert wrong, f"no module matches {members}"
    assert {m: names for m, names in wrong.items() if names} == {}


def test_nothing_imports_the_faces() -> None:
    modules = _modules()
    importers = {module: sorted(name for name in _imports(path) if name == "plugin" or name.split(".")[0] == "_cli")
                 for module, path in modules.items() if module != "__main__" and not module.startswith("_cli.")}
    assert {m: names for m, names in importers.items() if names} == {}


def test_the_top_level_holds_the_public_modules_and_the_layers_folders() -> None:
    modules = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, f"{len(modules)} modules at pipecheck/'s top: {modules}"
    private = [name for name in modules if name.startswith("_") and name not in ("__init__", "__main__")]
    assert private == [], f"put these in the folder of their layer: {private}"
    folders = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists())
    unplaced = [name for name in folders if not any(name in members for members in LAYERS.values())]
    assert unplaced == [], f"give these folders a layer in tests/test_layers.py: {unplaced}"


def test_no_module_is_longer_than_a_read() -> None:
    long = {module: lines for module, path in _modules().items()
            if (lines := len(path.read_text().splitlines())) > MODULE_LINES}
    assert long == {}, f"split these modules (over {MODULE_LINES} lines): {long}"


def test_the_test_folders_mirror_the_package_s() -> None:
    """tests/split/ tests pipecheck/_split/, tests/strategies/ pipecheck/strategies/, ...; tests of
    the public modules and of the package as a whole sit at tests/'s top."""
    tests = PACKAGE.parent / "tests"
    folders = sorted(path.name for path in tests.iterdir() if path.is_dir() and any(path.glob("test_*.py")))
    unmatched = [name for name in folders if name != "mutants"
                 and not (PACKAGE / f"_{name}").is_dir() and not (PACKAGE / name).is_dir()]
    assert folders and unmatched == [], f"test folders with no package folder of that name: {unmatched}"


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipecheck."):
            if node.module.split(".")[1].startswith("_"):
                found.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module == "pipecheck":
            found += [f"pipecheck.{alias.name}" for alias in node.names if alias.name.startswith("_")
                      and alias.name != "__version__"]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("pipecheck._")]
    return found


def test_tests_and_benchmarks_use_public_names_or_say_why_not() -> None:
    """A test in tests/<folder>/ may import pipecheck/_<folder>/ (the thing under test); any other
    private import needs a ``# private: why`` line in its file."""
    root = PACKAGE.parent
    unexplained = {}
    for path in sorted([*(root / "tests").rglob("*.py"), *(root / "benchmarks").glob("*.py")]):
        parts = path.relative_to(root).parts
        own = f"pipecheck._{parts[1]}" if parts[0] == "tests" and len(parts) > 2 else None
        foreign = [name for name in _private_imports(path) if not (own and (name == own or name.startswith(own + ".")))]
        if foreign and "# private: " not in path.read_text():
            unexplained[str(path.relative_to(root))] = sorted(set(foreign))
    assert unexplained == {}, f"import public names (pc.*), or say in a '# private: ' line why not: {unexplained}"
