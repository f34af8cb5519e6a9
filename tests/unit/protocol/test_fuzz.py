"""Fuzzing: corrupted input raises ProtocolError and nothing else, and never hangs.

Three layers:

* byte level - a seeded loop mutates valid frames (truncate, flip bits,
  overwrite, insert, delete, duplicate slices, splice two frames, rewrite the
  header length) and counts the outcomes;
* map level - decoded maps are mutated (wrong types, junk values, missing
  keys, bad array elements and lengths, deep nesting) and re-framed with
  :func:`protocol.codec.pack_frame`, both in a seeded counted loop and under
  hypothesis;
* hand-written hostile frames (huge declared sizes, bogus magic, ...).

A random mutation can occasionally produce another *valid* message (a flipped
bit inside a reward, a deleted padding byte that msgpack re-balances...).
Such an outcome is accepted only if the result is itself a clean message:
it re-encodes and decodes to the same thing. Rejections are counted, and the
test asserts that at least 10,000 corruptions were rejected.
"""
from __future__ import annotations

import copy
import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import ProtocolError, decode, encode
from protocol.codec import MAGIC, pack_frame, unpack_frame

from msg_strategies import assert_same_message, messages, random_message
from wire_maps import wire_map

MIN_REJECTED = 10_000


def _outcome(data, max_bytes: int = 1 << 30) -> str:
    """'rejected' or 'valid'; any other exception propagates and fails the test."""
    try:
        msg = decode(data, max_bytes=max_bytes)
    except ProtocolError as err:
        assert err.path is not None and str(err), "a ProtocolError must say where and what"
        return "rejected"
    wire = encode(msg)                      # what was accepted is a clean message
    assert_same_message(msg, decode(wire))
    return "valid"


# ----------------------------------------------------------------------------- byte level

def _mutate_bytes(wire: bytes, other: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(wire)
    n = len(b)
    op = rng.integers(0, 9)
    if op == 0:                                          # truncate
        return bytes(b[:rng.integers(0, n)])
    if op == 1:                                          # flip one bit
        i = rng.integers(0, n)
        b[i] ^= 1 << int(rng.integers(0, 8))
    elif op == 2:                                        # overwrite a few bytes
        for _ in range(int(rng.integers(1, 5))):
            b[rng.integers(0, n)] = int(rng.integers(0, 256))
    elif op == 3:                                        # insert random bytes
        i = int(rng.integers(0, n + 1))
        b[i:i] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
    elif op == 4:                                        # delete a slice
        i = int(rng.integers(0, n))
        del b[i:i + int(rng.integers(1, 9))]
    elif op == 5:                                        # duplicate a slice
        i, j = sorted(int(x) for x in rng.integers(0, n, 2))
        b[j:j] = b[i:j]
    elif op == 6:                                        # splice with another frame
        return bytes(b[:rng.integers(0, n)]) + other[rng.integers(0, len(other)):]
    elif op == 7:                                        # lie about the header length
        struct.pack_into("<I", b, 4, int(rng.choice([0, 1, n, n - 8, 1 << 31, (1 << 32) - 1,
                                                       int(rng.integers(0, n))])))
    else:                                                # flip a byte inside the msgpack header
        hlen = struct.unpack_from("<I", b, 4)[0]
        i = 8 + int(rng.integers(0, max(hlen, 1)))
        if i < n:
            b[i] = int(rng.integers(0, 256))
    return bytes(b)


@pytest.mark.timeout(120)
def test_random_byte_corruptions_raise_only_protocol_error():
    rng = np.random.default_rng(20261130)
    corpus = [encode(random_message(rng)) for _ in range(64)]
    counts = {"rejected": 0, "valid": 0}
    for k in range(12_000):
        wire = corpus[k % len(corpus)]
        mutant = _mutate_bytes(wire, corpus[(k * 7 + 3) % len(corpus)], rng)
        if mutant == wire:
            continue
        counts[_outcome(mutant)] += 1
    print(f"byte-level corruptions: {counts}")
    assert counts["rejected"] >= MIN_REJECTED
    assert counts["valid"] < counts["rejected"] / 10   # mutations are overwhelmingly caught


# ----------------------------------------------------------------------------- map level


def _slots(obj, path=(), max_depth: int = 6):
    """Every (container, key, path) in a nested map, arrays included as leaves
    (messages nest at most 4 deep; the limit keeps junk from nesting in junk)."""
    if len(path) >= max_depth:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield obj, k, path + (k,)
            yield from _slots(v, path + (k,), max_depth)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield obj, i, path + (i,)
            yield from _slots(v, path + (i,), max_depth)


def _deep(depth: int):
    x = []
    for _ in range(depth):
        x = [x]
    return x


JUNK = [None, True, False, 0, -1, 1 << 63, -(1 << 63), (1 << 64) - 1, math.nan, math.inf, -math.inf, 1e308,
        "", "x" * 5000, b"\x00\xff", [], [1, "a", None], {}, {"k": [1]}, {1: 2}, "deep:200", "deep:480",
        np.zeros(3, np.float64), np.zeros((2, 2), np.int32), np.array([], np.uint8), np.arange(5, dtype=np.int64)]
"""Values planted in place of a field; "deep:N" stands for a list nested N levels (built fresh)."""


def _junk(i: int):
    value = JUNK[i]
    if isinstance(value, str) and value.startswith("deep:"):
        return _deep(int(value[5:]))
    return copy.deepcopy(value)


def _mutate_array(arr: np.ndarray, rng: np.random.Generator):
    op = rng.integers(0, 6)
    if op == 0 or arr.size == 0:                         # wrong length
        return np.concatenate([arr, arr[:1] if arr.size else np.zeros(1, arr.dtype)])
    i = int(rng.integers(0, arr.size))
    out = arr.copy()
    if op == 1:
        return out[:-1]
    if arr.dtype.kind == "f":                            # NaN, inf, positive log-prob
        out[i] = [math.nan, math.inf, -math.inf, 0.5, 1e30][int(rng.integers(0, 5))]
    elif arr.dtype.kind in "iu":                         # out of vocab, negative, extreme
        info = np.iinfo(arr.dtype)
        out[i] = [info.max, info.min, -1, 1 << 24][int(rng.integers(0, 4))] if arr.dtype.kind == "i" else info.max
    if op == 5:
        return out.astype(np.float64 if arr.dtype.kind == "f" else np.int64)   # wrong dtype
    return out


def _mutate_map(m: dict, rng: np.random.Generator) -> dict:
    for _ in range(int(rng.integers(1, 3))):
        slots = list(_slots(m))
        if not slots:
            break
        container, key, _ = slots[int(rng.integers(0, len(slots)))]
        value = container[key]
        op = rng.integers(0, 5)
        if isinstance(value, np.ndarray) and op < 3:
            container[key] = _mutate_array(value, rng)
        elif op == 0 and isinstance(container, dict):
            del container[key]
        elif op == 1 and isinstance(value, (int, float)) and not isinstance(value, bool):
            container[key] = [-value - 1, value + 1, value * 1e6, -1, 0][int(rng.integers(0, 5))]
        elif op == 2 and isinstance(value, list):
            container[key] = value[:-1] if value and rng.random() < 0.5 else value + value[:1]
        else:
            container[key] = _junk(int(rng.integers(0, len(JUNK))))
    return m


@pytest.mark.timeout(120)
def test_random_map_corruptions_raise_only_protocol_error():
    rng = np.random.default_rng(7)
    bases = [wire_map(random_message(rng)) for _ in range(32)]
    counts = {"rejected": 0, "valid": 0}
    for k in range(3_000):
        mutant = _mutate_map(copy.deepcopy(bases[k % len(bases)]), rng)
        counts[_outcome(pack_frame(mutant))] += 1
    print(f"map-level corruptions: {counts}")
    assert counts["rejected"] > 2_000


@settings(max_examples=150, deadline=None)
@given(messages(), st.data())
def test_hypothesis_map_corruptions_raise_only_protocol_error(msg, data):
    m = wire_map(msg)
    slots = list(_slots(m))
    container, key, _ = data.draw(st.sampled_from(slots))
    junk = data.draw(st.one_of(
        st.integers(0, len(JUNK) - 1).map(_junk), st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
        st.floats(), st.text(max_size=8), st.binary(max_size=8),
        st.recursive(st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=3),  # msgpack's int range
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                     max_leaves=10)))
    container[key] = junk
    _outcome(pack_frame(m))


@settings(max_examples=60, deadline=None)
@given(messages(), st.sampled_from(["schema", "kind"]),
       st.one_of(st.integers(-5, 5), st.text(max_size=10), st.none(), st.floats(), st.booleans()))
def test_unknown_schema_or_kind_is_rejected(msg, field, value):
    m = wire_map(msg)
    if m[field] == value and type(value) is type(m[field]):
        return
    m[field] = value
    with pytest.raises(ProtocolError) as err:
        decode(pack_frame(m))
    if m["kind"] == "trajectory_group" and field == "schema" and type(value) is int and value == 1:
        assert err.value.path == "trajectories[0].loss_mask"  # schema 1 is read, but it has no mask
    else:
        assert err.value.path == field


# ----------------------------------------------------------------------------- hostile frames

def _frame(header: bytes, tail: bytes = b"") -> bytes:
    return struct.pack("<4sI", MAGIC, len(header)) + header + tail


def _array_ref(dtype, shape, offset) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([dtype, shape, offset]))


_ONE_F32_ARRAY = msgpack.packb({"a": _array_ref("float32", [4], 0)})

HOSTILE = {
    "empty": (b"", "<frame>"),
    "plain msgpack, no frame": (msgpack.packb({"schema": 1, "kind": "control"}), "<frame>.magic"),
    "header longer than frame": (struct.pack("<4sI", MAGIC, 1 << 31) + b"\x80", "<frame>.header_length"),
    "top level is a list": (_frame(msgpack.packb([1, 2, 3])), "<message>"),
    "top level is an int": (_frame(msgpack.packb(7)), "<message>"),
    "header is not msgpack": (_frame(b"\xc1\xc1"), "<frame>.header"),
    "trailing bytes after header": (_frame(msgpack.packb({"schema": 1}), b"junk"), "<frame>"),
    "msgpack declares a 4 GiB string": (_frame(b"\xdb\xff\xff\xff\xff"), "<frame>.header"),
    "msgpack declares a 4G-entry map": (_frame(b"\xdf\xff\xff\xff\xff"), "<frame>.header"),
    "msgpack declares a 4G-entry list": (_frame(b"\xdd\xff\xff\xff\xff"), "<frame>.header"),
    "nesting 100k deep": (_frame(b"\x91" * 100_000 + b"\x90"), "<frame>.header"),
    "non-string map key": (_frame(msgpack.packb({1: 2})), "<frame>.header"),
    "unknown extension type": (_frame(msgpack.packb({"a": msgpack.ExtType(9, b"")})), "<frame>.arrays[0]"),
    "array ref is junk": (_frame(msgpack.packb({"a": msgpack.ExtType(1, b"\xc1")})), "<frame>.arrays[0]"),
    "array of 2**80 elements": (_frame(msgpack.packb({"a": _array_ref("uint8", [1 << 40, 1 << 40], 0)})),
                                "<frame>.arrays[0]"),
    "array past the end": (_frame(_ONE_F32_ARRAY, b"\0" * (64 - 8 - len(_ONE_F32_ARRAY) + 2)),
                           "<frame>.arrays[0]"),   # 16 bytes declared, 2 present
    "array with unsupported dtype": (_frame(msgpack.packb({"a": _array_ref("object", [1], 0)})),
                                     "<frame>.arrays[0].dtype"),
    "array with negative dim": (_frame(msgpack.packb({"a": _array_ref("uint8", [-1], 0)})),
                                "<frame>.arrays[0].shape"),
    "array with 9 dims": (_frame(msgpack.packb({"a": _array_ref("uint8", [1] * 9, 0)})),
                          "<frame>.arrays[0].shape"),
    "array at a non-canonical offset": (_frame(msgpack.packb({"a": _array_ref("uint8", [1], 64)})),
                                        "<frame>.arrays[0].offset"),
    "array offset as float": (_frame(msgpack.packb({"a": _array_ref("uint8", [0], 0.0)})),
                              "<frame>.arrays[0].offset"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_frames_are_rejected_with_a_path(name):
    data, path = HOSTILE[name]
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert err.value.path == path, str(err.value)


def test_non_zero_padding_is_rejected():
    wire = bytearray(pack_frame({"schema": 1, "a": np.zeros(1, np.uint8), "b": np.zeros(1, np.uint8)}))
    wire[-2] = 1                              # between the two arrays
    with pytest.raises(ProtocolError, match=r"arrays\[1\]\.padding"):
        decode(bytes(wire))


def test_oversized_message_is_rejected_before_parsing():
    wire = encode(random_message(np.random.default_rng(0)))
    assert decode(wire, max_bytes=len(wire))
    with pytest.raises(ProtocolError, match=f"at most {len(wire) - 1} bytes"):
        decode(wire, max_bytes=len(wire) - 1)


@pytest.mark.parametrize("junk", [None, "text", 12, [b"x"], np.zeros(3, np.uint8)])
def test_non_bytes_input_is_rejected(junk):
    with pytest.raises(ProtocolError):
        decode(junk)
