"""Keep Python's full garbage collections short in a process that runs rollout engines.

A full (generation 2) collection walks every tracked object, and a started vLLM engine leaves some 700k of
them in its front end's process (vLLM, torch, transformers, the engine's own state); generating then creates
objects fast enough to trigger full collections every few seconds, each holding the process's event loop --
a weight push's calls, the pool's relays -- for 0.1-0.6 s on CPU, longer as the heap grows (1.1-1.6 s per push on
one H100, 2026-12-06; ``refit_engine_loop_lag_s``). :func:`engine_started` freezes what is there once an engine
has started (``gc.freeze``: later collections skip it); :func:`engine_stopped` thaws it so that the stopped
engine's cycles are collected, and freezes again while other engines still run in the process.
"""
from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_running = 0


def engine_started() -> int:
    """An engine of this process has started: collect once, then freeze the heap; returns the objects frozen."""
    global _running
    with _lock:
        _running += 1
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def engine_stopped() -> None:
    """An engine of this process has stopped: thaw the heap and collect (its objects go); freeze again if others
    still run."""
    global _running
    with _lock:
        _running = max(0, _running - 1)
        gc.unfreeze()
        gc.collect()
        if _running:
            gc.freeze()


def running() -> int:
    """Engines of this process between :func:`engine_started` and :func:`engine_stopped`."""
    return _running
