"""A session's earlier answers spliced back into its next prompt as the ids the engine sampled (NeMo-Gym's fix).

An agent that appends ``{"role": "assistant", "content": text}`` has the chat template render the answer's text
again, and text re-tokenizes to other ids than the model sampled; the session's calls would then not extend each
other (:mod:`services.pool.session_episode`). :func:`splice_answers` puts the sampled ids back where the template
rendered the same text (whitespace and undecodable bytes aside), and leaves a prompt whose history the agent
changed as rendered.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from services.pool.token_capture import CapturedCompletion


@dataclass(frozen=True)
class Splice:
    """A rendered prompt with the session's earlier answers put back as sampled, and what was done."""

    prompt_ids: list[int]
    spliced: int
    """Earlier answers whose rendered ids were replaced by the sampled ones."""
    refused: bool
    """Splicing stopped at an earlier answer whose text the prompt changed."""
    stopped: str
    """Why splicing stopped before the last earlier call; "" when every earlier call was gone through."""


def splice_answers(earlier: Sequence[CapturedCompletion], rendered: Sequence[int], stop_ids: Collection[int],
                   decode: Callable[[Sequence[int]], str]) -> Splice:
    """``rendered`` (a new call's prompt ids as the template wrote them) with each answer of the ``earlier`` calls
    of its session (one choice each, taken in order of prompt length; calls of more choices are passed over) that
    the template re-rendered replaced by the ids sampled. An answer is the rendered ids after the call's prompt up
    to the first of ``stop_ids`` (the end of turn); it is replaced when its ``decode``-d text equals the sampled
    answer's (without its stop id), all whitespace and U+FFFD removed. Stops, leaving the rest as rendered, at an answer
    whose text differs or a call whose prompt the new one does not begin with (an edited history). Never raises."""
    ids = list(rendered)
    spliced = 0
    ordered = sorted((c for c in earlier if len(c.choices) == 1), key=lambda c: len(c.prompt_token_ids))
    for k, call in enumerate(ordered):
        prompt = list(call.prompt_token_ids)
        (choice,) = call.choices.values()
        sampled = list(choice.token_ids)
        if ids[:len(prompt) + len(sampled)] == prompt + sampled:
            continue
        if ids[:len(prompt)] != prompt:
            return Splice(ids, spliced, False, f"the prompt does not begin with earlier call {k}'s (an edited history)")
        end = next((j for j in range(len(prompt), len(ids)) if ids[j] in stop_ids), len(ids))
        ended = bool(sampled) and sampled[-1] in stop_ids
        answer = sampled[:-1] if ended else sampled
        if _bare(decode(ids[len(prompt):end])) != _bare(decode(answer)):
            return Splice(ids, spliced, True, f"earlier call {k}'s answer came back as other text (an edited answer)")
        ids = prompt + sampled + ids[end + 1 if ended else end:]
        spliced += 1
    return Splice(ids, spliced, False, "")


def _bare(text: str) -> str:
    """``text`` without whitespace (a tool call's JSON comes back with other spacing) and U+FFFD (bytes that form no
    character: an answer's text leaves out the unfinished character it ends with, and text renders one as 3 bytes)."""
    return "".join(text.split()).replace("\ufffd", "")
