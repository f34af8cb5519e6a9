"""Weight pushes: pack -> wire -> verify -> unpack gives the original bytes,
and every way a push can be incomplete or damaged is rejected whole."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings

from protocol import ProtocolError, WeightBucket, decode, encode, pack_buckets, unpack_buckets
from protocol.weights import verify_buckets

from msg_strategies import weight_pushes


def _push(version: int = 7):
    rng = np.random.default_rng(0)
    tensors = [(f"model.layers.{i}.weight", "float32", (8, 4), rng.integers(0, 256, 128, dtype=np.uint8))
               for i in range(5)]
    manifest, buckets = pack_buckets(tensors, version, bucket_bytes=256)
    assert len(buckets) == 3
    return manifest, buckets, tensors


def _over_the_wire(manifest, buckets):
    return decode(encode(manifest)), [decode(encode(b)) for b in buckets]


@settings(max_examples=80, deadline=None)
@given(weight_pushes())
def test_unpack_gives_the_original_bytes(push):
    manifest, buckets, tensors = push
    manifest, buckets = _over_the_wire(manifest, buckets[::-1])    # arrival order does not matter
    out = list(unpack_buckets(manifest, buckets))
    assert [s.name for s, _ in out] == [t[0] for t in tensors]
    for (spec, raw), (name, dtype, shape, original) in zip(out, tensors):
        assert (spec.dtype, spec.shape) == (dtype, tuple(shape))
        assert raw.tobytes() == original.tobytes()


def test_good_push_verifies_in_index_order():
    manifest, buckets, _ = _push()
    manifest, buckets = _over_the_wire(manifest, buckets)
    assert [b.index for b in verify_buckets(manifest, [buckets[2], buckets[0], buckets[1]])] == [0, 1, 2]


def test_missing_bucket():
    manifest, buckets, _ = _push()
    with pytest.raises(ProtocolError, match=r"all 3 buckets, got 'missing \[1\]'"):
        verify_buckets(manifest, [buckets[0], buckets[2]])


def test_duplicate_bucket():
    manifest, buckets, _ = _push()
    with pytest.raises(ProtocolError) as err:
        verify_buckets(manifest, [*buckets, buckets[1]])
    assert err.value.path == "bucket[1]" and "a duplicate" in str(err.value)


def test_extra_bucket_index():
    manifest, buckets, _ = _push()
    stray = WeightBucket(manifest.version, 3, buckets[0].data, buckets[0].checksum)
    with pytest.raises(ProtocolError, match=r"bucket indices < 3"):
        verify_buckets(manifest, [*buckets, stray])


def test_bucket_from_another_version():
    manifest, buckets, _ = _push(version=7)
    _, old = pack_buckets(_push()[2], 6, bucket_bytes=256)
    with pytest.raises(ProtocolError) as err:
        verify_buckets(manifest, [buckets[0], old[1], buckets[2]])
    assert err.value.path == "bucket[1].version" and "expected 7, got 6" in str(err.value)


def test_flipped_byte_fails_the_checksum():
    manifest, buckets, _ = _push()
    wire = bytearray(encode(buckets[1]))
    wire[-10] ^= 0x01                       # inside the data section: still a well-formed frame
    damaged = decode(bytes(wire))
    with pytest.raises(ProtocolError) as err:
        verify_buckets(manifest, [buckets[0], damaged, buckets[2]])
    assert err.value.path == "bucket[1].checksum"


def test_truncated_bucket_data():
    manifest, buckets, _ = _push()
    short = WeightBucket(manifest.version, 1, buckets[1].data[:-1], buckets[1].checksum)
    with pytest.raises(ProtocolError, match=r"bucket\[1\].data: expected 256 bytes"):
        verify_buckets(manifest, [buckets[0], short, buckets[2]])


@pytest.mark.parametrize("tamper", [
    lambda m: dataclasses.replace(m, version=m.version + 1),
    lambda m: dataclasses.replace(m, bucket_checksums=[m.bucket_checksums[1]] * 3),
    lambda m: dataclasses.replace(m, tensors=[dataclasses.replace(m.tensors[0], name="lm_head.weight"),
                                              *m.tensors[1:]]),
    lambda m: dataclasses.replace(m, tensors=m.tensors[::-1]),
], ids=["version", "bucket checksums", "tensor name", "tensor order"])
def test_tampered_manifest_fails_its_checksum(tamper):
    manifest, buckets, _ = _push()
    with pytest.raises(ProtocolError) as err:
        verify_buckets(tamper(manifest), buckets)
    assert err.value.path == "manifest.checksum"


def test_nothing_is_yielded_from_a_bad_push():
    """unpack_buckets verifies before it returns the generator."""
    manifest, buckets, _ = _push()
    with pytest.raises(ProtocolError):
        unpack_buckets(manifest, buckets[:2])
