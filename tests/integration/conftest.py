"""How the integration tier splits over pytest-xdist workers (``make test-integration INTEGRATION_WORKERS=2``).

Each worker is a session of its own (its own Ray cluster, pools and engines), so tests that share a session stack
must run on one worker, and a module's tests on one worker (module-scoped pools). Every integration module gets
one ``xdist_group``: the shared stack any of its tests uses (:data:`SHARED_STACKS`), else the module itself.
The groups start longest first (:data:`MODULE_SECONDS`), so no long module is left to run alone at the end; a
module's tests keep their file order. Without xdist the marks change nothing.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

SHARED_STACKS = ("harness", "served", "data_pool")
"""Session fixtures of a stack several modules share (rollout/conftest.py's engine, services/conftest.py's
OpenAI-serving pool and data pool), in the order a module that uses several is grouped by."""
HERE = Path(__file__).resolve().parent
MODULE_SECONDS = HERE / "module_seconds.json"
"""Each module's seconds in one run of the tier (``test-durations/integration.json``'s ``modules``, copied; refresh
it when modules change a lot). Only the order the groups start in depends on it; a module it lacks counts as 0 s."""


def group_of(fixtures_by_module: dict[str, set[str]], module: str) -> str:
    """The ``xdist_group`` of ``module``, from the fixtures its tests use."""
    used = fixtures_by_module[module]
    return next((f"stack-{name}" for name in SHARED_STACKS if name in used), module)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(item.path).resolve().parents]
    fixtures: defaultdict[str, set[str]] = defaultdict(set)
    for item in mine:
        fixtures[module_of(item)].update(getattr(item, "fixturenames", ()))
    groups = {module: group_of(fixtures, module) for module in fixtures}  # in collection order
    for item in mine:
        item.add_marker(pytest.mark.xdist_group(groups[module_of(item)]))
    seconds = json.loads(MODULE_SECONDS.read_text())
    group_seconds: defaultdict[str, float] = defaultdict(float)
    for module, group in groups.items():
        group_seconds[group] += seconds.get(module, 0.0)
    collected = {group: i for i, group in enumerate(dict.fromkeys(groups.values()))}
    rank = {module: (-group_seconds[group], collected[group]) for module, group in groups.items()}
    ours = set(map(id, mine))
    # items of other directories first, as they were; then the groups, longest first, each in collection order
    items[:] = sorted(items, key=lambda item: (True, *rank[module_of(item)]) if id(item) in ours else (False,))


def module_of(item: pytest.Item) -> str:
    """The path of ``item``'s module as its node id starts."""
    return item.nodeid.split("::", 1)[0]
