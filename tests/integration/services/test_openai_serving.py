"""OpenAI-compatible serving from a live CPU pool (issue 38, item 1), driven by the official ``openai`` client. A
one-engine pool of the tiny model (its chat template writes Qwen2.5's tool turns) is deployed with
``policy.generation.vllm_cfg.expose_http_server`` and the hermes tool parser. The client, unchanged, lists the model,
chats (``n``, ``temperature`` / ``top_p``, ``stop``, ``max_tokens``, log-probs), streams, calls a named tool and has
its reasoning split from its answer; every answer says the policy version that served it. Malformed requests (the
ingress's checks and vLLM's) and a wrong key get OpenAI-shaped errors, which the client raises as its usual
exceptions. A rollout session's calls become one trajectory: a plain agent loop's answers, which the template renders
back to other ids, are spliced back as sampled; an edited answer is refused. The pool:
tests/integration/services/openai_pool.py.
"""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from openai_pool import MESSAGES, POOL_NAME, TOKEN, WEATHER
from test_pool_and_loops import scrape

from services.pool.openai_api import serving_key


def test_models_and_chat(served):
    recipe, _, client = served
    (model,) = client.models.list().data
    assert model.id == recipe.policy.model_name and model.model_extra["policy_version"] == 0
    raw = client.chat.completions.with_raw_response.create(
        model=model.id, messages=MESSAGES, n=2, max_tokens=6, temperature=0.8, top_p=0.9, stop=["\n\n"],
        logprobs=True, top_logprobs=2)
    assert raw.headers["x-inflight-policy-version"] == "0" and raw.headers["x-inflight-engine"].endswith("-0")
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1]
    versions = completion.model_extra["policy_versions"]
    assert len(versions) == 2
    for choice, spans in zip(completion.choices, versions, strict=True):
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        tokens = choice.logprobs.content
        assert 1 <= len(tokens) <= 6 and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
        assert spans == [{"version": 0, "start": 0, "end": len(tokens)}]  # every token sampled by version 0
    assert completion.usage.completion_tokens == sum(len(c.logprobs.content) for c in completion.choices)


def test_streaming(served):
    recipe, _, client = served
    stream = client.chat.completions.create(model=recipe.policy.model_name, messages=MESSAGES, n=2, max_tokens=5,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True)
    text, finished, usage, tokens, versions = {0: "", 1: ""}, {}, None, {0: 0, 1: 0}, {}
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            if c.finish_reason:
                finished[c.index] = c.finish_reason
                versions[c.index] = c.model_extra["policy_versions"]
            else:
                assert "policy_versions" not in c.model_extra  # only where the choice finishes
    assert set(finished) == {0, 1} and usage is not None
    assert usage.completion_tokens == tokens[0] + tokens[1] and 2 <= usage.completion_tokens <= 10
    assert versions == {i: [{"version": 0, "start": 0, "end": tokens[i]}] for i in (0, 1)}


def test_reasoning_comes_apart_from_the_answer(served):
    """The recipe's ``reasoning_parser`` (granite here: its marks are text, which the tiny model's tokenizer can
    write when a regex constrains the answer) splits the thinking from the answer, plain and streamed, under
    vLLM's name ``reasoning`` and the older ``reasoning_content``. Both requests carry one seed, so the streamed
    one samples the same tokens."""
    recipe, _, client = served
    ask = {"model": recipe.policy.model_name, "messages": MESSAGES, "max_tokens": 60, "seed": 11, "extra_body": {
        "structured_outputs": {"regex": "Here is my thought process: [a-z]{2,6} Here is my response: [a-z]{2,6}"}}}
    message = client.chat.completions.create(**ask).choices[0].message
    thought = message.model_extra["reasoning"]
    assert re.fullmatch(r" ?[a-z]{2,6} ?", thought) and message.model_extra["reasoning_content"] == thought
    assert re.fullmatch(r" ?[a-z]{2,6}", message.content or ""), message
    streamed = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            for key in streamed:
                streamed[key] += (c.delta.content if key == "content" else c.delta.model_extra.get(key)) or ""
    # vLLM's streamed granite parser cuts the marks by delta: a busy engine merges tokens into one delta (its output
    # collector), and then the streamed thought may lose its first letters ("r " for a longer thought) or keep the
    # tail of a mark around it ("ss: repeat Here" for " repeat "; both seen in fresh-clone CI runs beside the other
    # xdist worker). So one streamed word must be the thought, or its end.
    assert streamed["reasoning"] == streamed["reasoning_content"], streamed
    streamed_thought = streamed["reasoning"].split()
    assert any(thought.strip().endswith(word) for word in streamed_thought), (thought, streamed)
    assert streamed["content"] == message.content, (message, streamed)  # the same answer, apart from the thought


def test_named_tool_call(served):
    recipe, _, client = served
    completion = client.chat.completions.create(
        model=recipe.policy.model_name, max_tokens=64, temperature=0.0, tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = completion.choices[0].message
    if message.tool_calls:  # the JSON was finished within max_tokens: parsed by the hermes parser
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris",
                                                                                                         "Oslo")
    else:  # the random model pads the constrained JSON with whitespace past max_tokens: unparsed, but forced
        assert completion.choices[0].finish_reason == "length"
        assert re.match(r'<tool_call>\s*\{"name": "get_weather", "arguments": \{', message.content), message.content
    auto = client.chat.completions.create(model=recipe.policy.model_name, max_tokens=8, tools=[WEATHER],
                                          tool_choice="auto", messages=[{"role": "user", "content": "Hi"}])
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # the parser read the answer


def test_errors_are_openai_shaped(served):
    recipe, url, client = served
    model = recipe.policy.model_name
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="messages"):  # the ingress's check
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError, match="n: expected 1..64"):
        client.chat.completions.create(model=model, messages=MESSAGES, n=1000)
    with pytest.raises(openai.BadRequestError):  # vLLM's own validation
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1.0, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json",
                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)  # the admin token works too
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}


def test_rollout_session_captures_tokens(served):
    """Token capture (issue 38, item 2, its core): a session's calls are kept as the sampled token ids, their
    log-probs and per-token versions, exactly what the answer reported, never re-tokenized."""
    from services import pool as pool_api

    recipe, _, client = served
    session = {"x-inflight-session": "episode-7"}
    answer = client.chat.completions.create(model=recipe.policy.model_name, messages=MESSAGES, n=2, max_tokens=6,
                                            logprobs=True, extra_headers=session)
    streamed = client.chat.completions.create(model=recipe.policy.model_name, messages=MESSAGES, max_tokens=5,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_headers=session)
    usage = [c.usage for c in streamed if c.usage][-1]
    plain = client.chat.completions.create(model=recipe.policy.model_name, messages=MESSAGES, max_tokens=3)
    handle = pool_api.connect(POOL_NAME)
    first, second = handle.take_session.remote("episode-7").result(timeout_s=30)
    assert handle.take_session.remote("episode-7").result(timeout_s=30) == []  # taken once
    assert plain.choices and first.prompt_token_ids == second.prompt_token_ids != []
    for choice, captured in zip(answer.choices, first.in_order(), strict=True):
        assert captured.logprobs == [t.logprob for t in choice.logprobs.content]
        assert len(captured.token_ids) == len(captured.logprobs) and captured.versions() == [0] * len(captured.logprobs)
    (only,) = second.in_order()  # the streamed call: the caller asked no log-probs, the capture has them
    assert len(only.token_ids) == len(only.logprobs) == usage.completion_tokens
    assert all(lp <= 0 for lp in only.logprobs) and only.versions() == [0] * usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="x-inflight-session"):
        client.chat.completions.create(model=recipe.policy.model_name, messages=MESSAGES, max_tokens=3,
                                       extra_headers={"x-inflight-session": "no spaces"})


HANG_UP_N, HANG_UP_TOKENS = 16, 900
"""A request its caller leaves: n answers of max_tokens each, ``ignore_eos``, so that vLLM would sample exactly
n x max_tokens tokens (seconds on 2 cores) unless it aborts the request."""


def test_a_caller_that_hangs_up_stops_its_request_and_gives_its_place_back(served):
    """A caller that leaves (a read timeout on a plain answer; a stream closed after its first chunk) has its request
    aborted in vLLM: the engine has no request left unfinished and sampled fewer than n x max_tokens tokens for it.
    Its place among the pool's vllm_cfg.max_num_seqs is given back, counted as hung up (a plain answer's place
    was never given back before: after max_num_seqs hang-ups every request got a 429)."""
    import time

    import ray

    recipe, url, client = served
    model = recipe.policy.model_name
    eid = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES,
                                                           max_tokens=1).headers["x-inflight-engine"]
    engine = ray.get_actor(eid, namespace="inflight")
    body = {"model": model, "messages": MESSAGES, "n": HANG_UP_N, "max_tokens": HANG_UP_TOKENS, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {serving_key(TOKEN)}"}
    hung_up_before = _openai_requests(url).get("hung_up", 0.0)
    for stream in (False, True):
        before = ray.get(engine.stats.remote(), timeout=30).counters.kv.vllm_generated_tokens
        if stream:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                              timeout=60) as answer:
                assert answer.status_code == 200
                next(answer.iter_lines())  # the first chunk; leaving the block hangs up
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                           timeout=httpx.Timeout(60, read=1.0))
        deadline = time.monotonic() + 60
        while (stats := ray.get(engine.stats.remote(), timeout=30).counters).vllm_unfinished_requests:
            assert time.monotonic() < deadline, f"stream={stream}: the engine still runs the request: {stats}"
            time.sleep(0.2)
        sampled = stats.kv.vllm_generated_tokens - before
        assert 0 < sampled < HANG_UP_N * HANG_UP_TOKENS, (stream, sampled)
    after = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length")
    assert _openai_requests(url)["hung_up"] - hung_up_before == 2
    (running,) = scrape(url)["inflight_openai_requests_running"]
    assert running.value == 0, "a place is still held by a request whose caller left"


def _openai_requests(url: str) -> dict[str, float]:
    """``inflight_openai_requests_total`` by outcome."""
    return {s.labels["outcome"]: s.value for s in scrape(url)["inflight_openai_requests"] if s.name.endswith("_total")}


def test_a_session_becomes_a_trajectory_and_an_edited_history_is_refused(served):
    """Through the real engine's capture (issue 38, item 2): a one-call session is laid out as its trajectory with
    the engine's own ids, log-probs and versions; a second call whose history rewrites the first answer is refused
    at the first token of the rewrite, never re-tokenized."""
    from services import pool as pool_api
    from services.pool.session_episode import SessionBroken, session_episode

    recipe, _, client = served
    handle = pool_api.connect(POOL_NAME)
    model = recipe.policy.model_name
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                           extra_headers={"x-inflight-session": "one-call"})
    (captured,) = handle.take_session.remote("one-call").result(timeout_s=30)
    episode = session_episode([captured], reward=1.0)
    t = episode.trajectory
    assert episode.prompt_ids == captured.prompt_token_ids and t.loss_mask.tolist() == [1] * len(t.response_ids)
    assert t.logprobs.tolist() == pytest.approx([x.logprob for x in first.choices[0].logprobs.content], abs=1e-6)
    assert set(t.versions.tolist()) == {0} and t.finish_reason == first.choices[0].finish_reason

    edited = [*MESSAGES, {"role": "assistant", "content": "An answer the model never gave."},
              {"role": "user", "content": "And then?"}]
    for messages in (MESSAGES, edited):
        client.chat.completions.create(model=model, messages=messages, max_tokens=3,
                                       extra_headers={"x-inflight-session": "edited"})
    calls = handle.take_session.remote("edited").result(timeout_s=30)
    with pytest.raises(SessionBroken, match=r"call 1's prompt does not extend the episode so far") as broken:
        session_episode(calls, reward=1.0)
    at = int(re.search(r"differs at token (\d+)", str(broken.value)).group(1))
    assert at >= len(calls[0].prompt_token_ids)  # the shared history matched; the rewritten answer did not


def test_a_plain_agent_loops_re_rendered_answers_are_spliced_into_one_trajectory(served):
    """An agent written against OpenAI's API appends each answer as text; the template renders it back to other
    ids than the random model sampled (checked against the template's own rendering). The engine puts the sampled
    ids back into the next prompt, so the session is one trajectory: its sampled tokens are each call's, byte for
    byte, and between them are what the template added (the end of turn where the answer had none, the user's
    next message, the assistant's turn)."""
    from transformers import AutoTokenizer

    from services import pool as pool_api
    from services.models.source import resolve_model
    from services.pool.session_episode import session_episode

    recipe, url, client = served
    model = recipe.policy.model_name
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    messages, sent, users = list(MESSAGES), [], ["Go on.", "And then?"]
    for seed in range(3):
        sent.append(list(messages))
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=seed,
                                                extra_headers={"x-inflight-session": "agent-loop"})
        if seed < len(users):
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": users[seed]}]
    calls = pool_api.connect(POOL_NAME).take_session.remote("agent-loop").result(timeout_s=30)
    calls.sort(key=lambda c: len(c.prompt_token_ids))
    rendered = [tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False) for m in sent]
    assert rendered[0] == calls[0].prompt_token_ids  # the engine renders as the template does
    assert any(r != c.prompt_token_ids for r, c in zip(rendered[1:], calls[1:], strict=True)), \
        "every answer was rendered back to its sampled ids: the splice was not exercised"

    trajectory = session_episode(calls, reward=1.0).trajectory
    sampled = [c.in_order()[0].token_ids for c in calls]
    ids, mask = trajectory.response_ids.tolist(), trajectory.loss_mask.tolist()
    assert [i for i, m in zip(ids, mask, strict=True) if m == 1] == sum(sampled, [])
    added = [calls[k + 1].prompt_token_ids[len(calls[k].prompt_token_ids) + len(sampled[k]):] for k in range(2)]
    assert [i for i, m in zip(ids, mask, strict=True) if m == 0] == sum(added, [])
    for k, user in enumerate(users):
        end = "" if sampled[k][-1] == tokenizer.eos_token_id else "<|im_end|>"
        assert tokenizer.decode(added[k]) == f"{end}\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    spliced = sum(r != c.prompt_token_ids for r, c in zip(rendered[1:], calls[1:], strict=True))
    deadline = time.monotonic() + 60
    while _spliced(url) < spliced and time.monotonic() < deadline:  # engine stats reach /metrics each period
        time.sleep(1)
    assert _spliced(url) >= spliced, "the splices are not counted on /metrics"


def _spliced(url: str) -> float:
    """``inflight_openai_answers_spliced_total``."""
    return sum(s.value for s in scrape(url).get("inflight_openai_answers_spliced", []) if s.name.endswith("_total"))

