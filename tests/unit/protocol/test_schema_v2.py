"""Schema 2: the per-token ``loss_mask`` and ``turn_finish_reasons`` of a trajectory, and reading schema 1.

Round trip of a multi-turn trajectory; frames written by the schema 1 code (``v1_frames.py``, byte for byte)
decode with every token sampled, and the kinds that did not change are still written exactly as the schema 1
code wrote them (a pool of the previous version reads this learner's prompts and weight pushes); each rule on
the new fields fires with its field path.
"""
from __future__ import annotations

import numpy as np
import pytest

from msg_strategies import assert_same_message
from protocol import Trajectory, TrajectoryGroup, decode, encode, masked_fill
from protocol.codec import KIND_SCHEMAS, SCHEMA_VERSION, unpack_frame
from protocol.loss_mask import sampled_spans
from v1_frames import V1_FRAMES, messages
from wire_maps import reject, wire_map

VOCAB = 100
#                   turn 1 (sampled)  env turn   turn 2 (sampled)  env  turn 3
MASK = np.array([1, 1, 1, 0, 0, 0, 1, 1, 0, 1], np.uint8)


def multi_turn(mask=MASK) -> Trajectory:
    n = mask.size
    lps, vers = masked_fill(mask, -np.linspace(0.1, 2.0, n), np.array([3, 3, 4, 9, 9, 9, 4, 5, 9, 5])[:n])
    return Trajectory(np.arange(10, 10 + n), lps, vers, 1.0, "length", "", {}, mask,
                      ["stop", "stop", "length"][:sampled_spans(mask)])


def group(*trajs: Trajectory) -> TrajectoryGroup:
    return TrajectoryGroup("g", "p", [1, 2], list(trajs), len(trajs), VOCAB, 5, "engine-0", 1.0)


def test_masked_fill_gives_environment_tokens_log_prob_zero_and_the_version_before_them():
    lps, vers = masked_fill(MASK, -np.ones(10), np.array([3, 3, 4, 9, 9, 9, 4, 5, 9, 5]))
    assert lps.tolist() == [-1, -1, -1, 0, 0, 0, -1, -1, 0, -1] and lps.dtype == np.float32
    assert vers.tolist() == [3, 3, 4, 4, 4, 4, 4, 5, 5, 5]
    lead = np.array([0, 0, 1, 0], np.uint8)  # environment tokens ahead of the first sampled one take its version
    assert masked_fill(lead, np.zeros(4), np.array([9, 9, 6, 9]))[1].tolist() == [6, 6, 6, 6]
    assert masked_fill(np.zeros(3, np.uint8), -np.ones(3), np.full(3, 7))[1].tolist() == [0, 0, 0]


def test_multi_turn_round_trip_is_byte_and_field_exact():
    g = group(multi_turn(), Trajectory([4, 5], [-0.5, -1.0], [5, 5], 0.0))
    wire = encode(g)
    assert unpack_frame(wire)["schema"] == SCHEMA_VERSION - 1 == 2  # no routing: still schema 2 (protocol.routing)
    back = decode(wire, expect=TrajectoryGroup)
    assert_same_message(g, back)
    assert encode(back) == wire
    t = back.trajectories[0]
    assert t.loss_mask.dtype == np.uint8 and not t.loss_mask.flags.writeable
    assert t.turn_finish_reasons == ["stop", "stop", "length"]
    assert back.trajectories[1].loss_mask.tolist() == [1, 1] and back.trajectories[1].turn_finish_reasons == ["stop"]


def test_defaults_are_one_sampled_turn():
    t = Trajectory([4, 5, 6], [-0.5, -1.0, -0.1], [0, 0, 1], 1.0, "length")
    assert t.loss_mask.tolist() == [1, 1, 1] and t.turn_finish_reasons == ["length"]
    assert Trajectory([4], [-0.5], [0], 1.0, loss_mask=np.array([True])).loss_mask.dtype == np.uint8


def test_oldest_version_counts_only_sampled_tokens():
    t = multi_turn()
    t.versions = np.array([3, 3, 4, 0, 0, 0, 4, 5, 0, 5], np.int32)  # not canonical: built in memory, not decoded
    g = group(t, Trajectory([4], [-0.5], [6], 0.0))
    assert t.sampled_versions.tolist() == [3, 3, 4, 4, 5, 5] and g.oldest_version == 3


# ----------------------------------------------------------------------------- schema 1


def test_a_schema_1_group_decodes_with_every_token_sampled():
    back = decode(V1_FRAMES["trajectory_group"], expect=TrajectoryGroup)
    assert_same_message(messages()["trajectory_group"], back)  # built with the defaults: all ones, one turn
    for t in back.trajectories:
        assert t.loss_mask.tolist() == [1] * t.response_ids.size and t.turn_finish_reasons == [t.finish_reason]
    assert unpack_frame(encode(back))["schema"] == 2  # re-encoded at the current version


@pytest.mark.parametrize("kind", ["prompt", "control", "weight_manifest", "weight_bucket"])
def test_unchanged_kinds_are_written_as_schema_1_wrote_them(kind):
    """New learner -> old pool: its prompts and weight pushes are byte-identical to the schema 1 code's."""
    assert KIND_SCHEMAS[kind] == (1,)
    assert encode(messages()[kind]) == V1_FRAMES[kind]
    assert_same_message(messages()[kind], decode(V1_FRAMES[kind]))


def test_a_schema_1_frame_carrying_a_mask_is_rejected():
    m = wire_map(group(multi_turn()))
    m["schema"] = 1
    reject(m, "trajectories[0].loss_mask", "absent in a schema 1 message")
    del m["trajectories"][0]["loss_mask"]
    reject(m, "trajectories[0].turn_finish_reasons", "absent in a schema 1 message")


def test_a_schema_2_group_must_carry_both_fields():
    for key in ("loss_mask", "turn_finish_reasons"):
        m = wire_map(group(multi_turn()))
        del m["trajectories"][0][key]
        reject(m, f"trajectories[0].{key}", "field is required")


# ----------------------------------------------------------------------------- bad masks


@pytest.mark.parametrize(("mask", "path", "fragment"), [
    (np.ones(9, np.uint8), "trajectories[0].loss_mask", "length 10"),
    (np.ones(10, np.int32), "trajectories[0].loss_mask", "dtype uint8"),
    (np.ones((10, 1), np.uint8), "trajectories[0].loss_mask", "1-d array"),
    (np.array([1, 1, 2, 1, 1, 1, 1, 1, 1, 1], np.uint8), "trajectories[0].loss_mask[2]", "0 (environment token) or 1"),
    (np.zeros(10, np.uint8), "trajectories[0].loss_mask", "at least one sampled (1) token"),
    ("all", "trajectories[0].loss_mask", "an ndarray of uint8"),
])
def test_bad_masks_are_rejected_by_field(mask, path, fragment):
    m = wire_map(group(Trajectory(np.arange(10), -np.ones(10), np.zeros(10), 1.0)))
    m["trajectories"][0]["loss_mask"] = mask
    reject(m, path, fragment)


def test_a_failed_sample_may_have_nothing_sampled():
    t = Trajectory(np.arange(3), np.zeros(3), np.zeros(3), None, "error", "env down", {}, np.zeros(3, np.uint8))
    assert decode(encode(group(t)), expect=TrajectoryGroup).trajectories[0].loss_mask.tolist() == [0, 0, 0]


def test_environment_tokens_carry_the_canonical_log_prob_and_version():
    m = wire_map(group(multi_turn()))
    m["trajectories"][0]["logprobs"][4] = -0.5
    reject(m, "trajectories[0].logprobs[4]", "expected 0.0 (environment token, loss_mask 0)", "got -0.5")
    m = wire_map(group(multi_turn()))
    m["trajectories"][0]["versions"][8] = 4  # the sampled token before it has version 5
    reject(m, "trajectories[0].versions[8]", "expected 5 (environment token", "nearest sampled token before it", "got 4")


@pytest.mark.parametrize(("turns", "path", "fragment"), [
    (["stop", "stop"], "trajectories[0].turn_finish_reasons", "3 to 6 entries"),   # three runs of sampled tokens
    (["stop"] * 7, "trajectories[0].turn_finish_reasons", "3 to 6 entries"),       # six sampled tokens
    (["stop", "eos", "stop"], "trajectories[0].turn_finish_reasons[1]", "one of ('stop'"),
    (["stop", 3, "stop"], "trajectories[0].turn_finish_reasons[1]", "a string"),
    ("stop", "trajectories[0].turn_finish_reasons", "a list"),
])
def test_bad_turn_finish_reasons_are_rejected_by_field(turns, path, fragment):
    m = wire_map(group(multi_turn()))
    m["trajectories"][0]["turn_finish_reasons"] = turns
    reject(m, path, fragment)
