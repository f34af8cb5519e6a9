"""A failed push is named by the exception types of its causes, looked up inside Ray's RayTaskError."""
from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError, RayTaskError

from protocol import ProtocolError
from rollout.liveness import EngineDead
from rollout.install.weight_receiver import WeightUpdateError
from services.refit.result import engine_gone, failure_reason, remote_cause


def _remote(cause: BaseException) -> RayTaskError:
    """What awaiting a failed actor call raises."""
    return RayTaskError("EngineActor.install", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


def test_refit_failure_reasons():
    assert failure_reason([asyncio.TimeoutError()]) == "timeout"
    assert failure_reason([WeightUpdateError("bad shape")]) == "rejected"
    assert failure_reason([ProtocolError("buckets", "4 buckets", "3")]) == "rejected"
    assert failure_reason([RuntimeError("no engine is up")]) == "failed"
    assert failure_reason([RuntimeError("ProtocolError in the text only")]) == "failed"  # types, not text


def test_refit_failure_reason_looks_inside_ray_task_errors():
    assert failure_reason([_remote(TimeoutError())]) == "timeout"
    assert failure_reason([_remote(WeightUpdateError("checksum mismatch")), _remote(ValueError("x"))]) == "rejected"
    assert failure_reason([_remote(ValueError("x"))]) == "failed"
    err = WeightUpdateError("bad")
    assert remote_cause(_remote(err)) is err and remote_cause(err) is err


def test_an_engine_is_gone_when_its_process_died_or_its_vllm_core_did():
    assert engine_gone(RayActorError())
    assert engine_gone(_remote(EngineDead("core died")))
    assert not engine_gone(_remote(WeightUpdateError("bad")))
