"""tests/integration/conftest.py under pytest-xdist, as `make test-integration` runs it (``-n 2 --dist loadgroup
--no-loadscope-reorder``): every module's tests run on one worker, and so do all the modules of one shared session
stack; the longest group (``module_seconds.json``) starts first.

Run on a tree of small modules that records which worker ran each test. With pytest 9.2 and pytest-xdist 3.8 the
groups are silently ignored (pytest-xdist#1386: xdist renames the node id through a field pytest 9.2 no longer
reads), every module's tests go round-robin over both workers and each worker starts the module's stack again.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

INTEGRATION_CONFTEST = Path(__file__).resolve().parents[2] / "integration" / "conftest.py"
TESTS_PER_MODULE = 4
STACK_CONFTEST = '''
import os, pytest

@pytest.fixture(scope="session")
def data_pool():
    return os.getpid()
'''
MODULE = '''
import os, time, pytest

@pytest.fixture(scope="module")
def stack({uses}):
    return os.getpid()

@pytest.mark.parametrize("i", range({n}))
def test_one(stack, i):
    time.sleep(0.05)
    with open({log!r}, "a") as f:
        f.write(f"{name} {{os.getpid()}}\\n")
'''


def write_tree(root: Path, log: Path) -> None:
    services = root / "tests" / "integration" / "services"
    services.mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    shutil.copy(INTEGRATION_CONFTEST, root / "tests" / "integration" / "conftest.py")
    (root / "tests" / "integration" / "module_seconds.json").write_text(json.dumps(
        {"tests/integration/services/test_own_a.py": 5.0, "tests/integration/services/test_own_c.py": 90.0}))
    (services / "conftest.py").write_text(STACK_CONFTEST)
    for name in ("own_a", "own_b", "own_c", "pool_a", "pool_b"):
        uses = "data_pool" if name.startswith("pool") else ""
        (services / f"test_{name}.py").write_text(MODULE.format(uses=uses, n=TESTS_PER_MODULE, log=str(log), name=name))


def test_a_modules_tests_and_a_stacks_modules_run_on_one_worker(tmp_path):
    log = tmp_path / "ran.log"
    write_tree(tmp_path, log)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "--no-loadscope-reorder",
                          "tests/integration"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    workers: defaultdict[str, set[str]] = defaultdict(set)
    ran_by: defaultdict[str, list[str]] = defaultdict(list)
    for line in log.read_text().splitlines():
        module, pid = line.split()
        workers[module].add(pid)
        ran_by[pid].append(module)
    assert sorted(workers) == ["own_a", "own_b", "own_c", "pool_a", "pool_b"]
    assert all(len(pids) == 1 for pids in workers.values()), dict(workers)
    assert workers["pool_a"] == workers["pool_b"], dict(workers)       # the data pool's modules share its worker
    assert len(set().union(*workers.values())) == 2, dict(workers)     # and the other worker ran something
    (own_c_worker,) = workers["own_c"]
    assert ran_by[own_c_worker][0] == "own_c", dict(ran_by)             # the longest group started first
