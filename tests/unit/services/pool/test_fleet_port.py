"""The fleet as the weight transports' port (services.refit.port.PoolPort): what a push reads of the engines, and
what it records on the pool (an install, a landed push, an engine down, a failed push)."""
from __future__ import annotations

from pool_fakes import fleet_of

from rollout.install.weight_receiver import WeightUpdateError
from services.refit.port import KeptPush


def test_a_push_reads_the_engines_that_are_up_and_records_installs_and_the_new_version():
    fleet = fleet_of({"e0": object(), "e1": object()}, version=2)
    assert fleet.engines_up() == ["e0", "e1"] and fleet.incarnation("e1") == "1.0"
    fleet.installed("e1", 3)
    assert fleet.engine_version("e1") == 3 and fleet.engine_version("e0") == 2
    kept = KeptPush(b"manifest", [])
    fleet.advance(3, kept)
    assert fleet.version == 3 and fleet.kept is kept and fleet.metrics.policy_version._value.get() == 3
    assert fleet.serving() == ["e1"]                                  # e0 is stale until it installs v3
    fleet.mark_down("e0", RuntimeError("actor died"))
    assert fleet.engines_up() == ["e1"] and fleet.metrics.engine_up.labels(engine="e0")._value.get() == 0
    fleet.advance(4, None)
    assert fleet.kept is None


def test_a_failed_push_is_counted_by_reason_and_named_with_the_version_that_keeps_serving():
    fleet = fleet_of({"e0": object()}, version=5)
    fleet.advance(5, None)
    err = fleet.refit_failed(6, {"e0": WeightUpdateError("bucket 0 checksum mismatch")})
    assert str(err).startswith("pool 'inflight-pool': weight push v6 rejected; the old version v5 keeps serving: ")
    assert "checksum mismatch" in str(err) and "refit v6 rejected" in fleet.errors[-1]
    assert fleet.metrics.refit_failures.labels(reason="rejected")._value.get() == 1
