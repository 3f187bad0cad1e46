"""Production code never imports the test helpers (minedraft_ray/testing): an installed server must not depend
on code that exists for tests. Checked on the source, without importing anything."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minedraft_ray"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of what a module imports (relative imports resolved against its package)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


def test_production_code_does_not_import_testing():
    offenders = {str(p.relative_to(PACKAGE.parent)): sorted(n for n in imported_modules(p)
                                                            if n.startswith("minedraft_ray.testing"))
                 for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts}
    assert not {p: n for p, n in offenders.items() if n}
