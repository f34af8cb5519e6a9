"""The unit tier's guard (installed by ``tests/unit/conftest.py``): a unit test touches no Ray cluster, no vLLM
engine and no torch process group.

Starting any of them while a unit test runs fails it, naming the call and where such tests belong
(``tests/integration``, which shares one stack per session). The calls are wrapped when their modules are
first imported, so a unit test that never imports Ray or vLLM pays nothing; outside unit tests (a session that
runs both tiers) they work as usual.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

REFUSED: dict[str, tuple[str, ...]] = {
    "ray": ("init",),
    "torch.distributed": ("init_process_group",),
    "vllm.v1.engine.async_llm": ("AsyncLLM.__init__",),
    "vllm.v1.engine.core": ("EngineCore.__init__",),
    "vllm.entrypoints.llm": ("LLM.__init__",),
}
"""module -> the attributes (``Class.method`` for methods) a unit test may not call."""


class UnitTierViolation(RuntimeError):
    """A unit test started Ray, a vLLM engine or a process group."""


_IN_UNIT_TEST = [False]
"""True while a unit test (its fixtures included) runs; the refused calls work elsewhere (a session that runs
unit and integration tests together)."""


class unit_test_running:
    """Context: the refused calls raise inside it."""

    def __enter__(self) -> None:
        _IN_UNIT_TEST[0] = True

    def __exit__(self, *exc) -> None:
        _IN_UNIT_TEST[0] = False


def _refusing(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def refuse(*args, **kwargs):
        if not _IN_UNIT_TEST[0]:
            return original(*args, **kwargs)
        raise UnitTierViolation(f"{name} was called from a unit test: tests/unit touches no Ray, vLLM engine or "
                                "process group; such a test belongs in tests/integration (one shared stack)")
    refuse.__inflight_refused__ = True  # type: ignore[attr-defined]
    return refuse


def guard(module) -> None:
    """Replace ``module``'s refused attributes (:data:`REFUSED`) with callables that raise."""
    for path in REFUSED.get(module.__name__, ()):
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        original = getattr(owner, attr, None)
        if original is None or getattr(original, "__inflight_refused__", False):
            continue
        setattr(owner, attr, _refusing(f"{module.__name__}.{path}", original))


class _GuardingFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a module in :data:`REFUSED` so that it is guarded once run."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in REFUSED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_and_guard(module):
            run(module)
            guard(module)
        loader.exec_module = exec_and_guard  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Guard the modules of :data:`REFUSED` already imported, and the others as they are imported."""
    if any(isinstance(f, _GuardingFinder) for f in sys.meta_path):
        return
    for name in REFUSED:
        if name in sys.modules:
            guard(sys.modules[name])
    sys.meta_path.insert(0, _GuardingFinder())
