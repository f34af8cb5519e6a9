"""The install state machine (rollout.install.installer) against a fake vLLM client: verify before touching the engine,
pause -> drain -> install -> label -> advance the version, always resume, then reset the prefix cache; every
step timed."""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from protocol import encode, pack_buckets
from rollout.errors import EngineError
from rollout.install.installer import Installer, pause
from rollout.labels import VersionLabels
from rollout.install.weight_receiver import ExpectedParams, ParamSpec, WeightUpdateError

EXPECTED = ExpectedParams({"a.weight": ParamSpec((2, 3), "float32")})


def push(version: int, value: float = 1.0):
    a = np.full((2, 3), value, np.float32)
    return pack_buckets([("a.weight", "float32", (2, 3), a.view(np.uint8))], version=version, bucket_bytes=64)


class FakeLLM:
    """Records the engine calls of an install; ``fail`` / ``hang`` name a collective_rpc method."""

    engine_core = None  # no pause_scheduler_async: the install takes pause_generation

    def __init__(self, fail: str = "", hang: str = "", reset_ok: bool = True, received=None):
        self.calls: list[str] = []
        self.fail, self.hang, self.reset_ok, self.received = fail, hang, reset_ok, received
        self.staged_files: list[bool] = []

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(f"pause:{mode}:{clear_cache}")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.reset_ok

    async def update_weight_version(self, version: str):
        self.calls.append(f"label:{version}")

    async def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method)
        if method == self.hang:
            await asyncio.sleep(10)
        if method == self.fail:
            raise RuntimeError(f"{method} broke")
        if method == "inflight_reload_weights":
            self.staged_files.append((Path(kwargs["weights_path"]) / "model.safetensors").exists())
        if method in ("inflight_receive_weights", "inflight_map_ipc"):
            return self.received
        if method in ("inflight_install_received", "inflight_install_mapped"):
            return [{"path": "reload", "refused_reason": "plain load raised", "copy_refused_reason": ""}]
        return [None]


def installer(version: int = 2, engine_side: bool = True, timeout_s: float = 5.0) -> Installer:
    labels = VersionLabels()
    labels.engine_side, labels.streamed = engine_side, not engine_side
    inst = Installer("t", labels, version, recompute_kv=False, in_flight=True, timeout_s=timeout_s)
    inst.expected = EXPECTED
    return inst


def test_a_good_push_is_installed_in_order_and_the_version_advances():
    inst, llm = installer(), FakeLLM()
    assert asyncio.run(inst.install(llm, *push(3))) == 3 == inst.version
    assert llm.calls == ["pause:keep:False", "inflight_reload_weights", "label:3", "resume", "reset_prefix_cache"]
    assert llm.staged_files == [True]
    assert inst.stats.refits == 1 and inst.stats.refit_bytes_last == 24 and inst.stats.refit_rejected == 0


def test_a_bad_push_is_rejected_before_the_engine_is_touched():
    inst, llm = installer(), FakeLLM()
    with pytest.raises(WeightUpdateError, match="must be greater than the version being served"):
        asyncio.run(inst.install(llm, *push(2)))
    assert llm.calls == [] and inst.version == 2 and inst.stats.refit_rejected == 1
    assert asyncio.run(inst.install(llm, *push(1), reset=True)) == 1  # reset skips only the version order


def test_a_failed_install_marks_the_weights_broken_and_still_resumes_until_a_push_succeeds():
    inst, llm = installer(), FakeLLM(fail="inflight_reload_weights")
    with pytest.raises(WeightUpdateError, match="installing v3 failed: RuntimeError: inflight_reload_weights broke"):
        asyncio.run(inst.install(llm, *push(3)))
    assert llm.calls[-1] == "resume" and inst.version == 2 and inst.broken
    with pytest.raises(EngineError, match="weights are inconsistent"):
        inst.require_consistent()
    llm.fail = ""
    assert asyncio.run(inst.install(llm, *push(3))) == 3
    assert inst.broken == "" and inst.stats.refit_rejected == 1
    inst.require_consistent()


def test_a_hung_step_is_named_and_bounded():
    inst, llm = installer(timeout_s=0.05), FakeLLM(hang="inflight_reload_weights")
    with pytest.raises(WeightUpdateError, match="reload_weights of v3 did not finish within 0.05s"):
        asyncio.run(inst.install(llm, *push(3)))
    assert llm.calls[-1] == "resume"


def test_a_pause_on_an_engine_whose_core_dies_is_abandoned_at_once_not_at_the_deadline():
    """A push that meets a killed engine core: the hung pause ends within a poll, as EngineDead (the pool then
    restarts the engine), not after the install deadline as a rejected push."""
    import time

    from rollout.liveness import EngineDead

    class DyingLLM(FakeLLM):
        errored = False

        async def pause_generation(self, mode, clear_cache):
            self.calls.append("pause")
            self.errored = True  # the core died: vLLM's monitor marks the client errored; the pause never returns
            await asyncio.sleep(30)

    inst, llm = installer(timeout_s=20.0), DyingLLM()
    started = time.monotonic()
    with pytest.raises(EngineDead, match="pause_generation before a weight update abandoned: vLLM engine errored"):
        asyncio.run(inst.install(llm, *push(3)))
    assert time.monotonic() - started < 3.0
    assert inst.version == 2 and not inst.broken


def test_a_deferred_prefix_cache_reset_is_counted_and_streamed_labels_mark_running_samples():
    inst, llm = installer(engine_side=False), FakeLLM(reset_ok=False)
    running = inst.labels.open("r", 2)
    assert running is not None
    running.token_ids += [5, 6]
    asyncio.run(inst.install(llm, *push(3)))
    running.token_ids += [7]
    assert running.versions().tolist() == [2, 2, 3]
    assert "label:3" not in llm.calls  # streamed: no engine-side label
    assert inst.stats.prefix_cache_reset_deferred == 1
    assert inst.stats.version_drain_incomplete == 1  # this fake has no output queue to drain


def test_a_group_push_is_checked_before_the_pause_and_dropped_if_rejected():
    manifest, _ = push(3)
    inst, llm = installer(), FakeLLM(received=[encode(manifest)])
    assert asyncio.run(inst.install_from_group(llm, direct_load=True)) == 3
    assert llm.calls == ["inflight_receive_weights", "pause:keep:False", "inflight_install_received", "label:3",
                         "resume", "reset_prefix_cache"]
    assert inst.stats.install_path_last == "reload" and inst.stats.direct_load_refused == "plain load raised"
    other, _ = push(4, value=2.0)
    llm = FakeLLM(received=[encode(push(4)[0]), encode(other)])
    with pytest.raises(WeightUpdateError, match="the workers received different pushes"):
        asyncio.run(inst.install_from_group(llm))
    assert llm.calls == ["inflight_receive_weights", "inflight_drop_received"] and inst.version == 3


def test_the_engine_pauses_without_pause_generations_fixed_sleep():
    """``rollout.install.installer.pause`` asks the engine client to pause (what ``AsyncLLM.pause_generation`` does
    before its 20 ms sleep); only where the client cannot does it take the full ``pause_generation``."""
    calls = []

    class Core:
        async def pause_scheduler_async(self, mode, clear_cache):
            calls.append(("core", mode, clear_cache))

    class Client:
        engine_core = Core()

        async def pause_generation(self, mode, clear_cache):
            calls.append(("generation", mode, clear_cache))
            await asyncio.sleep(0.02)

    class OldClient(Client):
        engine_core = None

    asyncio.run(pause(Client(), "keep", False))
    assert calls == [("core", "keep", False)]
    asyncio.run(pause(OldClient(), "wait", True))
    assert calls[-1] == ("generation", "wait", True)


class SlowLLM(FakeLLM):
    """Each engine call takes its own time, so the breakdown can be checked against it."""

    delays = {"pause": 0.03, "inflight_reload_weights": 0.05, "resume": 0.02, "reset_prefix_cache": 0.04}

    async def pause_generation(self, mode, clear_cache):
        await asyncio.sleep(self.delays["pause"])
        await super().pause_generation(mode, clear_cache)

    async def resume_generation(self):
        await asyncio.sleep(self.delays["resume"])
        await super().resume_generation()

    async def reset_prefix_cache(self):
        await asyncio.sleep(self.delays["reset_prefix_cache"])
        return await super().reset_prefix_cache()

    async def collective_rpc(self, method, args=(), kwargs=None):
        await asyncio.sleep(self.delays.get(method, 0.0))
        return await super().collective_rpc(method, args, kwargs)


def test_every_step_of_an_install_is_timed_and_the_prefix_reset_is_outside_the_pause():
    inst, llm = installer(), SlowLLM()
    asyncio.run(inst.install(llm, *push(3)))
    t = inst.stats.phases_last
    assert 0.03 <= t.pause_s < 0.03 + 0.025 and 0.05 <= t.install_s < 0.05 + 0.025
    assert 0.02 <= t.resume_s < 0.02 + 0.025 and 0.04 <= t.prefix_reset_s < 0.04 + 0.025
    assert t.settle_s == 0.0 and t.receive_s == 0.0 and t.verify_s > 0 and t.stage_s > 0
    inside = t.pause_s + t.settle_s + t.drain_s + t.install_s + t.label_s + t.resume_s
    assert inside <= t.paused_s < inside + 0.01 and t.paused_s == inst.stats.pause_seconds_last
    assert t.paused_s + t.prefix_reset_s + t.verify_s + t.stage_s <= t.total_s == inst.stats.refit_seconds_last
    stats = inst.stats.as_dict()
    assert stats["phases_last"]["prefix_reset_s"] == t.prefix_reset_s  # plain values for the engine's stats()


def test_vllms_own_order_is_a_setting_a_fixed_settle_and_the_prefix_reset_inside_the_pause():
    """What ``bench/gpu_smoke.py`` runs as "before": the sleep of ``pause_generation`` and the reset inside."""
    inst, llm = installer(), SlowLLM()
    inst.settings.settle_s, inst.settings.prefix_reset_inside = 0.02, True
    asyncio.run(inst.install(llm, *push(3)))
    t = inst.stats.phases_last
    assert llm.calls == ["pause:keep:False", "inflight_reload_weights", "reset_prefix_cache", "label:3", "resume"]
    assert 0.02 <= t.settle_s < 0.045 and t.paused_s >= t.prefix_reset_s + t.settle_s + t.install_s


def test_streamed_marks_count_the_front_ends_backlog_without_waiting_for_it():
    """The front end is behind: two engine outputs of the running sample wait in the client's queue, which nothing
    consumes during the install. The install still completes, marks the sample where the pause cut it (its
    tokens plus the queued ones) and leaves the queue to the front end."""
    class Core:
        outputs_queue: asyncio.Queue

        async def pause_scheduler_async(self, mode, clear_cache):
            pass

    async def scenario():
        core = Core()
        core.outputs_queue = asyncio.Queue()
        for n in (2, 3):
            core.outputs_queue.put_nowait(SimpleNamespace(outputs=[SimpleNamespace(request_id="r-7",
                                                                                   new_token_ids=[1] * n)]))
        llm = FakeLLM()
        llm.engine_core = core  # pyright: ignore[reportAttributeAccessIssue]
        llm.output_processor = SimpleNamespace(  # pyright: ignore[reportAttributeAccessIssue]
            request_states={"r-7": SimpleNamespace(external_req_id="r", queue=SimpleNamespace(output=None))})
        inst = installer(engine_side=False)
        running = inst.labels.open("r", 2)
        assert running is not None
        running.token_ids += [5, 6]
        await inst.install(llm, *push(3))
        return inst.stats, running, core.outputs_queue.qsize()
    stats, running, still_queued = asyncio.run(scenario())
    assert stats.drain_complete_last and stats.version_drain_incomplete == 0
    assert stats.drain_backlog_last == 2 and stats.drain_pending_tokens_last == 5 and still_queued == 2
    running.token_ids += [0] * 6  # the 5 queued tokens arrive, then one sampled after the pause
    assert running.versions().tolist() == [2] * 7 + [3]


def test_a_cuda_ipc_push_is_mapped_checked_and_installed_and_a_rejected_one_is_let_go():
    manifest, _ = push(3)
    inst, llm = installer(), FakeLLM(received=[encode(manifest)])
    assert asyncio.run(inst.install_ipc(llm, manifest, [["share"]])) == 3
    assert llm.calls == ["inflight_map_ipc", "pause:keep:False", "inflight_install_mapped", "label:3", "resume",
                         "reset_prefix_cache"]
    assert inst.stats.phases_last.receive_s > 0 and inst.stats.install_path_last == "reload"
    llm = FakeLLM(fail="inflight_map_ipc")
    with pytest.raises(WeightUpdateError, match="weight push not received: RuntimeError: inflight_map_ipc broke"):
        asyncio.run(inst.install_ipc(llm, push(4)[0], [["share"]]))
    assert llm.calls == ["inflight_map_ipc", "inflight_drop_mapped"] and inst.version == 3
    stale, _ = push(3)
    llm = FakeLLM(received=[encode(stale)])
    with pytest.raises(WeightUpdateError, match="must be greater than the version being served"):
        asyncio.run(inst.install_ipc(llm, stale, [["share"]]))
    assert llm.calls == ["inflight_map_ipc", "inflight_drop_mapped"] and inst.stats.refit_rejected == 2
