"""Each layer of nvmedirect depends only downward (docs/ARCHITECTURE.md), checked on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nvmedirect"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any level (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_of(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PACKAGE)): imported_modules(p) for p in (PACKAGE / package).glob("*.py")}


ORDER = ["cli", "reader", "store", "system", "nvme", "queues", "spec", "vfio"]  # docs/ARCHITECTURE.md, top down


@pytest.mark.parametrize("lower,upper", [(low, f"nvmedirect.{high}") for i, high in enumerate(ORDER)
                                         for low in ORDER[i + 1:]])
def test_lower_layers_do_not_import_upper_ones(lower, upper):
    offenders = {f: sorted(m for m in mods if m == upper or m.startswith(upper + "."))
                 for f, mods in imports_of(lower).items()}
    assert not {f: m for f, m in offenders.items() if m}, f"{lower} imports {upper}"


def test_a_command_does_not_import_its_queue_pair():
    assert not any(m.startswith("nvmedirect.queues.qpair") for m in imported_modules(PACKAGE / "queues/command.py"))


def test_nvme_package_has_no_lazy_getattr():
    tree = ast.parse((PACKAGE / "nvme/__init__.py").read_text())
    assert not [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]


def test_page_size_is_defined_once():
    definitions = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("PAGE_SIZE", "PAGE")
                                                    and not isinstance(node.value, ast.Name) for t in node.targets):
                definitions.append(str(path.relative_to(PACKAGE)))
    assert definitions == ["host_memory.py"]


def test_importing_the_store_loads_no_reader():
    code = ("import sys, nvmedirect.store.writer, nvmedirect.store.targets, nvmedirect.store.nvme_target; "
            "sys.exit(any(m.startswith('nvmedirect.reader') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_host_memory_is_the_bottom():
    assert not [m for m in imported_modules(PACKAGE / "host_memory.py") if m.startswith("nvmedirect")]
