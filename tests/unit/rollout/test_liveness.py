"""rollout.liveness: reading vLLM's own dead state, and removing what a dead engine core left in /dev/shm."""
from __future__ import annotations

import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

from rollout.liveness import EngineProcesses, dead_reason


def _llm(engine_dead: bool = False, errored: bool = False, running: bool = True, resources: bool = True):
    """An object shaped like vLLM 0.32's ``AsyncLLM`` (``resources=False``: a client without ``resources``)."""
    core = types.SimpleNamespace(resources=types.SimpleNamespace(engine_dead=engine_dead)) if resources else object()
    return types.SimpleNamespace(engine_core=core, errored=errored, is_running=running,
                                 dead_error=RuntimeError("EngineCore encountered an issue"))


def test_a_live_engine_has_no_dead_reason():
    assert dead_reason(_llm()) == ""
    assert dead_reason(types.SimpleNamespace()) == ""  # an AsyncLLM without any of these attributes


def test_each_of_vllms_dead_signals_gives_a_reason():
    assert "engine core died" in dead_reason(_llm(engine_dead=True, errored=True))
    assert "errored (RuntimeError)" in dead_reason(_llm(errored=True, resources=False))
    assert "output loop stopped" in dead_reason(_llm(running=False))


def test_a_state_that_cannot_be_read_counts_as_dead():
    class Broken:
        @property
        def errored(self):
            raise RuntimeError("client torn down")

    assert "unreadable: RuntimeError: client torn down" in dead_reason(Broken())


MAPPER = """
import mmap, os, sys, time
with open(sys.argv[1], "wb") as f:
    f.truncate(1 << 16)
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 1 << 16)
print("mapped", flush=True)
time.sleep(600)
"""


def test_segments_of_a_killed_engine_process_are_removed_once_it_is_gone_and_not_before():
    path = Path(f"/dev/shm/inflight-test-{uuid.uuid4().hex}")
    before = EngineProcesses.before_start()
    child = subprocess.Popen([sys.executable, "-c", MAPPER, str(path)], stdout=subprocess.PIPE, text=True)
    # Python's resource tracker starts with the first engine and outlives it: not one of the engine's processes
    tracker = subprocess.Popen([sys.executable, "-c", "import time  # multiprocessing.resource_tracker\n"
                                                      "time.sleep(600)"])
    try:
        assert child.stdout.readline().strip() == "mapped"
        procs = EngineProcesses.started_since(before)
        assert list(procs.pids()) == [child.pid] and str(path) in procs.segments
        assert procs.release_leftovers() == [] and path.exists()  # its process lives: nothing removed
        child.kill()
        child.wait(10)
        time.sleep(0.1)
        assert procs.pids() == {}
        assert procs.release_leftovers() == [str(path)] and not path.exists()
    finally:
        child.kill()
        tracker.kill()
        path.unlink(missing_ok=True)
