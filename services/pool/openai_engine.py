"""The pool's OpenAI-compatible chat completions, engine side: vLLM's own chat serving around the engine's AsyncLLM.

:class:`ChatServer` builds vLLM's ``OpenAIServingChat`` (and the renderer and model list it needs) around the
``AsyncLLM`` the engine already runs, so a request is rendered with the model's chat template and the recipe's
``chat_template_kwargs``, and its output read by vLLM's tool-call and reasoning parsers exactly as ``vllm serve``
does; the requests share the engine (and its in-flight weight installs) with the training groups.

:meth:`ChatServer.complete` answers one request body as a :class:`ChatHead` followed by the body: one JSON text,
or the SSE chunks of a stream. Every token's policy version is recorded from the engine's labels
(``CompletionOutput.weight_versions``) by a thin wrapper of the engine client; an
answer carries them as ``policy_versions`` (per choice, spans of output tokens; in a stream, on the chunk where
the choice finishes), and every answer
says in its head the version served when it was admitted. The tokens themselves are captured
(:mod:`services.pool.token_capture`) and kept per rollout session. In a session, the rendered prompt has the
session's earlier answers put back as the ids this engine sampled (:mod:`services.pool.session_splice`) before
vLLM sizes and generates it: vLLM's ``render_chat_request`` is wrapped on the serving instance.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

from rollout.config import ServingChatKwargs
from services.pool.session_splice import splice_answers
from services.pool.token_capture import CapturedChoice, CapturedCompletion, CapturingClient, SessionStore

_SESSION: ContextVar[str | None] = ContextVar("inflight_chat_session", default=None)
"""The rollout session of the request :meth:`ChatServer.complete` is having vLLM render (None: none)."""


@dataclass(frozen=True)
class ChatHead:
    """The first item of an answer: its HTTP status, whether the body is an SSE stream, and the policy version
    the engine served when the request was admitted."""

    status: int
    stream: bool
    version: int


class ChatServer:
    """vLLM's chat-completion serving over one engine's ``AsyncLLM`` (see the module docstring)."""

    def __init__(self, llm: Any, model_path: str, model_name: str, kwargs: ServingChatKwargs,
                 chat_template_kwargs: dict[str, Any], version: Callable[[], int]):
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        self.client = CapturingClient(llm)
        self.sessions = SessionStore()
        self.version = version
        self.answers_spliced = 0
        """Earlier answers of a session put back into a later prompt as the ids sampled."""
        self.splice_refused = 0
        """Earlier answers a later prompt of their session gave back as other text (an edited answer; as rendered)."""
        self._tokenizer = llm.renderer.tokenizer
        self._stop_ids = _end_of_turn_ids(llm)
        models = OpenAIServingModels(engine_client=self.client,  # pyright: ignore[reportArgumentType]
                                     base_model_paths=[BaseModelPath(name=model_name, model_path=model_path)])
        auto, tools, reasoning = kwargs.enable_auto_tools, kwargs.tool_parser, kwargs.reasoning_parser or ""
        template_kwargs = dict(chat_template_kwargs) or None
        renderer = OnlineRenderer(llm.model_config, llm.renderer, request_logger=None, chat_template=None,
                                  chat_template_content_format="auto", default_chat_template_kwargs=template_kwargs,
                                  enable_auto_tools=auto, tool_parser=tools, reasoning_parser=reasoning)
        self.chat = OpenAIServingChat(self.client, models, "assistant",  # pyright: ignore[reportArgumentType]
                                      online_renderer=renderer, request_logger=None, chat_template=None,
                                      chat_template_content_format="auto", default_chat_template_kwargs=template_kwargs,
                                      enable_auto_tools=auto, tool_parser=tools, reasoning_parser=reasoning)
        self._render = self.chat.render_chat_request
        self.chat.render_chat_request = self._render_spliced

    async def complete(self, raw: bytes, session: str | None = None) -> AsyncIterator[ChatHead | str]:
        """Answer one ``/v1/chat/completions`` body: a :class:`ChatHead`, then the JSON body or the SSE chunks.
        In a rollout ``session``, the tokens served are kept for the trainer (:meth:`take_session`)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.utils import random_uuid

        version = self.version()
        try:
            request = ChatCompletionRequest.model_validate_json(raw)
        except ValidationError as err:
            why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
            yield ChatHead(400, False, version)
            yield json.dumps(_error(400, why[:2000], "BadRequestError"))
            return
        request.request_id = random_uuid()
        rid = f"chatcmpl-{request.request_id}"
        in_session = _SESSION.set(session)
        try:
            result = await self.chat.create_chat_completion(request, None)
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape (vLLM's mapping); the engine goes on
            result = create_error_response(exc)
        finally:
            _SESSION.reset(in_session)
        if isinstance(result, ErrorResponse):
            self.client.take(rid)
            yield ChatHead(result.error.code, False, version)
            yield result.model_dump_json()
            return
        if isinstance(result, ChatCompletionResponse):
            body = result.model_dump()
            for c in body.get("choices", ()):
                _name_reasoning(c.get("message") or {})
            body["policy_versions"] = [[asdict(s) for s in c.spans] for c in self._captured(rid, session)]
            yield ChatHead(200, False, version)
            yield json.dumps(body)
            return
        yield ChatHead(200, True, version)
        try:
            async for chunk in result:
                yield self._with_versions(chunk, rid)
        finally:
            self._captured(rid, session)

    async def _render_spliced(self, request: Any) -> Any:
        """vLLM's ``render_chat_request``, then, in a session, each token prompt (``TokensInput``) with the earlier
        answers of the session this engine served put back as sampled: what vLLM sizes, generates and the capture
        records. Its text (and the text's offsets) no longer match and are dropped; multimodal inputs are left."""
        result = await self._render(request)
        session = _SESSION.get()
        earlier = self.sessions.peek(session) if session is not None else []
        if not earlier or not isinstance(result, tuple):
            return result
        for engine_input in result[1]:
            if engine_input["type"] != "token":
                continue
            splice = splice_answers(earlier, engine_input["prompt_token_ids"], self._stop_ids, self._decode)
            self.answers_spliced += splice.spliced
            self.splice_refused += splice.refused
            if splice.spliced:
                engine_input["prompt_token_ids"] = splice.prompt_ids
                engine_input.pop("prompt", None)
                engine_input.pop("prompt_token_offsets", None)
        return result

    def _decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` as an answer shows it (special tokens left out)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def _with_versions(self, chunk: str, rid: str) -> str:
        """An SSE chunk of ``rid`` in which choices finish, with each one's ``policy_versions`` (the spans of its
        output tokens, as a plain answer carries them), reasoning also as ``reasoning_content``; other chunks as
        they are."""
        if not chunk.startswith("data: {"):
            return chunk  # "data: [DONE]"
        body = json.loads(chunk[len("data: "):])
        named = [_name_reasoning(c.get("delta") or {}) for c in body.get("choices", ())]
        finishing = [c for c in body.get("choices", ()) if c.get("finish_reason")]
        if not finishing:
            return f"data: {json.dumps(body)}\n\n" if any(named) else chunk
        captured = self.client.captured.get(rid)
        for c in finishing:
            choice = captured.choices.get(c["index"]) if captured is not None else None
            c["policy_versions"] = [asdict(s) for s in choice.spans] if choice is not None else []
        return f"data: {json.dumps(body)}\n\n"

    def _captured(self, rid: str, session: str | None) -> list[CapturedChoice]:
        """The choices captured for ``rid``, kept under ``session`` if there is one."""
        completion = self.client.take(rid)
        if session is not None and completion.choices:
            self.sessions.add(session, completion)
        return completion.in_order()

    def take_session(self, session: str) -> list[CapturedCompletion]:
        """The completions served in ``session`` on this engine, in the order they finished (forgotten here)."""
        return self.sessions.take(session)


def _name_reasoning(message: dict[str, Any]) -> bool:
    """Give a message's (or delta's) ``reasoning`` (vLLM 0.32's name) also as ``reasoning_content`` (the name of
    DeepSeek's API and of vLLM before 0.32, which agents read); whether it had any."""
    if message.get("reasoning") is None:
        return False
    message["reasoning_content"] = message["reasoning"]
    return True


def _end_of_turn_ids(llm: Any) -> set[int]:
    """The ids that end the model's answers, as vLLM stops on them: the tokenizer's end of sequence and the
    generation config's ``eos_token_id`` (one id or a list)."""
    ids = {llm.renderer.get_eos_token_id()}
    configured = llm.model_config.try_get_generation_config().get("eos_token_id")
    ids.update([configured] if isinstance(configured, int) else configured or ())
    return {i for i in ids if i is not None}


def _error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
