"""The floors the code map describes (docs/format.md), checked on the source (the ast, nothing
run): every package and top-level module has a floor and imports only the floors below it, with
no circle between modules (lazy imports included) and none between the floors; the storage floor
imports nothing of ours but errors and constants; the store knows other formats by their file
names only; nobody reaches into another package's private names; and the store and the reading
and writing of other formats are done in functions a reader can take in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmtailor"

# Package (or top-level module) -> the llmtailor packages it may import besides itself; every
# one has its floor here (``__init__``: the package's own public names), lowest first.
BELOW = {
    "constants": set(),
    "errors": set(),
    "distributed": {"errors"},
    "layouts": {"constants", "errors"},
    "policies": {"constants", "errors"},
    "store": {"constants", "errors", "distributed", "layouts"},
    "drift": {"constants", "errors", "store"},
    "providers": {"constants", "errors", "distributed", "layouts", "store"},
    "outputs": {"constants", "errors", "layouts", "store"},
    "interop": {"constants", "errors", "layouts", "store", "providers", "outputs"},
    "merge": {"constants", "errors", "layouts", "store", "interop", "outputs"},
    "async_stager": {"constants", "errors", "distributed", "store"},
    "reports": {"constants", "errors", "store", "async_stager"},
    "config": {"constants", "errors", "distributed", "policies", "store"},
    "frozen": {"constants", "errors", "distributed", "store", "drift", "providers", "interop"},
    "tailor": {"constants", "errors", "distributed", "layouts", "policies", "store", "drift", "providers",
               "async_stager", "reports", "config", "frozen"},
    "integrations": {"constants", "errors", "policies", "store", "providers", "interop", "reports", "config", "tailor"},
    "training_example": {"constants", "errors", "policies", "store", "tailor"},
    "plots": {"errors", "drift"},
    "demo": {"constants", "errors", "policies", "store", "drift", "tailor", "training_example", "plots"},
    "cli": {"constants", "errors", "store", "drift", "interop", "outputs", "merge", "plots", "demo"},
    "__init__": {"errors", "policies", "store", "interop", "config", "reports", "tailor"},
}
STORAGE = "llmtailor.store.storage"
STORAGE_MAY_IMPORT = {"llmtailor.errors", "llmtailor.constants"}  # and the storage floor itself
NAME_ONLY = {"llmtailor.errors"}  # what an interop/*/files.py module may import of ours
LONGEST = 60  # lines of a function in store/, interop/, merge/, outputs/ and cli/


def _modules() -> list[tuple[Path, str, ast.Module]]:
    """(path, its package or top-level module name, its ast) of every module."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        found.append((path, part, ast.parse(path.read_text(encoding="utf-8"))))
    return found


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every llmtailor import, lazy ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmtailor"):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("llmtailor")]
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path) -> str:
    """``llmtailor.store.run`` for store/run.py; a package by its own name (its ``__init__``)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(modules: list[tuple[Path, str, ast.Module]]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports, lazy and type-checking imports included.
    ``from a.b import c`` reads ``a.b.c`` where that is a module, else ``a.b`` (a package: its
    ``__init__``); ``import a.b`` reads ``a.b``. The packages Python runs first on the way to a
    module are not arrows: a package that re-exports its modules would sit in a circle with each."""
    names = {_module_name(path) for path, _, _ in modules}
    graph = {}
    for path, _, tree in modules:
        targets = set()
        for module, imported in _imports(tree):
            for name in imported or [""]:
                targets.add(f"{module}.{name}" if f"{module}.{name}" in names else module)
        graph[_module_name(path)] = targets - {_module_name(path)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of ``graph``: its strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                circles.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _in_storage(module: str) -> bool:
    return module == STORAGE or module.startswith(STORAGE + ".")


MODULES = _modules()
GRAPH = _graph(MODULES)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for path, part, tree in MODULES:
        for module, _ in _imports(tree):
            target = _package(module)
            if part in BELOW and target not in BELOW[part] | {part}:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not wrong


def test_every_package_and_top_level_module_has_its_floor():
    """No exception list: a new package (or top-level module) is given its floor in ``BELOW``."""
    assert {part for _, part, _ in MODULES} - set(BELOW) == set()


def test_the_floors_are_an_order():
    """No floor may import, through others, one that may import it: no arrow points up."""
    assert not _circles(BELOW)


def test_no_module_imports_itself_through_others():
    assert not _circles(GRAPH)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_the_storage_floor_imports_nothing_above_it():
    """store/storage/ is the bottom floor of the store: byte I/O and its strategies, told from
    above what it needs to know (other formats' names, by ``recognise_other_formats``)."""
    wrong = [f"{path.relative_to(PACKAGE)} imports {module}" for path, _, tree in MODULES
             if _in_storage(_module_name(path)) for module, _ in _imports(tree)
             if module not in STORAGE_MAY_IMPORT and not _in_storage(module)]
    assert not wrong


def test_nothing_but_the_cli_imports_the_cli():
    wrong = [f"{path.relative_to(PACKAGE)} imports {module}" for path, part, tree in MODULES
             for module, _ in _imports(tree) if _package(module) == "cli" and part != "cli"]
    assert not wrong


def test_other_formats_are_known_by_their_file_names_only():
    """The store imports no interop module: what else a directory may be is told to its run
    detection from above (``interop/formats.py``, wired in by the package), through the interop
    modules that know names only; those import nothing heavy of ours."""
    wrong = []
    for path in [*PACKAGE.glob("interop/*/files.py"), PACKAGE / "interop" / "formats.py"]:
        wrong += [f"{path.relative_to(PACKAGE)} imports {module}" for module, _ in
                  _imports(ast.parse(path.read_text(encoding="utf-8")))
                  if module not in NAME_ONLY and not module.endswith(".files")]
    assert not wrong


def test_no_package_imports_another_packages_private_names():
    wrong = [f"{path.relative_to(PACKAGE)}: {name} from {module}" for path, part, tree in MODULES
             for module, names in _imports(tree) for name in names
             if name.startswith("_") and _package(module) != part]
    assert not wrong


@pytest.mark.parametrize("folder", ["store", "interop", "merge", "outputs", "cli"])
def test_functions_are_short_enough_to_read_at_once(folder):
    long = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LONGEST:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long


def test_the_rules_see_the_code():
    """The checks above would pass on nothing: make sure they see the package and its imports."""
    parts = {part for _, part, _ in MODULES}
    assert {"store", "interop", "merge", "cli", "providers", "layouts"} <= parts
    store_imports = [m for path, part, tree in MODULES if part == "store" for m, _ in _imports(tree)]
    assert "llmtailor.store.storage" in store_imports and "llmtailor.errors" in store_imports
    assert "llmtailor.cli.render" in GRAPH["llmtailor.cli"]  # imported inside a function
    assert "llmtailor.store.tiers.promote" in GRAPH["llmtailor.store.tiers.runtime"]
    assert "llmtailor.store.tiers" in GRAPH["llmtailor.tailor"]  # a package: its __init__
    assert "llmtailor.store.storage.local_durable" in GRAPH["llmtailor.store.storage.local_lock"]


def test_tailor_delegates_rather_than_grows():
    """``Tailor`` keeps the public methods and hands lineage, staging, drift, frozen parts and
    the restore agreement to their own objects: the class stays under 250 lines."""
    tree = ast.parse((PACKAGE / "tailor.py").read_text(encoding="utf-8"))
    (tailor,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Tailor"]
    assert tailor.end_lineno - tailor.lineno + 1 < 250


def test_every_module_compiles_without_a_warning():
    """No module's source warns as it is compiled (an invalid escape such as ``\\ `` in a
    docstring: a SyntaxWarning from Python 3.12, a SyntaxError where warnings are errors, as a
    CI with ``-W error`` or ``PYTHONWARNINGS=error`` has them, on any import not served from a
    cached .pyc)."""
    import warnings

    warned = []
    for path in sorted(PACKAGE.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
            except (SyntaxError, Warning) as err:
                warned.append(f"{path.relative_to(PACKAGE.parent)}: {err}")
    assert warned == []
