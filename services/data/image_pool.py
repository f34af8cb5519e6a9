"""A bounded pool of worker processes that prepare images (:func:`services.data.images.prepare_image`), the seed's
parallel image preparation (``data.image_workers``, default 8).

:meth:`ImagePool.prepare` takes a batch of image references and returns, in the same order, a
:class:`~services.data.images.PreparedImage` or an :class:`~services.data.images.ImageFailure` for each: a bad image
fails alone, with its reason, and is counted by kind (:attr:`ImagePool.counts`); nothing a worker does raises out of
``prepare``. At most ``max_in_flight`` images are queued to the workers at once (the rest wait in the caller), so a
large batch never holds more than that many decoded images in the pool's queues. Identical references in one batch
are prepared once. Each image has a deadline (``timeout_s``, from when a worker starts it): past it the worker is
killed (pebble starts a fresh one) and the image fails with ``timeout``; a worker that dies fails its image with
``worker_died``.

A worker writes an image's pixel values (float32, 3.5 MB for a 480 x 320 image under Qwen2.5-VL's rules) to a file
in ``/dev/shm`` and sends the rest of the result through pebble's pipe; the caller maps the file read-only and
removes it at once (the pages live until the array is freed). Pickled through the pipe, those arrays cost the caller
2.5-3.0 ms of CPU per 480 x 320 image; mapped, 0.5-0.7 ms (bench/image_prep.py, 2 cores).

Workers are started with ``spawn`` (the engine process runs vLLM and Ray threads, which a forked child must not
inherit) on the first batch; they import only numpy and Pillow and load Pillow's plugins before their first image.
:meth:`ImagePool.close` (or leaving the ``with`` block) stops them; a running task is killed.
"""
from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from services.data.images import ImageFailure, ImageLimits, ImageRef, PreparedImage, prepare_image

if TYPE_CHECKING:
    from services.data.vision_rules import VisionRules
    from services.recipe.data import DataConfig

ImageResult = PreparedImage | ImageFailure
SHARED_MEMORY = "/dev/shm"
"""Where the workers write pixel values (a RAM file system; the system's temp directory where there is none)."""


def prepare_to_file(ref: ImageRef, rules: VisionRules, limits: ImageLimits, base_dir: str | None,
                    path: str) -> ImageResult:
    """In a worker: prepare one image and write its pixel values (raw float32) and then its resized RGB (uint8) to
    ``path``; the result returned through the pipe carries neither (empty arrays of the right widths)."""
    out = prepare_image(ref, rules, limits, base_dir)
    if isinstance(out, PreparedImage):
        with open(path, "wb") as f:
            f.write(out.pixel_values.tobytes())
            f.write(out.rgb.tobytes())
        out = replace(out, pixel_values=out.pixel_values[:0], rgb=out.rgb[:0])
    return out


def warm_up() -> None:
    """Worker initializer: load Pillow's image plugins before the first image (about 0.1 s of a fresh process), so
    that no image's deadline pays for it."""
    from PIL import Image

    Image.init()


@dataclass
class ImageCounts:
    """What a pool has done since it was made."""

    prepared: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    """Failures by :data:`~services.data.images.FAILURE_KINDS`."""
    deduplicated: int = 0
    """References that repeated an earlier one of their batch and were not prepared again."""
    peak_in_flight: int = 0
    """Most images queued to the workers at once (at most ``max_in_flight``)."""


class ImagePool:
    """``num_workers`` processes preparing images by ``rules`` within ``limits`` (default :class:`ImageLimits`);
    see the module docstring."""

    def __init__(self, rules: VisionRules, limits: ImageLimits | None = None, num_workers: int = 8,
                 max_in_flight: int | None = None, timeout_s: float = 30.0):
        if num_workers < 1:
            raise ValueError(f"num_workers: expected >= 1, got {num_workers}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight: expected >= 1, got {max_in_flight}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        self.rules, self.limits, self.num_workers = rules, limits or ImageLimits(), num_workers
        self.max_in_flight = max_in_flight or 2 * num_workers
        self.timeout_s = timeout_s
        self.counts = ImageCounts()
        self._pool = None
        self._dir: str | None = None
        self._names = itertools.count()

    @classmethod
    def for_data(cls, data: DataConfig, model_dir: str, num_workers: int | None = None) -> ImagePool:
        """A pool of the ``data`` section's settings (workers unless ``num_workers`` is given, deadline, limits,
        ``image_roots``), with the image rules of ``model_dir`` (:func:`services.data.vision_rules.image_rules`: by
        its ``config.json``)."""
        from services.data.vision_rules import image_rules

        for k, root in enumerate(data.image_roots):
            if not os.path.isdir(root):
                raise ValueError(f"data.image_roots[{k}] {root!r}: not a directory")
        roots = tuple(os.path.realpath(r) for r in data.image_roots)
        return cls(image_rules(model_dir), ImageLimits(data.max_image_bytes, data.max_image_pixels, roots),
                   num_workers=num_workers or data.image_workers, timeout_s=data.image_timeout_s)

    def __enter__(self) -> ImagePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _started(self):
        if self._pool is None:
            from pebble import ProcessPool

            self._pool = ProcessPool(max_workers=self.num_workers, initializer=warm_up,
                                     context=multiprocessing.get_context("spawn"))
            shm = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
            self._dir = tempfile.mkdtemp(prefix=f"inflight-images-{os.getpid()}-", dir=shm)
        return self._pool

    def prepare(self, refs: Sequence[ImageRef], base_dir: str | None = None) -> list[ImageResult]:
        """Prepare ``refs`` (relative paths against ``base_dir``) in the workers; one result per reference, in
        order."""
        first: dict[object, int] = {}
        unique: list[int] = []
        same_as: list[int] = []
        for i, ref in enumerate(refs):
            key = _key(ref)
            if key is not None and key in first:
                same_as.append(first[key])
                self.counts.deduplicated += 1
                continue
            if key is not None:
                first[key] = i
            unique.append(i)
            same_as.append(i)
        results: dict[int, ImageResult] = {}
        pending: dict[Future, tuple[int, str]] = {}
        for i in unique:
            future, path = self._schedule(refs[i], base_dir)
            pending[future] = (i, path)
            self.counts.peak_in_flight = max(self.counts.peak_in_flight, len(pending))
            if len(pending) >= self.max_in_flight:
                self._collect(pending, results, FIRST_COMPLETED)
        self._collect(pending, results, ALL_COMPLETED)
        out = [results[same_as[i]] for i in range(len(refs))]
        for r in out:
            if isinstance(r, PreparedImage):
                self.counts.prepared += 1
            else:
                self.counts.failed[r.kind] += 1
        return out

    def _schedule(self, ref: ImageRef, base_dir: str | None) -> tuple[Future, str]:
        """The task preparing ``ref`` and the file its pixel values go to."""
        try:
            pool = self._started()
            path = os.path.join(str(self._dir), f"{next(self._names)}.f32")
            return pool.schedule(prepare_to_file, args=(ref, self.rules, self.limits, base_dir, path),
                                 timeout=self.timeout_s), path
        except RuntimeError as e:  # a pool whose workers could not start: this image fails, the next one restarts
            self.close()
            failed: Future = Future()
            failed.set_result(ImageFailure("worker_died", f"the image worker pool failed: {e}"[:300]))
            return failed, ""

    def _collect(self, pending: dict[Future, tuple[int, str]], results: dict[int, ImageResult], when: str) -> None:
        """Move finished tasks from ``pending`` to ``results`` (``when``: ``FIRST_COMPLETED``, at least one, or
        ``ALL_COMPLETED``)."""
        done, _ = wait(list(pending), return_when=when)
        for future in done:
            i, path = pending.pop(future)
            results[i] = self._result(future, path)

    def _result(self, future: Future, path: str) -> ImageResult:
        """The task's result, its pixel values mapped from ``path`` (which is then removed: the mapping keeps the
        pages until the array is freed)."""
        out = self._outcome(future)
        if isinstance(out, PreparedImage):
            try:
                with open(path, "rb") as f:
                    pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                rows, width = int(np.prod(out.image_grid_thw)), out.pixel_values.shape[1]
                w, h = out.resized
                floats = np.frombuffer(pages, dtype=np.float32, count=rows * width)
                rgb = np.frombuffer(pages, dtype=np.uint8, count=h * w * 3, offset=floats.nbytes)
                out = replace(out, pixel_values=floats.reshape(rows, width), rgb=rgb.reshape(h, w, 3))
            except (OSError, ValueError) as e:
                out = ImageFailure("worker_died", f"its worker's pixel values could not be read from {path}: {e}",
                                   out.sha256)
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return out

    def _outcome(self, future: Future) -> ImageResult:
        from pebble import ProcessExpired

        try:
            return future.result()
        except TimeoutError:
            return ImageFailure("timeout", f"image preparation timed out after {self.timeout_s:g}s (its worker was "
                                           f"killed)")
        except ProcessExpired as e:
            return ImageFailure("worker_died", f"its image worker process died ({e})")
        except Exception as e:  # noqa: BLE001 - e.g. a reference that cannot be pickled to the worker
            return ImageFailure("worker_died", f"image preparation failed in its worker: {type(e).__name__}: {e}"
                                               [:1000])

    def close(self) -> None:
        """Stop the workers (a running task is killed); the next batch starts new ones."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _key(ref: ImageRef) -> object | None:
    """What makes two references the same image within a batch (None: never deduplicated)."""
    if isinstance(ref, str | bytes):
        return ref
    if isinstance(ref, bytearray | memoryview):
        return bytes(ref)
    if not isinstance(ref, Mapping):
        return None  # not a reference at all: its worker says so
    data, path = ref.get("bytes"), ref.get("path")
    return bytes(data) if isinstance(data, bytes | bytearray | memoryview) else path if isinstance(path, str) else None
