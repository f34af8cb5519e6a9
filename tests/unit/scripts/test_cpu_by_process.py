"""bench/cpu_by_process.py: processes are told apart by their retitled command lines, a process alive before the
command counts only what it used since, kernel threads are left out; and the script runs a real command, finding
the CPU seconds its child burned."""
from __future__ import annotations

import json
import subprocess
import sys

from repo_scripts import ROOT, load_script

SCRIPT = "bench/cpu_by_process.py"


def _bench():
    return load_script(SCRIPT, "cpu_by_process_bench")


def test_kinds_come_from_retitled_command_lines():
    bench = _bench()
    assert bench.kind_of("ray::EngineAct", "ray::EngineActor.generate") == "ray::EngineActor"
    assert bench.kind_of("python", "VLLM::EngineCore") == "VLLM::EngineCore"
    assert bench.kind_of("python", ".venv/bin/python -m services.cli run --steps 2") == "the CLI in subprocesses"
    assert bench.kind_of("raylet", "/x/raylet --node-ip-address=1") == "Ray per cluster"
    assert bench.kind_of("bash", "bash -c true") == "the rest"


def test_the_table_counts_only_the_seconds_used_since_the_start_and_leaves_kernel_threads_out():
    bench = _bench()
    before = {"1:10": ["python", "ray::ServeController", 50.0]}
    seen = {"1:10": ["python", "ray::ServeController", 53.0], "2:20": ["python", "ray::ProxyActor", 2.0],
            "3:30": ["kdamond.0", "", 900.0], "4:40": ["bash", "bash", 5.0]}
    rows = {r["kind"]: r for r in bench.table(seen, before)}
    assert set(rows) == {"Serve", "the rest"}
    assert rows["Serve"]["core_s"] == 5.0 and rows["Serve"]["processes"] == 2
    assert rows["Serve"]["share"] == 0.5 and rows["the rest"]["share"] == 0.5


def test_a_command_that_burns_a_second_of_cpu_is_found(tmp_path):
    out = tmp_path / "cpu.json"
    first = f"import time  # cpu_by_process burner {tmp_path.name}"  # the script sees every process on the machine
    burn = f"{first}\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass\ntime.sleep(0.3)"
    done = subprocess.run([sys.executable, str(ROOT / SCRIPT), "--out", str(out), "--period", "0.1", "--",
                           sys.executable, "-c", burn], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["exit"] == 0 and "| the rest |" in done.stdout
    burners = [p for p in report["processes"].values() if p[1].startswith(f"{sys.executable} -c {first}")]
    assert len(burners) == 1 and burners[0][2] >= 1.4, burners
