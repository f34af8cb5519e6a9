"""The operator's path, as a user walks it: README's "Deploy a pool, attach a learner" block.

HOME is a fresh directory that already holds ``~/.ray/auth_token`` (what any earlier local
``ray.init``, e.g. ``make run``, leaves): Ray 2.60's ``ray start --head`` then turns token
authentication on, and every client must agree with it. The commands are read from README.md
and run one by one through bash; the test only appends overrides that keep the recipe tiny, runs
them in a scratch directory (``runs/a`` lands there) and picks a free HTTP port. Afterwards no
process of that head node and none of the ``/dev/shm`` entries they held may remain.

``test_cluster_cycles_leave_nothing`` runs three head start/stop cycles (each with a driver and
a detached actor, so workers and Ray's self-renaming agents exist: ``idle_workers.py``) and prints the
times; in the first, that driver sees no idle worker on the head.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from services.cluster import head as cluster

from test_cluster_workers import WAIT_S, idle_workers_seen

ROOT = Path(__file__).resolve().parents[3]
README_SECTION = "## Deploy a pool, attach a learner"
README_PORT = "8123"
TINY = ("grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "logger.tensorboard_enabled=false")
STALE_RAY_TOKEN = "0123456789abcdef" * 4


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(README_SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def user_env(home: Path) -> dict[str, str]:
    """The environment of a user's shell: a HOME of its own, no Ray/Inflight variables set."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "INFLIGHT_HOME", "PYTEST"))}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    return env


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HOME left by an earlier local Ray run (``~/.ray/auth_token`` exists), INFLIGHT_HOME unset."""
    h = tmp_path / "home"
    (h / ".ray").mkdir(parents=True)
    (h / ".ray" / "auth_token").write_text(STALE_RAY_TOKEN)
    for var in ("RAY_ADDRESS", "INFLIGHT_HOME", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(h))
    yield h
    if (h / ".inflight" / "cluster.json").exists():          # a failed test must not leave its head running
        cluster.stop_cluster()


def head_processes(temp_dir: str, home: Path) -> list[psutil.Process]:
    """Every process of the head node: those naming its temp dir or running with its HOME, and all their
    descendants (walked here through parent PIDs, independently of ``services.cluster.procs``)."""
    procs, children = {}, {}
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        children.setdefault(p.info["ppid"], []).append(p)
        try:
            mine = p.environ().get("HOME") == str(home)
        except psutil.Error:
            mine = False
        if mine or any(temp_dir in a for a in p.info["cmdline"] or []):
            procs[p.pid] = p
    todo = list(procs)
    while todo:
        for c in children.get(todo.pop(), []):
            if c.pid not in procs:
                procs[c.pid] = c
                todo.append(c.pid)
    procs.pop(os.getpid(), None)
    return list(procs.values())


def survivors(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()} ({p.memory_info().rss >> 20} MiB)")
        except psutil.Error:
            continue
    return out


def rss_mib(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total >> 20


def shm_of(procs: list[psutil.Process]) -> set[str]:
    """``/dev/shm`` entries these processes have open or mapped (other test runs on the machine create and
    remove their own entries meanwhile, so only entries of this head node's processes are checked)."""
    held = set()
    for p in procs:
        try:
            held |= {line.split("/dev/shm/", 1)[1].split()[0] for line in open(f"/proc/{p.pid}/maps")
                     if "/dev/shm/" in line}
            held |= {f.path[len("/dev/shm/"):] for f in p.open_files() if f.path.startswith("/dev/shm/")}
        except (OSError, psutil.Error):
            continue
    return held


def shm_left(entries: set[str]) -> set[str]:
    return entries & set(os.listdir("/dev/shm"))


def json_tail(stdout: str) -> dict:
    """The JSON document a command prints last (Ray and Serve may log lines before it)."""
    start = 0 if stdout.startswith("{") else stdout.rindex("\n{") + 1
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


def _bash(cmd: str, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"`{cmd}` exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def test_readme_deploy_attach_shutdown(home, tmp_path):
    from services.cluster.head import free_port

    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", "recipes"):
        (work / name).symlink_to(ROOT / name)
    env = user_env(home)
    port = str(free_port())
    cmds = readme_commands()
    assert [c.split()[:3] for c in cmds if c.startswith(".venv/bin/inflight")] == [
        [".venv/bin/inflight", "pool", "deploy"], [".venv/bin/inflight", "pool", "status"],
        [".venv/bin/inflight", "learner", "attach"], [".venv/bin/inflight", "pool", "shutdown"]]
    outputs, procs = {}, []
    for cmd in cmds:
        cmd = cmd.replace(README_PORT, port)
        if cmd.startswith("export "):
            name = cmd.split()[1].split("=")[0]
            env[name] = _bash(f'{cmd}; printf %s "${name}"', env, work, 30).stdout
            assert len(env[name]) >= 32
            continue
        if cmd.split()[1:3] in (["pool", "deploy"], ["learner", "attach"]):
            cmd += " " + " ".join(TINY)
        if cmd.split()[1:3] == ["pool", "shutdown"]:
            state = json.loads((home / ".inflight" / "cluster.json").read_text())
            procs = head_processes(state["temp_dir"], home)
            shm = shm_of(procs)
            _no_token_client_gets_one_line(state["address"], tmp_path, env, work)
        t0 = time.monotonic()
        outputs[" ".join(cmd.split()[:3])] = _bash(cmd, env, work, 400).stdout
        print(f"{cmd[:60]}: {time.monotonic() - t0:.1f} s")

    assert json_tail(outputs[".venv/bin/inflight pool deploy"])["ready"] is True
    status = outputs[".venv/bin/inflight pool status"]
    assert re.search(r"^pool inflight-pool: version 0, ready", status, re.M), status[-2000:]
    assert re.search(r"^inflight-pool-engine-0\s+up\s+0\s", status, re.M), status[-2000:]
    steps = [json.loads(line)["step"] for line in (work / "runs" / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    curl = outputs["curl -s 127.0.0.1:" + port + "/readyz;"]
    assert '"ready":true' in curl.replace(" ", ""), curl[:500]
    assert re.search(r"^inflight_policy_version 3(\.0)?$", curl, re.M), curl[-3000:]
    assert "local Ray cluster stopped" in outputs[".venv/bin/inflight pool shutdown"]

    state_dir = home / ".inflight"
    assert state["auth_mode"] == "token" and Path(state["token_path"]).parent == state_dir
    assert not (state_dir / "cluster.json").exists() and not Path(state["token_path"]).exists()
    assert len(procs) >= 6, f"found only {len(procs)} processes of the head node"
    time.sleep(1)
    assert not survivors(procs), f"processes of the stopped head survived: {survivors(procs)}"
    assert not shm_left(shm), f"/dev/shm entries left behind: {sorted(shm_left(shm))}"


def _no_token_client_gets_one_line(address: str, tmp_path: Path, env: dict[str, str], work: Path) -> None:
    """A client without the head's token (another INFLIGHT_HOME) fails at once with one line saying what to do."""
    stranger = dict(env, RAY_ADDRESS=address, INFLIGHT_HOME=str(tmp_path / "elsewhere"))
    t0 = time.monotonic()
    out = subprocess.run([".venv/bin/inflight", "pool", "status"], env=stranger, cwd=work, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - t0 < 15
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "requires a token" in lines[0] and "INFLIGHT_HOME" in lines[0], out.stderr[-2000:]


def test_cluster_cycles_leave_nothing(home):
    for cycle in range(3):
        t0 = time.monotonic()
        address = cluster.ensure_cluster()
        started = time.monotonic() - t0
        state = json.loads(cluster.state_file().read_text())
        assert stat_mode(Path(state["token_path"])) == 0o600 and state["auth_mode"] == "token"
        # a driver and its detached actor; in the first cycle it also looks for idle workers while it runs
        idle = idle_workers_seen(address, user_env(home), wait_s=WAIT_S if cycle == 0 else 0)
        if cycle == 0:  # no Python worker started for a driver that nothing of Inflight's uses
            assert idle == 0
        procs = head_processes(state["temp_dir"], home)
        mem, shm = rss_mib(procs), shm_of(procs)
        names = " ".join(p.name() for p in procs if p.is_running())
        assert "ray::DashboardAgent" in names and "ray::RuntimeEnvAgent" in names and "raylet" in names, names
        t1 = time.monotonic()
        assert cluster.stop_cluster() is True
        stopped = time.monotonic() - t1
        time.sleep(0.5)
        print(f"cycle {cycle}: start {started:.1f} s, stop {stopped:.1f} s, {len(procs)} processes, "
              f"{mem} MiB, {len(shm)} /dev/shm entries before stop")
        assert not survivors(procs), f"cycle {cycle}: processes of the stopped head survived: {survivors(procs)}"
        assert not cluster.state_file().exists()
        assert not shm_left(shm), f"cycle {cycle}: /dev/shm entries left behind: {sorted(shm_left(shm))}"


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777
