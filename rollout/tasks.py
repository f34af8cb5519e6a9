"""Built-in prompt sets (``data.dataset_name``): deterministic prompt sets for the shipped rewards.

``make_prompts(task, tokenizer, num_prompts, seed)`` returns
:class:`protocol.PromptRequest` s built with the tokenizer's chat template,
whose ``task`` dict carries what the matching reward needs; the same seed
gives the same prompts (``prompt_id`` is ``f"{task}-{i}"``; the validation
split, ``split="val"``, draws from another stream and its ids are
``f"val:{task}-{i}"``). Tasks:
``repeat_letter`` ("Repeat the letter i.", reward ``repeat_letter``) and
``arithmetic`` ("What is a plus b?", rewards ``math_exact`` / ``format``);
docs/rollout.md ("The toy task") says why the letter task is built as it is.
"""
from __future__ import annotations

import random
import string

import numpy as np

from protocol import PromptRequest

TASKS = ("repeat_letter", "arithmetic")
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


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    """Token ids of one user turn through the chat template, ready for the assistant's answer."""
    return chat_ids(tokenizer, [{"role": "user", "content": content}])


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat turns ``[{role, content}]`` through the model's chat template, ready for the
    assistant's answer (``add_generation_prompt=True``)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"apply_chat_template returned {type(ids).__name__}, expected a list of token ids")
    return ids


SPLITS = ("train", "val")


def make_prompts(task: str, tokenizer, num_prompts: int, seed: int, split: str = "train") -> list[PromptRequest]:
    """``num_prompts`` prompts of ``task``, the same for the same ``seed``; ``split="val"`` draws them from
    another random stream and prefixes their ids with ``val:`` (they never collide with training ids)."""
    if task not in TASKS:
        raise ValueError(f"data.dataset_name: expected one of {TASKS}, got {task!r}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts: expected >= 1, got {num_prompts}")
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{task}:{seed}" if split == "train" else f"{task}:{split}:{seed}")
    prefix = "" if split == "train" else f"{split}:"
    prompts: list[PromptRequest] = []
    if task == "repeat_letter":
        targets = repeat_targets(tokenizer)
        for i in range(num_prompts):
            letter, token_id, starting = targets[rng.randrange(len(targets))]
            ids = np.asarray(chat_prompt_ids(tokenizer, f"Repeat the letter {letter}."))
            prompts.append(PromptRequest(f"{prefix}{task}-{i}", ids,
                                         {"target": letter, "target_token_id": token_id,
                                          "target_token_ids": ",".join(map(str, starting))}))
    else:
        for i in range(num_prompts):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            ids = np.asarray(chat_prompt_ids(tokenizer, f"What is {a} plus {b}?"))
            prompts.append(PromptRequest(f"{prefix}{task}-{i}", ids,
                                         {"answer": a + b}))
    return prompts
