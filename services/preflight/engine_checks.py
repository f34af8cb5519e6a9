"""``policy.generation.vllm_kwargs`` checked against the installed vLLM before anything starts (``inflight
validate``, ``run``, ``pool deploy``): the engine arguments are built as an engine would build them and handed to
vLLM's ``AsyncEngineArgs`` (which checks its config classes' keys and values) without starting an engine. Only a
recipe that sets ``vllm_kwargs`` pays for importing vLLM here; the engines check every option again at start.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.preflight.checks import RecipeChecks
    from services.recipe.config import Recipe


def check_vllm_kwargs(recipe: Recipe, checks: RecipeChecks) -> None:
    """A problem for a ``vllm_kwargs`` entry vLLM or Inflight refuses; a note for each one ignored on this
    platform (GPU-only ones on CPU) and each one applied."""
    from rollout.options import EngineOptionError, build_engine_options, probe_vllm
    from rollout.vllm_kwargs import SECTION, VllmKwargError, engine_args_object

    g = recipe.policy.generation
    if not g.vllm_kwargs.model_dump(exclude_none=True):
        return
    try:
        options = build_engine_options(g.vllm_cfg, recipe.policy.model_name, recipe.policy.max_total_sequence_length,
                                       probe_vllm(), colocated=g.colocated.enabled, kwargs=g.vllm_kwargs,
                                       tempered=g.tempered)
        engine_args_object(options.engine_args)
    except VllmKwargError as err:
        checks.add(f"{SECTION}.{err.key}", str(err.value), err.expected)
        return
    except EngineOptionError as err:
        checks.add(f"policy.generation.vllm_cfg.{err.key}", str(err.value), err.expected)
        return
    checks.notes += [f"{SECTION}.{k} -> {v}" for k, v in options.applied_kwargs.items()]
    checks.notes += [i.message(options.platform) for i in options.ignored if i.section == SECTION]
