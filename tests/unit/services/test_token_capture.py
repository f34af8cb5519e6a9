"""Token capture of the pool's OpenAI endpoint (services/pool/token_capture.py) against fake vLLM outputs: the
sampled ids, their log-probs and versions, for final-only and delta outputs; the session store's bounds."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace

from services.pool.token_capture import CapturedCompletion, CapturingClient, SessionStore, VersionSpan


class Kind(Enum):
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Params:
    output_kind: Kind
    logprobs: int | None = None


@dataclass
class FakeLLM:
    outputs: list
    seen: list = field(default_factory=list)
    model_config: str = "the model config"

    async def generate(self, prompt, params, request_id, **kwargs):
        self.seen.append(params)
        for out in self.outputs:
            yield out


def lp(token: int, value: float, other: int = 99) -> dict:
    return {token: SimpleNamespace(logprob=value), other: SimpleNamespace(logprob=-9.0)}


def out(choices: list, prompt=(1, 2, 3)) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=list(prompt), outputs=choices)


def choice(index: int, ids: list[int], values: list[float], spans=None) -> SimpleNamespace:
    return SimpleNamespace(index=index, token_ids=ids, logprobs=[lp(t, v) for t, v in zip(ids, values, strict=True)],
                           weight_versions=spans)


def span(version: str, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, start=start, end=end)


def run(client: CapturingClient, params: Params) -> None:
    async def drain():
        async for _ in client.generate("prompt", params, "r1"):
            pass
    asyncio.run(drain())


def test_final_only_outputs_are_captured_with_versions():
    llm = FakeLLM([out([choice(1, [7, 8], [-0.5, -1.0], [span("3", 0, 1), span("4", 1, 2)]),
                        choice(0, [5], [-0.25], [span("3", 0, 1)])])])
    client = CapturingClient(llm)
    params = Params(Kind.FINAL_ONLY)
    run(client, params)
    assert params.logprobs is None and llm.seen[0].logprobs == 0  # asked of vLLM, the caller's params untouched
    assert client.model_config == "the model config"  # everything else is the engine's
    got = client.take("r1")
    assert got.prompt_token_ids == [1, 2, 3] and [c.token_ids for c in got.in_order()] == [[5], [7, 8]]
    assert got.in_order()[1].logprobs == [-0.5, -1.0] and got.in_order()[1].versions() == [3, 4]
    assert got.in_order()[1].spans == [VersionSpan(3, 0, 1), VersionSpan(4, 1, 2)]
    assert client.take("r1") == CapturedCompletion("r1")  # taken once


def test_delta_outputs_accumulate_and_keep_the_callers_logprobs():
    llm = FakeLLM([out([choice(0, [5], [-0.5])]), out([choice(0, [6, 7], [-1.0, -2.0], [span("2", 0, 3)])])])
    client = CapturingClient(llm)
    run(client, Params(Kind.DELTA, logprobs=2))
    assert llm.seen[0].logprobs == 2
    (c,) = client.take("r1").in_order()
    assert c.token_ids == [5, 6, 7] and c.logprobs == [-0.5, -1.0, -2.0] and c.versions() == [2, 2, 2]


def test_missing_labels_and_logprobs():
    bare = SimpleNamespace(index=0, token_ids=[4, 5], logprobs=[{}, None], weight_versions=[span("default", 0, 1)])
    client = CapturingClient(FakeLLM([out([bare])]))
    run(client, Params(Kind.FINAL_ONLY))
    (c,) = client.take("r1").in_order()
    assert all(math.isnan(v) for v in c.logprobs) and c.versions() == [-1, -1]


def test_session_store_bounds():
    store = SessionStore(max_sessions=2, max_per_session=2)
    for s, r in (("a", "1"), ("a", "2"), ("a", "3"), ("b", "4"), ("c", "5")):
        store.add(s, CapturedCompletion(r))
    assert store.take("a") == []  # pushed out by b and c (its 2 kept ones count as dropped, and the refused one)
    assert store.dropped == 3 and [c.request_id for c in store.take("b")] == ["4"]
    assert [c.request_id for c in store.take("c")] == ["5"] and store.take("c") == []
