"""``inflight`` command line.

    inflight run [--recipe PATH] [--steps N] [--run-dir DIR] [--fresh] [key=value ...]   (resumes RUN_DIR's run)
    inflight pool deploy --recipe PATH [--name N] [key=value ...]
    inflight pool status [--name N]
    inflight pool scale --engines N [--name N] [--drain-timeout-s S] [--json]   (add or remove engines, live)
    inflight pool shutdown [--name N] [--stop-cluster]
    inflight learner attach --pool NAME --recipe PATH [--run-dir DIR] [--fresh] [key=value ...]   (in the foreground)
    inflight learner submit --pool NAME --recipe PATH [--run-dir DIR] [key=value ...]   (the same, as a Ray job)
    inflight learner status|logs|stop [--pool NAME] [--json] [--follow] [--timeout-s S]
    inflight validate --recipe PATH [key=value ...]     (also checks that the learner supports policy.model_name)
    inflight env serve ENV [--host H] [--port 8300] [--kwargs JSON]   (an environment class over HTTP)
    inflight export --run-dir DIR [--step N] --out HF_DIR [--overwrite] [--recipe PATH] [key=value ...]
    inflight eval --model HF_DIR [--recipe PATH] | --run-dir DIR [--step N]  [--pass-k K] [--out FILE]   (no training)
    inflight generate --model HF_DIR | --run-dir DIR [--step N]  [--prompts FILE] [-n N] [--max-tokens M]
    inflight make-tiny-model DIR [--seed N] [--arch qwen2|...|qwen2_5_vl|nemotron_h_omni] [--max-positions N]
                                 [--tie-word-embeddings] [--size tiny|small|0.6b]

A NeMo-RL GRPO recipe is accepted as it is (docs/nemo_rl.md): the keys that have no meaning here are listed once
on stderr, with why, before the command runs.

User errors (bad recipe, bad arguments, a cluster that refuses the connection) print one line and exit 2; a
pool that does not start prints its reason in one line and exits 1; no traceback. An error out of an actor (a
learner rank, an engine) prints one line naming it and exits 1; its traceback goes to RUN_DIR/logs/driver.log;
so does any other error once the command has opened RUN_DIR/logs. ``validate``, ``run``, ``pool deploy`` and
``learner attach`` first check every file, class and model the recipe names (:mod:`services.preflight.checks`):
all problems at once, one line each, exit 2, before anything starts.

``run``, ``pool deploy`` and ``learner attach`` print Inflight's own lines; the Ray, Serve and vLLM logs go to
RUN_DIR/logs (``pool status|shutdown``: INFLIGHT_HOME/logs; ``--verbose`` prints them too):
:mod:`services.console.output`.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from protocol.pool_client import PoolClient
from services.cluster.auth import ClusterConnectError
from services.console import output as console
from services.learner_jobs import LearnerJobError, LearnerJobFailed, exit_on_sigterm
from services.offline.local_engine import LocalEngineError
from services.preflight.checks import check_recipe
from services.recipe.config import Recipe, RecipeError, load_recipe_with_report, recipe_to_yaml

EXIT_USER_ERROR = 2
EXIT_FAILED = 1


def _recipe(args: argparse.Namespace, extra: list[str] | None = None) -> Recipe:
    """The recipe of ``--recipe`` with the overrides; the keys its translation ignored (a NeMo-RL recipe's) are
    listed once on stderr, with why."""
    recipe, report = load_recipe_with_report(args.recipe, list(args.overrides) + (extra or []))
    if report.ignored:
        print(f"inflight: {report.summary()}", file=sys.stderr)
    for resolved in report.resolved:
        print(f"inflight: {resolved.line()}", file=sys.stderr)
    return recipe


def _cmd_validate(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    checks = check_recipe(recipe, here=False)  # every file, class and model it names; all problems at once
    checks.raise_problems()
    sys.stdout.write(recipe_to_yaml(recipe))
    for note in checks.notes:
        print(f"inflight: {note}", file=sys.stderr)
    return 0


def _cmd_env_serve(args: argparse.Namespace) -> int:
    from services.pool.env_server import serve_environment_main

    return serve_environment_main(list(args.args))


def _cmd_run(args: argparse.Namespace) -> int:
    from services.run_resume import run  # resumes the run the directory holds, or --fresh starts over

    recipe = _recipe(args, [f"grpo.max_num_steps={args.steps}"] if args.steps else [])
    check_recipe(recipe, here=True).raise_problems()  # before Ray starts: every problem at once
    return run(recipe, Path(args.run_dir or recipe.logger.log_dir), fresh=args.fresh, verbose=args.verbose)


def _cmd_pool_deploy(args: argparse.Namespace) -> int:
    from services.app import deploy_pool
    from services.cluster import head as cluster
    from services.cluster import ray_runtime

    recipe = _recipe(args, [f"rollout_pool.name={args.name}"] if args.name else [])
    check_recipe(recipe, here=True).raise_problems()  # before Ray starts: every problem at once
    run_dir = Path(args.run_dir or recipe.logger.log_dir)
    logs = console.setup(run_dir, verbose=args.verbose).log_dir
    ray_runtime.connect(cluster.ensure_cluster())
    deployed = deploy_pool(recipe, run_dir)
    print(json.dumps(deployed.to_json(), indent=2, default=str))
    print(f"logs: {logs}", file=sys.stderr)
    return 0


def _cmd_pool_status(args: argparse.Namespace) -> int:
    from services import pool
    from services.cluster import head as cluster
    from services.cluster import ray_runtime
    console.setup(cluster.state_dir(), verbose=args.verbose)
    ray_runtime.connect(_require_cluster(cluster))
    status = PoolClient(pool.connect(args.name)).status()
    if args.json:
        print(json.dumps(status.to_json(), indent=2, default=str))
    else:
        from services.pool.status_table import render

        print(render(status.to_json()), end="")
    return 0


def _cmd_pool_scale(args: argparse.Namespace) -> int:
    """Scale a running pool; a refused request or a bad value is a user error (2), engines that did not boot
    a failure (1)."""
    from services import pool
    from services.cluster import head as cluster
    from services.cluster import ray_runtime
    from services.pool.fleet import ScaleError, ScaleRequestError
    from services.refit.result import remote_cause

    ray_runtime.connect(_require_cluster(cluster))
    try:
        result = pool.scale(pool.connect(args.name), args.engines, args.drain_timeout_s)
    except (ScaleRequestError, ScaleError) as err:
        cause = remote_cause(err)
        if isinstance(cause, ScaleError) and cause.outcome == "failed":
            print(f"inflight: {cause}", file=sys.stderr)
            return EXIT_FAILED
        raise UserError(str(cause)) from None
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        changed = (f"added {', '.join(result.added)}" if result.added else
                   f"removed {', '.join(result.removed)} ({result.handed_back_prompts} prompts handed back)"
                   if result.removed else "nothing to change")
        states = ", ".join(f"{e} {s}" for e, s in sorted(result.states.items()))
        print(f"pool {args.name!r}: {result.engines_before} -> {result.engines} engines in {result.seconds:.1f} s, "
              f"{changed}; engines: {states}")
    return 0


def _cmd_pool_shutdown(args: argparse.Namespace) -> int:
    from services import pool
    from services.cluster import head as cluster
    from services.cluster import ray_runtime
    console.setup(cluster.state_dir(), verbose=args.verbose)
    ray_runtime.connect(_require_cluster(cluster))
    pool.shutdown(args.name)
    print(f"pool {args.name!r} shut down")
    if args.stop_cluster:
        ray_runtime.shutdown()
        console.keep_ray_logs()  # the head's session logs, before its temp dir goes
        cluster.stop_cluster()
        print("local Ray cluster stopped")
    return 0


def _cmd_learner_attach(args: argparse.Namespace) -> int:
    from services.app import run_learner
    from services.cluster import head as cluster
    from services.cluster import ray_runtime
    from services.run_resume import announced_start

    recipe = _recipe(args, [f"rollout_pool.name={args.pool}"])
    check_recipe(recipe, here=True).raise_problems()  # before Ray starts: every problem at once
    run_dir = Path(args.run_dir or recipe.logger.log_dir)
    start = announced_start(recipe, run_dir, args.fresh)  # as `inflight run`: resume, refuse or start over
    if isinstance(start, int):
        return start
    console.setup(run_dir, verbose=args.verbose)
    ray_runtime.connect(_require_cluster(cluster))
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # `learner stop` (Ray Jobs) sends SIGTERM: detach cleanly
    run_learner(recipe, args.pool, run_dir, resume=start.resume_from is not None)
    return 0


def _cmd_learner_submit(args: argparse.Namespace) -> int:
    from services.learner_jobs import JobRecord, LearnerJobs

    recipe = _recipe(args, [f"rollout_pool.name={args.pool}"])  # a bad recipe fails here, not in the job
    record = JobRecord.for_recipe(args.pool, recipe, args.recipe, list(args.overrides), args.run_dir)
    jobs = LearnerJobs.connect()
    jobs.require_pool(args.pool)
    status = jobs.submit(record, withheld_env=(recipe.rollout_pool.admin_token_env,))
    print(f"{status.line()}\nfollow it: inflight learner logs --pool {args.pool} --follow; "
          f"stop it: inflight learner stop --pool {args.pool}")
    return 0


def _cmd_learner_job(args: argparse.Namespace) -> int:
    """``learner status|logs|stop``: the pool's newest learner job."""
    from services.learner_jobs import LearnerJobs

    jobs = LearnerJobs.connect()
    if args.learner_cmd == "status":
        status = jobs.status(args.pool)
        print(json.dumps(status.as_dict(), indent=2) if args.json else status.line())
    elif args.learner_cmd == "stop":
        print(jobs.stop(args.pool, timeout_s=args.timeout_s).line())
    else:
        try:
            jobs.logs(args.pool, follow=args.follow)
        except KeyboardInterrupt:  # Ctrl-C stops following, not the job
            return 130
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from services.offline.export import ExportError, export

    try:
        export(args.run_dir, args.out, args.step, args.recipe, list(args.overrides), overwrite=args.overwrite)
    except ExportError as err:
        raise UserError(str(err)) from None
    return 0


def _is_pool_start_error(err: Exception) -> bool:
    """Whether ``err`` is :class:`services.pool.startup.PoolStartError`: only a command that imported the pool's
    start-up can raise one, so a command that did not (``validate``, ``export``...) never imports Ray Serve."""
    startup = sys.modules.get("services.pool.startup")
    return startup is not None and isinstance(err, startup.PoolStartError)


def _require_cluster(cluster) -> str:
    addr = cluster.known_address()
    if not addr:
        raise UserError("no Ray cluster: set RAY_ADDRESS or run `inflight pool deploy` first")
    return addr


class UserError(Exception):
    """A mistake in how the command was called."""


def build_parser() -> argparse.ArgumentParser:
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
    r.add_argument("--fresh", action="store_true", help="start over: an earlier run's files move to RUN_DIR/previous")

    pool = sub.add_parser("pool", help="the long-lived rollout pool").add_subparsers(dest="pool_cmd", required=True)
    d = recipe_command(pool, "deploy", "deploy a rollout pool (starts a local Ray cluster if none is given)",
                       _cmd_pool_deploy)
    d.add_argument("--name", default=None, help="pool name (default: rollout_pool.name)")
    s = pool.add_parser("status", help="print a pool's status: engines, learner, last refit")
    s.add_argument("--name", default="inflight-pool")
    s.add_argument("--json", action="store_true", help="print the status dict as JSON (for scripts)")
    s.set_defaults(func=_cmd_pool_status)
    sc = pool.add_parser("scale", help="add or remove engines of a running pool (a learner may be training)")
    sc.add_argument("--name", default="inflight-pool")
    sc.add_argument("--engines", type=int, required=True, help="engines the pool should have")
    sc.add_argument("--drain-timeout-s", type=float, default=None,
                    help="longest a removed engine's batches may take to finish before they are handed back to "
                         "the other engines (default: policy.generation.request_timeout_s)")
    sc.add_argument("--json", action="store_true", help="print the result as JSON")
    sc.set_defaults(func=_cmd_pool_scale)
    x = pool.add_parser("shutdown", help="stop a pool's engines and delete it")
    x.add_argument("--name", default="inflight-pool")
    x.add_argument("--stop-cluster", action="store_true", help="also stop the local Ray cluster deploy started")
    x.set_defaults(func=_cmd_pool_shutdown)

    learner = sub.add_parser("learner", help="learner jobs").add_subparsers(dest="learner_cmd", required=True)
    a = recipe_command(learner, "attach", "attach a learner to a pool and train (resumes from run-dir)",
                       _cmd_learner_attach)
    a.add_argument("--pool", required=True, help="name of the pool to attach to")
    a.add_argument("--fresh", action="store_true", help="start over: an earlier run's files move to RUN_DIR/previous")
    for sp in (r, d, a, s, x):
        sp.add_argument("-v", "--verbose", action="store_true",
                        help="also print the Ray, Serve and vLLM logs (always written to RUN_DIR/logs; for pool "
                             "status|shutdown to INFLIGHT_HOME/logs)")
    j = recipe_command(learner, "submit", "run `learner attach` as a Ray job: it outlives this terminal; a "
                       "re-submit with the same run-dir resumes", _cmd_learner_submit)
    j.add_argument("--pool", required=True, help="name of the pool to attach to")

    def job_command(name: str, help: str):
        c = learner.add_parser(name, help=help)
        c.add_argument("--pool", default="inflight-pool", help="the pool whose learner job (default inflight-pool)")
        c.set_defaults(func=_cmd_learner_job)
        return c
    job_command("status", "the pool's learner job: id, state, step, run dir").add_argument(
        "--json", action="store_true", help="print the status as JSON (for scripts)")
    job_command("logs", "print the pool's learner job's log").add_argument(
        "--follow", action="store_true", help="keep printing until the job ends (Ctrl-C stops following only)")
    job_command("stop", "stop the pool's learner job and wait until it has exited").add_argument(
        "--timeout-s", type=float, default=60.0, help="how long to wait for the job to end (default 60)")

    recipe_command(sub, "validate", "load a recipe, apply overrides, print the result", _cmd_validate, run_dir=False)

    env = sub.add_parser("env", help="environment servers").add_subparsers(dest="env_cmd", required=True)
    es = env.add_parser("serve", add_help=False, help="serve an environment class over HTTP (POST /reset, /step)")
    es.add_argument("args", nargs=argparse.REMAINDER, help="ENV [--host H] [--port P] [--kwargs JSON] [--name N]")
    es.set_defaults(func=_cmd_env_serve)

    e = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory")
    e.add_argument("--run-dir", required=True, help="the run directory (holds recipe.yaml and the checkpoints)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step_N (default: the latest)")
    e.add_argument("--out", required=True, help="where the Hugging Face directory goes")
    e.add_argument("--overwrite", action="store_true", help="replace --out if it is not empty (an old export)")
    e.add_argument("--recipe", default=None, help="the recipe the run used (default: RUN_DIR/recipe.yaml)")
    e.add_argument("overrides", nargs="*", help="dotted overrides applied to that recipe (with --recipe: the run's)")
    e.set_defaults(func=_cmd_export)

    from services.models.command import add_command  # inflight make-tiny-model
    add_command(sub)
    from services.offline.eval import add_commands  # inflight eval, inflight generate
    add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["env", "serve"]:  # its own parser (argparse's REMAINDER would swallow no leading --option)
        return _cmd_env_serve(argparse.Namespace(args=argv[2:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    # The pool's stack (Ray Serve, torch) is imported when a command runs, not with this module: processes started
    # with ``spawn`` import the main script again (the image pool's eight workers did, ~3 s of CPU each); and only
    # by commands that start or reach a pool (Ray Serve's import is 1 s of CPU: `validate` took 1.9 s with it).
    try:
        return args.func(args)
    except ClusterConnectError as err:
        print(f"inflight: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (RecipeError, UserError, LocalEngineError) as err:
        print(f"inflight: {'recipe error: ' if isinstance(err, RecipeError) else ''}{err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except LearnerJobError as err:  # a job that failed or did not end in time: 1; a mistake in the call: 2
        print(f"inflight: {err}", file=sys.stderr)
        return EXIT_FAILED if isinstance(err, LearnerJobFailed) else EXIT_USER_ERROR
    except Exception as err:  # an actor's error, or any once RUN_DIR/logs is open: one line (traceback: driver.log)
        if _is_pool_start_error(err):  # the pool removed what it had made; one line, no traceback
            print(f"inflight: {err}", file=sys.stderr)
            return EXIT_FAILED
        if not console.is_actor_error(err) and console.active() is None:
            raise
        print(f"inflight: {console.failure_line(err)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
