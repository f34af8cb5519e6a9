"""CPU seconds of a command and every process on the machine while it runs, by kind of process.

Runs COMMAND (e.g. ``make test``) and samples ``/proc/<pid>/stat`` every ``--period`` seconds; a process's CPU
seconds are the most it was seen with (so its last seconds before it exits are missed: lower bounds). Prints a
table by kind (vLLM engine cores, engine actors, learner ranks, the CLI, Ray's and Serve's processes, ...) and
writes every process and the table to ``--out``. docs/testing.md, "Where the time goes", reads one such run.

    .venv/bin/python bench/cpu_by_process.py --out bench/results/cpu_make_test.json -- make test
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = (  # (kind, substrings of the command line or the process name that say it), first match wins
    ("kernel threads", ("kdamond", "kworker", "rcu_")),
    ("VLLM::EngineCore", ("EngineCore",)),
    ("ray::EngineActor", ("ray::EngineActor",)),
    ("ray::LearnerActor", ("ray::LearnerActor",)),
    ("the CLI in subprocesses", ("services.cli", "bin/inflight", "multinode_run")),
    ("pytest's processes", ("pytest-xdist", "-m pytest")),
    ("Serve", ("ray::ServeController", "ray::ProxyActor", "ray::ServeReplica")),
    ("ray::ModelFileHolder", ("ray::ModelFileHolder",)),
    ("Ray per cluster", ("log_monitor", "gcs_server", "raylet", "dashboard", "ray::DashboardAgent", "ray::IDLE",
                         "ray::RuntimeEnvAgent", "runtime_env")),
    ("channel actors", ("ray::_QueueActor",)),
    ("spawn children", ("spawn_main",)),
    ("set-up and lint", ("pip", "pyright", "ruff")),
)


def kind_of(name: str, cmdline: str) -> str:
    """The kind of a process, from its name and command line (Ray and vLLM retitle theirs)."""
    text = f"{name} {cmdline}"
    return next((kind for kind, marks in KINDS if any(m in text for m in marks)), "the rest")


def sample(seen: dict[str, list]) -> None:
    """Add or update every live process: key ``pid:start time``, value ``[name, command line, CPU seconds]``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited between the listing and the read
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
        entry = seen.setdefault(f"{pid}:{fields[19]}", [name, cmdline[:300], cpu_s])
        if cmdline.startswith(("ray::", "VLLM")) or not entry[1]:
            entry[1] = cmdline[:300]  # the latest title
        entry[0], entry[2] = name, max(entry[2], cpu_s)


def table(seen: dict[str, list], before: dict[str, list]) -> list[dict]:
    """Core-seconds and process counts by kind, largest first, kernel threads left out; a process that was alive
    before the command started counts only what it used since (``before``)."""
    by_kind: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for key, (name, cmdline, cpu_s) in seen.items():
        row = by_kind[kind_of(name, cmdline)]
        row[0] += cpu_s - (before[key][2] if key in before else 0.0)
        row[1] += 1
    by_kind.pop("kernel threads", None)
    total = sum(s for s, _ in by_kind.values()) or 1.0
    return [{"kind": k, "processes": int(n), "core_s": round(s, 1), "share": round(s / total, 3)}
            for k, (s, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the processes and the table")
    parser.add_argument("--period", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    before: dict[str, list] = {}
    sample(before)
    seen: dict[str, list] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen)
        time.sleep(args.period)
    sample(seen)
    wall_s = time.monotonic() - t0
    rows = table(seen, before)
    total = sum(r["core_s"] for r in rows)
    print(f"{' '.join(command)}: exit {proc.returncode}, {wall_s:.0f} s, {total:.0f} core-seconds "
          f"({total / wall_s / os.cpu_count():.0%} of {os.cpu_count()} cores)")
    print("| processes | how many | core-seconds | share |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['processes']} | {r['core_s']:.0f} | {r['share']:.0%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "exit": proc.returncode, "wall_s": round(wall_s, 1),
                                    "cores": os.cpu_count(), "table": rows, "processes": seen}, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
