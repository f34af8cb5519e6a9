"""Learner jobs on Ray Jobs, as a user runs them: README's ``learner submit|status|logs|stop`` block.

The block (the second one of "Deploy a pool, attach a learner") runs command by command through bash on a
real ``ray start`` head node with token authentication and its dashboard (the job server), in a scratch
directory with a HOME of its own (the helpers of ``test_operator_path``). The test appends overrides that keep
the recipe tiny; the first job is given more steps than it will reach (it is stopped), the re-submit exactly one
more than the checkpoint it resumes from, so that ``logs --follow`` returns when that job ends. Checked: the
job runs and steps, a second submit while it runs is refused, stop waits until the job has ended and its
learner has detached from the pool, the re-submit continues the run (metrics rows, policy version, the prompt
ledger) and ends, and no process of the head survives.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import test_operator_path
from test_operator_path import (
    README_SECTION,
    ROOT,
    TINY,
    head_processes,
    json_tail,
    shm_left,
    shm_of,
    survivors,
    user_env,
)

home = test_operator_path.home  # the fixture: a fresh HOME left by an earlier local Ray run

SUBMIT = ".venv/bin/inflight learner submit"
PROMPTS_PER_STEP = 4  # TINY's grpo.num_prompts_per_step


def job_commands() -> list[str]:
    """The commands of the section's second bash block (the first is test_operator_path's)."""
    section = (ROOT / "README.md").read_text().split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[1]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def run(cmd: str, env: dict[str, str], cwd: Path, timeout: float = 300, rc: int = 0) -> str:
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    print(f"{cmd[:70]}: {time.monotonic() - t0:.1f} s")
    assert out.returncode == rc, f"`{cmd}` exited {out.returncode}, expected {rc}:\n{out.stderr[-4000:]}"
    return out.stdout if rc == 0 else out.stderr


def status(env: dict[str, str], cwd: Path) -> dict:
    return json.loads(run(".venv/bin/inflight learner status --pool inflight-pool --json", env, cwd))


def test_readme_learner_jobs(home, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", "recipes"):
        (work / name).symlink_to(ROOT / name)
    env = user_env(home)
    cmds = job_commands()
    assert [c.split()[1:3] for c in cmds] == [
        ["pool", "deploy"], ["learner", "submit"], ["learner", "status"], ["learner", "logs"], ["learner", "stop"],
        ["learner", "submit"], ["learner", "logs"], ["pool", "shutdown"]]
    submits, checkpoint, out = 0, 0, {}
    for i, cmd in enumerate(cmds):
        if cmd.startswith(SUBMIT):
            submits += 1
            if submits == 1:
                cmd += " " + " ".join(TINY) + " grpo.max_num_steps=1000"
            else:
                cmd += " " + " ".join(TINY) + f" grpo.max_num_steps={checkpoint + 1}"
        elif cmd.split()[1:3] == ["pool", "deploy"]:
            cmd += " " + " ".join(TINY)
        elif cmd.split()[1:3] == ["pool", "shutdown"]:
            state = json.loads((home / ".inflight" / "cluster.json").read_text())
            procs = head_processes(state["temp_dir"], home)
            shm = shm_of(procs)
        out[i] = run(cmd, env, work)
        if cmd.startswith(SUBMIT) and submits == 1:
            assert re.search(r"^learner job inflight-learner-inflight-pool-1 \(pool inflight-pool\): RUNNING",
                             out[i], re.M), out[i]
            refused = run(cmd, env, work, rc=2)
            assert "already has learner job inflight-learner-inflight-pool-1 (RUNNING)" in refused, refused
            wait_for_step(env, work, 2)
        if cmd.split()[1:3] == ["learner", "stop"]:
            stopped = re.search(r"^learner job inflight-learner-inflight-pool-1 \(pool inflight-pool\): STOPPED, "
                                r"step \d+, checkpoint step_(\d+), run dir ", out[i], re.M)
            assert stopped, out[i]
            checkpoint = int(stopped.group(1))
            assert checkpoint >= 2
            pool = json_tail(run(".venv/bin/inflight pool status --json", env, work))
            assert pool["learner"] is None, pool["learner"]  # on SIGTERM the learner detached before it exited
        if cmd.split()[1:3] == ["learner", "logs"] and submits == 2:
            done = status(env, work)
            assert done["state"] == "SUCCEEDED" and done["step"] == checkpoint + 1, done
            assert done["record"]["run_dir"] == str(work / "runs" / "b"), done

    assert re.search(r"RUNNING, step \d+", out[2]) and "run dir " + str(work / "runs" / "b") in out[2], out[2]
    assert "Running entrypoint for job inflight-learner-inflight-pool-1" in out[3], out[3][-2000:]
    # A re-submit that started afresh would append rows 1, 2, ... after the first job's; this one kept rows
    # 1..checkpoint, trained one step, and its ledger (restored from the checkpoint) counts every step's prompts.
    rows = [json.loads(line) for line in (work / "runs" / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, checkpoint + 2)), [r["step"] for r in rows]
    resumed = out[6]                                  # the second job's whole log (`logs --follow`)
    assert re.search(rf"^ledger: \d+ scheduled, {PROMPTS_PER_STEP * (checkpoint + 1)} trained, ", resumed, re.M), \
        resumed[-3000:]
    assert rows[-1]["policy_version"] == checkpoint + 1
    assert "local Ray cluster stopped" in out[7]
    time.sleep(1)
    assert not survivors(procs), f"processes of the stopped head survived: {survivors(procs)}"
    assert not shm_left(shm), f"/dev/shm entries left behind: {sorted(shm_left(shm))}"


def wait_for_step(env: dict[str, str], cwd: Path, step: int, timeout_s: float = 180) -> None:
    """Until the run's metrics have a row for ``step`` (the job is running and stepping); the file is watched
    here, so that no CLI process competes with the learner for the two cores meanwhile."""
    from services.learner_jobs import last_step

    checked = time.monotonic()
    deadline = checked + timeout_s
    while (last_step(cwd / "runs" / "b") or 0) < step:
        assert time.monotonic() < deadline, f"the learner job did not reach step {step} in {timeout_s} s"
        if time.monotonic() > checked + 20:  # a job that failed is not waited for to the end
            checked = time.monotonic()
            assert (s := status(env, cwd))["state"] == "RUNNING", s
        time.sleep(0.5)
    print(f"metrics row of step {step} after {time.monotonic() - deadline + timeout_s:.1f} s of waiting")
