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
