"""The unit tier: its tests touch no Ray cluster, vLLM engine or process group (tests/unit_guard.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from unit_guard import install, unit_test_running

install()

UNIT_TIER = Path(__file__).resolve().parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every unit test, its fixtures' set-up and tear-down included, runs with the guard on. pytest calls this
    hook of a conftest for every item of the session, not only for those below it, so an item outside
    ``tests/unit`` (a session that runs both tiers) runs without the guard."""
    if Path(item.path).resolve().is_relative_to(UNIT_TIER):
        with unit_test_running():
            yield
    else:
        yield
