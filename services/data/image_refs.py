"""Where an image's encoded bytes come from, and what a reference may point at.

A data row names an image by a path, a ``data:image/...;base64,`` URI, the bytes, or a ``{bytes, path}`` mapping
(:data:`ImageRef`). :func:`read_ref` returns the bytes, or an :class:`ImageFailure` saying why not; it never raises.
A path is read only when its real path (symlinks resolved) lies inside the data's own directory (``base_dir``: the
data file's directory or the ``save_to_disk`` directory) or one of :attr:`ImageLimits.roots` (``data.image_roots``):
``../x.png``, ``/etc/passwd`` and a symlink to outside fail with ``outside_root`` without being opened. Only a
regular file is read, never more than ``max_bytes + 1`` bytes of it (:mod:`services.recipe.regular_file`: a FIFO,
a device such as ``/dev/zero``, a directory fail with ``not_a_file``).
Which decoders may then look at the bytes is :data:`IMAGE_FORMATS` (``services.data.images``).
"""
from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.recipe.regular_file import FileRefused, read_regular_file

ImageRef = str | bytes | Mapping[str, object]
"""How a dataset row names an image: a file path (relative ones against the data file's directory), a
``data:image/...;base64,`` URI, the encoded bytes, or a ``{"bytes": ..., "path": ...}`` mapping (the layout of a
Hugging Face ``datasets.Image`` column)."""
FailureKind = Literal["missing", "empty", "too_many_bytes", "not_an_image", "truncated", "corrupt", "too_large",
                      "bad_aspect", "bad_mode", "bad_reference", "outside_root", "not_a_file", "timeout",
                      "worker_died"]
FAILURE_KINDS: tuple[FailureKind, ...] = ("missing", "empty", "too_many_bytes", "not_an_image", "truncated",
                                          "corrupt", "too_large", "bad_aspect", "bad_mode", "bad_reference",
                                          "outside_root", "not_a_file", "timeout", "worker_died")
"""Why an image failed; ``timeout`` and ``worker_died`` come from the worker pool."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The Pillow formats an image may be decoded as; any other (EPS/PostScript, which Pillow hands to Ghostscript,
among them) fails as ``not_an_image`` before a decoder runs."""


@dataclass(frozen=True)
class ImageLimits:
    """What an input image may be before it is decoded, and where a path may point."""

    max_bytes: int = 32 * 2**20
    """Encoded size."""
    max_pixels: int = 8192 * 8192
    """Width x height, read from the header before the pixels are decoded."""
    roots: tuple[str, ...] = ()
    """Directories (absolute) whose trees a path may point into besides the row's ``base_dir``
    (``data.image_roots``); with neither, a path reference fails with ``outside_root``."""


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImageFailure:
    """An image that cannot be used, with why; ``sha256`` when its bytes were read."""

    kind: FailureKind
    reason: str
    sha256: str | None = None


def read_ref(ref: ImageRef, base_dir: str | None, limits: ImageLimits) -> bytes | ImageFailure:
    """The encoded bytes an :data:`ImageRef` names, or why they cannot be had (module docstring)."""
    if isinstance(ref, Mapping):
        data, path = ref.get("bytes"), ref.get("path")
        if isinstance(data, bytes | bytearray | memoryview):
            return read_ref(bytes(data), base_dir, limits)
        if isinstance(path, str):
            return read_ref(path, base_dir, limits)
        return ImageFailure("bad_reference", f"a mapping needs 'bytes' or a 'path' string, got keys {sorted(ref)}")
    if isinstance(ref, bytes | bytearray | memoryview):
        data = bytes(ref)
    elif isinstance(ref, str) and ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.endswith(";base64") or not head.startswith("data:image/"):
            return ImageFailure("bad_reference", f"a data URI must be data:image/<type>;base64,..., got {head[:40]!r}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            return ImageFailure("bad_reference", f"a data URI whose base64 does not decode: {e}")
    elif isinstance(ref, str):
        read = read_path(ref, base_dir, limits)
        if isinstance(read, ImageFailure):
            return read
        data = read
    else:
        return ImageFailure("bad_reference", f"expected a path, data URI, bytes or {{bytes, path}} mapping, got "
                                             f"{type(ref).__name__}")
    if not data:
        return ImageFailure("empty", "zero size (0 bytes)")
    if len(data) > limits.max_bytes:
        return ImageFailure("too_many_bytes", f"{len(data)} bytes, over max_bytes {limits.max_bytes}")
    return data


def read_path(ref: str, base_dir: str | None, limits: ImageLimits) -> bytes | ImageFailure:
    """The bytes of the regular file ``ref`` names (relative: against ``base_dir``), if its real path lies inside
    ``base_dir`` or one of ``limits.roots``; at most ``max_bytes + 1`` of them are read."""
    if "\0" in ref:
        return ImageFailure("bad_reference", f"a path with a NUL character: {ref[:80]!r}")
    path = Path(ref) if base_dir is None or os.path.isabs(ref) else Path(base_dir) / ref
    roots = [os.path.realpath(r) for r in ((base_dir,) if base_dir is not None else ()) + limits.roots]
    real = os.path.realpath(path)
    if not any(_inside(real, root) for root in roots):
        where = f"the data's directory tree ({', '.join(roots)})" if roots else "no directory (the data has no " \
                "local directory and data.image_roots is not set)"
        return ImageFailure("outside_root", f"{path}: resolves to {real}, outside {where}; image paths are read only "
                                            f"under the data file's directory and data.image_roots")
    try:
        return read_regular_file(real, limits.max_bytes, follow_symlinks=False)
    except FileRefused as refused:
        if refused.kind == "not_a_file":
            return ImageFailure("not_a_file", f"{path}: not a regular file (a FIFO, device, directory or socket)")
        return ImageFailure("too_many_bytes", f"{path}: {refused.size} bytes, over max_bytes {limits.max_bytes}")
    except OSError as e:
        return ImageFailure("missing", f"{path}: cannot be read ({type(e).__name__}: {e.strerror or e})")


def _inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it (both real, absolute paths)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
