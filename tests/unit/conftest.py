"""The unit tier: its tests touch no Ray cluster, vLLM engine or process group (tests/unit_guard.py)."""
from __future__ import annotations

import pytest
from unit_guard import install, unit_test_running

install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every unit test, its fixtures' set-up and tear-down included, runs with the guard on."""
    with unit_test_running():
        yield
