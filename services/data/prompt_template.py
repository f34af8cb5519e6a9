"""How a row's prompt becomes token ids: ``data.prompt_file`` (a template with one ``{}``), ``data.system_prompt_file``
(a system turn) and the model's own chat template (``apply_chat_template(..., add_generation_prompt=True)``).

The template is applied with ``str.format`` (NeMo-RL's rule: literal braces are written ``{{`` / ``}}``) to the text
of ``data.input_key``; a row given as chat turns (``data.messages_key``) is used as is, with the system turn put
first when the row has none.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.data.tasks import chat_ids


def read_template(path: str | None) -> str | None:
    """The text of ``data.prompt_file``, checked to hold exactly one ``{}`` field (None: no template)."""
    if path is None:
        return None
    text = _read(path, "data.prompt_file")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        raise ValueError(f"data.prompt_file {path!r}: not a format string ({e}); write literal braces as "
                         f"{{{{ and }}}}") from e
    if fields != [""]:
        raise ValueError(f"data.prompt_file {path!r}: expected exactly one {{}} for the prompt text, found "
                         f"{len(fields)} fields {fields}")
    return text


def read_system_prompt(path: str | None) -> str | None:
    """The text of ``data.system_prompt_file`` (None: no system turn)."""
    return None if path is None else _read(path, "data.system_prompt_file")


def _read(path: str, key: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{key} {path!r}: no such file")
    text = p.read_text()
    if not text.strip():
        raise ValueError(f"{key} {path!r}: the file is empty")
    return text


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for: the longest string in the tokenizer's vocabulary (a byte-level
    token's string has one character per byte, so it is never shorter than the text it decodes to); None for a
    tokenizer without ``get_vocab``. A prompt of more than ``n * max_token_chars`` characters has more than ``n``
    tokens, known without tokenizing it."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    return max((len(t) for t in get_vocab()), default=None)


@dataclass(frozen=True)
class PromptTemplate:
    """Turns a prompt text or chat turns into token ids with the model's chat template."""

    tokenizer: object
    template: str | None = None
    """``data.prompt_file``'s text (one ``{}``), applied to a prompt text."""
    system_prompt: str | None = None
    """``data.system_prompt_file``'s text, the first turn unless a row brings its own system turn."""
    tools: list[dict] | None = None
    """Tool schemas shown by the chat template (``env.<name>.tools``)."""
    template_kwargs: dict[str, Any] | None = None
    """Extra arguments of the chat template (``policy.tokenizer.chat_template_kwargs``, e.g. ``enable_thinking``)."""

    def messages(self, text: str | None = None, turns: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """The chat turns of a prompt text (through the template) or of a row's own turns."""
        if turns is None:
            assert text is not None
            turns = [{"role": "user", "content": self.template.format(text) if self.template else text}]
        if self.system_prompt is not None and not any(t["role"] == "system" for t in turns):
            turns = [{"role": "system", "content": self.system_prompt}, *turns]
        return turns

    def ids(self, text: str | None = None, turns: list[dict[str, str]] | None = None) -> list[int]:
        """Token ids of the prompt, ready for the assistant's answer."""
        return chat_ids(self.tokenizer, self.messages(text, turns), self.tools, self.template_kwargs)
