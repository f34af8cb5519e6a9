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


def every_import(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports anywhere in its body: at module level, under
    ``if TYPE_CHECKING:``, inside functions; relative imports resolved; ``importlib.import_module("...")`` and
    ``__import__("...")`` of a literal name too (``from a import b`` counts as ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def test_every_import_sees_imports_in_function_bodies_type_checking_blocks_and_relative_ones():
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from services.pool.fleet import Fleet
def push():
    from ..job import learner_job
    import importlib
    importlib.import_module("services.pool.watcher")
"""
    assert {"services.pool.fleet.Fleet", "services.job.learner_job", "services.pool.watcher"} <= every_import(
        source, "services.refit")


def test_the_weight_transports_import_neither_wing_anywhere():
    """services/refit/ holds both ends of each transport and the port the pool implements
    (``services.refit.port.PoolPort``): no module of it imports the pool or the job wing, not at module level,
    not under ``TYPE_CHECKING``, not inside a function."""
    files = sorted((ROOT / "services" / "refit").rglob("*.py"))
    assert files, "services/refit/ is missing"
    for f in files:
        package = ".".join(f.relative_to(ROOT).parts[:-1])
        bad = {m for m in every_import(f.read_text(), package)
               if m.split(".")[:2] in (["services", "pool"], ["services", "job"])}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


NEVER_IMPORTS = {
    "rollout/install": ("rollout.engine", "rollout.sampling", "rollout.episodes", "rollout.rewards"),
    "rollout/episodes": ("rollout.engine", "rollout.sampling", "rollout.install"),
    "rollout/rewards": ("rollout.engine", "rollout.sampling", "rollout.install", "rollout.episodes"),
    "services/data": ("services.pool", "services.job"),
}
"""Wings and what they never import, anywhere in their modules. rollout's wings (docs/rollout.md): the engine core
(``engine``, ``sampling``) drives them and they never import it back -- an episode reaches the sampler only
through ``rollout.episodes.turn_sampler.TurnSampler`` --; between the wings only the episodes use the rewards
(no circle). services/data (docs/architecture.md): the job and the pool may use the data wing, never the other
way."""


@pytest.mark.parametrize("wing", sorted(NEVER_IMPORTS))
def test_a_wing_never_imports_what_drives_it_nor_a_wing_beside_it(wing):
    files = sorted((ROOT / wing).rglob("*.py"))
    assert files, f"{wing}/ is missing"
    for f in files:
        package = ".".join(f.relative_to(ROOT).parts[:-1])
        bad = {m for m in every_import(f.read_text(), package)
               if any(m == p or m.startswith(p + ".") for p in NEVER_IMPORTS[wing])}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def face_modules() -> set[str]:
    """The modules at the top of services/ (the face: the CLI and what its commands call)."""
    return {f"services.{f.stem}" for f in (ROOT / "services").glob("*.py") if f.stem != "__init__"}


def wing_imports() -> dict[str, dict[str, set[str]]]:
    """{wing: {module of services it imports: {importing file}}} for every sub-package (wing) of services/."""
    out: dict[str, dict[str, set[str]]] = {}
    for wing in sorted(d for d in (ROOT / "services").iterdir() if (d / "__init__.py").is_file()):
        seen = out.setdefault(wing.name, {})
        for f in sorted(wing.rglob("*.py")):
            package = ".".join(f.relative_to(ROOT).parts[:-1])
            for m in every_import(f.read_text(), package):
                if m.startswith("services."):
                    seen.setdefault(m, set()).add(str(f.relative_to(ROOT)))
    return out


MAX_FACE_MODULES = 7


def test_the_face_of_services_holds_at_most_seven_modules():
    """The face keeps what the CLI's commands are (issue 31); every other concern lives in a wing."""
    face = sorted(face_modules())
    assert face, "services/ has no top-level module"
    assert len(face) <= MAX_FACE_MODULES, f"services/ has {len(face)} top-level modules: {face}"


def test_no_wing_imports_a_face_module():
    """The arrows point down: the face imports the wings, a wing never imports the face (anywhere in its body)."""
    face = face_modules()
    wings = wing_imports()
    assert {"pool", "job", "refit"} <= set(wings)
    for wing, imported in wings.items():
        for module, files in imported.items():
            hit = next((f for f in face if module == f or module.startswith(f + ".")), None)
            assert hit is None, f"services/{wing}/ imports the face module {hit}: {sorted(files)}"


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` ({node: nodes it points to}) as [a, b, ..., a], or None when it has none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_circle_finds_and_names_a_circle():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"a"}}) == ["a", "a"]
    assert circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_wings_of_services_import_each_other_in_no_circle():
    """Each wing of services/ sits above or below another, never both: built from every import of every module
    (function bodies and ``TYPE_CHECKING`` blocks too), the graph of the wings has no circle."""
    wings = wing_imports()
    graph = {wing: {m.split(".")[1] for m in imported} & set(wings) - {wing} for wing, imported in wings.items()}
    found = circle(graph)
    if found:
        steps = []
        for a, b in zip(found, found[1:], strict=False):
            files = sorted({f for m, fs in wings[a].items() if m.split(".")[1] == b for f in fs})
            steps.append(f"{a} -> {b} ({', '.join(files)})")
        raise AssertionError("the wings of services/ import in a circle: " + "; ".join(steps))
