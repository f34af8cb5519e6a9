"""Package rooms (design §2): rollout and learner speak only protocol."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = {"protocol": {"rollout", "learner", "services"}, "rollout": {"learner", "services"},
             "learner": {"rollout", "services"}}


def imported_top_levels(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_room(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for f in files:
        bad = imported_top_levels(f) & FORBIDDEN[package]
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute imports; ``from a import b`` counts as ``a`` and ``a.b``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


WINGS = {"pool": "job", "job": "pool"}
"""The two wings of services/ (design §2): each imports nothing from the other; the job reaches the pool only
through the DeploymentHandle it is given."""


@pytest.mark.parametrize("wing", sorted(WINGS))
def test_the_pool_and_job_wings_import_nothing_from_each_other(wing):
    other = f"services.{WINGS[wing]}"
    files = sorted((ROOT / "services" / wing).rglob("*.py"))
    assert files, f"services/{wing}/ is missing"
    for f in files:
        bad = {m for m in imported_modules(f) if m == other or m.startswith(other + ".")}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_weight_transports_import_neither_wing_at_run_time():
    """services/refit/ holds both ends of each transport; the job loads it, so it may name the pool's types only
    for the type checker (under ``TYPE_CHECKING``)."""
    for f in sorted((ROOT / "services" / "refit").rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in tree.body:  # module-level imports (those under ``if TYPE_CHECKING:`` are not at this level)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad = [m for m in mods if m.split(".")[:2] in (["services", "pool"], ["services", "job"])]
                assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
