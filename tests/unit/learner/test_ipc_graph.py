"""The CUDA graph pack's pieces that run anywhere: the weights' key, when a learner may capture, the bucket pack,
and which way ``IpcExporter.export_learner`` packs (the capture itself: tests/integration/learner/
test_ipc_graph_gpu.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from learner.ipc_export import IpcExporter
from learner.ipc_graph import graph_refusal, pack_into_buckets, weights_key


def test_the_key_follows_the_weights_addresses_not_their_values():
    model = torch.nn.Linear(4, 3)
    key = weights_key(model)
    assert [k[0] for k in key] == ["weight", "bias"]
    with torch.no_grad():
        model.weight.add_(1.0)                      # an optimizer step: same storage
    assert weights_key(model) == key
    model.weight = torch.nn.Parameter(torch.zeros(3, 4))   # a rebuilt model: the graph would read freed memory
    assert weights_key(model) != key


@pytest.mark.parametrize(("device", "world", "tower", "why"), [
    ("cuda", 1, False, ""),
    ("cpu", 1, False, "the weights are on cpu, not a GPU"),
    ("cuda", 2, False, "2 ranks gather the export"),
    ("cuda", 1, True, "the vision tower's untrained tensors are read from the checkpoint"),
])
def test_only_a_one_gpu_learner_without_a_vision_tower_captures(device, world, tower, why):
    got = graph_refusal(torch.device(device), world, tower)
    assert got.startswith(why) and bool(got) == bool(why)


def test_the_pack_places_every_tensor_at_its_planned_offset():
    tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
               ("b", torch.arange(10, dtype=torch.bfloat16).reshape(5, 2).t()),   # not contiguous
               ("c", torch.ones(300, dtype=torch.float32))]
    specs, sizes, buckets = pack_into_buckets(tensors, 1024)
    assert sizes == [b.numel() for b in buckets] and len({s.bucket for s in specs}) == len(buckets) > 1
    for spec, (_, t) in zip(specs, tensors, strict=True):
        raw = buckets[spec.bucket][spec.offset:spec.offset + spec.nbytes]
        assert torch.equal(raw.view(t.dtype).view(t.shape), t)
    placed = torch.zeros(sum(sizes), dtype=torch.bool)
    for spec in specs:
        start = sum(sizes[:spec.bucket]) + spec.offset
        placed[start:start + spec.nbytes] = True
    assert not torch.cat(buckets)[~placed].any()             # the padding is zero: equal weights, equal sums
    with pytest.raises(ValueError, match="no tensors"):
        pack_into_buckets([], 1024)
    with pytest.raises(ValueError, match="several devices"):
        pack_into_buckets([("a", torch.ones(2)), ("b", torch.ones(2, device="meta"))], 1024)


class _Learner(SimpleNamespace):
    def export_weight_tensors(self):
        return [("w", torch.ones(4))]


def test_export_learner_captures_only_where_it_may_and_says_once_why_not(monkeypatch, caplog):
    exporter, calls = IpcExporter(), []
    monkeypatch.setattr(exporter, "export_graphed", lambda v, fn, key, b: calls.append(("graphed", v)) or "g")
    monkeypatch.setattr(exporter, "export", lambda v, tensors, b: calls.append(("eager", v)) or "e")
    gpu = _Learner(device=torch.device("cuda"), arch=SimpleNamespace(radio=None), policy_version=3,
                   gpt=torch.nn.Linear(2, 2))
    assert exporter.export_learner(gpu, 1, 1024, cuda_graph=True) == "g"
    assert exporter.export_learner(gpu, 1, 1024, cuda_graph=False) == "e"
    cpu = _Learner(device=torch.device("cpu"), arch=SimpleNamespace(radio=None), policy_version=4)
    with caplog.at_level(logging.INFO, logger="learner.ipc_export"):
        assert exporter.export_learner(cpu, 1, 1024, cuda_graph=True) == "e"
        assert exporter.export_learner(cpu, 1, 1024, cuda_graph=True) == "e"
    assert calls == [("graphed", 3), ("eager", 3), ("eager", 4), ("eager", 4)]
    assert [r.getMessage() for r in caplog.records] == [
        "refit: the CUDA IPC export is packed eagerly: the weights are on cpu, not a GPU"]


class _FakePack(SimpleNamespace):
    """A captured pack without CUDA: its buckets, and how many times it was replayed."""

    @classmethod
    def capture(cls, make_tensors, key, bucket_bytes, checksum):
        return cls(key=key, bucket_bytes=bucket_bytes, specs=[], sizes=[4], buckets=[torch.zeros(4, dtype=torch.uint8)],
                   replays=0)

    def replay(self):
        self.replays += 1
        return [0]


def test_a_pack_still_held_by_an_unreleased_export_is_not_replayed_over(monkeypatch):
    import learner.ipc_export as ipc_export

    monkeypatch.setattr(ipc_export, "PackGraph", _FakePack)
    monkeypatch.setattr(ipc_export, "share_bucket", lambda b: b.data_ptr())
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    exporter, key = IpcExporter(), (("w", 1, (4,), torch.uint8),)
    first = exporter.export_graphed(1, list, key, 4)[1]
    exporter.release(1)
    assert exporter.export_graphed(2, list, key, 4)[1] == first and exporter.captures == 1   # replayed in place
    third = exporter.export_graphed(3, list, key, 4)[1]           # v2 not released: its buckets stay as they are
    assert exporter.captures == 2 and third != first and set(exporter.held) == {2, 3}
    exporter.release()
    exporter.export_graphed(4, list, key, 8)                      # another bucket size: captured again
    assert exporter.captures == 3
