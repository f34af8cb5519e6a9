"""Learner jobs on Ray Jobs: what ``inflight learner submit|status|logs|stop`` do.

A foreground ``inflight learner attach`` dies with its terminal. ``submit`` hands that same command (same
recipe, overrides and run directory, run in the caller's working directory with the caller's venv) to the
cluster's job server (Ray Jobs, served by the head node's dashboard) as a job's entrypoint; the learner then
runs as a driver on the head node and outlives the terminal, and a re-submit with the same run directory
resumes from its latest checkpoint. The cluster keeps the record: each job's metadata is a
:class:`JobRecord` (pool, run directory, recipe), so ``status`` / ``logs`` / ``stop`` find a pool's job from
any client of that cluster, and a pool has at most one learner job that is not finished.
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.recipe.config import Recipe

KIND_KEY, KIND = "inflight_kind", "learner"
"""The metadata entry that marks a Ray job as an Inflight learner job."""
STOP_GRACE_S = 30
"""Seconds a stopped job's learner has after SIGTERM to detach from the pool and end its ranks before Ray
sends SIGKILL (the job's ``RAY_JOB_STOP_WAIT_TIME_S``)."""
FORWARDED_ENV = ("INFLIGHT_", "HF_", "TRANSFORMERS_", "TOKENIZERS_PARALLELISM", "WANDB_", "MLFLOW_", "PYTHONPATH")
"""Variables of the submitting shell (by prefix) the job's driver gets besides the head node's environment,
so that it behaves as ``learner attach`` would in that shell (state and model caches, loggers)."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class LearnerJobError(Exception):
    """A learner-job command that cannot be done as asked (no cluster, no such pool, no job, one running)."""


class LearnerJobFailed(LearnerJobError):
    """A learner job that failed as soon as it started, or did not reach the state waited for in time."""


@dataclass(frozen=True)
class JobRecord:
    """What a learner job runs, kept as its Ray job metadata (strings only)."""

    pool: str
    run_dir: str
    """Absolute run directory: metrics, checkpoints, the recipe the learner ran."""
    checkpoint_dir: str
    """Absolute directory of the run's checkpoints (``checkpointing.checkpoint_dir``)."""
    recipe: str | None
    """Absolute recipe path; None: the embedded default."""
    overrides: tuple[str, ...]
    workdir: str
    """The submitting shell's working directory (relative paths in the recipe resolve from it)."""

    def metadata(self) -> dict[str, str]:
        return {KIND_KEY: KIND, "pool": self.pool, "run_dir": self.run_dir, "checkpoint_dir": self.checkpoint_dir,
                "recipe": self.recipe or "", "overrides": json.dumps(list(self.overrides)), "workdir": self.workdir}

    @classmethod
    def for_recipe(cls, pool: str, recipe: Recipe, recipe_path: str | None, overrides: list[str],
                   run_dir: str | None) -> JobRecord:
        """The record of ``learner attach --pool pool --recipe recipe_path [--run-dir run_dir] overrides`` run in
        this working directory (``recipe``: that recipe loaded; it gives the defaults of the run directory and
        of the checkpoint directory)."""
        run = Path(run_dir or recipe.logger.log_dir).resolve()
        ckpt = Path(recipe.checkpointing.checkpoint_dir)
        return cls(pool, str(run), str(ckpt if ckpt.is_absolute() else run / ckpt),
                   str(Path(recipe_path).resolve()) if recipe_path else None, tuple(overrides), os.getcwd())

    @classmethod
    def of(cls, metadata: dict[str, str] | None) -> JobRecord | None:
        """The record in a job's metadata; None for a job that is not an Inflight learner job."""
        md = metadata or {}
        if md.get(KIND_KEY) != KIND:
            return None
        return cls(md["pool"], md["run_dir"], md["checkpoint_dir"], md["recipe"] or None,
                   tuple(json.loads(md["overrides"])), md["workdir"])

    def entrypoint(self, inflight: str) -> str:
        """The shell command of the job: ``inflight learner attach`` as the submitting shell would run it."""
        args = [inflight, "learner", "attach", "--pool", self.pool, "--run-dir", self.run_dir]
        args += ["--recipe", self.recipe] if self.recipe else []
        return f"cd {shlex.quote(self.workdir)} && exec {shlex.join(args + list(self.overrides))}"


@dataclass(frozen=True)
class JobStatus:
    """One learner job as ``inflight learner status`` shows it."""

    submission_id: str
    state: str
    """Ray's job status: PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED."""
    message: str
    record: JobRecord
    step: int | None
    """The last step in the run's ``metrics.jsonl`` (None: no row yet, or not on this machine)."""
    checkpoint: str | None
    """The run's latest checkpoint (``step_NNNNNN``), if any."""
    start_time: float | None
    end_time: float | None

    def line(self) -> str:
        step = f"step {self.step}" if self.step is not None else "no step yet"
        ckpt = f", checkpoint {self.checkpoint}" if self.checkpoint else ""
        since = f", {_age(self.start_time)} since start" if self.start_time and not self.end_time else ""
        why = f" -- {self.message}" if self.state == "FAILED" and self.message else ""
        return (f"learner job {self.submission_id} (pool {self.record.pool}): {self.state}, {step}{ckpt}{since}, "
                f"run dir {self.record.run_dir}{why}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def last_step(run_dir: str | Path) -> int | None:
    """The ``step`` of the last row of ``run_dir/metrics.jsonl`` (None when it has none or is not here)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a row being written, or a line cut by the seek
    return None


def latest_checkpoint(checkpoint_dir: str | Path) -> str | None:
    """The name the run's ``latest`` marker points at (``step_NNNNNN``), None without one."""
    try:
        return (Path(checkpoint_dir) / "latest").read_text().strip() or None
    except OSError:
        return None


def forwarded_env(withheld: tuple[str, ...] = (), environ: dict[str, str] | None = None) -> dict[str, str]:
    """The job's environment variables: the :data:`FORWARDED_ENV` of ``environ`` (default this process's) but
    the ``withheld`` names (the pool's admin token: the learner does not use it, and Ray shows a job's
    variables to every holder of the cluster's token), the stop grace and unbuffered output (the log is a file)."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k.startswith(FORWARDED_ENV) and k not in withheld}
    env.update(PYTHONUNBUFFERED="1", RAY_JOB_STOP_WAIT_TIME_S=str(STOP_GRACE_S))
    return env


class LearnerJobs:
    """The learner jobs of one Ray cluster, through its job server (``ray.job_submission``)."""

    def __init__(self, client: Any, address: str):
        self.client, self.address = client, address

    @classmethod
    def connect(cls) -> LearnerJobs:
        """The job server of the cluster the CLI uses (``RAY_ADDRESS``, else the head ``pool deploy`` started),
        authenticated with that cluster's token: Ray's client sends ``Authorization: Bearer <token>`` from the
        process's token source (``RAY_AUTH_MODE=token`` + ``RAY_AUTH_TOKEN_PATH``, set by ``cluster_auth``)."""
        from ray.job_submission import JobSubmissionClient

        from services.cluster import auth as cluster_auth
        from services.cluster import head as cluster
        address = cluster.known_address()
        if not address:
            raise LearnerJobError("no Ray cluster: set RAY_ADDRESS or run `inflight pool deploy` first")
        token, dashboard = cluster.token_for(address), cluster.dashboard_address(address)
        if (missing := cluster.dashboard_missing(address)) and not os.environ.get("RAY_ADDRESS"):
            raise LearnerJobError(f"the Ray head at {address} runs without its dashboard, which hosts Ray's job "
                                  f"server ({missing}; install ray[default] for it); attach the learner in the "
                                  f"foreground instead: `inflight learner attach`")
        if token is not None and dashboard is None and not os.environ.get("RAY_ADDRESS"):
            raise LearnerJobError(f"the Ray head at {address} was started without its job server (by an older "
                                  f"`inflight pool deploy`); restart it: `inflight pool shutdown --stop-cluster`, "
                                  f"then `inflight pool deploy ...`")
        if token is not None:
            cluster_auth.use_token(token)
        if ":" in address and "://" not in address:
            cluster_auth.check_gcs(address, cluster_auth.client_token())
        try:  # with RAY_ADDRESS set, Ray asks that cluster's GCS for its dashboard address
            client = JobSubmissionClient(dashboard)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise LearnerJobError(f"the Ray job server of the cluster at {address} does not answer "
                                  f"({dashboard or 'address from its GCS'}): {err}") from None
        return cls(client, address)

    # ------------------------------------------------------------ queries
    def jobs_of(self, pool: str) -> list[tuple[Any, JobRecord]]:
        """The pool's learner jobs (Ray ``JobDetails`` and record), oldest first."""
        out = [(j, r) for j in self.client.list_jobs() if (r := JobRecord.of(j.metadata)) and r.pool == pool]
        return sorted(out, key=lambda jr: (jr[0].start_time or 0, jr[0].submission_id or ""))

    def latest(self, pool: str) -> tuple[Any, JobRecord]:
        jobs = self.jobs_of(pool)
        if not jobs:
            raise LearnerJobError(f"no learner job for pool {pool!r} on the Ray cluster at {self.address}; "
                                  f"start one with `inflight learner submit --pool {pool} --recipe ...`")
        return jobs[-1]

    def status(self, pool: str) -> JobStatus:
        """The pool's newest learner job."""
        job, record = self.latest(pool)
        return _status(job, record)

    # ------------------------------------------------------------ actions
    def require_pool(self, pool: str) -> None:
        """An error unless a rollout pool named ``pool`` runs on the cluster (asked through Ray Serve)."""
        from services import pool as pool_api
        from services.cluster import ray_runtime

        ray_runtime.connect(self.address)
        try:
            pool_api.connect(pool)
        except RuntimeError as err:
            raise LearnerJobError(str(err)) from None
        finally:
            ray_runtime.shutdown()

    def submit(self, record: JobRecord, withheld_env: tuple[str, ...] = (), wait_s: float = 60.0) -> JobStatus:
        """Submit ``record`` as the pool's learner job and wait (at most ``wait_s``) until Ray runs its driver;
        an error when the pool has a job that is not finished, or when the job fails at once."""
        jobs = self.jobs_of(record.pool)
        for job, _ in jobs:
            if str(job.status) not in TERMINAL:
                raise LearnerJobError(f"pool {record.pool!r} already has learner job {job.submission_id} "
                                      f"({job.status}); stop it first: `inflight learner stop --pool {record.pool}`")
        submission_id = next_submission_id(record.pool, [job.submission_id for job, _ in jobs])
        inflight = str(Path(sys.executable).with_name("inflight"))
        try:
            self.client.submit_job(entrypoint=record.entrypoint(inflight), submission_id=submission_id,
                                   runtime_env={"env_vars": forwarded_env(withheld_env)}, metadata=record.metadata())
        except RuntimeError as err:  # Ray refuses a submission id it has: another submit won the race
            raise LearnerJobError(f"could not submit learner job {submission_id} for pool {record.pool!r}: "
                                  f"{err}") from None
        state = self._wait(submission_id, lambda s: s != "PENDING", wait_s, "Ray to start the job's driver")
        if state == "FAILED":
            tail = self.client.get_job_logs(submission_id)[-3000:]
            raise LearnerJobFailed(f"learner job {submission_id} failed at once; its log ends:\n{tail}")
        return self.status(record.pool)

    def stop(self, pool: str, timeout_s: float = STOP_GRACE_S + 30) -> JobStatus:
        """Stop the pool's running learner job and wait until it has ended (at most ``timeout_s``)."""
        job, _ = self.latest(pool)
        if str(job.status) in TERMINAL:
            raise LearnerJobError(f"pool {pool!r} has no running learner job (the newest, {job.submission_id}, "
                                  f"is {job.status})")
        what = f"its driver (`inflight learner attach`: SIGTERM, SIGKILL after {STOP_GRACE_S} s) to exit"
        print(f"stopping learner job {job.submission_id} (pool {pool}): waiting up to {timeout_s:.0f} s for {what}",
              file=sys.stderr)
        self.client.stop_job(job.submission_id)
        self._wait(job.submission_id, lambda s: s in TERMINAL, timeout_s, what)
        return self.status(pool)

    def logs(self, pool: str, follow: bool = False, out=None) -> None:
        """Print the pool's newest learner job's log; with ``follow``, keep printing until the job ends."""
        out = out or sys.stdout
        job, _ = self.latest(pool)
        if not follow:
            out.write(self.client.get_job_logs(job.submission_id))
            return

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(job.submission_id):
                out.write(chunk)
                out.flush()
        asyncio.run(tail())

    def _wait(self, submission_id: str, done, timeout_s: float, what: str) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            state = str(self.client.get_job_status(submission_id))
            if done(state):
                return state
            if time.monotonic() > deadline:
                raise LearnerJobFailed(f"learner job {submission_id}: waited {timeout_s:.0f} s for {what}; it is "
                                      f"still {state}")
            time.sleep(0.5)


def exit_on_sigterm(signum: int, _frame) -> None:
    """A job's driver (``learner attach``) takes the SIGTERM of ``learner stop`` as Ctrl-C: its ``finally``
    detaches from the pool and ends the ranks (a second SIGTERM kills at once)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def next_submission_id(pool: str, taken: list[str | None]) -> str:
    """``inflight-learner-<pool>-<n>``, ``n`` one more than the pool's highest so far (Ray refuses an id it has,
    so of two concurrent submits one fails)."""
    prefix = f"inflight-learner-{pool}-"
    numbers = [int(t[len(prefix):]) for t in taken if t and t.startswith(prefix) and t[len(prefix):].isdigit()]
    return f"{prefix}{max(numbers, default=0) + 1}"


def _status(job: Any, record: JobRecord) -> JobStatus:
    ms = 1e-3
    return JobStatus(job.submission_id, str(job.status), job.message or "", record, last_step(record.run_dir),
                     latest_checkpoint(record.checkpoint_dir), job.start_time and job.start_time * ms,
                     job.end_time and job.end_time * ms)


def _age(t: float) -> str:
    s = max(0, int(time.time() - t))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
