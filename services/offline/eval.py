"""``inflight eval``: score a model on the recipe's validation set with the recipe's rewards, without training.

    inflight eval --model HF_DIR [--recipe PATH] [--pass-k K] [--temperature T] [--max-prompts N] [--out FILE]
    inflight eval --run-dir DIR [--step N] [...]          (the checkpoint is exported first, once)

The validation prompts are the ones a run validates on (:func:`services.data.prompt_source.validation_prompts`:
``data.val_data_path``, a held-out split or the built-in task's, same templates and chat template); one rollout
engine in this process (:mod:`services.offline.local_engine`) answers each ``--pass-k`` times (default 1, greedy) and
scores the answers as training does (reward functions, environment). The table goes to stdout, the JSON file
(:mod:`services.offline.eval_report`) to ``--out`` (default ``RUN_DIR/eval/step_NNNNNN[-passK].json`` or
``./eval-<model dir>.json``), and its path is printed last.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.offline.eval_report import PromptResult, summarize, table, write_json
from services.offline.local_engine import LocalEngineError, ModelChoice, pick_model, quiet_libraries, running

if TYPE_CHECKING:
    from protocol import PromptRequest, TrajectoryGroup
    from services.recipe.config import Recipe


def add_commands(sub) -> None:
    """Register ``eval`` and ``generate`` on the ``inflight`` parser's subcommands."""
    from services.offline.generate import add_generate_command

    e = sub.add_parser("eval", help="score a checkpoint or an exported model on the recipe's validation set")
    add_model_arguments(e)
    e.add_argument("--pass-k", type=int, default=1, metavar="K",
                   help="answers per prompt (default 1: greedy); reports pass@1 and pass@K")
    e.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: 0 for K=1, else grpo.val_temperature or the recipe's)")
    e.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts (grpo.max_val_samples)")
    e.add_argument("--out", default=None, help="the JSON file (default: RUN_DIR/eval/step_N.json or "
                                               "./eval-<model>.json)")
    e.set_defaults(func=cmd_eval)
    add_generate_command(sub)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments eval and generate share: which model, which recipe, overrides, --verbose."""
    p.add_argument("--model", default=None, help="an exported Hugging Face model directory")
    p.add_argument("--run-dir", default=None, help="a run directory: its checkpoint is exported and used")
    p.add_argument("--step", type=int, default=None, help="with --run-dir: checkpoint step_N (default: the latest)")
    p.add_argument("--recipe", default=None, help="recipe YAML (default: the run's recipe.yaml with --run-dir, "
                                                  "else recipes/tiny-cpu.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. grpo.max_val_samples=16")
    p.add_argument("-v", "--verbose", action="store_true", help="also print vLLM's INFO lines")


def sampling(recipe: Recipe, k: int, temperature: float | None) -> float:
    """The temperature of ``k`` answers per prompt: given, else 0 (greedy) for one answer, else the recipe's
    ``grpo.val_temperature`` when above 0, else ``policy.generation.temperature``."""
    if k < 1:
        raise LocalEngineError(f"--pass-k: expected >= 1, got {k}")
    if temperature is None:
        g = recipe.grpo.val_temperature
        temperature = 0.0 if k == 1 else g if g > 0 else recipe.policy.generation.temperature
    if temperature < 0:
        raise LocalEngineError(f"--temperature: expected >= 0, got {temperature:g}")
    if k > 1 and temperature == 0:
        raise LocalEngineError(f"--pass-k {k} with temperature 0 gives {k} identical greedy answers; "
                               "pass --temperature > 0")
    return temperature


def default_out(choice: ModelChoice, k: int) -> Path:
    suffix = f"-pass{k}" if k > 1 else ""
    if choice.run_dir is not None and choice.step is not None:
        return choice.run_dir / "eval" / f"step_{choice.step:06d}{suffix}.json"
    return Path(f"eval-{Path(choice.model_dir).name}{suffix}.json")


def cmd_eval(args: argparse.Namespace) -> int:
    """A LocalEngineError is one line, exit 2 (services.cli.main)."""
    from services.data.prompt_source import validation_prompts

    quiet_libraries(args.verbose)
    if args.max_prompts is not None and args.max_prompts < 1:
        raise LocalEngineError(f"--max-prompts: expected >= 1, got {args.max_prompts}")
    overrides = list(args.overrides) + ([f"grpo.max_val_samples={args.max_prompts}"] if args.max_prompts else [])
    say = _say
    choice = pick_model(args.model, args.run_dir, args.step, args.recipe, overrides, say)
    recipe, k = choice.recipe, args.pass_k
    temperature = sampling(recipe, k, args.temperature)
    try:
        prompts = validation_prompts(recipe, choice.model_dir)
    except (ValueError, OSError) as err:
        raise LocalEngineError(f"validation set: {err}") from None
    say(f"eval: {len(prompts)} prompts x {k} answer(s) at temperature {temperature:g} on {choice.label}")
    t0 = time.perf_counter()
    results = asyncio.run(_answers(recipe, choice.model_dir, prompts, k, temperature))
    summary = summarize(results, k, time.perf_counter() - t0)
    print(table(summary, f"eval of {choice.label} ({len(prompts)} prompts, k={k}, temperature {temperature:g})"))
    about = {"model": choice.model_dir, "label": choice.label, "run_dir": str(choice.run_dir or ""),
             "step": choice.step, "recipe": args.recipe or ("RUN_DIR/recipe.yaml" if args.run_dir else "default"),
             "overrides": overrides, "k": k, "temperature": temperature,
             "max_new_tokens": recipe.policy.generation.max_new_tokens}
    out = write_json(args.out or default_out(choice, k), summary, results, about)
    print(f"wrote {out}")
    return 0


async def _answers(recipe: Recipe, model_dir: str, prompts: list[PromptRequest], k: int,
                   temperature: float) -> list[PromptResult]:
    """Each prompt's ``k`` scored answers, in batches of ``grpo.val_batch_size`` (each bounded by the recipe's
    ``policy.generation.group_deadline_s``)."""
    bound = recipe.policy.generation.group_deadline_s
    out: list[PromptResult] = []
    async with running(recipe, model_dir, engine_id="eval", say=_say) as engine:
        size = recipe.grpo.val_batch_size
        for start in range(0, len(prompts), size):
            batch = prompts[start:start + size]
            try:
                got = await asyncio.wait_for(engine.evaluate(batch, k, temperature), bound)
            except TimeoutError:
                got = [TimeoutError(f"no answer within {bound:.0f} s")] * len(batch)
            out += [result_of(p, g, k, engine.tokenizer) for p, g in zip(batch, got, strict=True)]
            _say(f"eval: {len(out)}/{len(prompts)} prompts")
    return out


def result_of(prompt: PromptRequest, group: TrajectoryGroup | BaseException, k: int, tokenizer) -> PromptResult:
    """One prompt's answers (text, reward or why it failed); a group that never came: ``k`` failed answers."""
    if isinstance(group, BaseException):
        why = f"{type(group).__name__}: {group}"[:300]
        return PromptResult(prompt.prompt_id, [None] * k, [""] * k, [why] * k)
    rewards = [t.reward if t.ok else None for t in group.trajectories]
    answers = [tokenizer.decode(t.response_ids, skip_special_tokens=True) if t.ok else "" for t in group.trajectories]
    return PromptResult(prompt.prompt_id, rewards, answers, [t.error for t in group.trajectories if not t.ok])


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
