"""How the integration tier splits over pytest-xdist workers (``make test-integration INTEGRATION_WORKERS=2``).

Each worker is a session of its own (its own Ray cluster, pools and engines), so tests that share a session stack
must run on one worker, and a module's tests on one worker (module-scoped pools). Every integration module gets
one ``xdist_group``: the shared stack any of its tests uses (:data:`SHARED_STACKS`), else the module itself.
Without xdist the marks change nothing: the tests run in file order.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

SHARED_STACKS = ("harness", "served", "data_pool")
"""Session fixtures of a stack several modules share (rollout/conftest.py's engine, services/conftest.py's
OpenAI-serving pool and data pool), in the order a module that uses several is grouped by."""
HERE = Path(__file__).resolve().parent


def group_of(fixtures_by_module: dict[str, set[str]], module: str) -> str:
    """The ``xdist_group`` of ``module``, from the fixtures its tests use."""
    used = fixtures_by_module[module]
    return next((f"stack-{name}" for name in SHARED_STACKS if name in used), module)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(item.path).resolve().parents]
    fixtures: defaultdict[str, set[str]] = defaultdict(set)
    for item in mine:
        fixtures[item.nodeid.split("::", 1)[0]].update(getattr(item, "fixturenames", ()))
    for item in mine:
        item.add_marker(pytest.mark.xdist_group(group_of(fixtures, item.nodeid.split("::", 1)[0])))
