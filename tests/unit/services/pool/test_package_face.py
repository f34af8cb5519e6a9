"""The pool package's face imports Ray Serve only when one of its functions runs: every engine's Ray worker imports
``services.pool.engine_actor`` (and with it the package), and with Serve and the pool's HTTP app imported at the
package's top each engine actor paid for code it never runs (the import 1.11 s in one ``inflight run``'s engine
worker, 0.18 s without)."""
from __future__ import annotations

import json
import subprocess
import sys

SERVE_SIDE = ("ray.serve", "fastapi", "services.pool.deployment", "services.pool.fleet")


def imported_after(statement: str) -> list[str]:
    code = f"import json, sys; {statement}; print(json.dumps([m for m in {SERVE_SIDE!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_actor_imports_no_serve_side_module():
    assert imported_after("import services.pool.engine_actor") == []


def test_the_face_imports_serve_when_a_pool_is_deployed_not_before():
    assert imported_after("import services.pool") == []
    assert imported_after("import services.pool; from services.pool.deployment import RolloutPool") == list(SERVE_SIDE)
