"""Property tests: every valid message survives encode -> decode exactly.

Exact means both byte-for-byte (``encode(decode(encode(m))) == encode(m)``)
and field by field (same values, same dtypes, same shapes), for every kind.
Also checks the zero-copy promise of the codec: decoded arrays are read-only
views into the caller's buffer.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import ProtocolError, Trajectory, TrajectoryGroup, WeightBucket, decode, encode
from protocol.codec import ALIGN, unpack_frame

from msg_strategies import (assert_same_message, control_messages, messages, prompt_requests,
                            trajectory_groups, weight_messages)

FAST = settings(max_examples=120, deadline=None)


def _roundtrip(msg):
    wire = encode(msg)
    back = decode(wire)
    assert encode(back) == wire
    assert_same_message(msg, back)
    return back


@FAST
@given(trajectory_groups())
def test_trajectory_group_roundtrip(group):
    back = _roundtrip(group)
    for t in back.trajectories:
        assert (t.reward is None) == (t.finish_reason == "error")
        assert t.response_ids.dtype == np.int32 and t.logprobs.dtype == np.float32


@FAST
@given(prompt_requests())
def test_prompt_request_roundtrip(req):
    _roundtrip(req)


@FAST
@given(control_messages())
def test_control_message_roundtrip(msg):
    _roundtrip(msg)


@FAST
@given(weight_messages())
def test_weight_message_roundtrip(msg):
    _roundtrip(msg)


@settings(max_examples=80, deadline=None)
@given(messages(), st.sampled_from([bytes, bytearray, memoryview]))
def test_decode_accepts_any_byte_buffer(msg, buffer_type):
    wire = encode(msg)
    assert_same_message(msg, decode(buffer_type(wire)))


@settings(max_examples=60, deadline=None)
@given(messages())
def test_expect_restricts_kind(msg):
    assert type(decode(encode(msg), expect=type(msg))) is type(msg)
    other = TrajectoryGroup if not isinstance(msg, TrajectoryGroup) else WeightBucket
    with pytest.raises(ProtocolError) as err:
        decode(encode(msg), expect=other)
    assert err.value.path == "kind"


def test_decoded_arrays_are_readonly_views_of_the_input():
    data = np.arange(1 << 20, dtype=np.uint8)
    wire = bytearray(encode(WeightBucket(3, 0, data, "crc32:00000000")))
    bucket = decode(wire)
    assert np.shares_memory(bucket.data, np.frombuffer(wire, dtype=np.uint8))
    assert not bucket.data.flags.writeable
    with pytest.raises(ValueError):
        bucket.data[0] = 1


def test_arrays_are_aligned_in_the_frame():
    group = TrajectoryGroup("g", "p", [1, 2, 3], [Trajectory([4, 5], [-0.5, -1.0], [0, 0], 1.0)],
                            1, 10, 0, "e", 0.0)
    wire = encode(group)
    back = decode(wire)
    base = np.frombuffer(wire, dtype=np.uint8).ctypes.data
    for arr in (back.prompt_ids, back.trajectories[0].response_ids, back.trajectories[0].logprobs):
        assert (arr.ctypes.data - base) % ALIGN == 0


def test_big_endian_and_strided_arrays_encode_as_little_endian_contiguous():
    ids = np.arange(10, dtype=">i4")[::2]
    group = TrajectoryGroup("g", "p", ids, [Trajectory(ids, np.zeros(5, ">f4"), ids, 0.0)], 1, 100)
    back = decode(encode(group))
    assert back.prompt_ids.dtype == np.dtype("<i4")
    assert back.prompt_ids.tolist() == [0, 2, 4, 6, 8]


def test_unpack_frame_returns_the_plain_map():
    wire = encode(TrajectoryGroup("g", "p", [1], [Trajectory([], [], [], None, "error", "boom")], 1, 5))
    obj = unpack_frame(wire)
    assert obj["kind"] == "trajectory_group" and obj["schema"] == 2
    assert obj["trajectories"][0]["reward"] is None
