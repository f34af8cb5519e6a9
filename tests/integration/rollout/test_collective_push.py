"""Weight pushes over a collective group (gloo on CPU) into the real vLLM engine's worker.

This process plays the learner (rank 0 of a :class:`WeightTransferGroup`); the
engine's worker joins as rank 1 through ``rollout.install.collective_receiver`` and
installs what it receives with ``reload_weights``.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from protocol.weight_transfer import WeightTransferGroup
from services.data.tasks import make_prompts
from rollout.install.weight_receiver import WeightUpdateError
from services.cluster.head import free_port

from model_weights import model_tensors
from rollout_engine_helpers import GROUP_SIZE

TIMEOUT_S = 120.0


def _torch_tensors(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return [(name, torch.from_numpy(raw.copy()).view(dtypes[dtype]).view(shape))
            for name, dtype, shape, raw in model_tensors(model_dir)]


class Sender:
    """Rank 0 of the engine's weight group, in a thread of this process."""

    def __init__(self, harness):
        self.harness = harness
        port = free_port()
        made: dict = {}
        t = threading.Thread(target=lambda: made.setdefault(
            "group", WeightTransferGroup("127.0.0.1", port, 0, 2, "cpu", TIMEOUT_S)))
        t.start()
        self.ranks = harness.run(harness.engine.join_weight_group("127.0.0.1", port, 1, 2, TIMEOUT_S))
        t.join(TIMEOUT_S)
        self.group = made["group"]

    def push(self, version: int, tensors, reset: bool = False) -> int:
        """Send ``tensors`` as ``version`` while the engine receives; returns the engine's answer."""
        sent: dict = {}
        t = threading.Thread(target=lambda: sent.setdefault("manifest", self.group.send(version, tensors, 1 << 16)))
        t.start()
        try:
            return self.harness.run(self.harness.engine.install_from_group(reset=reset))
        finally:
            t.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def sender(harness):
    s = Sender(harness)
    yield s
    s.group.close()


def greedy_tokens(harness, seed: int = 11) -> list[list[int]]:
    request = make_prompts("repeat_letter", harness.engine.tokenizer, 1, seed)[0]
    group = harness.run(harness.engine.generate_group(request, GROUP_SIZE))
    return [t.response_ids.tolist() for t in group.trajectories], group


def test_engine_worker_joins_the_group_as_rank_one(sender):
    assert sender.ranks == [1]
    assert sender.harness.engine.weight_group_members == 1


def test_collective_push_installs_the_weights_and_reset_restores_them(harness, sender, tiny_model_dir,
                                                                      tiny_model_dir_v2):
    engine = harness.engine
    before, _ = greedy_tokens(harness)
    v = engine.version
    assert sender.push(v + 1, _torch_tensors(tiny_model_dir_v2)) == v + 1 == engine.version
    first = engine.stats()
    assert first["install_path_last"] == "checked"  # plain load_weights vs reload_weights, decided here
    changed, group = greedy_tokens(harness)
    assert changed != before
    assert all((t.versions == v + 1).all() for t in group.trajectories)
    # the same weights through the object-store path give the same samples, bit for bit
    from protocol import pack_buckets
    manifest, buckets = pack_buckets(model_tensors(tiny_model_dir_v2), v + 2, 1 << 20)
    harness.run(engine.install(manifest, buckets))
    again, group2 = greedy_tokens(harness)
    assert again == changed
    for a, b in zip(group.trajectories, group2.trajectories):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert sender.push(v, _torch_tensors(tiny_model_dir), reset=True) == v == engine.version
    restored, _ = greedy_tokens(harness)
    assert restored == before  # on whichever path the check chose
    stats = engine.stats()
    # CPU: plain load raises (repacked linear weights), so reload; GPU dense: the copy plan is checked now
    assert stats["install_path_last"] == ("reload" if stats["direct_load_refused"] else "checked")
    print(f"\ninstall path after the check: {stats['install_path_last']} {stats['direct_load_refused']}")
    print(f"\ncollective push over gloo: {stats['refit_seconds_last'] * 1e3:.0f} ms, "
          f"pause {stats['pause_seconds_last'] * 1e3:.0f} ms")


@pytest.mark.parametrize("damage", ["stale_version", "wrong_shape", "missing_tensor"])
def test_bad_collective_push_is_rejected_and_old_weights_keep_serving(harness, sender, tiny_model_dir_v2, damage):
    engine = harness.engine
    v = engine.version
    before, _ = greedy_tokens(harness, seed=3)
    tensors = _torch_tensors(tiny_model_dir_v2)
    version = v + 1
    if damage == "stale_version":
        version = v
    elif damage == "wrong_shape":
        name, t = tensors[0]
        tensors[0] = (name, t.reshape(-1)[:-1].clone())
    else:
        tensors = tensors[1:]
    rejected = engine.stats()["refit_rejected"]
    with pytest.raises(WeightUpdateError, match="rejected"):
        sender.push(version, tensors)
    assert engine.version == v
    assert engine.stats()["refit_rejected"] == rejected + 1
    after, _ = greedy_tokens(harness, seed=3)
    assert after == before
