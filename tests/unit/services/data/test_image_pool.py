"""The image worker pool (services/data/image_pool.py) with real worker processes: a batch of good and bad images comes
back in order, equal to preparing each in process, with every failure counted by kind and nothing raised; repeats
are prepared once; the queue stays bounded; a deadline and a dying worker fail one image and the pool goes on;
closing stops the workers."""
from __future__ import annotations

import io
import multiprocessing
import os
import time

import numpy as np
import pytest
from image_samples import RULES, KillsItsWorker, bad_images, data_limits, encoded, noise
from PIL import Image

from services.data.image_pool import ImagePool
from services.data.images import ImageFailure, ImageLimits, PreparedImage, prepare_image


def test_a_mixed_batch_comes_back_in_order_and_failures_are_counted(tmp_path):
    good = [encoded(noise(40 + 30 * k, 200 - 25 * k, seed=k)) for k in range(6)]
    limits = data_limits(tmp_path)
    bad = {kind: ref for kind, (ref, lim) in bad_images(tmp_path).items() if lim == limits}
    refs = [good[0], *bad.values(), *good[1:]]
    with ImagePool(RULES, limits, num_workers=2, max_in_flight=3) as pool:
        out = pool.prepare(refs)  # type: ignore[arg-type]
        assert len(out) == len(refs)
        for ref, got in zip(refs, out, strict=True):
            want = prepare_image(ref, RULES, limits)  # type: ignore[arg-type]
            assert type(got) is type(want)
            if isinstance(want, PreparedImage):
                assert got.sha256 == want.sha256 and np.array_equal(got.pixel_values, want.pixel_values)  # type: ignore
            else:
                assert got == want
        assert pool.counts.prepared == len(good)
        assert dict(pool.counts.failed) == {kind: 1 for kind in bad}
        assert 1 <= pool.counts.peak_in_flight <= 3


def test_repeated_references_are_prepared_once(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encoded(noise(90, 60)))
    data = encoded(noise(50, 50, seed=1))
    with ImagePool(RULES, num_workers=1) as pool:
        out = pool.prepare([str(path), data, str(path), {"bytes": data, "path": None}, data], str(tmp_path))
        assert pool.counts.deduplicated == 3 and pool.counts.prepared == 5
        assert out[0] is out[2] and out[1] is out[3] is out[4]


def test_a_deadline_and_a_dying_worker_fail_one_image_each_and_the_pool_goes_on():
    big = encoded(Image.new("RGB", (6000, 4000), "red"), "JPEG")
    small = encoded(noise(64, 64))
    with ImagePool(RULES, num_workers=1, timeout_s=0.01) as pool:
        out = pool.prepare([big])
        assert isinstance(out[0], ImageFailure) and out[0].kind == "timeout" and "0.01s" in out[0].reason
        assert isinstance(pool.prepare([small])[0], PreparedImage)  # a fresh worker took over
    with ImagePool(RULES, num_workers=1) as pool:
        out = pool.prepare([KillsItsWorker(), small])
        assert isinstance(out[0], ImageFailure) and out[0].kind == "worker_died"
        assert isinstance(out[1], PreparedImage)
        assert dict(pool.counts.failed) == {"worker_died": 1}


def test_pixel_values_arrive_read_only_and_no_file_outlives_its_batch(tmp_path):
    refs = [encoded(noise(60, 60, seed=k)) for k in range(4)] + [b"not an image", str(tmp_path / "nope.png")]
    with ImagePool(RULES, num_workers=2) as pool:
        out = pool.prepare(refs)
        assert pool._dir is not None and os.listdir(pool._dir) == []
        first = out[0]
        assert isinstance(first, PreparedImage) and not first.pixel_values.flags.writeable
        assert first.pixel_values.shape == (int(np.prod(first.image_grid_thw)), 1176)
        folder = pool._dir
    assert not os.path.exists(folder)


def test_close_stops_the_workers():
    others = set(multiprocessing.active_children())  # e.g. reward workers of earlier tests
    pool = ImagePool(RULES, num_workers=2)
    assert isinstance(pool.prepare([encoded(noise(30, 30))])[0], PreparedImage)
    workers = [p for p in multiprocessing.active_children() if p not in others]
    assert workers
    pool.close()
    deadline = time.monotonic() + 10  # a killed worker is reaped shortly after the pool's join
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers)
    assert isinstance(pool.prepare([encoded(noise(30, 30))])[0], PreparedImage)  # the next batch starts anew
    pool.close()


@pytest.mark.parametrize("kwargs,match", [({"num_workers": 0}, "num_workers: expected >= 1"),
                                          ({"max_in_flight": 0}, "max_in_flight: expected >= 1"),
                                          ({"timeout_s": 0}, "timeout_s: expected > 0")])
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImagePool(RULES, **kwargs)


def test_big_images_are_checked_against_the_limits_in_the_workers():
    data = encoded(Image.new("RGB", (300, 300), "blue"))
    with ImagePool(RULES, ImageLimits(max_pixels=100 * 100), num_workers=1) as pool:
        out = pool.prepare([io.BytesIO(data).getvalue()])
        assert isinstance(out[0], ImageFailure) and out[0].kind == "too_large"
