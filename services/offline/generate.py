"""``inflight generate``: sample from a model for a quick look, without training or scoring.

    inflight generate --model HF_DIR | --run-dir DIR [--step N] [--recipe PATH] [--prompts FILE] [-n N]
                      [--max-tokens M] [--temperature T]

Each non-empty line of ``--prompts`` (default: stdin) is one prompt, put through the recipe's
``data.prompt_file`` / ``data.system_prompt_file`` and the model's chat template as a run's prompts are
(:class:`services.data.prompt_template.PromptTemplate`). One rollout engine in this process
(:mod:`services.offline.local_engine`) samples ``-n`` answers of each; they are printed plainly, prompt by prompt.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.offline.local_engine import LocalEngineError, pick_model, quiet_libraries, running

if TYPE_CHECKING:
    from protocol import PromptRequest, TrajectoryGroup
    from rollout.rewards.reward_types import RewardInput
    from services.recipe.config import Recipe


def add_generate_command(sub) -> None:
    from services.offline.eval import add_model_arguments

    g = sub.add_parser("generate", help="sample answers to prompts (a file or stdin) from a model, for a look")
    add_model_arguments(g)
    g.add_argument("--prompts", default="-", help="a file with one prompt per line (default: stdin)")
    g.add_argument("-n", "--num-samples", type=int, default=1, help="answers per prompt (default 1)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per answer at most (default: policy.generation.max_new_tokens)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0: greedy (default: policy.generation.temperature)")
    g.set_defaults(func=cmd_generate)


def read_prompts(source: str) -> list[str]:
    """The non-empty lines of ``source`` (a path, or ``-`` for stdin), stripped."""
    if source == "-":
        text = sys.stdin.read()
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise LocalEngineError(f"--prompts {source!r}: no such file")
        text = path.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise LocalEngineError(f"--prompts {'stdin' if source == '-' else repr(source)}: no prompt (one per line)")
    return lines


def check_counts(n: int, max_tokens: int | None, temperature: float | None) -> None:
    """``-n`` >= 1, ``--max-tokens`` >= 1, ``--temperature`` >= 0 (those given)."""
    if n < 1:
        raise LocalEngineError(f"-n: expected >= 1, got {n}")
    if max_tokens is not None and max_tokens < 1:
        raise LocalEngineError(f"--max-tokens: expected >= 1, got {max_tokens}")
    if temperature is not None and temperature < 0:
        raise LocalEngineError(f"--temperature: expected >= 0, got {temperature:g}")


def cmd_generate(args: argparse.Namespace) -> int:
    """A LocalEngineError is one line, exit 2 (services.cli.main)."""
    import numpy as np
    from transformers import AutoTokenizer

    from protocol import PromptRequest
    from services.data.prompt_source import recipe_tools
    from services.data.prompt_template import PromptTemplate, read_system_prompt, read_template

    quiet_libraries(args.verbose)
    check_counts(args.num_samples, args.max_tokens, args.temperature)
    texts = read_prompts(args.prompts)
    choice = pick_model(args.model, args.run_dir, args.step, args.recipe, list(args.overrides),
                        lambda line: print(line, file=sys.stderr, flush=True))
    recipe, d = choice.recipe, choice.recipe.data
    try:
        template = PromptTemplate(AutoTokenizer.from_pretrained(choice.model_dir), read_template(d.prompt_file),
                                  read_system_prompt(d.system_prompt_file), recipe_tools(recipe),
                                  recipe.policy.tokenizer.chat_template_kwargs)
        requests = [PromptRequest(f"prompt-{i}", np.asarray(template.ids(text), np.int32))
                    for i, text in enumerate(texts, 1)]
    except (ValueError, OSError) as err:
        raise LocalEngineError(str(err)) from None
    gen = recipe.policy.generation
    max_tokens = args.max_tokens or gen.max_new_tokens
    temperature = gen.temperature if args.temperature is None else args.temperature
    longest = max(len(r.prompt_ids) for r in requests)
    recipe = with_generation(recipe, max_tokens)
    groups = asyncio.run(_sample(recipe, choice.model_dir, requests, args.num_samples, temperature,
                                 max(recipe.policy.max_total_sequence_length, longest + max_tokens)))
    for i, (text, group) in enumerate(zip(texts, groups, strict=True), 1):
        print(f"=== prompt {i}: {text}")
        for line in sample_lines(group):
            print(line)
    return 0


def with_generation(recipe: Recipe, max_tokens: int) -> Recipe:
    """``recipe`` with ``policy.generation.max_new_tokens`` set to ``max_tokens``."""
    gen = recipe.policy.generation.model_copy(update={"max_new_tokens": max_tokens})
    return recipe.model_copy(update={"policy": recipe.policy.model_copy(update={"generation": gen})})


async def _sample(recipe: Recipe, model_dir: str, requests: list[PromptRequest], n: int, temperature: float,
                  max_model_len: int) -> list[tuple[list[str], TrajectoryGroup | BaseException]]:
    """Each request's group of ``n`` answers (decoded) or the error that stopped it, in request order."""
    async with running(recipe, model_dir, engine_id="generate", reward_fn=unscored,
                       max_model_len=max_model_len) as engine:
        bound = recipe.policy.generation.group_deadline_s
        try:
            groups = await asyncio.wait_for(engine.evaluate(requests, n, temperature), bound * len(requests))
        except TimeoutError:
            groups = [TimeoutError(f"no answer within {bound * len(requests):.0f} s")] * len(requests)
        tok = engine.tokenizer
        return [([tok.decode(t.response_ids, skip_special_tokens=True) for t in g.trajectories]
                 if not isinstance(g, BaseException) else [], g) for g in groups]


def sample_lines(got: tuple[list[str], TrajectoryGroup | BaseException]) -> list[str]:
    """The printed lines of one prompt's answers: ``--- sample i`` then its text (or why it failed)."""
    texts, group = got
    if isinstance(group, BaseException):
        return [f"--- failed: {type(group).__name__}: {group}"]
    out = []
    for i, (text, t) in enumerate(zip(texts, group.trajectories, strict=True), 1):
        if t.ok:
            out += [f"--- sample {i} ({len(t.response_ids)} tokens, {t.finish_reason})", text]
        else:
            out.append(f"--- sample {i} failed: {t.error}")
    return out


def unscored(inputs: list[RewardInput]) -> list[float]:
    """The reward of a quick look: none is computed (every answer gets 0.0, which nothing reads)."""
    return [0.0] * len(inputs)
