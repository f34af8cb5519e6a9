"""Generated images for the image preparation tests: noise of any size and mode, encoded, and one reference of
every bad kind."""
from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Mapping

import numpy as np
from PIL import Image

from services.data.images import ImageLimits, ImageRules

RULES = ImageRules(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
"""The tiny VLM's budget (services/models/tiny_vlm.py): 4 to 16 image tokens."""


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def forged_png_header(width: int, height: int) -> bytes:
    """A small PNG whose IHDR claims ``width`` x ``height`` (CRC fixed, so only the size is wrong)."""
    data = bytearray(encoded(noise(8, 8)))
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr) & 0xFFFFFFFF)
    return bytes(data)


def bad_images(tmp_path) -> dict[str, tuple[object, ImageLimits]]:
    """One reference of every bad kind the preparation itself detects, with the limits it is read under (paths may
    point into ``tmp_path / "data"``: :func:`data_limits`)."""
    png = encoded(noise(120, 100))
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "empty.png").write_bytes(b"")
    (tmp_path / "outside.png").write_bytes(png)
    (data / "sub").mkdir(exist_ok=True)
    corrupt = bytearray(png)
    corrupt[60:400] = bytes(340)  # zeroed compressed pixels: the header reads, the pixels do not
    limits = data_limits(tmp_path)
    return {
        "missing": (str(data / "nope.png"), limits),
        "empty": (str(data / "empty.png"), limits),
        "too_many_bytes": (png, ImageLimits(max_bytes=len(png) - 1)),
        "not_an_image": (b"this is not an image at all", limits),
        "truncated": (png[: len(png) // 2], limits),
        "corrupt": (bytes(corrupt), limits),
        "too_large": (encoded(noise(200, 200)), ImageLimits(max_pixels=199 * 200)),
        "bad_aspect": (encoded(Image.new("RGB", (402, 2))), limits),
        "bad_mode": (encoded(Image.new("I;16", (64, 64))), limits),
        "bad_reference": (12345, limits),
        "outside_root": (str(data / ".." / "outside.png"), limits),
        "not_a_file": (str(data / "sub"), limits),
    }


def data_limits(tmp_path) -> ImageLimits:
    """Default limits with ``tmp_path / "data"`` as the one directory paths may point into."""
    return ImageLimits(roots=(str((tmp_path / "data").resolve()),))


class KillsItsWorker(Mapping):
    """An image reference (a mapping) whose reading ends the worker process reading it, as a crashing decoder
    would; read in the process that made it, it is a mapping without keys."""

    def __init__(self):
        self.pid = os.getpid()

    def __getitem__(self, key):
        if os.getpid() != self.pid:
            os._exit(3)
        raise KeyError(key)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0
