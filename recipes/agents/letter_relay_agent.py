"""The letter relay as a plain OpenAI-client agent: no Inflight import, only ``openai`` (docs/agents.md).

Three rounds: the agent asks the model to repeat a letter, scores the answer (the share of its tokens whose text
starts with that letter, read from the answer's log-probs), tells the model how it did and names the next letter.
The reward is the mean score over the rounds: what ``environment: letter_relay`` gives, played from outside.
``task["letters"]`` holds the rounds' letters (``"i,o,i"``; the ``letter_relay`` dataset makes them).
Inflight calls ``run(task, client)`` with a client bound to the sample's rollout session.
"""
from __future__ import annotations

MAX_TOKENS = 12
"""Tokens of one answer (the model is told nothing of it; an answer cut there scores what it has)."""


async def run(task: dict, client) -> float:
    letters = [x.strip() for x in str(task["letters"]).split(",")]
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": f"Repeat the letter {letters[0]}."}]
    scores = []
    for k, letter in enumerate(letters):
        answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=1.0, logprobs=True)
        choice = answer.choices[0]
        tokens = [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
        score = sum(t.strip().lower().startswith(letter) for t in tokens) / max(1, len(tokens))
        scores.append(score)
        messages.append({"role": "assistant", "content": choice.message.content or ""})
        if k + 1 < len(letters):
            verdict = "Good." if score >= 0.5 else f"That was not {letter}."
            messages.append({"role": "user", "content": f"{verdict} Now repeat the letter {letters[k + 1]}."})
    return sum(scores) / len(scores)
