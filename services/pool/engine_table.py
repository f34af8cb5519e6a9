"""What the pool knows of each of its engines: up or down, the version it serves, its process and vLLM start.

One :class:`EngineState` per engine id, made when the engine has booted
(:meth:`EngineTable.mark_up`). An engine the table does not know is *not* up:
dispatch, pushes and readiness only count engines the pool has seen answer.
The health watcher and the weight transports change states; dispatch asks which
engines serve the pool's version.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass


@dataclass
class EngineState:
    """One engine, as the pool last saw it."""

    up: bool = False
    """It answered its last health check (or its boot) and may take work."""
    version: int | None = None
    """The policy version it serves (its last install, or its boot)."""
    pid: int | None = None
    incarnation: str | None = None
    """``<pid>.<vLLM starts>``: changes when its process or its vLLM engine restarts (the weight group is made of
    incarnations)."""
    error: str | None = None
    """Why it is down (None while up)."""


class EngineTable:
    """Engine id -> :class:`EngineState`."""

    def __init__(self) -> None:
        self._states: dict[str, EngineState] = {}

    def __getitem__(self, eid: str) -> EngineState:
        return self._states[eid]

    def __contains__(self, eid: object) -> bool:
        return eid in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def mark_up(self, eid: str, version: int, pid: int | None, incarnation: str | None) -> None:
        """``eid`` answered: up at ``version`` (a new engine enters the table here)."""
        self._states[eid] = EngineState(up=True, version=version, pid=pid, incarnation=incarnation, error=None)

    def mark_down(self, eid: str, error: str) -> None:
        state = self._states.setdefault(eid, EngineState())
        state.up, state.error = False, error

    def set_version(self, eid: str, version: int) -> None:
        """``eid`` installed ``version``."""
        self._states.setdefault(eid, EngineState()).version = version

    def up(self) -> list[str]:
        return [e for e, s in self._states.items() if s.up]

    def incarnations_up(self) -> dict[str, str | None]:
        """Engines that are up -> their incarnation."""
        return {e: s.incarnation for e, s in self._states.items() if s.up}

    def serving(self, version: int) -> list[str]:
        """Engines that are up at ``version``: those that take work."""
        return [e for e, s in self._states.items() if s.up and s.version == version]

    def behind(self, version: int) -> list[str]:
        """Engines that are up but not at ``version`` (restarted; waiting for a push)."""
        return [e for e, s in self._states.items() if s.up and s.version != version]

    def all_serving(self) -> bool:
        """Every engine is up and its version known (and there is at least one)."""
        return bool(self._states) and all(s.up and s.version is not None for s in self._states.values())

    def as_dict(self) -> dict[str, dict]:
        """For ``status`` (JSON)."""
        return {e: asdict(s) for e, s in self._states.items()}
