"""What the pool knows of each of its engines: its state, the version it serves, its process and vLLM start.

One :class:`EngineState` per engine id, made when the engine has booted
(:meth:`EngineTable.mark_up`), or when a scale-up starts it
(:meth:`EngineTable.mark_starting`). An engine the table does not know is *not*
up: dispatch, pushes and readiness only count engines the pool has seen answer.
The health watcher and the weight transports change states; dispatch asks which
engines serve the pool's version; a scale-down marks engines *draining* and then
forgets them. :meth:`EngineTable.state` names each engine's state for
``/v1/status`` (:meth:`EngineTable.snapshot`), the status table and the
``inflight_engines{state}`` gauge.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Literal

from protocol.pool_replies import EngineStatus

StateName = Literal["starting", "up", "stale", "draining", "down"]
STATES: tuple[StateName, ...] = ("starting", "up", "stale", "draining", "down")
"""``starting``: a scale-up is booting it, it takes no work; ``up``: up at the pool's version, takes work;
``stale``: up at another version (restarted, or new: the model on disk), takes no work until it installs the pool's
version; ``draining``: a scale-down removes it, it takes no new work and finishes or hands back what it has;
``down``: did not answer (restarting)."""


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
    starting: bool = False
    """A scale-up is booting it (not up yet, not counted by readiness)."""
    draining: bool = False
    """A scale-down is removing it: it takes no new work (still up for pushes while it finishes)."""


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

    def mark_starting(self, eid: str) -> None:
        """A scale-up created ``eid`` and boots it."""
        self._states[eid] = EngineState(starting=True)

    def mark_up(self, eid: str, version: int, pid: int | None, incarnation: str | None) -> None:
        """``eid`` answered: up at ``version`` (a new engine enters the table here). A draining engine stays
        draining."""
        draining = eid in self._states and self._states[eid].draining
        self._states[eid] = EngineState(up=True, version=version, pid=pid, incarnation=incarnation, error=None,
                                        draining=draining)

    def mark_down(self, eid: str, error: str) -> None:
        state = self._states.setdefault(eid, EngineState())
        state.up, state.error, state.starting = False, error, False

    def mark_draining(self, eid: str) -> None:
        """A scale-down removes ``eid``: no new work for it from now on."""
        self._states[eid].draining = True

    def forget(self, eid: str) -> None:
        """``eid`` was removed from the pool (or its scale-up failed)."""
        self._states.pop(eid, None)

    def set_version(self, eid: str, version: int) -> None:
        """``eid`` installed ``version``."""
        self._states.setdefault(eid, EngineState()).version = version

    def up(self) -> list[str]:
        """Engines that are up (draining ones too: they install pushes while they finish their batches)."""
        return [e for e, s in self._states.items() if s.up]

    def incarnations_up(self) -> dict[str, str | None]:
        """Engines that are up -> their incarnation."""
        return {e: s.incarnation for e, s in self._states.items() if s.up}

    def serving(self, version: int) -> list[str]:
        """Engines that are up at ``version`` and not draining: those that take work."""
        return [e for e, s in self._states.items() if s.up and s.version == version and not s.draining]

    def behind(self, version: int) -> list[str]:
        """Engines that are up but not at ``version`` (restarted or new; waiting for a push)."""
        return [e for e, s in self._states.items() if s.up and s.version != version]

    def all_serving(self) -> bool:
        """Every engine that is not starting or draining is up and its version known (and there is one)."""
        settled = [s for s in self._states.values() if not s.starting and not s.draining]
        return bool(settled) and all(s.up and s.version is not None for s in settled)

    def state(self, eid: str, version: int) -> StateName:
        """``eid``'s state (:data:`STATES`) against the pool's ``version``."""
        s = self._states[eid]
        if s.starting:
            return "starting"
        if s.draining:
            return "draining"
        if not s.up:
            return "down"
        return "up" if s.version == version else "stale"

    def counts(self, version: int) -> Counter[StateName]:
        """Engines per state against the pool's ``version``."""
        return Counter(self.state(e, version) for e in self._states)

    def snapshot(self, version: int) -> dict[str, EngineStatus]:
        """Each engine as ``status`` shows it, its ``state`` against the pool's ``version``."""
        return {e: EngineStatus(**asdict(s), state=self.state(e, version)) for e, s in self._states.items()}
