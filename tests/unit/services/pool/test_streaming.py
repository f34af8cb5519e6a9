"""services/pool/streaming.py: a streamed answer whose caller leaves closes its body generator at once (the pool's
relay counts the hang-up and cancels the engine's call in its ``finally``), not when the garbage collector finds it."""
from __future__ import annotations

import asyncio

from services.pool.streaming import ClosingStreamingResponse


def body(closed: list[str]):
    async def chunks():
        try:
            yield b"data: first\n\n"
            yield b"data: second\n\n"
            closed.append("ended")
        finally:
            closed.append("closed")
    return chunks()


async def _caller_leaves_after_the_first_chunk(spec_version: str, cancel: bool) -> list[str]:
    closed: list[str] = []
    gen = body(closed)  # held here, so only the response can close it
    first = asyncio.Event()

    async def receive():
        await first.wait()
        if cancel:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message.get("body"):
            first.set()
            await asyncio.Event().wait()  # the caller reads no more

    call = ClosingStreamingResponse(gen, media_type="text/event-stream")(
        {"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)
    task = asyncio.ensure_future(call)
    await first.wait()
    if cancel:  # Serve cancels the handler's task when the caller hangs up
        task.cancel()
    try:
        await asyncio.wait_for(task, 10)
    except asyncio.CancelledError:
        pass
    assert gen is not None
    return list(closed)  # before asyncio.run's end closes every generator left open


def test_a_caller_that_disconnects_closes_the_body_at_once():
    assert asyncio.run(_caller_leaves_after_the_first_chunk("2.0", cancel=False)) == ["closed"]


def test_a_cancelled_answer_closes_the_body_at_once():
    assert asyncio.run(_caller_leaves_after_the_first_chunk("2.4", cancel=True)) == ["closed"]


def test_an_answer_read_to_its_end_runs_the_body_to_its_end():
    closed: list[str] = []
    sent: list[bytes] = []

    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(ClosingStreamingResponse(body(closed))(scope, receive, send))
    assert closed == ["ended", "closed"] and b"data: second\n\n" in sent
