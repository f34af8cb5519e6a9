"""Learner jobs (``services.learner_jobs``) against a small fake of Ray's ``JobSubmissionClient``.

The fake keeps jobs as Ray's job server lists them (``JobDetails``-like: submission id, status, metadata, times)
and moves a submitted job to RUNNING, a stopped one to STOPPED; the real server is exercised by
``tests/integration/services/test_learner_jobs.py``.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import time
from dataclasses import dataclass, field

import pytest

from services import cli
from services.recipe.config import load_recipe_with_report
from services.learner_jobs import (
    STOP_GRACE_S,
    JobRecord,
    LearnerJobError,
    LearnerJobFailed,
    LearnerJobs,
    exit_on_sigterm,
    forwarded_env,
    last_step,
    next_submission_id,
)


@dataclass
class FakeJob:
    submission_id: str
    status: str
    metadata: dict
    start_time: int = 1_000_000
    end_time: int | None = None
    message: str = ""
    entrypoint: str = ""
    runtime_env: dict = field(default_factory=dict)


class FakeClient:
    """Ray's job server as a dict; ``on_submit`` is the state a new job reaches, ``on_stop`` a stopped one's."""

    def __init__(self, jobs=(), on_submit="RUNNING", on_stop="STOPPED", logs=""):
        self.jobs = {j.submission_id: j for j in jobs}
        self.on_submit, self.on_stop, self.logs, self.stopped = on_submit, on_stop, logs, []

    def list_jobs(self):
        return list(self.jobs.values())

    def submit_job(self, entrypoint, submission_id, runtime_env, metadata):
        if submission_id in self.jobs:
            raise RuntimeError(f"Job with submission_id {submission_id} already exists.")
        start = max((j.start_time for j in self.jobs.values()), default=0) + 1
        self.jobs[submission_id] = FakeJob(submission_id, self.on_submit, metadata, start, entrypoint=entrypoint,
                                           runtime_env=runtime_env)

    def get_job_status(self, submission_id):
        return self.jobs[submission_id].status

    def stop_job(self, submission_id):
        self.stopped.append(submission_id)
        self.jobs[submission_id].status = self.on_stop
        return True

    def get_job_logs(self, submission_id):
        return self.logs


def record(tmp_path, pool="p", **kw) -> JobRecord:
    run = tmp_path / "runs" / "a"
    base = dict(pool=pool, run_dir=str(run), checkpoint_dir=str(run / "results" / "checkpoints"),
                recipe="/r/tiny cpu.yaml", overrides=("grpo.max_num_steps=3",), workdir=str(tmp_path))
    return JobRecord(**{**base, **kw})


def job(rec: JobRecord, n: int, status: str) -> FakeJob:
    return FakeJob(f"inflight-learner-{rec.pool}-{n}", status, rec.metadata(), start_time=n)


def test_record_round_trips_through_ray_metadata(tmp_path):
    rec = record(tmp_path, recipe=None)
    md = rec.metadata()
    assert all(isinstance(v, str) for v in md.values())           # Ray keeps metadata as strings
    assert JobRecord.of(md) == rec
    assert JobRecord.of({"owner": "someone else"}) is None and JobRecord.of(None) is None


def test_entrypoint_is_attach_in_the_submitters_directory(tmp_path):
    rec = record(tmp_path, workdir=str(tmp_path / "my dir"), overrides=("data.prompt='a b'",))
    cmd = rec.entrypoint("/venv/bin/inflight")
    cd, rest = cmd.split(" && exec ")
    assert shlex.split(cd) == ["cd", str(tmp_path / "my dir")]
    assert shlex.split(rest) == ["/venv/bin/inflight", "learner", "attach", "--pool", "p", "--run-dir", rec.run_dir,
                                 "--recipe", "/r/tiny cpu.yaml", "data.prompt='a b'"]


def test_record_for_recipe_resolves_paths_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, _ = load_recipe_with_report(None, ["checkpointing.checkpoint_dir=ck"])
    rec = JobRecord.for_recipe("p", recipe, "recipes/x.yaml", ["a=1"], "runs/b")
    assert (rec.run_dir, rec.checkpoint_dir) == (str(tmp_path / "runs/b"), str(tmp_path / "runs/b/ck"))
    assert rec.recipe == str(tmp_path / "recipes/x.yaml") and rec.workdir == str(tmp_path)
    recipe, _ = load_recipe_with_report(None, [f"checkpointing.checkpoint_dir={tmp_path}/abs"])
    default = JobRecord.for_recipe("p", recipe, None, [], None)
    assert default.run_dir == str(tmp_path / recipe.logger.log_dir) and default.checkpoint_dir == f"{tmp_path}/abs"
    assert default.recipe is None


def test_submission_ids_count_up_per_pool():
    assert next_submission_id("p", []) == "inflight-learner-p-1"
    assert next_submission_id("p", ["inflight-learner-p-1", "inflight-learner-p-7", None,
                                    "inflight-learner-p-x", "raysubmit_abc"]) == "inflight-learner-p-8"


def test_submit_records_the_job_and_withholds_the_admin_token(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_ADMIN_TOKEN", "secret")
    monkeypatch.setenv("HF_HOME", "/hf")
    rec = record(tmp_path)
    client = FakeClient([job(rec, 1, "STOPPED"), job(record(tmp_path, pool="other"), 5, "RUNNING")])
    status = LearnerJobs(client, "127.0.0.1:1").submit(rec, withheld_env=("INFLIGHT_ADMIN_TOKEN",))
    assert status.submission_id == "inflight-learner-p-2" and status.state == "RUNNING" and status.record == rec
    env = client.jobs["inflight-learner-p-2"].runtime_env["env_vars"]
    assert env["HF_HOME"] == "/hf" and "INFLIGHT_ADMIN_TOKEN" not in env
    assert env["RAY_JOB_STOP_WAIT_TIME_S"] == str(STOP_GRACE_S) and env["PYTHONUNBUFFERED"] == "1"
    assert " learner attach --pool p " in client.jobs["inflight-learner-p-2"].entrypoint


@pytest.mark.parametrize("state", ["PENDING", "RUNNING"])
def test_a_second_job_while_one_has_not_ended_is_refused(tmp_path, state):
    rec = record(tmp_path)
    client = FakeClient([job(rec, 1, state)])
    with pytest.raises(LearnerJobError, match=rf"pool 'p' already has learner job inflight-learner-p-1 \({state}\); "
                                              r"stop it first: `inflight learner stop --pool p`"):
        LearnerJobs(client, "a:1").submit(rec)
    assert list(client.jobs) == ["inflight-learner-p-1"]


def test_a_job_that_fails_at_once_shows_its_log(tmp_path):
    client = FakeClient(on_submit="FAILED", logs="Traceback ...\nValueError: policy.model_name: 'x' is not ...")
    with pytest.raises(LearnerJobFailed, match=r"inflight-learner-p-1 failed at once; its log ends:\n"
                                               r"Traceback[\s\S]*policy.model_name"):
        LearnerJobs(client, "a:1").submit(record(tmp_path))


def test_a_submit_that_loses_a_race_names_the_id(tmp_path):
    rec = record(tmp_path)
    client = FakeClient()
    client.list_jobs = lambda: []                        # the other submit is not listed yet, its id is taken
    client.jobs["inflight-learner-p-1"] = job(rec, 1, "RUNNING")
    with pytest.raises(LearnerJobError, match=r"could not submit learner job inflight-learner-p-1 .*already exists"):
        LearnerJobs(client, "a:1").submit(rec)


def test_status_shows_the_newest_job_with_its_step_and_checkpoint(tmp_path):
    rec = record(tmp_path)
    run = tmp_path / "runs" / "a"
    (run / "results" / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4}) + "\n" + json.dumps({"step": 5}) + "\n{\"step\": 6, ")
    (run / "results" / "checkpoints" / "latest").write_text("step_000005\n")
    client = FakeClient([job(rec, 2, "RUNNING"), job(rec, 1, "STOPPED"), job(record(tmp_path, pool="q"), 3, "RUNNING")])
    s = LearnerJobs(client, "a:1").status("p")
    assert (s.submission_id, s.state, s.step, s.checkpoint) == ("inflight-learner-p-2", "RUNNING", 5, "step_000005")
    assert s.line().startswith("learner job inflight-learner-p-2 (pool p): RUNNING, step 5, checkpoint step_000005, ")
    assert s.line().endswith(f", run dir {run}")
    assert json.loads(json.dumps(s.as_dict()))["record"]["pool"] == "p"


def test_status_of_a_failed_job_says_why_and_a_run_without_rows_says_so(tmp_path):
    failed = job(record(tmp_path), 1, "FAILED")
    failed.message, failed.end_time = "Job entrypoint command failed with exit code 1", 5
    line = LearnerJobs(FakeClient([failed]), "a:1").status("p").line()
    assert "FAILED, no step yet, run dir " in line
    assert line.endswith("-- Job entrypoint command failed with exit code 1")


def test_status_logs_and_stop_without_a_job_name_the_pool(tmp_path):
    jobs = LearnerJobs(FakeClient([job(record(tmp_path, pool="q"), 1, "RUNNING")]), "127.0.0.1:9")
    for call in (lambda: jobs.status("p"), lambda: jobs.stop("p"), lambda: jobs.logs("p")):
        with pytest.raises(LearnerJobError, match=r"no learner job for pool 'p' on the Ray cluster at 127.0.0.1:9; "
                                                  r"start one with `inflight learner submit --pool p"):
            call()


def test_stop_waits_until_the_job_has_ended(tmp_path):
    client = FakeClient([job(record(tmp_path), 1, "RUNNING")])
    s = LearnerJobs(client, "a:1").stop("p")
    assert client.stopped == ["inflight-learner-p-1"] and s.state == "STOPPED"


def test_stop_of_an_ended_job_is_an_error_and_a_stuck_one_times_out_naming_what_it_waits_for(tmp_path):
    with pytest.raises(LearnerJobError, match=r"pool 'p' has no running learner job \(the newest, "
                                              r"inflight-learner-p-1, is SUCCEEDED\)"):
        LearnerJobs(FakeClient([job(record(tmp_path), 1, "SUCCEEDED")]), "a:1").stop("p")
    stuck = FakeClient([job(record(tmp_path), 1, "RUNNING")], on_stop="RUNNING")
    with pytest.raises(LearnerJobFailed, match=r"inflight-learner-p-1: waited 0 s for its driver "
                                               r"\(`inflight learner attach`: SIGTERM, SIGKILL after 30 s\) to exit; "
                                               r"it is still RUNNING"):
        LearnerJobs(stuck, "a:1").stop("p", timeout_s=0.01)


def test_logs_prints_the_newest_jobs_log(tmp_path, capsys):
    LearnerJobs(FakeClient([job(record(tmp_path), 1, "RUNNING")], logs="step 1\nstep 2\n"), "a:1").logs("p")
    assert capsys.readouterr().out == "step 1\nstep 2\n"


def test_forwarded_env_takes_the_named_prefixes_only():
    env = forwarded_env(("INFLIGHT_ADMIN_TOKEN",), {"INFLIGHT_HOME": "/h", "INFLIGHT_ADMIN_TOKEN": "t", "HF_HOME": "/f",
                                                   "WANDB_MODE": "offline", "PATH": "/bin", "RAY_ADDRESS": "x:1"})
    assert env == {"INFLIGHT_HOME": "/h", "HF_HOME": "/f", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
                   "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)}


def test_last_step_of_a_missing_or_empty_run(tmp_path):
    assert last_step(tmp_path / "nowhere") is None
    (tmp_path / "metrics.jsonl").write_text("")
    assert last_step(tmp_path) is None


def test_cli_without_a_cluster_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "inflight"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for argv in (["learner", "status"], ["learner", "logs", "--pool", "p"], ["learner", "stop"]):
        assert cli.main(argv) == cli.EXIT_USER_ERROR
        err = capsys.readouterr().err
        assert err == "inflight: no Ray cluster: set RAY_ADDRESS or run `inflight pool deploy` first\n", err


def test_cli_against_a_head_without_its_job_server_says_how_to_restart_it(tmp_path, monkeypatch, capsys):
    home = tmp_path / "inflight"
    home.mkdir()
    (home / "cluster.json").write_text(json.dumps({"address": "127.0.0.1:9", "token_path": str(home / "tok"),
                                                   "temp_dir": str(tmp_path)}))
    monkeypatch.setenv("INFLIGHT_HOME", str(home))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["learner", "status"]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "was started without its job server" in err and "inflight pool shutdown --stop-cluster" in err, err


def test_sigterm_exits_through_finally_once_then_kills():
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    try:
        signal.signal(signal.SIGTERM, exit_on_sigterm)
        with pytest.raises(SystemExit) as exc:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)                                   # interrupted by the handler
            finally:
                cleaned.append(True)                            # what `learner attach` runs: detach, end ranks
        assert exc.value.code == 128 + signal.SIGTERM and cleaned == [True]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second SIGTERM kills at once
    finally:
        signal.signal(signal.SIGTERM, before)
