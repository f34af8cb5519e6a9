"""Where an image reference may point (services/data/image_refs.py, issue 32.1): only into the data's directory tree or
``data.image_roots`` (``../``, absolute paths and symlinks to outside are refused unopened), only regular files
(a FIFO or ``/dev/zero`` neither blocks nor fills memory), bounded in size before reading, decoded only as an
accepted format (an EPS named ``.png`` never reaches Ghostscript), and a decoder's own exception is the image's
failure, never the caller's."""
from __future__ import annotations

import os
import subprocess
import threading

import pytest
from image_samples import RULES, encoded, noise

from services.data.images import ImageFailure, ImageLimits, PreparedImage, prepare_image

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n%%EndComments\n"
       b"newpath 0 0 moveto 32 32 lineto stroke\nshowpage\n%%EOF\n")


@pytest.fixture
def data(tmp_path):
    """``tmp_path/data`` holding ``a.png``; ``tmp_path/secret.png`` beside it, outside."""
    (tmp_path / "data").mkdir()
    png = encoded(noise(60, 40))
    (tmp_path / "data" / "a.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    return tmp_path / "data"


def _fails(ref, kind, base_dir=None, limits: ImageLimits | None = None) -> str:
    out = prepare_image(ref, RULES, limits or ImageLimits(), base_dir)
    assert isinstance(out, ImageFailure) and out.kind == kind, out
    return out.reason


def test_paths_inside_the_data_directory_read(data):
    assert isinstance(prepare_image("a.png", RULES, base_dir=str(data)), PreparedImage)
    assert isinstance(prepare_image(str(data / "a.png"), RULES, base_dir=str(data)), PreparedImage)
    (data / "sub").mkdir()
    os.symlink(data / "a.png", data / "sub" / "link.png")  # a symlink that stays inside is fine
    assert isinstance(prepare_image("sub/link.png", RULES, base_dir=str(data)), PreparedImage)


def test_paths_outside_the_data_directory_are_refused(data, monkeypatch):
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    reason = _fails("../secret.png", "outside_root", str(data))
    assert "outside the data's directory tree" in reason and "data.image_roots" in reason
    _fails(str(data.parent / "secret.png"), "outside_root", str(data))
    _fails("/etc/passwd", "outside_root", str(data))
    _fails("/proc/self/environ", "outside_root", str(data))
    os.symlink(data.parent / "secret.png", data / "innocent.png")
    _fails("innocent.png", "outside_root", str(data))
    _fails(str(data / "a.png"), "outside_root")  # no data directory (a Hub data set) and no roots: no path at all
    assert not any("secret" in p or p.startswith(("/etc", "/proc")) for p in opened), opened


def test_image_roots_allow_more_directories(data):
    limits = ImageLimits(roots=(str(data.parent.resolve()),))
    assert isinstance(prepare_image("../secret.png", RULES, limits, str(data)), PreparedImage)
    assert isinstance(prepare_image(str(data.parent / "secret.png"), RULES, limits), PreparedImage)


def test_a_fifo_and_a_device_are_refused_without_blocking(data):
    os.mkfifo(data / "pipe.png")
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(prepare_image("pipe.png", RULES, base_dir=str(data))),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert results, "reading a FIFO blocked"
    assert isinstance(results[0], ImageFailure) and results[0].kind == "not_a_file"
    reason = _fails("/dev/zero", "not_a_file", limits=ImageLimits(roots=("/dev",)))
    assert "not a regular file" in reason


def test_an_oversized_file_is_refused_before_reading(data):
    with open(data / "big.png", "wb") as f:
        f.truncate(64 * 2**30)  # sparse: reading it would take 64 GiB
    reason = _fails("big.png", "too_many_bytes", str(data))
    assert f"{64 * 2**30} bytes, over max_bytes" in reason


def test_eps_is_refused_without_ghostscript(data, monkeypatch):
    from PIL import EpsImagePlugin

    calls: list[object] = []

    def ghostscript(*args, **kwargs):
        calls.append(args)
        raise subprocess.CalledProcessError(1, ["gs"])

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    (data / "eps.png").write_bytes(EPS)
    reason = _fails("eps.png", "not_an_image", str(data))
    assert "PNG/JPEG" in reason
    _fails(EPS, "not_an_image")  # bytes in the row: the same allow-list
    assert not calls


def test_a_decoders_own_exception_is_the_images_failure(monkeypatch):
    from PIL import PngImagePlugin

    def broken(self):
        raise RuntimeError("decoder bug")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", broken)
    reason = _fails(encoded(noise(40, 40)), "corrupt")
    assert "RuntimeError: decoder bug" in reason


def test_data_image_roots_reach_the_pool_as_real_paths(data, tmp_path):
    from services.data.image_pool import ImagePool
    from services.recipe.data import DataConfig

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    os.symlink(data.parent, tmp_path / "link")
    pool = ImagePool.for_data(DataConfig(image_key="image", image_roots=[str(tmp_path / "link")]),
                              str(tmp_path / "model"))
    assert pool.limits.roots == (str(data.parent.resolve()),)
    with pytest.raises(ValueError, match=r"data.image_roots\[1\] '.*nowhere': not a directory"):
        ImagePool.for_data(DataConfig(image_key="image", image_roots=[str(data), str(tmp_path / "nowhere")]),
                           str(tmp_path / "model"))


def test_a_datasets_image_column_is_not_decoded_by_datasets(tmp_path, monkeypatch):
    """A ``datasets.Image`` column would be decoded by ``datasets`` with Pillow's every format (EPS: Ghostscript)
    when the row is read; it stays ``{bytes, path}`` for the preparation's rules."""
    import datasets
    from PIL import EpsImagePlugin

    from services.data.dataset import RowMapper, load_rows

    calls: list[object] = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: calls.append(a) or 1 / 0)
    png = encoded(noise(40, 30))
    ds = datasets.Dataset.from_dict({"input": ["q0", "q1"], "output": ["1", "2"], "thumb": [None, None],
                                     "image": [{"bytes": png, "path": "a.png"}, {"bytes": EPS, "path": "b.png"}]})
    ds = ds.cast_column("image", datasets.Image()).cast_column("thumb", datasets.Image())
    ds.save_to_disk(str(tmp_path / "disk"))
    rows = load_rows(str(tmp_path / "disk"))
    first, second = rows.row(0), rows.row(1)
    assert first["image"] == {"bytes": png, "path": "a.png"} and second["image"]["bytes"] == EPS
    assert isinstance(prepare_image(first["image"], RULES), PreparedImage)
    _fails(second["image"], "not_an_image")
    assert not calls
    task = RowMapper("input", "output", "messages").map(first).task  # a text recipe: the image column's path only
    assert task == {"image": "a.png", "answer": "1"}
