"""The quiet console: which lines reach the terminal, which go to RUN_DIR/logs, and the one line of an actor's error.

The lines are in the formats the libraries really print (copied from a run of ``inflight run``); the dispatcher is
Ray's own (the pinned Ray must still have it), given a recording printer in place of Ray's.
"""
from __future__ import annotations

import logging
import os

import pytest

from services.console import output as console

FORWARDED = [
    "[inflight] WARNING inflight.pool: pool inflight-pool: engine inflight-pool-engine-0 died with 4 prompts",
    "INFO inflight.pool: pool inflight-pool: scaled from 1 to 2 engines",
    "(EngineCore pid=14714) INFO 12-02 08:49:32 [core.py:133] Initializing a V1 LLM engine (v0.32.0)",
    "(EngineCore pid=14714) WARNING 12-02 08:49:44 [vllm.py:725] Model Runner V2 requires Triton",
    "(EngineCore pid=14714) ERROR 12-02 08:50:01 [core.py:900] EngineCore encountered a fatal error.",
    "ERROR 12-02 08:50:01 [core.py:901] Traceback (most recent call last):",
    "INFO 2026-12-02 08:49:13,679 proxy 192.0.2.2 -- Got updated endpoints: {}.",
    "ERROR 2026-12-02 08:49:13,679 controller 14480 -- Exception in deployment 'RolloutPool'",
    "2026-12-02 08:49:09,268\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled",
    "2026-12-02 08:49:09,268\tERROR worker.py:432 -- Unhandled error (suppress with RAY_IGNORE_UNHANDLED_ERRORS)",
    "ERROR:asyncio:Task exception was never retrieved",
    "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 80.09it/s]",
    "  warnings.warn(\"Apex is not installed. Falling back to Torch Norm\")",
    "[W1202 08:49:39.117487375 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
    "INFO 12-02 08:50:04 [scheduler.py:2756] an ERROR in the message is not an error line",
]


def test_the_quiet_console_keeps_inflight_warnings_unmarked_and_library_errors_only():
    kept = console.kept_lines({"pid": 14660, "actor_name": "EngineActor", "lines": FORWARDED})
    assert kept == [
        "WARNING inflight.pool: pool inflight-pool: engine inflight-pool-engine-0 died with 4 prompts",
        "(EngineCore pid=14714) ERROR 12-02 08:50:01 [core.py:900] EngineCore encountered a fatal error.",
        "ERROR 12-02 08:50:01 [core.py:901] Traceback (most recent call last):",
        "ERROR 2026-12-02 08:49:13,679 controller 14480 -- Exception in deployment 'RolloutPool'",
        "2026-12-02 08:49:09,268\tERROR worker.py:432 -- Unhandled error (suppress with RAY_IGNORE_UNHANDLED_ERRORS)",
        "ERROR:asyncio:Task exception was never retrieved",
    ]


def test_the_raylet_and_the_autoscaler_are_passed_to_rays_printer():
    lines = ["A worker died or was killed while executing a task by an unexpected system error."]
    assert console.kept_lines({"pid": "raylet", "lines": lines}) == lines
    assert console.kept_lines({"pid": "autoscaler", "lines": lines}) == lines  # Ray's printer keeps its events


def test_an_actors_inflight_records_are_marked_from_warning_up(capsys):
    console.setup_worker()
    console.setup_worker()  # a second call does not print twice
    logging.getLogger("inflight.engine").info("engine e0: started")
    logging.getLogger("rollout.engine").warning("engine e0: gpu_memory_utilization ignored on cpu")
    logging.getLogger("learner.trainer").error("learner step 3 skipped: non-finite loss")
    err = capsys.readouterr().err.splitlines()
    assert err == ["INFO inflight.engine: engine e0: started",
                   "[inflight] WARNING rollout.engine: engine e0: gpu_memory_utilization ignored on cpu",
                   "[inflight] ERROR learner.trainer: learner step 3 skipped: non-finite loss"]
    for name in console.INFLIGHT_LOGGERS:
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


@pytest.fixture
def fresh_logging(monkeypatch):
    """Undo what :func:`console.setup` changes in this process: root and Ray's loggers, warnings capture, the
    rotation variables, the active console."""
    root, ray_loggers = logging.getLogger(), [logging.getLogger(n) for n in console.LIBRARY_LOGGERS]
    saved = (list(root.handlers), root.level, [(lg.handlers[:], lg.propagate) for lg in ray_loggers])
    for var in ("RAY_ROTATION_MAX_BYTES", "RAY_ROTATION_BACKUP_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(console, "_active", None)  # restored to None after the test
    yield
    for handler in root.handlers[:]:
        if handler not in saved[0]:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(saved[1])
    for lg, (handlers, propagate) in zip(ray_loggers, saved[2], strict=True):
        lg.handlers, lg.propagate = handlers, propagate
    logging.captureWarnings(False)
    for name in console.INFLIGHT_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)


def _log_everywhere() -> None:
    logging.getLogger("inflight.job").info("resumed from step 3")
    logging.getLogger("inflight.job").warning("refit attempt 1/3 failed")
    logging.getLogger("ray.serve").info("Started Serve in namespace 'serve'")
    logging.getLogger("ray._private.worker").warning("Token authentication is enabled")
    logging.getLogger("ray._private.worker").error("A worker died or was killed")


def test_quiet_the_driver_prints_inflight_warnings_and_library_errors_and_files_the_rest(tmp_path, capsys,
                                                                                       fresh_logging):
    c = console.setup(tmp_path, verbose=False)
    _log_everywhere()
    assert capsys.readouterr().err.splitlines() == ["WARNING inflight.job: refit attempt 1/3 failed",
                                                    "ERROR ray._private.worker: A worker died or was killed"]
    text = c.driver_log.read_text()
    for line in ("INFO inflight.job: resumed from step 3", "INFO ray.serve: Started Serve",
                 "WARNING ray._private.worker: Token authentication", "ERROR ray._private.worker: A worker died"):
        assert line in text
    assert c.driver_log == tmp_path / "logs" / "driver.log"
    assert console.active() is c
    assert int(os.environ["RAY_ROTATION_MAX_BYTES"]) == console.ROTATE_BYTES  # for the clusters it starts


def test_verbose_the_driver_prints_everything_and_still_files_it(tmp_path, capsys, fresh_logging):
    c = console.setup(tmp_path, verbose=True)
    _log_everywhere()
    err = capsys.readouterr().err
    assert "INFO inflight.job: resumed from step 3" in err
    serve_screens = [h for h in logging.getLogger("ray.serve").handlers if console._is_stream(h)]
    assert serve_screens  # Serve keeps printing through its own handler, as without Inflight (its stream is
    # the stderr of whichever test imported Serve first, so capsys cannot be asked)
    filed = c.driver_log.read_text()
    assert "WARNING ray._private.worker: Token authentication" in filed and "INFO ray.serve: Started Serve" in filed


def test_the_quiet_console_wraps_rays_printer_in_the_pinned_rays_dispatcher(tmp_path, fresh_logging):
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed: list[dict] = []
    dispatcher.add_handler(console.RAY_PRINTER, printed.append)
    try:
        console.setup(tmp_path, verbose=False)
        assert console.forward_actor_lines()
        assert console.forward_actor_lines()  # idempotent: wrapped once
        dispatcher.emit({"pid": 7, "actor_name": "LearnerActor", "is_err": True, "lines": FORWARDED[:3]})
        dispatcher.emit({"pid": 7, "actor_name": "LearnerActor", "is_err": False, "lines": FORWARDED[6:7]})
    finally:
        dispatcher.remove_handler(console.RAY_PRINTER)
    assert printed == [{"pid": 7, "actor_name": "LearnerActor", "is_err": True,
                        "lines": ["WARNING inflight.pool: pool inflight-pool: engine inflight-pool-engine-0 died "
                                  "with 4 prompts"]}]


def test_verbose_leaves_rays_printer_alone(tmp_path, fresh_logging):
    console.setup(tmp_path, verbose=True)
    assert not console.forward_actor_lines()


def test_an_actors_exception_is_one_line_naming_its_method_and_process(tmp_path, capsys, fresh_logging):
    from ray.exceptions import RayTaskError

    c = console.setup(tmp_path, verbose=False)
    try:
        raise OSError("[Errno 20] Not a directory: 'step_000001/model'")
    except OSError as cause:
        err = RayTaskError("LearnerActor.save_checkpoint", "Traceback (most recent call last): ...", cause,
                           proctitle="ray::LearnerActor.save_checkpoint", pid=4242, ip="127.0.0.1")
    dual = err.as_instanceof_cause()  # what ray.get raises: an OSError too, with Ray's text
    assert isinstance(dual, OSError) and console.is_actor_error(dual) and not console.is_actor_error(OSError("x"))
    line = console.failure_line(err)
    assert line == (f"LearnerActor.save_checkpoint (pid 4242) failed: OSError: [Errno 20] Not a directory: "
                    f"'step_000001/model' (traceback: {c.driver_log})")
    assert console.failure_line(dual) == line
    assert capsys.readouterr().err == ""  # the traceback is in driver.log only
    logged = c.driver_log.read_text()
    assert line.split(" (traceback")[0] in logged and "ray::LearnerActor.save_checkpoint()" in logged


def test_a_failure_without_a_console_is_its_type_and_first_line():
    assert console.failure_line(RuntimeError("engine gone\nmore")) == "RuntimeError: engine gone"


def test_ray_logs_are_linked_while_the_cluster_runs_and_copied_after(tmp_path, fresh_logging):
    session = tmp_path / "ray-tmp" / "session_1" / "logs"
    (session / "serve").mkdir(parents=True)
    (session / "worker-1.out").write_text("INFO vllm engine started\n")
    c = console.setup(tmp_path / "run", verbose=False)
    console.link_ray_logs(session)
    assert c.ray_logs.is_symlink() and (c.ray_logs / "worker-1.out").read_text() == "INFO vllm engine started\n"
    console.link_ray_logs(session)  # again (a second connect): still one link
    console.keep_ray_logs()
    assert not c.ray_logs.is_symlink() and (c.ray_logs / "worker-1.out").read_text() == "INFO vllm engine started\n"
    assert (c.ray_logs / "serve").is_dir()
    console.link_ray_logs(session)  # a later run into the same directory replaces the copy by a link
    assert c.ray_logs.is_symlink()


def test_a_second_setup_replaces_the_first_handlers(tmp_path, fresh_logging):
    console.setup(tmp_path / "a")
    console.setup(tmp_path / "b")
    mine = [h for h in logging.getLogger().handlers if getattr(h, "_inflight", False)]
    assert len(mine) == 2 and any(getattr(h, "baseFilename", "").startswith(str(tmp_path / "b")) for h in mine)
