"""A streamed HTTP answer that closes its body generator however the answer ends.

Starlette's ``StreamingResponse`` stops iterating its body when the caller disconnects but leaves the generator
suspended where it yielded; its ``finally`` (the pool's relay gives the request's place back, counts it hung up
and cancels the engine's call there) then waits for the garbage collector. :class:`ClosingStreamingResponse`
closes the generator as soon as the response returns or is cancelled.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` over an async generator, closed (``aclose``) when the response ends."""

    def __init__(self, body: AsyncGenerator[Any, None], **kwargs: Any):
        super().__init__(body, **kwargs)
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
