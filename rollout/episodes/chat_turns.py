"""Environment turns as token ids: the chat template's rendering of new messages, tokenized once (design §7).

A multi-turn trajectory is token-in/token-out: the sampled ids stay exactly as the engine produced them, and
each environment turn is appended as ids. :class:`ChatTurns` renders only the *delta* -- what the model's chat
template writes for the new messages after a history -- and tokenizes that text alone; the history is never
decoded and re-tokenized. The delta is found by rendering a fixed dummy history ending in a unique marker with
and without the new messages and taking the suffix, so any template that renders a conversation as its turns
one after the other works; one that does not is refused with a ``ValueError`` naming the template.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.episodes.environment import Message

MARKER = "\u27e6inflight-sampled-turn\u27e7"
"""The dummy assistant turn's content: finds where the template's text after an assistant message begins."""
_USER = {"role": "user", "content": "\u2026"}


class ChatTurns:
    """Token ids of environment messages for one tokenizer and its chat template (built once per engine).

    Nothing is rendered at construction, so an engine whose model has no chat template still starts; the first
    use renders (and caches) the template's turn-closing text and generation prompt, or raises ``ValueError``."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools
        """The tool schemas passed to ``apply_chat_template(tools=...)``, as the prompt was rendered."""
        self.template_kwargs = dict(template_kwargs or {})
        """Extra ``apply_chat_template`` arguments (``policy.tokenizer.chat_template_kwargs``), as the prompt was
        rendered."""
        self._closing: str | None = None
        self._generation_prompt: list[int] | None = None

    # ------------------------------------------------------------------ public
    def after_turn(self, sampled_ids: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """The environment tokens appended after a sampled assistant turn: the rest of the template's turn-closing
        text (the whole of it unless the last sampled token, e.g. the EOS ``<|im_end|>``, is its start; a turn
        cut at the length limit gets all of it), then ``messages`` as the template renders them after a
        history, ending with the generation prompt."""
        closing = self.closing_text
        rest = closing
        if sampled_ids:
            last = self.tokenizer.decode([int(sampled_ids[-1])], skip_special_tokens=False)
            if last and closing.startswith(last):
                rest = closing[len(last):]
        history = [_USER, {"role": "assistant", "content": MARKER}]
        return self._encode(rest + self._delta(history, messages))

    def opening(self, prompt_ids: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """The prompt of an episode whose ``reset`` gave ``messages``: ``prompt_ids`` without the generation
        prompt it ends with, then ``messages`` rendered after it, ending with the generation prompt.
        ``messages == []``: ``prompt_ids`` unchanged."""
        ids = [int(t) for t in prompt_ids]
        if not messages:
            return ids
        gen = self.generation_prompt_ids
        if len(ids) < len(gen) or ids[len(ids) - len(gen):] != gen:
            raise ValueError(f"chat template of {self._name()}: the prompt ({len(ids)} tokens) does not end with "
                             f"the generation prompt {self._decode(gen)!r} (ids {gen}); a prompt that reset "
                             f"messages follow must be rendered with add_generation_prompt=True")
        return ids[:len(ids) - len(gen)] + self._encode(self._delta([_USER], messages))

    @property
    def closing_text(self) -> str:
        """What the template writes after an assistant message's content (``"<|im_end|>\\n"`` for ChatML)."""
        if self._closing is None:
            history = self._render([_USER, {"role": "assistant", "content": MARKER}], False)
            at = history.rfind(MARKER)
            if at < 0:
                raise ValueError(f"chat template of {self._name()}: an assistant message's content does not "
                                 f"appear in its rendering; cannot tell where a sampled turn ends")
            self._closing = history[at + len(MARKER):]
        return self._closing

    @property
    def generation_prompt_ids(self) -> list[int]:
        """The tokens ``add_generation_prompt=True`` adds after a history (``<|im_start|>assistant\\n``)."""
        if self._generation_prompt is None:
            self._generation_prompt = self._encode(self._suffix(self._render([_USER], False),
                                                                self._render([_USER], True)))
        return list(self._generation_prompt)

    # ------------------------------------------------------------------ helpers
    def _delta(self, history: list[dict[str, str]], messages: Sequence[Message]) -> str:
        """``messages`` as the template renders them after ``history``, with the generation prompt."""
        return self._suffix(self._render(history, False),
                            self._render(history + [m.to_chat() for m in messages], True))

    def _suffix(self, before: str, after: str) -> str:
        if not after.startswith(before):
            raise ValueError(f"chat template of {self._name()}: rendering more messages changes the rendering of "
                             f"the ones before them (it does not render a conversation turn after turn); "
                             f"environment turns cannot be tokenized without re-tokenizing the history. "
                             f"Rendered history: {before[-200:]!r}; with the new messages: {after[-400:]!r}")
        return after[len(before):]

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer of {self._name()}: has no chat template; multi-turn episodes render "
                             f"environment messages with it")
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
        return text

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _name(self) -> str:
        return repr(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__)
