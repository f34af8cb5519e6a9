"""Where ``ensure_cluster`` finds Ray's ``ray`` command: beside the interpreter (a virtual environment), else on
``PATH`` (Ray installed with ``pip --target``, as on the GPU hosts, where the first ``pool deploy`` failed with
``FileNotFoundError: .../bin/ray``), else a one-line error naming both places."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.cluster import head as cluster


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_ray_beside_the_interpreter_comes_first(tmp_path, monkeypatch):
    beside = _executable(tmp_path / "venv" / "bin" / "ray")
    _executable(tmp_path / "path" / "ray")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert cluster.ray_command() == str(beside)


def test_else_the_ray_on_path(tmp_path, monkeypatch):
    on_path = _executable(tmp_path / "site" / "bin" / "ray")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "host" / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert cluster.ray_command() == str(on_path)


def test_no_ray_anywhere_is_one_line_naming_both_places(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "host" / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(cluster.ClusterStartError, match=r"`ray` command is neither beside .*host/bin/python3 nor "
                                                        r"on PATH"):
        cluster.ray_command()
