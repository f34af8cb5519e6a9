"""The pool package's face imports Ray Serve only when one of its functions runs: every engine's Ray worker imports
``services.pool.engine_actor`` (and with it the package), and with Serve and the pool's HTTP app imported at the
package's top each engine actor paid for code it never runs (the import 1.11 s in one ``inflight run``'s engine
worker, 0.18 s without)."""
from __future__ import annotations

from import_probe import imported_after

SERVE_SIDE = ("ray.serve", "fastapi", "services.pool.deployment", "services.pool.fleet")


def test_the_engine_actor_imports_no_serve_side_module():
    assert imported_after("import services.pool.engine_actor", SERVE_SIDE) == []


def test_the_face_imports_serve_when_a_pool_is_deployed_not_before():
    assert imported_after("import services.pool", SERVE_SIDE) == []
    deployed = "import services.pool; from services.pool.deployment import RolloutPool"
    assert imported_after(deployed, SERVE_SIDE) == list(SERVE_SIDE)
