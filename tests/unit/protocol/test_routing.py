"""Schema 3: a trajectory's optional ``routed_experts`` (routing replay, :mod:`protocol.routing`).

Round trip; a group without routing is still written at schema 2 (an older reader reads it); the key is refused in
schema 1 and 2 messages; every rule on the array fires with its field path; the engine's full-layer array is cut to
the MoE layers of each family's config.
"""
from __future__ import annotations

import numpy as np
import pytest

from protocol import Trajectory, TrajectoryGroup, decode, encode
from protocol.codec import unpack_frame
from protocol.routing import MAX_TOP_K, compact, moe_layers
from wire_maps import reject, wire_map

VOCAB = 100


def routed(positions: int = 4, layers: int = 2, k: int = 2, dtype=np.uint8) -> np.ndarray:
    base = np.arange(positions * layers)[:, None] % 3 + np.arange(k)[None, :]  # k distinct experts per row
    return base.reshape(positions, layers, k).astype(dtype)


def group(routing: np.ndarray | None) -> TrajectoryGroup:
    t = Trajectory(np.array([4, 5, 6]), np.array([-0.5, -1.0, -0.1]), np.ones(3), 1.0, routed_experts=routing)
    return TrajectoryGroup("g", "p", np.array([1, 2]), [t, Trajectory(np.array([7, 8]), np.array([-1.0, -2.0]), np.ones(2), 0.0)],
                           2, VOCAB, 1)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routing_round_trips_at_schema_3(dtype):
    r = routed(dtype=dtype)
    wire = encode(group(r))
    assert unpack_frame(wire)["schema"] == 3
    back = decode(wire, TrajectoryGroup)
    assert back.trajectories[0].routed_experts is not None
    assert back.trajectories[0].routed_experts.dtype == dtype
    assert np.array_equal(back.trajectories[0].routed_experts, r)
    assert back.trajectories[1].routed_experts is None


def test_a_group_without_routing_is_written_at_schema_2():
    wire = encode(group(None))
    assert unpack_frame(wire)["schema"] == 2
    assert decode(wire, TrajectoryGroup).trajectories[0].routed_experts is None


@pytest.mark.parametrize("schema", [1, 2])
def test_routing_is_refused_before_schema_3(schema):
    m = wire_map(group(routed()))
    m["schema"] = schema
    if schema == 1:
        for t in m["trajectories"]:
            del t["loss_mask"], t["turn_finish_reasons"]
    reject(m, "trajectories[0].routed_experts", f"absent in a schema {schema} message")


@pytest.mark.parametrize("bad, fragment", [
    (routed().astype(np.int32), "an ndarray of uint8 or uint16"),
    (routed()[0], "3-d array"),
    (routed(positions=6), "at most 5 positions"),  # prompt 2 + response 3
    (np.zeros((2, 1, 2), np.uint8), "2 distinct experts"),
    (np.zeros((1, 1, MAX_TOP_K + 1), np.uint8), f"at most {MAX_TOP_K} experts per token"),
    (np.zeros((1, 0, 2), np.uint8), "at least one MoE layer"),
])
def test_each_routing_rule_fires_with_its_path(bad, fragment):
    m = wire_map(group(routed()))
    m["trajectories"][0]["routed_experts"] = bad
    path = "trajectories[0].routed_experts" + ("[0, 0]" if "distinct" in fragment else "")
    reject(m, path, fragment)


def test_compact_keeps_the_moe_layers_in_the_narrowest_dtype():
    full = np.zeros((3, 4, 2), np.int64)
    full[:, 1] = [[1, 2]] * 3
    full[:, 3] = [[300, 4]] * 3
    assert compact(full, (1,)).dtype == np.uint8 and compact(full, (1,)).shape == (3, 1, 2)
    both = compact(full, (1, 3))
    assert both.dtype == np.uint16 and both[:, 1].tolist() == [[300, 4]] * 3
    with pytest.raises(ValueError, match="MoE layer 4"):
        compact(full, (4,))


def test_moe_layers_of_each_family():
    assert moe_layers({"num_hidden_layers": 3, "num_experts": 4}) == (0, 1, 2)
    assert moe_layers({"num_hidden_layers": 4, "num_experts": 4, "decoder_sparse_step": 2,
                       "mlp_only_layers": [3]}) == (1,)
    assert moe_layers({"num_hidden_layers": 5, "hybrid_override_pattern": "M*EME"}) == (2, 4)
    assert moe_layers({"text_config": {"num_hidden_layers": 2, "num_experts": 8}}) == (0, 1)
    assert moe_layers({"num_hidden_layers": 2, "intermediate_size": 8}) == ()
