"""Fakes of Ray handles for unit tests (no Ray): a Serve DeploymentHandle method and an actor handle method."""
from __future__ import annotations


class Answer:
    """A DeploymentResponse: ``result()`` gives the value or raises the exception."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class ServeMethod:
    """``handle.method.remote(*args)`` like a DeploymentHandle: calls ``fn`` now, answers with an :class:`Answer`."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        try:
            return Answer(self.fn(*args))
        except Exception as exc:  # noqa: BLE001 - raised by result(), as a DeploymentResponse does
            return Answer(exc)


class ActorMethod:
    """``handle.method.remote(*args)`` like a Ray actor handle: the coroutine (or value) ``fn`` returns."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)
