"""services.recipe.regular_file: only a regular file is read, without blocking, and never past its bound."""
from __future__ import annotations

import os
import threading

import pytest

from services.recipe.regular_file import FileRefused, read_regular_file


def test_a_regular_file_within_the_bound_is_read_whole(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    assert read_regular_file(tmp_path / "a", 10) == b"x" * 10


def test_a_larger_file_is_refused_with_its_size(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 11)
    with pytest.raises(FileRefused) as err:
        read_regular_file(tmp_path / "a", 10)
    assert (err.value.kind, err.value.size) == ("too_large", 11)


def test_a_file_that_claims_no_size_is_still_read_within_the_bound():
    with pytest.raises(FileRefused) as err:  # /proc files report st_size 0
        read_regular_file("/proc/self/status", 8)
    assert (err.value.kind, err.value.size) == ("too_large", 9)


@pytest.mark.parametrize("make", ["fifo", "dir", "device"])
def test_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path, make):
    path = {"fifo": tmp_path / "f", "dir": tmp_path, "device": "/dev/zero"}[make]
    if make == "fifo":
        os.mkfifo(path)
    out: list[BaseException] = []

    def read() -> None:
        try:
            read_regular_file(path, 1 << 20)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "blocked"
    assert isinstance(out[0], FileRefused) and out[0].kind == "not_a_file"


def test_a_symlink_is_not_followed_when_asked_not_to(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert read_regular_file(tmp_path / "link", 1) == b"x"
    with pytest.raises(FileRefused) as err:
        read_regular_file(tmp_path / "link", 1, follow_symlinks=False)
    assert err.value.kind == "not_a_file"
