"""The package's floors (docs/architecture.md), read from the imports of every module under cuflash/:
no import runs up a floor, the product never imports the tooling, and no module uses another's
private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cuflash"

# Bottom to top; a module stands on the floor of the longest prefix that names it.
FLOORS = (
    ("references", ("cuflash._cpu.reference", "cuflash._cpu.reference_kvcache", "cuflash._cpu.philox")),
    ("internals", ("cuflash._core",)),
    ("CPU path", ("cuflash._cpu",)),
    ("entry points", ("cuflash", "cuflash.torch")),
    ("benchmarks", ("cuflash.bench",)),
    ("command line", ("cuflash.cli", "cuflash.__main__")),
)
PRODUCT_TOP = "entry points"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _floor(module: str) -> int:
    """The index in FLOORS of ``module``'s floor."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} stands on no floor: add it to FLOORS and docs/architecture.md"
    return best


def _imports(module: str) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) of every cuflash import in ``module``,
    function-level ones included; a name that is itself a module is resolved to it."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "cuflash"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cuflash":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.append((node.lineno, child, None) if child in MODULES else (node.lineno, node.module, alias.name))
    return found


def _private_owner(module: str) -> str | None:
    """The package to which ``module`` is private (its first underscore component's parent), or
    None for a public module."""
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:index])
    return None


def test_every_module_stands_on_a_floor():
    assert len(MODULES) > 30
    for module in MODULES:
        _floor(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_up_a_floor(module):
    mine = _floor(module)
    for line, target, _ in _imports(module):
        assert target in MODULES or target == "cuflash", f"{module}:{line} imports {target}, which does not exist"
        theirs = _floor(target)
        assert theirs <= mine, (f"{module}:{line} ({FLOORS[mine][0]}) imports {target} ({FLOORS[theirs][0]}), "
                                f"a floor above it")


def test_the_product_never_imports_the_tooling():
    top = [name for name, _ in FLOORS].index(PRODUCT_TOP)
    for module in MODULES:
        if _floor(module) <= top:
            for line, target, _ in _imports(module):
                assert _floor(target) <= top, f"{module}:{line} imports the tooling module {target}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_of_another_module(module):
    """A name with a leading underscore (a module-level name, or a private module or package) is
    used only inside the module or package that owns it."""
    bound = {}
    tree = ast.parse(MODULES[module].read_text())
    for line, target, name in _imports(module):
        owner = _private_owner(target)
        assert owner is None or module == owner or module.startswith(owner + "."), (
            f"{module}:{line} imports {target}, private to {owner}")
        if name is not None:
            assert not name.startswith("_") or name.startswith("__"), f"{module}:{line} imports {target}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cuflash"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cuflash") and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            raise AssertionError(f"{module}:{node.lineno} uses {bound[node.value.id]}.{node.attr}, a private name")
