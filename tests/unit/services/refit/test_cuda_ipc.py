"""CUDA IPC pushes, without a GPU: the pool plans which engines share the learner's GPU, the learner falls back to
the object store (saying why, once) where one does not, frees its exported buffers whatever the outcome, and the
pool installs atomically and keeps no copy."""
from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import RayTaskError

from rollout.install.installer import PauseBreakdown
from rollout.install.weight_receiver import WeightUpdateError
from services.recipe.config import load_recipe
from services.refit import CudaIpcRefit, RefitError, RefitResult, make_refit
from services.refit.cuda_ipc import IpcFanout, IpcPlan
from services.refit.learner_port import ExportedWeights, IpcExport
from services.refit.port import KeptPush
from services.refit.result import GroupInstall
from handle_fakes import ActorMethod, ServeMethod
from port_fakes import FakePool


def test_a_plan_names_why_a_cuda_ipc_push_cannot_reach_every_engine():
    assert IpcPlan("GPU-a", ("e0",), ()).refusal() == ""
    assert IpcPlan("", (), ("e0",)).refusal() == "the learner's rank 0 has no GPU"
    assert "engines ['e1'] do not run on the learner's GPU GPU-a alone" in IpcPlan("GPU-a", ("e0",), ("e1",)).refusal()
    assert IpcPlan("GPU-a", (), ()).refusal() == "no engine is up"
    assert "counted for one process" in IpcPlan("GPU-a", ("e0", "e1"), ()).refusal()


class _Engine:
    """An engine actor of given workers' GPUs that installs CUDA IPC pushes (or rejects one)."""

    def __init__(self, gpus: tuple[str, ...], reject: bool = False):
        self.gpus, self.reject, self.asked, self.installs = gpus, reject, 0, []

        async def gpu_uuids():
            self.asked += 1
            return list(self.gpus)

        async def install_ipc(manifest_bytes, shares, reset):
            self.installs.append((manifest_bytes, shares, reset))
            if self.reject:
                cause = WeightUpdateError("CUDA IPC push v4: 1 of 2 mapped buckets differ from the learner's checksums")
                raise RayTaskError("EngineActor.install_ipc", "...", cause).as_instanceof_cause()
            await asyncio.sleep(0.03)   # the call's way to the engine and back
            return GroupInstall(version=4, bytes=100, pause_s=0.004, install_s=0.001, install_path="copy",
                                drain_complete=False, phases=PauseBreakdown(pause_s=0.002, install_s=0.001),
                                call_s=0.01, loop_lag_s=0.2)

        self.gpu_uuids, self.install_ipc = ActorMethod(gpu_uuids), ActorMethod(install_ipc)


def test_the_pool_installs_on_the_engine_of_the_learners_gpu_and_keeps_no_copy():
    async def scenario():
        engine = _Engine(("GPU-a",))
        pool = FakePool({"e0": engine})
        pool.kept = KeptPush(b"m", [])
        ipc = IpcFanout(pool, refit_timeout_s=5.0)
        assert await ipc.plan("GPU-a") == IpcPlan("GPU-a", ("e0",), ())
        out = await ipc.install(b"manifest", [["share"]], "GPU-a", reset=True)
        assert out == RefitResult(version=4, seconds=out.seconds, bytes=100, engines=1, pause_seconds_max=0.004,
                                  install_seconds_max=0.001, install_paths=("copy",), transport="cuda_ipc",
                                  phases=PauseBreakdown(pause_s=0.002, install_s=0.001),
                                  engine_call_seconds=out.engine_call_seconds, engine_seconds=0.01,
                                  engine_loop_lag_seconds=0.2, pool_loop_lag_seconds=0.0)
        assert out.engine_call_seconds is not None and 0.03 <= out.engine_call_seconds <= out.seconds
        assert engine.installs == [(b"manifest", [["share"]], True)] and engine.asked == 1   # asked once
        assert pool.version == 4 and pool.kept is None and pool.versions == {"e0": 4}
        assert pool.metrics.version_drain_incomplete._value.get() == 1
        assert pool.metrics.weight_installs.labels(path="copy")._value.get() == 1
        engine.reject = True
        with pytest.raises(RefitError, match="weight push v\\? rejected.*differ from the learner's checksums"):
            await ipc.install(b"manifest", [["share"]], "GPU-a")
        assert pool.version == 4 and pool.metrics.refit_failures.labels(reason="rejected")._value.get() == 1
        pool.restarted("e1", _Engine(("GPU-b",)), "9.1")
        with pytest.raises(RefitError, match="cuda_ipc: engines \\['e1'\\] do not run on the learner's GPU"):
            await ipc.install(b"manifest", [["share"]], "GPU-a")   # an engine came up elsewhere meanwhile
    asyncio.run(scenario())


class _Pool:
    def __init__(self, plan: IpcPlan, fail: bool = False):
        self.pushed, self.fail = [], fail
        self.ipc_plan = ServeMethod(lambda gpu: plan)
        self.install_ipc_push = ServeMethod(self._install)
        self.push = ServeMethod(lambda manifest, refs, reset: RefitResult(version=2, seconds=0.3, bytes=10,
                                                                          engines=1, transport="object_store"))
        self.engines_wanting_weights = ServeMethod(lambda: ["e0"])

    def _install(self, manifest_bytes, shares, gpu, reset, timeout_s):
        self.pushed.append((manifest_bytes, shares, gpu, reset))
        if self.fail:
            raise RefitError("pool 'p': weight push v2 timeout")
        return RefitResult(version=2, seconds=0.01, bytes=10, engines=1, transport="cuda_ipc")


class _Learner:
    """The learner's side of a CUDA IPC push (``LearnerPort``) on the GPU ``gpu`` ('' on CPU)."""

    def __init__(self, gpu: str):
        self.gpu, self.calls = gpu, []

    def gpu_uuid(self):
        self.calls.append("gpu_uuid")
        return self.gpu

    def export_ipc(self, bucket_bytes, cuda_graph):
        self.calls.append(f"export_ipc graph={cuda_graph}")
        return IpcExport(b"manifest", [["share"]])

    def export_weights(self, bucket_bytes):
        self.calls.append("export_weights")
        return ExportedWeights(b"manifest", ["ref"])

    def release_ipc(self, failed):
        self.calls.append(f"release_ipc failed={failed}")
        return 10


def test_the_learner_shares_its_buckets_and_frees_them_after_the_pools_answer_even_a_failure():
    recipe = load_recipe(None, ["policy.refit_transport=cuda_ipc", "policy.refit_timeout_s=5"])
    pool, learner = _Pool(IpcPlan("GPU-a", ("e0",), ())), _Learner("GPU-a")
    refit = make_refit(recipe, pool, learner)
    assert isinstance(refit, CudaIpcRefit) and not refit.engines_waiting()   # nothing pushed yet
    out = refit.push(reset=True)
    assert out.transport == "cuda_ipc" and out.send_seconds is not None
    assert pool.pushed == [(b"manifest", [["share"]], "GPU-a", True)]
    assert learner.calls == ["gpu_uuid", "export_ipc graph=True", "release_ipc failed=False"]
    assert refit.engines_waiting()     # the pool keeps no copy: a restarted engine waits for the learner
    pool.fail = True
    with pytest.raises(RefitError, match="timeout"):
        refit.push(reset=False)
    # an engine may still read the failed push's buckets: the learner packs the next one into new ones
    assert learner.calls[-2:] == ["export_ipc graph=True", "release_ipc failed=True"]


def test_the_cuda_graph_pack_can_be_turned_off():
    recipe = load_recipe(None, ["policy.refit_transport=cuda_ipc", "policy.refit_cuda_graph=false"])
    learner = _Learner("GPU-a")
    make_refit(recipe, _Pool(IpcPlan("GPU-a", ("e0",), ())), learner).push(reset=False)
    assert learner.calls[1] == "export_ipc graph=False"


def test_without_an_engine_on_the_learners_gpu_every_push_goes_through_the_object_store(caplog):
    recipe = load_recipe(None, ["policy.refit_transport=cuda_ipc"])
    pool, learner = _Pool(IpcPlan("", (), ("e0",))), _Learner("")   # a CPU run
    refit = CudaIpcRefit(recipe, pool, learner)
    with caplog.at_level(logging.WARNING, logger="inflight.refit"):
        assert refit.push(reset=False).transport == "object_store"
        assert refit.push(reset=False).transport == "object_store"
    assert [r.getMessage() for r in caplog.records] == [
        "refit: cuda_ipc cannot reach every engine (the learner's rank 0 has no GPU); pushing through the object "
        "store"]                                                    # said once
    assert learner.calls == ["gpu_uuid", "export_weights", "export_weights"] and not pool.pushed
    assert not refit.engines_waiting()  # the pool reinstalls object-store pushes itself
