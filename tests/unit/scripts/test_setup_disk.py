"""scripts/setup.sh refuses to start a venv on a disk without room for it, naming the folder, before pip runs."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _copy_setup_inputs(dst: Path) -> None:
    (dst / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", dst / "scripts" / "setup.sh")
    for name in ("requirements-cpu.txt", "pyproject.toml"):
        shutil.copy(REPO / name, dst / name)


def test_setup_refuses_a_disk_without_room_for_the_venv(tmp_path: Path) -> None:
    _copy_setup_inputs(tmp_path)
    run = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "INFLIGHT_SETUP_NEED_GIB": "10000000"},
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{tmp_path}/.venv has" in run.stderr and "needs ~10000000 GiB" in run.stderr
    assert not (tmp_path / ".venv").exists(), "the refused venv folder was left behind"


def test_setup_goes_on_when_the_venv_fits(tmp_path: Path) -> None:
    """With room, setup passes the check and makes the venv (stopped at pip by a python that has no pip)."""
    _copy_setup_inputs(tmp_path)
    fake_python = tmp_path / "python3"
    fake_python.write_text('#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin"; '
                           'cp "$0" "$3/bin/python"; exit 0; fi\necho "no pip here" >&2; exit 7\n')
    fake_python.chmod(0o755)
    run = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python), "INFLIGHT_SETUP_NEED_GIB": "0"},
    )
    assert "GiB free" not in run.stderr
    assert (tmp_path / ".venv" / "bin" / "python").exists()
    assert run.returncode == 7 and "no pip here" in run.stderr
