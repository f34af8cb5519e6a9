"""The trajectory channel: pool engines -> learner job, as protocol bytes.

A small async queue actor holds msgpack-encoded :class:`protocol.TrajectoryGroup`
bytes by value: senders (the engines) enqueue, the one reader (the learner job)
dequeues a message at a time. The learner job creates the actor, so it dies with
the job, and :meth:`TrajectoryChannel.close` kills it; an accepted message lives
in the actor until read, so it survives its sender.

Bounds: at most ``maxsize`` messages are held, so a slow reader back-pressures
the engines; every wait has a timeout (:class:`ChannelTimeout`), and any call on
a closed channel raises :class:`ChannelClosed`. Why this transport and not
Compiled Graph channels, a streaming generator or object references, with the
measurements: docs/channel.md (``bench/channel.py``).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Extra time allowed for the queue actor to answer beyond the wait it was asked to make.
RPC_GRACE_S = 10.0


class ChannelTimeout(TimeoutError):
    """A send or receive on the trajectory channel did not complete in time."""


class ChannelClosed(RuntimeError):
    """The channel was closed (its queue actor is gone, e.g. its learner job ended)."""


class _QueueActor:
    """A bounded FIFO of encoded messages (bytes); runs as an async Ray actor."""

    def __init__(self, maxsize: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)

    async def put(self, item: bytes, timeout_s: float) -> bool:
        """Enqueue ``item``; False if there was no room within ``timeout_s``."""
        if self.queue.full():  # (asyncio.wait_for with timeout 0 would not even try)
            try:
                await asyncio.wait_for(self.queue.put(item), timeout_s)
            except TimeoutError:
                return False
        else:
            self.queue.put_nowait(item)
        return True

    async def get(self, timeout_s: float) -> list[bytes]:
        """The next item as ``[item]``, or ``[]`` if none arrived within ``timeout_s``."""
        if self.queue.empty():
            try:
                return [await asyncio.wait_for(self.queue.get(), timeout_s)]
            except TimeoutError:
                return []
        return [self.queue.get_nowait()]

    def size(self) -> int:
        return self.queue.qsize()


QUEUE_ACTOR_ENV = {"MALLOC_ARENA_MAX": "2"}
"""Environment of the queue actor's process. Two glibc malloc arenas instead of one per thread: with the
default, the actor's RSS kept creeping up (~80 B per message through the channel, measured over 16,000
messages) from fragmentation across Ray's threads; with two it is flat after warm-up (docs/channel.md)."""


@functools.cache
def _queue_actor_class():
    import ray

    return ray.remote(num_cpus=0, runtime_env={"env_vars": QUEUE_ACTOR_ENV})(_QueueActor)


@dataclass
class TrajectoryChannel:
    """Handle to one channel; picklable, so it can be given to the engines."""

    actor: Any  # ActorHandle of the _QueueActor (Ray types handle methods only under @ray.method)
    name: str
    maxsize: int

    @classmethod
    def create(cls, name: str, maxsize: int) -> TrajectoryChannel:
        """Start the queue actor (no CPU reserved); it lives as long as the calling job or until ``close``."""
        if maxsize < 1:
            raise ValueError(f"channel {name!r}: maxsize must be >= 1, got {maxsize}")
        return cls(_queue_actor_class().remote(maxsize), name, maxsize)

    # ------------------------------------------------------------------ send
    def send(self, data: bytes, timeout_s: float) -> None:
        """Put one encoded message; waits at most ``timeout_s`` for room."""
        import ray

        with self._bounded_call(timeout_s):
            accepted = ray.get(self.actor.put.remote(data, timeout_s), timeout=timeout_s + RPC_GRACE_S)
        if not accepted:
            raise self._full(timeout_s)

    async def send_async(self, data: bytes, timeout_s: float) -> None:
        """:meth:`send` for async actors (the engines): waits without blocking the event loop."""
        with self._bounded_call(timeout_s):
            accepted = await asyncio.wait_for(self.actor.put.remote(data, timeout_s), timeout_s + RPC_GRACE_S)
        if not accepted:
            raise self._full(timeout_s)

    @contextmanager
    def _bounded_call(self, timeout_s: float) -> Iterator[None]:
        """A call on the queue actor: no answer in time (``GetTimeoutError`` and asyncio's timeout are both
        ``TimeoutError``) means the actor is unresponsive; a dead actor means the channel is closed."""
        from ray.exceptions import RayActorError

        try:
            yield
        except TimeoutError:
            raise self._unresponsive(timeout_s) from None
        except RayActorError as exc:
            raise self._closed(exc) from None

    # --------------------------------------------------------------- receive
    def recv(self, timeout_s: float) -> bytes:
        """Take the next encoded message, waiting at most ``timeout_s`` for one to arrive."""
        return self._dequeue(timeout_s)

    def _dequeue(self, timeout_s: float) -> bytes:
        """The next message; ChannelTimeout if none arrives within ``timeout_s``."""
        import ray

        with self._bounded_call(timeout_s):
            items = ray.get(self.actor.get.remote(timeout_s), timeout=timeout_s + RPC_GRACE_S)
        if not items:
            raise ChannelTimeout(f"channel {self.name!r}: nothing arrived for {timeout_s:.1f} s")
        return items[0]

    # ----------------------------------------------------------------- admin
    def size(self) -> int:
        """Messages waiting in the queue."""
        import ray

        with self._bounded_call(0.0):
            return ray.get(self.actor.size.remote(), timeout=RPC_GRACE_S)

    def close(self) -> None:
        """Kill the queue actor: blocked and later sends/receives raise :class:`ChannelClosed`.
        Messages not yet read are dropped. Idempotent."""
        import ray

        ray.kill(self.actor, no_restart=True)  # a no-op for an actor that is already dead

    # ---------------------------------------------------------------- errors
    def _full(self, timeout_s: float) -> ChannelTimeout:
        return ChannelTimeout(f"channel {self.name!r}: no room for {timeout_s:.1f} s (queue full at "
                              f"{self.maxsize}: the reader is not keeping up or is gone)")

    def _unresponsive(self, timeout_s: float) -> ChannelTimeout:
        return ChannelTimeout(f"channel {self.name!r}: the queue actor did not answer within "
                              f"{timeout_s + RPC_GRACE_S:.1f} s")

    def _closed(self, exc: Exception) -> ChannelClosed:
        return ChannelClosed(f"channel {self.name!r} is closed (its queue actor is gone: {type(exc).__name__})")
