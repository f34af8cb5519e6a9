"""Each validation rule fires, with the exact field path and expected/got text.

Every case starts from one valid message, breaks exactly one thing in its
wire map, re-frames it and checks the ProtocolError's ``path`` and message.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from protocol import (ControlMessage, PromptRequest, ProtocolError, Trajectory, TrajectoryGroup, decode,
                      encode, pack_buckets)
from protocol.codec import pack_frame, unpack_frame
from wire_maps import reject, wire_map

VOCAB = 100


def _group() -> TrajectoryGroup:
    trajs = [Trajectory(np.arange(i, i + 5), np.full(5, -0.25), np.full(5, 2), float(i)) for i in range(3)]
    trajs[2] = Trajectory([7], [-1.0], [2], None, "error", "reward server down")
    return TrajectoryGroup("g-1", "p-1", [1, 2, 3], trajs, 3, VOCAB, 4, "engine-0", 12.5)


def _set_element(m, dotted, index, value):
    t = m["trajectories"][1][dotted]
    t[index] = value


@pytest.mark.parametrize("value,fragment", [(math.nan, "got nan"), (math.inf, "got inf"),
                                            (-math.inf, "got -inf"), (0.5, "got 0.5")])
def test_bad_logprob_names_the_token(value, fragment):
    m = wire_map(_group())
    _set_element(m, "logprobs", 3, value)
    reject(m, "trajectories[1].logprobs[3]", "a finite log-probability <= 0", fragment)


@pytest.mark.parametrize("token", [VOCAB, -1, 1 << 30])
def test_token_outside_vocab(token):
    m = wire_map(_group())
    _set_element(m, "response_ids", 4, token)
    reject(m, "trajectories[1].response_ids[4]", f"a token id in [0, {VOCAB})", f"got {token}")


def test_prompt_token_outside_vocab():
    m = wire_map(_group())
    m["prompt_ids"][2] = VOCAB
    reject(m, "prompt_ids[2]", f"[0, {VOCAB})", f"got {VOCAB}")


def test_negative_token_version():
    m = wire_map(_group())
    _set_element(m, "versions", 0, -3)
    reject(m, "trajectories[1].versions[0]", "a non-negative integer", "got -3")


@pytest.mark.parametrize("field", ["logprobs", "versions"])
def test_per_token_array_length_must_match_response(field):
    m = wire_map(_group())
    m["trajectories"][0][field] = m["trajectories"][0][field][:4]
    reject(m, f"trajectories[0].{field}", "length 5", "got 4")


def test_wrong_dtype_of_per_token_array():
    m = wire_map(_group())
    m["trajectories"][0]["logprobs"] = m["trajectories"][0]["logprobs"].astype(np.float64)
    reject(m, "trajectories[0].logprobs", "dtype float32", "float64")


def test_two_dimensional_ids_are_rejected():
    m = wire_map(_group())
    m["trajectories"][0]["response_ids"] = np.zeros((5, 1), np.int32)
    reject(m, "trajectories[0].response_ids", "1-d array", "2-d")


def test_group_size_mismatch():
    m = wire_map(_group())
    m["group_size"] = 4
    reject(m, "trajectories", "4 trajectories (group_size)", "got 3")


def test_failed_sample_must_not_carry_a_reward():
    m = wire_map(_group())
    m["trajectories"][2]["reward"] = 0.0
    reject(m, "trajectories[2].reward", "null for a failed sample", "got 0.0")


def test_failed_sample_needs_a_reason():
    m = wire_map(_group())
    m["trajectories"][2]["error"] = ""
    reject(m, "trajectories[2].error", "a reason for a failed sample")


def test_successful_sample_needs_a_finite_reward():
    m = wire_map(_group())
    m["trajectories"][0]["reward"] = None
    reject(m, "trajectories[0].reward", "a number", "got None")
    m["trajectories"][0]["reward"] = math.nan
    reject(m, "trajectories[0].reward", "a finite number", "got nan")


def test_unknown_finish_reason():
    m = wire_map(_group())
    m["trajectories"][1]["finish_reason"] = "timeout"
    reject(m, "trajectories[1].finish_reason", "one of ('stop', 'length', 'abort', 'error')", "'timeout'")


def test_missing_required_field():
    m = wire_map(_group())
    del m["trajectories"][1]["versions"]
    reject(m, "trajectories[1].versions", "field is required", "missing")


@pytest.mark.parametrize("field,value,expected", [
    ("scheduled_step", -1, "an integer >= 0"),
    ("vocab_size", 0, "an integer >= 1"),
    ("group_size", True, "an integer"),
    ("group_id", "", "a non-empty string"),
    ("created_at", "yesterday", "a number"),
    ("engine_id", "e" * 5000, "a string of at most 4096 chars"),
])
def test_top_level_field_rules(field, value, expected):
    m = wire_map(_group())
    m[field] = value
    reject(m, field, expected)


def test_trajectory_must_be_a_map():
    m = wire_map(_group())
    m["trajectories"][1] = [1, 2]
    reject(m, "trajectories[1]", "a map", "list")


def test_prompt_request_rules():
    m = wire_map(PromptRequest("p", [1, 2], {"answer": "4"}, 0))
    m["prompt_ids"][1] = -5
    reject(m, "prompt_ids[1]", "a non-negative integer", "got -5")
    m = wire_map(PromptRequest("p", [1, 2], {"answer": "4"}, 0))
    m["task"]["answer"] = [4]
    reject(m, "task.answer", "a string or number", "list")
    m["task"]["answer"] = math.inf
    reject(m, "task.answer", "a finite number", "inf")


def test_control_message_rules():
    m = wire_map(ControlMessage("error", {"reason": "refit"}))
    m["action"] = "explode"
    reject(m, "action", "one of ('error',)", "'explode'")
    m = wire_map(ControlMessage("error", {"reason": "refit"}))
    m["payload"]["reason"] = {"nested": 1}
    reject(m, "payload.reason", "a scalar", "dict")


def _manifest_map():
    raw = np.arange(24, dtype=np.uint8)
    manifest, _ = pack_buckets([("a", "float32", (2, 3), raw), ("b", "uint8", (4,), raw[:4])], 5, 16)
    return wire_map(manifest)


def test_manifest_rules():
    m = _manifest_map()
    m["tensors"][1]["nbytes"] = 5
    reject(m, "tensors[1].nbytes", "4 (= prod(shape) x itemsize of uint8)", "got 5")
    m = _manifest_map()
    m["tensors"][0]["dtype"] = "complex64"
    reject(m, "tensors[0].dtype", "one of", "'complex64'")
    m = _manifest_map()
    m["total_bytes"] += 1
    reject(m, "total_bytes", "(sum of bucket_sizes)")
    m = _manifest_map()
    m["tensors"][1]["offset"] = 1
    reject(m, "tensors[1]", "a range inside its bucket", "bucket 1 offset 1 nbytes 4")
    m = _manifest_map()
    m["bucket_checksums"].pop()
    reject(m, "bucket_checksums", "2 entries (one per bucket)", "got 1")
    m = _manifest_map()
    m["version"] = -1
    reject(m, "version", "an integer >= 0", "got -1")


def test_manifest_shape_overflow_is_not_wrapped():
    """np.prod(dtype=int64) would wrap (2**32)**2 to 0 and accept nbytes 0."""
    m = _manifest_map()
    m["tensors"][0]["shape"] = [1 << 32, 1 << 32]
    m["tensors"][0]["nbytes"] = 0
    reject(m, "tensors[0].nbytes", str((1 << 64) * 4))


def test_weight_bucket_rules():
    _, buckets = pack_buckets([("a", "uint8", (8,), np.arange(8, dtype=np.uint8))], 2, 16)
    m = wire_map(buckets[0])
    m["data"] = m["data"].astype(np.int32)
    reject(m, "data", "dtype uint8", "int32")
    m = wire_map(buckets[0])
    m["index"] = -1
    reject(m, "index", "an integer >= 0")


def test_error_repr_is_bounded_for_hostile_values():
    deep = []
    for _ in range(3000):
        deep = [deep]
    err = ProtocolError("kind", "a string", deep)
    assert len(str(err)) < 200
    assert len(str(ProtocolError("x", "y", "z" * 10**6))) < 200


@pytest.mark.parametrize("schema", [np.zeros(2, np.int32), np.ones(1, np.int64), 1.0, True, 0, 4, "1", None])
def test_schema_must_be_exactly_the_int_version(schema):
    """An array here once escaped as numpy's "truth value is ambiguous" ValueError."""
    m = wire_map(ControlMessage("error"))
    m["schema"] = schema
    reject(m, "schema", "a schema version in 1..3")


def test_a_kind_is_read_only_at_its_own_schema_versions():
    m = wire_map(ControlMessage("error"))
    m["schema"] = 2  # control did not change in schema 2: no such message exists
    reject(m, "schema", "schema version 1 for a control message", "got 2")
