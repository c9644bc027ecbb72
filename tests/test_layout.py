"""The layout's rules, checked over the source tree: modules keep their private names to themselves, the engine
contract stands above its implementations, and nothing outside the tests imports a test module."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("inkwell", "sdk", "service", "serving", "adapters", "trainer", "kernels", "models", "recipes")
SCRIPTS = ("benchmarks", "demo", "alembic")


def _files(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str) -> list[str]:
    """`from M import _x`, and `M._x` on a module `M` imported by name, in one file's source: what it takes from
    another inkwell module that the other module keeps private (other projects' private names are theirs)."""
    tree = ast.parse(source)
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("inkwell"):
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
            modules.update(a.asname or a.name for a in node.names)  # a name may be a submodule
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.asname and a.name.startswith("inkwell"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{base.id}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _files(PACKAGES + SCRIPTS)
        for name in private_imports(path.read_text())
    ]
    assert found == []


def test_the_checker_sees_a_private_import():
    source = "from inkwell.serving import rules\nfrom inkwell.serving.rules import _x, y\nrules._y\nself._z\n"
    assert private_imports(source) == ["inkwell.serving.rules._x", "rules._y"]


def test_the_engine_contract_loads_no_engine():
    """Importing the contract (and the rules every engine shares) brings in neither engine's modules."""
    probe = (
        "import sys, inkwell.serving.contract, inkwell.serving.rules; "
        "print(sorted(m for m in sys.modules if m.startswith(('inkwell.serving.native', 'inkwell.serving.sglang'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_nothing_but_tests_imports_a_test_module():
    found = []
    for path in _files(PACKAGES + SCRIPTS):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if "tests" in n.split(".")[:2]]
    assert found == []
