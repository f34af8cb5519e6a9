"""One rollout engine in this process, without Ray or a learner: what ``inflight eval`` and ``inflight generate`` use.

:func:`pick_model` turns the command's arguments into a recipe and a Hugging Face model directory: an exported
model (``--model HF_DIR``, with ``--recipe``), or a run's checkpoint (``--run-dir DIR [--step N]``), exported once
with :func:`services.offline.export.export` into ``RUN_DIR/exports/step_NNNNNN`` and reused after that. The engine is
the pool's own (:class:`services.pool.engine_actor.EngineActor` built from the recipe's :class:`EngineSpec`: reward
functions, environment, sampling settings), started here and shut down on the way out (:func:`running`).
"""
from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.engine import RolloutEngine
    from services.recipe.config import Recipe

EXPORTS = "exports"
"""Under a run directory: the checkpoints exported for eval and generate (``step_NNNNNN``)."""


class LocalEngineError(Exception):
    """A bad argument, model or recipe for eval / generate; the message is the one line the user sees."""


@dataclass(frozen=True)
class ModelChoice:
    """The recipe and the model directory a command samples from."""

    recipe: Recipe
    model_dir: str
    """A Hugging Face directory (config.json, safetensors, tokenizer)."""
    label: str
    """What the model is, for the table's title and the JSON file (the directory, or run and step)."""
    run_dir: Path | None = None
    """The run whose checkpoint it is (None for ``--model``)."""
    step: int | None = None
    """The checkpoint's step (None for ``--model``)."""


def pick_model(model: str | None, run_dir: str | None, step: int | None, recipe_path: str | None,
               overrides: list[str], say=None) -> ModelChoice:
    """``--model HF_DIR`` (the recipe: ``recipe_path``, default ``recipes/tiny-cpu.yaml``) or ``--run-dir DIR``
    with ``--step N`` (default: the latest checkpoint; the recipe: the run's, or ``recipe_path``)."""
    from services.offline.export import ExportError, find_checkpoint, load_run_recipe
    from services.recipe.config import load_recipe

    if (model is None) == (run_dir is None):
        raise LocalEngineError("give exactly one of --model HF_DIR and --run-dir DIR")
    if model is not None:
        if step is not None:
            raise LocalEngineError("--step goes with --run-dir (a checkpoint), not with --model")
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise LocalEngineError(f"--model {model!r}: not a Hugging Face model directory (no config.json); "
                                   "export a run's checkpoint with `inflight export` or pass --run-dir")
        return ModelChoice(load_recipe(recipe_path, overrides), str(path.resolve()), str(path.resolve()))
    assert run_dir is not None
    try:
        recipe = load_run_recipe(run_dir, recipe_path, overrides)
        ckpt = find_checkpoint(recipe, run_dir, step)
    except ExportError as err:
        raise LocalEngineError(str(err)) from None
    out = Path(run_dir) / EXPORTS / ckpt.name
    if not (out / "config.json").is_file():
        export_checkpoint(run_dir, ckpt.name, out, recipe_path, overrides, say)
    found = int(ckpt.name.removeprefix("step_"))
    return ModelChoice(recipe, str(out.resolve()), f"{run_dir} step {found}", Path(run_dir), found)


def export_checkpoint(run_dir: str, name: str, out: Path, recipe_path: str | None, overrides: list[str],
                      say=None) -> None:
    """Export checkpoint ``name`` (``step_NNNNNN``) of ``run_dir`` to ``out`` (:func:`services.offline.export.export`,
    which writes beside ``out`` and moves the complete directory into place)."""
    from services.offline.export import ExportError, export

    try:
        with stdout_to_stderr():  # Megatron's lines too
            export(run_dir, out, int(name.removeprefix("step_")), recipe_path, overrides, progress=say)
    except ExportError as err:
        raise LocalEngineError(str(err)) from None


def quiet_libraries(verbose: bool) -> None:
    """vLLM's INFO and WARNING lines off the console unless ``verbose`` (set before vLLM is imported)."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextmanager
def stdout_to_stderr():
    """Point file descriptor 1 at stderr for the block (vLLM and its processes print to stdout): the command's
    own stdout then holds only its results."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@asynccontextmanager
async def running(recipe: Recipe, model_dir: str, *, engine_id: str, reward_fn=None,
                  max_model_len: int | None = None, say=None) -> AsyncIterator[RolloutEngine]:
    """The recipe's engine on ``model_dir``, started; shut down (its processes and /dev/shm freed) on exit; what
    it prints goes to stderr (:func:`stdout_to_stderr`).
    ``reward_fn``: score with this instead of the recipe's reward (and play no environment); ``max_model_len``:
    instead of ``policy.max_total_sequence_length``."""
    import time

    from rollout.engine import RolloutEngine
    from services.pool.engine_actor import EngineActor, EngineSpec

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    if reward_fn is None:
        try:
            engine = EngineActor(EngineSpec.from_recipe(recipe, engine_id, model_dir)).engine
        except ValueError as err:  # a reward or environment that cannot be built here
            raise LocalEngineError(str(err)) from None
    else:
        engine = RolloutEngine(model_dir, recipe.policy.generation,
                               max_model_len or recipe.policy.max_total_sequence_length, reward_fn,
                               engine_id=engine_id, chat_template_kwargs=recipe.policy.tokenizer.chat_template_kwargs)
    t0 = time.perf_counter()
    say(f"starting vLLM on {model_dir} ...")
    with stdout_to_stderr():
        try:
            await engine.start()
            say(f"engine up in {time.perf_counter() - t0:.0f} s")
            yield engine
        finally:
            await engine.shutdown()
