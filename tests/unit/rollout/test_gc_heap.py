"""The heap is frozen while an engine of the process runs and thawed once the last one stops."""
from __future__ import annotations

import gc

from rollout import gc_heap


def test_frozen_while_an_engine_runs_thawed_after_the_last():
    assert gc_heap.running() == 0 and gc.get_freeze_count() == 0
    try:
        assert gc_heap.engine_started() > 0 and gc.get_freeze_count() > 0
        gc_heap.engine_started()                                   # a second engine in the same process
        gc_heap.engine_stopped()
        assert gc_heap.running() == 1 and gc.get_freeze_count() > 0  # the other still runs: frozen again
        gc_heap.engine_stopped()
        assert gc_heap.running() == 0 and gc.get_freeze_count() == 0
        gc_heap.engine_stopped()                                   # one stop too many changes nothing
        assert gc_heap.running() == 0
    finally:
        gc.unfreeze()
