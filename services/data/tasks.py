"""Built-in prompt sets (``data.dataset_name``): deterministic prompt sets for the shipped rewards.

``make_prompts(task, tokenizer, num_prompts, seed)`` returns
:class:`protocol.PromptRequest` s built with the tokenizer's chat template,
whose ``task`` dict carries what the matching reward needs; the same seed
gives the same prompts (``prompt_id`` is ``f"{task}-{i}"``; the validation
split, ``split="val"``, draws from another stream and its ids are
``f"val:{task}-{i}"``). Tasks:
``repeat_letter`` ("Repeat the letter i.", reward ``repeat_letter``) and
``arithmetic`` ("What is a plus b?", rewards ``math_exact`` / ``format``),
``letter_relay`` (the multi-turn game of :class:`rollout.episodes.envs.LetterRelay`: 3 rounds, the same letters as
``repeat_letter``) and ``multi_step_arithmetic`` ("Compute (a + b) * c.", the calculator tool shown through the
chat template's ``tools``; :class:`rollout.episodes.envs.CalculatorArithmetic`, or ``tool_calls`` with ``math_exact``);
docs/rollout.md ("The toy task") says why the letter task is built as it is.
"""
from __future__ import annotations

import random
import string
from collections.abc import Mapping
from typing import Any

import numpy as np

from protocol import PromptRequest
from rollout.episodes.calculator import CALCULATOR
from rollout.episodes.envs.arithmetic import make_problem, problem_text
from rollout.episodes.envs.letter_relay import first_prompt, relay_task

TASKS = ("repeat_letter", "arithmetic", "letter_relay", "multi_step_arithmetic")
RELAY_ROUNDS = 3
"""Rounds of a ``letter_relay`` episode (recipes set ``grpo.max_rollout_turns`` to it)."""
MAX_REPEAT_TARGETS = 2
"""Letters the repeat task draws from (fewer letters: faster visible learning on a tiny model)."""


def repeat_targets(tokenizer) -> list[tuple[str, int, list[int]]]:
    """``(letter, token id of " letter", ids of every token starting with the letter)`` for the letters
    that begin the most tokens, among those whose `` letter`` is a single token."""
    texts = [tokenizer.decode([i]).strip().lower() for i in range(len(tokenizer))]
    candidates = []
    for letter in string.ascii_lowercase:
        ids = tokenizer.encode(" " + letter, add_special_tokens=False)
        if len(ids) == 1:
            starting = [i for i, t in enumerate(texts) if t.startswith(letter)]
            candidates.append((letter, int(ids[0]), starting))
    if len(candidates) < MAX_REPEAT_TARGETS:
        raise ValueError(f"repeat_letter: the tokenizer has {len(candidates)} single-token letters ' a'..' z', "
                         f"the task needs {MAX_REPEAT_TARGETS}")
    candidates.sort(key=lambda c: (-len(c[2]), c[0]))
    return sorted(candidates[:MAX_REPEAT_TARGETS])


def chat_prompt_ids(tokenizer, content: str, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of one user turn through the chat template, ready for the assistant's answer."""
    return chat_ids(tokenizer, [{"role": "user", "content": content}], template_kwargs=template_kwargs)


def chat_ids(tokenizer, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None,
             template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of chat turns ``[{role, content}]`` through the model's chat template, ready for the
    assistant's answer (``add_generation_prompt=True``); ``tools``: the tool schemas the template shows;
    ``template_kwargs``: ``policy.tokenizer.chat_template_kwargs`` (e.g. ``enable_thinking``)."""
    extra = {"tools": tools} if tools else {}  # no tools: the call as before (tokenizer stand-ins lack the keyword)
    extra.update(template_kwargs or {})
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **extra)
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"apply_chat_template returned {type(ids).__name__}, expected a list of token ids")
    return ids


SPLITS = ("train", "val")


def check_template_shows_tools(tokenizer, tools: list[dict[str, Any]],
                               template_kwargs: Mapping[str, Any] | None = None) -> None:
    """``ValueError`` if the chat template renders a prompt the same with and without ``tools`` (it would
    silently hide them from the model)."""
    messages = [{"role": "user", "content": "hi"}]
    kw = dict(template_kwargs or {})
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    if tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw) == plain:
        names = [t.get("function", {}).get("name") for t in tools]
        raise ValueError(f"tools {names}: the model's chat template does not show tools (apply_chat_template "
                         f"ignores tools=); use a model whose template renders them (Qwen2.5, Qwen3, a tiny model "
                         f"built by this version of services/models/tiny_model.py)")


def make_prompts(task: str, tokenizer, num_prompts: int, seed: int, split: str = "train",
                 tools: list[dict[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> list[PromptRequest]:
    """``num_prompts`` prompts of ``task``, the same for the same ``seed``; ``split="val"`` draws them from
    another random stream and prefixes their ids with ``val:`` (they never collide with training ids).
    ``tools``: the tool schemas the chat template shows (``rollout.episodes.env_registry.tool_schemas``); None: the
    task's own (the calculator for ``multi_step_arithmetic``, none otherwise); ``[]``: none. ``template_kwargs``:
    extra arguments of every chat-template call (``policy.tokenizer.chat_template_kwargs``)."""
    if task not in TASKS:
        raise ValueError(f"data.dataset_name: expected one of {TASKS}, got {task!r}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts: expected >= 1, got {num_prompts}")
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{task}:{seed}" if split == "train" else f"{task}:{split}:{seed}")
    prefix = "" if split == "train" else f"{split}:"
    if tools is None and task == "multi_step_arithmetic":
        tools = [CALCULATOR.schema()]
    if tools:
        check_template_shows_tools(tokenizer, tools, template_kwargs)
    tools = tools or None

    def prompt(i: int, text: str, meta: dict) -> PromptRequest:
        ids = np.asarray(chat_ids(tokenizer, [{"role": "user", "content": text}], tools, template_kwargs))
        return PromptRequest(f"{prefix}{task}-{i}", ids, meta)

    prompts: list[PromptRequest] = []
    if task == "repeat_letter":
        targets = repeat_targets(tokenizer)
        for i in range(num_prompts):
            letter, token_id, starting = targets[rng.randrange(len(targets))]
            prompts.append(prompt(i, f"Repeat the letter {letter}.",
                                  {"target": letter, "target_token_id": token_id,
                                   "target_token_ids": ",".join(map(str, starting))}))
    elif task == "letter_relay":
        families = {letter: starting for letter, _, starting in repeat_targets(tokenizer)}
        for i in range(num_prompts):
            letters = [sorted(families)[rng.randrange(len(families))] for _ in range(RELAY_ROUNDS)]
            prompts.append(prompt(i, first_prompt(letters[0]), relay_task(letters, families)))
    elif task == "multi_step_arithmetic":
        for i in range(num_prompts):
            expression, answer = make_problem(rng)
            prompts.append(prompt(i, problem_text(expression), {"answer": answer, "expression": expression}))
    else:
        for i in range(num_prompts):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            prompts.append(prompt(i, f"What is {a} plus {b}?", {"answer": a + b}))
    return prompts
