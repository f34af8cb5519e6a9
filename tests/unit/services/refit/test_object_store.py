"""Object-store pushes, the pool's fan-out: a push rejected by one engine is rejected as a whole, and its retry is
not rejected by the engines that installed it the first time."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from protocol import WeightManifest, decode, encode
from protocol.weights import pack_buckets
from rollout.counters import RolloutCounters
from rollout.install.installer import InstallStats, PauseBreakdown
from rollout.install.weight_receiver import WeightUpdateError
from rollout.kv_stats import KvCounters
from rollout.sampling import SamplingStats
from services.pool.engine_replies import EngineStats
from services.recipe.config import load_recipe
from services.refit import RefitError, RefitResult
from services.refit.object_store import ObjectStoreFanout
from handle_fakes import ActorMethod
from port_fakes import FakePool


class FakeInstaller:
    """``install`` like an EngineActor handle: installs a version once, rejects it as not newer after that
    (like rollout.install.weight_receiver), and fails its first ``fail_first`` calls."""

    def __init__(self, fail_first: int = 0):
        self.version, self.calls, self.fail_first = 0, 0, fail_first
        self.install = ActorMethod(self._install)
        self.stats = ActorMethod(self._stats)

    async def _stats(self):
        """What the engine actor's stats say about the last install (the pool's metrics read it)."""
        phases = dict.fromkeys(f.name for f in dataclasses.fields(PauseBreakdown))
        installs = InstallStats(refit_bytes_last=8, pause_seconds_last=0.01 * self.calls, install_seconds_last=0.004,
                                install_path_last="", drain_complete_last=self.calls != 3,
                                phases_last=PauseBreakdown(**{k: 0.001 * self.calls for k in phases}))
        counters = RolloutCounters("e", self.version, SamplingStats(), installs, KvCounters(), sleeps_skipped_on_cpu=0,
                                   weights_broken="", vllm_unfinished_requests=0)
        return EngineStats("e", self.version, pid=1, incarnation="1.1", running_batches=0, channel_send_failures=0,
                           counters=counters)

    async def _install(self, manifest_bytes, refs, reset):
        self.calls += 1
        v = decode(manifest_bytes, expect=WeightManifest).version
        if self.calls <= self.fail_first:
            raise WeightUpdateError(f"weight push v{v} rejected: bucket 0 checksum mismatch")
        if v <= self.version and not reset:
            raise WeightUpdateError(f"weight push rejected: manifest.version {v} must be greater than the version "
                                    f"being served ({self.version})")
        self.version = v
        return v


def test_a_push_retried_after_failing_on_one_engine_is_not_rejected_by_the_engines_that_installed_it(monkeypatch):
    """A push that one engine rejected is retried by the learner; the engines that installed it the first time
    keep it instead of rejecting the retry as not newer (the retry used to fail on every attempt)."""
    import ray

    monkeypatch.setattr(ray, "put", lambda data: data)
    manifest, buckets = pack_buckets([("w", "float32", (2,), np.zeros(8, np.uint8))], version=1,
                                    bucket_bytes=1024)

    async def scenario():
        good, flaky = FakeInstaller(), FakeInstaller(fail_first=1)
        pool = FakePool({"e0": good, "e1": flaky})
        fanout = ObjectStoreFanout(pool, refit_timeout_s=10.0)

        def refs():
            async def bucket(b):
                return encode(b)
            return [bucket(b) for b in buckets]

        with pytest.raises(RefitError, match="rejected"):
            await fanout.push(encode(manifest), refs())
        assert pool.version == 0 and pool.kept is None and good.version == 1 and flaky.version == 0
        assert pool.metrics.refit_failures.labels(reason="rejected")._value.get() == 1
        out = await fanout.push(encode(manifest), refs())
        assert out == RefitResult(version=1, seconds=out.seconds, bytes=manifest.total_bytes, engines=2,
                                  pause_seconds_max=0.02, install_seconds_max=0.004, transport="object_store",
                                  phases=PauseBreakdown(**dict.fromkeys(out.phases.__dict__, 0.002)))
        assert pool.version == 1 and flaky.version == 1 and pool.kept is not None
        assert pool.versions == {"e0": 1, "e1": 1} and pool.metrics.refit_bytes._value.get() == 2 * manifest.total_bytes
        assert good.calls == 1                       # kept what it had installed; not asked again
        assert pool.metrics.version_drain_incomplete._value.get() == 0
        assert await fanout.reinstall("e1") and flaky.calls == 3   # the kept push, reset, for a restarted engine
        # its drain ran out (this fake's third install): counted, and the last phases shown by phase
        assert pool.metrics.version_drain_incomplete._value.get() == 1
        assert pool.metrics.refit_phase_seconds.labels(phase="paused")._value.get() == 0.003

    asyncio.run(scenario())


def test_the_learner_exports_buckets_and_hands_them_to_the_pools_push():
    from services.refit import ObjectStoreRefit, make_refit
    from services.refit.learner_port import ExportedWeights

    calls, result = [], RefitResult(version=2, seconds=0.1, bytes=10, engines=1)

    class _Push:
        def remote(self, *args):
            calls.append(args)
            return self

        def result(self, timeout_s: float):
            calls.append(timeout_s)
            return result

    recipe = load_recipe(None, ["policy.refit_bucket_mb=2", "policy.refit_timeout_s=10"])
    class _Learner:
        def export_weights(self, bucket_bytes):
            calls.append(("export_weights", bucket_bytes))
            return ExportedWeights(b"manifest", ["ref"])

    learner = _Learner()
    refit = make_refit(recipe, type("Pool", (), {"push": _Push()})(), learner)
    assert isinstance(refit, ObjectStoreRefit) and not refit.engines_waiting()
    assert refit.push(reset=True) is result
    assert calls == [("export_weights", 2 * 1024 * 1024), (b"manifest", ["ref"], True), 3 * 10 + 60]
