"""The layering the README's code map describes, checked on the source (the ast, nothing run):
each package imports only the ones below it, the store knows other formats by their file
names only, nobody reaches into another package's private names, and the reading and
writing of other formats is done in functions a reader can take in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmtailor"

# Package (or top-level module) -> the llmtailor packages it may import besides itself.
BELOW = {
    "constants": set(),
    "errors": set(),
    "distributed": {"errors"},
    "layouts": {"constants", "errors"},
    "policies": {"constants", "errors"},
    "store": {"constants", "errors", "distributed", "layouts"},
    "providers": {"constants", "errors", "distributed", "layouts", "store"},
    "outputs": {"constants", "errors", "layouts", "store"},
    "interop": {"constants", "errors", "layouts", "store", "providers", "outputs"},
    "merge": {"constants", "errors", "layouts", "store", "interop", "outputs"},
}
NAME_ONLY = {"llmtailor.errors"}  # what an interop/*/files.py module may import of ours
LONGEST = 60  # lines of a function in interop/, merge/, outputs/ and cli/


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


MODULES = _modules()


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for path, part, tree in MODULES:
        for module, _ in _imports(tree):
            target = _package(module)
            if part in BELOW and target not in BELOW[part] | {part}:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
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


@pytest.mark.parametrize("folder", ["interop", "merge", "outputs", "cli"])
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


def test_tailor_delegates_rather_than_grows():
    """``Tailor`` keeps the public methods and hands lineage, staging, drift, frozen parts and
    the restore agreement to their own objects: the class stays under 250 lines."""
    tree = ast.parse((PACKAGE / "tailor.py").read_text(encoding="utf-8"))
    (tailor,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Tailor"]
    assert tailor.end_lineno - tailor.lineno + 1 < 250
