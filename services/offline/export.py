"""``inflight export``: a run's checkpoint as a Hugging Face directory (safetensors, config, tokenizer).

A run directory holds the recipe its learner ran (``recipe.yaml``, written by :func:`save_run_recipe` when the
learner job starts, with ``policy.model_name`` resolved to the model's directory) and its checkpoints
(:mod:`services.job.checkpoints`). :func:`export` builds the learner from that recipe on this machine, without
Ray: in this process when the checkpoint has one rank, else one local process per rank (gloo on CPU, one GPU
each); it loads the checkpoint and writes what :meth:`learner.trainer.Learner.save_hf` writes. Before that,
:mod:`services.offline.export_checks` checks ``--out`` and that the recipe's layout is the checkpoint's; every
problem is an :class:`ExportError` of one line (a rank's error too: its last line).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.offline.export_checks import ExportError, check_layout, check_out, install_out, staging_dir

if TYPE_CHECKING:
    from services.job.learner_actor import LearnerSpec
    from services.recipe.config import Recipe

RECIPE_FILE = "recipe.yaml"
"""In a run directory: the recipe its learner ran (``policy.model_name`` is the resolved model directory)."""
RANK_TIMEOUT_S = 3600.0


def save_run_recipe(recipe: Recipe, model_path: str, run_dir: str | Path) -> Path:
    """Write ``run_dir/recipe.yaml``: ``recipe`` with ``policy.model_name`` set to ``model_path``."""
    from services.recipe.config import recipe_to_yaml

    out = Path(run_dir) / RECIPE_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    policy = recipe.policy.model_copy(update={"model_name": str(model_path)})
    out.write_text(recipe_to_yaml(recipe.model_copy(update={"policy": policy})))
    return out


def load_run_recipe(run_dir: str | Path, recipe_path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """The recipe of the run in ``run_dir`` (or ``recipe_path``, for a run from before recipes were stored)."""
    from services.recipe.config import load_recipe

    path = Path(recipe_path) if recipe_path else Path(run_dir) / RECIPE_FILE
    if not Path(run_dir).is_dir():
        raise ExportError(f"no run directory {run_dir}")
    if not path.is_file():
        raise ExportError(f"no recipe at {path}: pass --recipe with the recipe (and overrides) the run used")
    return load_recipe(path, overrides)


def find_checkpoint(recipe: Recipe, run_dir: str | Path, step: int | None = None) -> Path:
    """``step_<step>`` of the run's checkpoint directory, or the ``latest`` one when ``step`` is None (see
    :mod:`services.job.checkpoint_marker`: an unusable ``latest`` falls back to the newest complete step)."""
    from services.job.checkpoint_marker import CheckpointRefused, complete_steps
    from services.job.checkpoints import Checkpoints

    checkpoints = Checkpoints(recipe.checkpointing, Path(run_dir))
    steps = complete_steps(checkpoints.root)
    available = f"available steps: {', '.join(map(str, steps))}" if steps else "the run saved none"
    try:
        path = checkpoints.latest() if step is None else checkpoints.step(step)
    except CheckpointRefused as err:
        raise ExportError(str(err)) from None
    except FileNotFoundError:
        path = None
    if path is None:
        what = "no checkpoint" if step is None else f"no checkpoint of step {step}"
        raise ExportError(f"{what} in {checkpoints.root} ({available})")
    return path


def export(run_dir: str | Path, out: str | Path, step: int | None = None, recipe_path: str | None = None,
           overrides: list[str] | None = None, progress: Callable[[str], None] | None = None,
           overwrite: bool = False) -> Path:
    """Write the policy of the run's checkpoint (``step``, default the latest) to ``out`` as a Hugging Face
    directory; returns ``out``. A non-empty ``out`` is refused unless ``overwrite`` (then it is replaced whole).
    ``progress`` gets one line per stage (default: stderr)."""
    import json

    from services.job.learner_actor import LearnerSpec
    from services.models.variant import resolve_policy_model

    say = progress or (lambda line: print(f"export: {line}", file=sys.stderr, flush=True))
    recipe = load_run_recipe(run_dir, recipe_path, overrides)
    ckpt = find_checkpoint(recipe, run_dir, step)
    meta = json.loads((ckpt / "meta.json").read_text())
    check_layout(recipe, Path(recipe_path) if recipe_path else Path(run_dir) / RECIPE_FILE, meta, ckpt)
    check_out(Path(out), overwrite, Path(run_dir))
    try:
        model_path = resolve_policy_model(recipe.policy)
    except ValueError as err:
        raise ExportError(str(err)) from None
    # the export needs no reference policy: skip building one
    spec = LearnerSpec.of(recipe.model_copy(update={"loss_fn": recipe.loss_fn.model_copy(
        update={"reference_policy_kl_penalty": 0.0})}), model_path)
    world = int(meta.get("world_size", 1))
    tmp = staging_dir(Path(out))
    say(f"{ckpt} (step {meta.get('step')}, policy version {meta.get('policy_version')}, {world} rank(s)) "
        f"-> {out}; model {model_path}")
    t0 = time.perf_counter()
    try:
        if world == 1:
            _in_process(spec, ckpt, tmp)
        else:
            _spawn_ranks(world, spec, str(ckpt), str(tmp))
        install_out(tmp, Path(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return Path(out)


def export_rank(rank: int, world: int, port: int, spec: LearnerSpec, ckpt: str, out: str,
                own_group: bool = True) -> None:
    """One rank: build the learner, load ``ckpt``, write the HF directory (rank 0 writes). ``own_group``: this
    process joins a ``world``-rank group on ``port`` and tears it down at the end."""
    from learner.trainer import Learner

    if own_group:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    learner = Learner(str(spec.model), spec.megatron, spec.loss, spec.packing, spec.max_total_sequence_length,
                      normalize_rewards=spec.normalize_rewards, seed=spec.seed, step_config=spec.step_config)
    try:
        learner.load_checkpoint(ckpt)
        learner.save_hf(out)
    finally:
        learner.shutdown()
        if own_group:
            from learner.model import shutdown_distributed
            shutdown_distributed()


def _in_process(spec: LearnerSpec, ckpt: Path, out: Path) -> None:
    """:func:`export_rank` of a one-rank checkpoint in this process; its checkpoint and disk errors as one line."""
    from learner.checkpoint import CheckpointError

    try:
        export_rank(0, 1, 0, spec, str(ckpt), str(out), own_group=False)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    except OSError as err:
        raise ExportError(f"export failed: {err}") from None


def _spawn_ranks(world: int, spec: LearnerSpec, ckpt: str, out: str) -> None:
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

    from services.cluster.head import free_port

    ctx = start_processes(export_rank, args=(world, free_port(), spec, ckpt, out), nprocs=world, join=False,
                          start_method="spawn")
    assert ctx is not None  # join=False returns the context
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise ExportError(f"export ranks did not finish within {RANK_TIMEOUT_S:.0f} s")
    except (ProcessRaisedException, ProcessExitedException) as err:
        lines = [line for line in str(err).splitlines() if line.strip()]  # the rank's traceback: its last line
        raise ExportError(f"an export rank failed: {lines[-1] if lines else err}") from None
    finally:
        for p in ctx.processes:
            if p is not None and p.is_alive():
                p.terminate()
