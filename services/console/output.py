"""What ``inflight run``, ``pool deploy`` and ``learner attach`` print, and where the libraries' logs go instead.

Quiet (the default), the console shows what Inflight prints (the endpoints, the progress bar, the tables and
file paths), Inflight's log records at WARNING and above, those of its actors attributed to the actor
(``(EngineActor pid=123) WARNING inflight.engine: ...``), and the ERROR lines of Ray, Serve and vLLM in any
process. The rest goes to RUN_DIR/logs: ``driver.log`` (this process: Ray's and Serve's records, Python
warnings, Inflight's INFO records; rotated) and ``ray/`` (the Ray session's own per-process logs: each actor's
stdout and stderr, vLLM's engine processes included, Serve's logs, the raylet's; rotated by Ray). ``--verbose``
prints everything as Ray does and writes the same files.

How: Ray forwards every actor's output to the driver (``log_to_driver``). :func:`setup_worker` (Ray's
``worker_process_setup_hook``, in every actor) marks the lines of Inflight's records at WARNING and above, and
quiet, the driver prints only the forwarded lines :func:`console_line` keeps. Filtering where the lines arrive
catches whatever a library prints, from any process (C++ warnings, tqdm bars, vLLM's subprocesses), without
configuring each library. Ray has no public hook for it: :func:`forward_actor_lines` wraps the printer its
dispatcher calls (``ray._private.ray_logging``); a test checks that the pinned Ray still has it.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import re
import shutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

INFLIGHT_LOGGERS = ("inflight", "services", "rollout", "learner", "protocol")
"""Inflight's loggers: ``inflight.*`` and the packages' ``__name__`` loggers."""
MARK = "[inflight] "
"""Begins each line an actor writes for an Inflight record at WARNING or above; the quiet console keeps those."""
WORKER_SETUP_HOOK = "services.console.output.setup_worker"
ROTATE_BYTES = 16 * 1024 * 1024
"""Size at which ``driver.log`` and (``RAY_ROTATION_MAX_BYTES`` unless set) Ray's per-process logs rotate."""
ROTATE_BACKUPS = 4
"""Rotated files kept per log (``RAY_ROTATION_BACKUP_COUNT`` unless set)."""
LIBRARY_ERROR = re.compile(r"^(?:\([^)]*\)\s*)?(?:[\d/:,. -]+\s)?(?:ERROR|CRITICAL|FATAL)\b")
"""A library's error line: the level first, or after a time stamp and a ``(process pid=N)`` prefix, in the
formats of vLLM (``ERROR 12-02 08:49:32 [core.py:1] ...``), Ray (``2026-12-02 08:49:09,268\tERROR ...``),
Serve (``ERROR 2026-12-02 ...``) and Python's ``basicConfig`` (``ERROR:asyncio:...``)."""
TASK_HEADER = re.compile(r"ray::(?P<function>[\w.]+)\(\)\s*\(pid=(?P<pid>\d+)")
"""How a ``RayTaskError`` names where it happened: ``ray::LearnerActor.save_checkpoint() (pid=4242, ...``."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LIBRARY_LOGGERS = ("ray", "ray.serve")
"""The driver's library loggers that have their own console handlers and do not propagate."""
RAY_PRINTER = "ray_print_logs"
"""The name under which ``ray.init(log_to_driver=True)`` registers Ray's printer of forwarded lines."""


@dataclass(frozen=True)
class Console:
    """The console of this process, as :func:`setup` made it."""

    log_dir: Path
    """RUN_DIR/logs."""
    verbose: bool
    """Libraries print on the console as they do without Inflight."""

    @property
    def driver_log(self) -> Path:
        return self.log_dir / "driver.log"

    @property
    def ray_logs(self) -> Path:
        """Where the Ray session's logs appear: a link to them while the cluster runs, a copy of a private
        cluster's after it stopped."""
        return self.log_dir / "ray"


_active: Console | None = None


def active() -> Console | None:
    """The console :func:`setup` made in this process, or None (a library use: nothing was changed)."""
    return _active


def setup(run_dir: Path, verbose: bool = False) -> Console:
    """Make this process's console quiet (or, ``verbose``, leave the libraries printing) and open
    RUN_DIR/logs/driver.log. Call it before Ray starts: it also sets Ray's log rotation
    (``RAY_ROTATION_MAX_BYTES`` / ``RAY_ROTATION_BACKUP_COUNT``, unless set) for the clusters this process
    starts, private or ``ray start``."""
    global _active
    import ray.serve  # noqa: F401 - configures Serve's driver logger at import: it must be done before we re-route it

    console = Console(Path(run_dir) / "logs", verbose)
    console.log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_ROTATION_MAX_BYTES", str(ROTATE_BYTES))
    os.environ.setdefault("RAY_ROTATION_BACKUP_COUNT", str(ROTATE_BACKUPS))
    file_handler = logging.handlers.RotatingFileHandler(console.driver_log, maxBytes=ROTATE_BYTES,
                                                        backupCount=ROTATE_BACKUPS)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    screen = logging.StreamHandler(sys.stderr)
    screen.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not verbose:
        screen.addFilter(_on_screen)
    root, libraries = logging.getLogger(), [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    for logger in (root, *libraries):  # a second setup replaces the first one's handlers
        for handler in [h for h in logger.handlers if getattr(h, "_inflight", False)]:
            logger.removeHandler(handler)
            handler.close()
    for handler in (file_handler, screen):
        handler._inflight = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    for name in INFLIGHT_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    for lib in libraries:  # they print through their own handlers and do not propagate
        if verbose:
            lib.addHandler(file_handler)  # as before on the console, and filed too
        else:
            for handler in [h for h in lib.handlers if _is_stream(h)]:
                lib.removeHandler(handler)
            lib.propagate = True  # through ours instead
    if not verbose:
        logging.captureWarnings(True)  # Python warnings: driver.log (they are WARNING records of py.warnings)
    _active = console
    return console


def _is_stream(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def _is_inflight(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in INFLIGHT_LOGGERS)


def _on_screen(record: logging.LogRecord) -> bool:
    """Quiet: Inflight's records at WARNING and above, the others' at ERROR and above; not a traceback
    :func:`failure_line` leaves to driver.log."""
    floor = logging.WARNING if _is_inflight(record.name) else logging.ERROR
    return record.levelno >= floor and not getattr(record, "file_only", False)


class _ActorFormatter(logging.Formatter):
    """An actor's Inflight record: marked (:data:`MARK`) at WARNING and above, for the quiet console."""

    def __init__(self):
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return MARK + text if record.levelno >= logging.WARNING else text


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` (every actor of the job and the actors they make): Inflight's
    records go to this process's stderr, which Ray keeps in the process's log file and forwards to the
    driver; those at WARNING and above are marked for the quiet console."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ActorFormatter())
    for name in INFLIGHT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if not isinstance(h.formatter, _ActorFormatter)] + [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def runtime_env() -> dict:
    """The job's runtime environment: :func:`setup_worker` in each of its actor processes."""
    return {"worker_process_setup_hook": WORKER_SETUP_HOOK}


def kept_lines(data: dict) -> list[str]:
    """The lines of one batch Ray forwarded (its dict: ``pid``, ``lines``, ``actor_name``, ...) that the quiet
    console prints: Inflight's marked records (unmarked), library error lines, and what the raylet and the
    autoscaler send (Ray's printer keeps only the autoscaler's events: a request that cannot be scheduled)."""
    lines = data.get("lines", [])
    if data.get("pid") in ("raylet", "autoscaler"):
        return list(lines)
    return [line[len(MARK):] if line.startswith(MARK) else line for line in lines
            if line.startswith(MARK) or LIBRARY_ERROR.match(line)]


def forward_actor_lines() -> bool:
    """After ``ray.init(log_to_driver=True)``: quiet, wrap Ray's printer of the actors' forwarded lines so that
    it prints only :func:`kept_lines` (with Ray's own prefix, ``(EngineActor pid=123)``). False when nothing
    was changed (no quiet console, or a Ray without that printer: it then prints everything, and a warning
    says so)."""
    if _active is None or _active.verbose:
        return False
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        printer = dict(dispatcher.handlers)[RAY_PRINTER]
    except (ImportError, AttributeError, KeyError) as exc:
        logging.getLogger("inflight.console").warning(
            "console: this Ray has no printer %r to filter (%s: %s); the actors' lines are printed unfiltered",
            RAY_PRINTER, type(exc).__name__, exc)
        return False
    if isinstance(printer, _Filtered):
        return True
    dispatcher.remove_handler(RAY_PRINTER)  # same name: ray.shutdown() removes it as it removes its own
    dispatcher.add_handler(RAY_PRINTER, _Filtered(printer))
    return True


@dataclass(frozen=True)
class _Filtered:
    """Ray's printer, given only the :func:`kept_lines` of each batch."""

    printer: Callable[[dict], None]

    def __call__(self, data: dict) -> None:
        if kept := kept_lines(data):
            self.printer({**data, "lines": kept})


def link_ray_logs(session_logs: Path) -> None:
    """RUN_DIR/logs/ray: a link to the running Ray session's logs directory."""
    if _active is None:
        return
    link = _active.ray_logs
    if link.is_symlink():
        link.unlink()
    elif link.exists():  # the copy of an earlier run into the same directory
        shutil.rmtree(link)
    link.symlink_to(session_logs.resolve(), target_is_directory=True)


def keep_ray_logs() -> None:
    """After a private cluster stopped: replace the link RUN_DIR/logs/ray by a copy of what it points to (the
    cluster's temporary directory is removed next)."""
    if _active is None or not _active.ray_logs.is_symlink():
        return
    link = _active.ray_logs
    source = link.resolve()
    link.unlink()
    try:
        shutil.copytree(source, link, symlinks=True, ignore_dangling_symlinks=True)
    except OSError as exc:
        logging.getLogger("inflight.console").warning("console: could not copy Ray's logs %s to %s: %s",
                                                      source, link, exc)


def is_actor_error(exc: BaseException) -> bool:
    """Whether ``exc`` came out of Ray: an actor's exception, a dead actor, a lost object."""
    exceptions = sys.modules.get("ray.exceptions")
    return exceptions is not None and isinstance(exc, exceptions.RayError)


def failure_line(exc: BaseException) -> str:
    """One line for an error that came out of an actor: the actor's method and process when Ray names them
    (a ``RayTaskError``, also as the dual instance ``ray.get`` raises), then the cause's type and first line;
    the whole traceback goes to driver.log."""
    cause = getattr(exc, "cause", None)
    inner = cause if isinstance(cause, BaseException) else exc
    first = next((ln.strip() for ln in str(inner).splitlines() if ln.strip()), "")
    task = TASK_HEADER.search(ANSI.sub("", str(exc))) if inner is not exc else None
    where = f"{task['function']} (pid {task['pid']}) failed: " if task else ""
    line = f"{where}{type(inner).__name__}: {first}" if first else f"{where}{type(inner).__name__}"
    if _active is None:
        return line
    logging.getLogger("inflight.console").error(
        "%s\n%s", line, "".join(traceback.format_exception(exc)), extra={"file_only": True})
    return f"{line} (traceback: {_active.driver_log})"
