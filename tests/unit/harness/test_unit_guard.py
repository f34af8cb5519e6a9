"""tests/unit_guard.py: a unit test that starts Ray or a process group fails, naming the call."""
from __future__ import annotations

import pytest
from unit_guard import UnitTierViolation


def test_ray_init_is_refused_in_a_unit_test():
    import ray
    with pytest.raises(UnitTierViolation, match="ray.init"):
        ray.init(address="local")
    assert not ray.is_initialized()


def test_a_process_group_is_refused_in_a_unit_test():
    import torch.distributed as dist
    with pytest.raises(UnitTierViolation, match="init_process_group"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_a_vllm_engine_is_refused_in_a_unit_test():
    from vllm.v1.engine.async_llm import AsyncLLM
    with pytest.raises(UnitTierViolation, match="AsyncLLM.__init__"):
        AsyncLLM(None, None)  # type: ignore[arg-type]


def test_outside_a_unit_test_the_calls_are_the_originals():
    from unit_guard import _refusing
    calls = []
    refusing = _refusing("f", lambda x: calls.append(x))
    import unit_guard
    was = unit_guard._IN_UNIT_TEST[0]
    unit_guard._IN_UNIT_TEST[0] = False
    try:
        refusing(1)
    finally:
        unit_guard._IN_UNIT_TEST[0] = was
    assert calls == [1]


def test_a_session_of_both_tiers_guards_only_the_unit_tests(tmp_path):
    """pytest calls tests/unit/conftest.py's run-test hook for every item of the session: a test outside
    tests/unit that runs after a unit test must run without the guard (it used to fail with UnitTierViolation)."""
    import subprocess
    import sys
    from pathlib import Path

    outside = tmp_path / "test_outside_the_unit_tier.py"
    outside.write_text("import unit_guard\n\n\ndef test_runs_unguarded():\n    assert unit_guard._IN_UNIT_TEST[0] is False\n")
    tests = Path(__file__).resolve().parents[2]
    inside = f"{Path(__file__).resolve()}::test_outside_a_unit_test_the_calls_are_the_originals"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(tests.parent), inside, str(outside)],
                          cwd=tests.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
