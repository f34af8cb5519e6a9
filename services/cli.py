"""``inflight`` command line.

    inflight run [--recipe PATH] [--steps N] [--run-dir DIR] [key=value ...]
    inflight pool deploy --recipe PATH [--name N] [key=value ...]
    inflight pool status [--name N]
    inflight pool shutdown [--name N] [--stop-cluster]
    inflight learner attach --pool NAME --recipe PATH [--run-dir DIR] [key=value ...]
    inflight validate --recipe PATH [key=value ...]     (also checks that the learner supports policy.model_name)
    inflight env serve ENV [--host H] [--port 8300] [--kwargs JSON]   (an environment class over HTTP)
    inflight export --run-dir DIR [--step N] --out HF_DIR [--recipe PATH] [key=value ...]
    inflight make-tiny-model DIR [--seed N] [--arch qwen2|qwen3|llama|llama3|qwen3_moe|mistral]
                                 [--tie-word-embeddings] [--size tiny|small|0.6b]

A NeMo-RL GRPO recipe is accepted as it is (docs/nemo_rl.md): the keys that have no meaning here are listed once
on stderr, with why, before the command runs.

User errors (bad recipe, bad arguments, a cluster that refuses the connection) print one line and exit 2; a
pool that does not start prints its reason in one line and exits 1; no traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.cluster_auth import ClusterConnectError
from services.config import Recipe, RecipeError, load_recipe_with_report, recipe_to_yaml
from services.pool.startup import PoolStartError

EXIT_USER_ERROR = 2
EXIT_FAILED = 1


def _recipe(args: argparse.Namespace, extra: list[str] | None = None) -> Recipe:
    """The recipe of ``--recipe`` with the overrides; the keys its translation ignored (a NeMo-RL recipe's) are
    listed once on stderr, with why."""
    recipe, report = load_recipe_with_report(args.recipe, list(args.overrides) + (extra or []))
    if report.ignored:
        print(f"inflight: {len(report.ignored)} recipe keys have no meaning here:\n{report.summary()}", file=sys.stderr)
    return recipe


def _cmd_validate(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    model = _check_model(recipe.policy.model_name)
    environment = _check_environment(recipe)
    sys.stdout.write(recipe_to_yaml(recipe))
    print(f"inflight: policy.model_name: {model}", file=sys.stderr)
    if environment:
        print(f"inflight: {environment}", file=sys.stderr)
    return 0


def _check_environment(recipe: Recipe) -> str:
    """One line on the environment that plays the episodes ('' for single-turn scoring); a class that does not
    load is a user error (exit 2)."""
    from rollout.env_registry import TOOL_CALLS, load_environment_class

    name = recipe.data.env_name
    if name is None or not (e := recipe.env.named[name]).episodic:
        return ""
    turns = f"up to {recipe.grpo.max_rollout_turns} turns"
    if e.url is not None:
        return f"env.{name}: environment server {e.url}, {turns}"
    assert e.environment is not None
    if e.environment == TOOL_CALLS:
        return f"env.{name}: tool_calls with {', '.join(e.tools)}, {turns}"
    try:
        cls = load_environment_class(e.environment)
    except ValueError as err:
        raise UserError(f"env.{name}.environment: {err}") from None
    served = ", served by Ray Serve" if e.serve else ""
    return f"env.{name}: {cls.__module__}.{cls.__qualname__}{served}, {turns}"


def _check_model(model_name: str) -> str:
    """The model's family in one line; an unsupported model is a user error (exit 2)."""
    from services.model_source import check_model

    try:
        return check_model(model_name)
    except ValueError as err:
        raise UserError(str(err)) from None


def _cmd_env_serve(args: argparse.Namespace) -> int:
    from services.pool.env_server import serve_environment_main

    return serve_environment_main(list(args.args))


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from services.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, arch=args.arch, size=args.size, dtype=args.dtype,
                          tie_word_embeddings=args.tie_word_embeddings)
    tied = ", tied embeddings" if args.tie_word_embeddings else ""
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}{tied}) to {out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from services.app import run_embedded

    extra = [f"grpo.max_num_steps={args.steps}"] if args.steps else []
    recipe = _recipe(args, extra)
    run_dir = Path(args.run_dir or recipe.logger.log_dir)
    run_embedded(recipe, run_dir)
    return 0


def _cmd_pool_deploy(args: argparse.Namespace) -> int:
    from services import cluster, ray_runtime
    from services.app import deploy_pool

    recipe = _recipe(args, [f"rollout_pool.name={args.name}"] if args.name else [])
    ray_runtime.connect(cluster.ensure_cluster())
    status = deploy_pool(recipe, Path(args.run_dir or recipe.logger.log_dir))
    print(json.dumps(status, indent=2, default=str))
    return 0


def _cmd_pool_status(args: argparse.Namespace) -> int:
    from services import cluster, pool, ray_runtime

    ray_runtime.connect(_require_cluster(cluster))
    status = pool.connect(args.name).status.remote().result(timeout_s=60)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        from services.pool.status_table import render

        print(render(status), end="")
    return 0


def _cmd_pool_shutdown(args: argparse.Namespace) -> int:
    from services import cluster, pool, ray_runtime

    ray_runtime.connect(_require_cluster(cluster))
    pool.shutdown(args.name)
    print(f"pool {args.name!r} shut down")
    if args.stop_cluster:
        ray_runtime.shutdown()
        cluster.stop_cluster()
        print("local Ray cluster stopped")
    return 0


def _cmd_learner_attach(args: argparse.Namespace) -> int:
    from services import cluster, ray_runtime
    from services.app import run_learner

    recipe = _recipe(args, [f"rollout_pool.name={args.pool}"])
    ray_runtime.connect(_require_cluster(cluster))
    run_learner(recipe, args.pool, Path(args.run_dir or recipe.logger.log_dir), resume=True)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from services.export import ExportError, export

    try:
        export(args.run_dir, args.out, args.step, args.recipe, list(args.overrides))
    except ExportError as err:
        raise UserError(str(err)) from None
    return 0


def _require_cluster(cluster) -> str:
    addr = cluster.known_address()
    if not addr:
        raise UserError("no Ray cluster: set RAY_ADDRESS or run `inflight pool deploy` first")
    return addr


class UserError(Exception):
    """A mistake in how the command was called."""


def build_parser() -> argparse.ArgumentParser:
    from services.tiny_model import ARCHS, SIZES

    p = argparse.ArgumentParser(prog="inflight", description="Asynchronous GRPO: vLLM rollout pool + Megatron learner.")
    sub = p.add_subparsers(dest="command", required=True)

    def recipe_command(group, name: str, help: str, func, run_dir: bool = True, run_dir_help: str | None = None):
        sp = group.add_parser(name, help=help)
        sp.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/tiny-cpu.yaml)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.async_grpo.enabled=true")
        if run_dir:
            sp.add_argument("--run-dir", default=None, help=run_dir_help)
        sp.set_defaults(func=func)
        return sp

    r = recipe_command(sub, "run", "run the whole loop on this machine (local Ray, pool, learner)", _cmd_run,
                       run_dir_help="where metrics, plots and checkpoints go (default: logger.log_dir)")
    r.add_argument("--steps", type=int, default=None, help="override grpo.max_num_steps")

    pool = sub.add_parser("pool", help="the long-lived rollout pool").add_subparsers(dest="pool_cmd", required=True)
    d = recipe_command(pool, "deploy", "deploy a rollout pool (starts a local Ray cluster if none is given)",
                       _cmd_pool_deploy)
    d.add_argument("--name", default=None, help="pool name (default: rollout_pool.name)")
    s = pool.add_parser("status", help="print a pool's status: engines, learner, last refit")
    s.add_argument("--name", default="inflight-pool")
    s.add_argument("--json", action="store_true", help="print the status dict as JSON (for scripts)")
    s.set_defaults(func=_cmd_pool_status)
    x = pool.add_parser("shutdown", help="stop a pool's engines and delete it")
    x.add_argument("--name", default="inflight-pool")
    x.add_argument("--stop-cluster", action="store_true", help="also stop the local Ray cluster deploy started")
    x.set_defaults(func=_cmd_pool_shutdown)

    learner = sub.add_parser("learner", help="learner jobs").add_subparsers(dest="learner_cmd", required=True)
    a = recipe_command(learner, "attach", "attach a learner to a pool and train (resumes from run-dir)",
                       _cmd_learner_attach)
    a.add_argument("--pool", required=True, help="name of the pool to attach to")

    recipe_command(sub, "validate", "load a recipe, apply overrides, print the result", _cmd_validate, run_dir=False)

    env = sub.add_parser("env", help="environment servers").add_subparsers(dest="env_cmd", required=True)
    es = env.add_parser("serve", add_help=False, help="serve an environment class over HTTP (POST /reset, /step)")
    es.add_argument("args", nargs=argparse.REMAINDER, help="ENV [--host H] [--port P] [--kwargs JSON] [--name N]")
    es.set_defaults(func=_cmd_env_serve)

    e = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory")
    e.add_argument("--run-dir", required=True, help="the run directory (holds recipe.yaml and the checkpoints)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step_N (default: the latest)")
    e.add_argument("--out", required=True, help="where the Hugging Face directory goes")
    e.add_argument("--recipe", default=None, help="the recipe the run used (default: RUN_DIR/recipe.yaml)")
    e.add_argument("overrides", nargs="*", help="dotted overrides applied to that recipe (with --recipe: the run's)")
    e.set_defaults(func=_cmd_export)

    t = sub.add_parser("make-tiny-model", help="write a random-init HF model + local tokenizer")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--arch", choices=ARCHS, default="qwen2",
                   help="model family (llama: Llama 2 layout, llama3: with Llama 3.x RoPE scaling)")
    t.add_argument("--tie-word-embeddings", action="store_true",
                   help="share the embedding with the output layer (as Qwen2.5-0.5B/1.5B)")
    t.add_argument("--size", choices=tuple(SIZES), default="tiny")
    t.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    t.set_defaults(func=_cmd_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["env", "serve"]:  # its own parser (argparse's REMAINDER would swallow no leading --option)
        return _cmd_env_serve(argparse.Namespace(args=argv[2:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ClusterConnectError as err:
        print(f"inflight: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except PoolStartError as err:  # the pool removed what it had made; one line, no traceback
        print(f"inflight: {err}", file=sys.stderr)
        return EXIT_FAILED
    except (RecipeError, UserError) as err:
        print(f"inflight: {'recipe error: ' if isinstance(err, RecipeError) else ''}{err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
