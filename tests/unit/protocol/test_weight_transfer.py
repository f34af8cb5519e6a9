"""Weight transfer group: bucket planning, the device checksum, and a push over gloo (CPU) between two threads."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from protocol.weights import _manifest_checksum
from protocol.weight_transfer import (ALIGN, WeightTransferError, WeightTransferGroup, device_checksum,
                                      named_views, plan_buckets)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_aligns_offsets_and_closes_buckets_on_overflow():
    specs, sizes = plan_buckets([("a", "bfloat16", (3,)), ("b", "float32", (600,)), ("c", "bfloat16", (5000,)),
                                 ("d", "uint8", (1,))], bucket_bytes=4096)
    assert [(s.bucket, s.offset, s.nbytes) for s in specs] == [(0, 0, 6), (0, 1024, 2400), (1, 0, 10000),
                                                               (2, 0, 1)]
    assert sizes == [4096, 10240, 1024]  # the 10000-byte tensor gets a bucket of its own
    assert all(s % ALIGN == 0 for s in sizes)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([], 100)
    assert plan_buckets([], 4096) == ([], [])


def test_checksum_sees_changed_and_swapped_words():
    buf = torch.randint(0, 256, (8 * ALIGN,), dtype=torch.uint8)
    base = int(device_checksum(buf))
    flipped = buf.clone()
    flipped[5] ^= 1
    rows = buf.clone().view(8, ALIGN)
    rows[[0, 1]] = rows[[1, 0]]
    words = buf.clone().view(torch.int32).view(8, -1)
    words[3, [0, 1]] = words[3, [1, 0]]
    others = {int(device_checksum(b.reshape(-1).view(torch.uint8))) for b in (flipped, rows, words)}
    assert base not in others and len(others) == 3


def _run_pair(sender, receiver, timeout_s=30.0):
    port, results = free_port(), {}

    def side(rank, fn):
        try:
            group = WeightTransferGroup("127.0.0.1", port, rank, 2, "cpu", timeout_s=timeout_s)
            try:
                results[rank] = fn(group)
            finally:
                group.close()
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            results[rank] = exc
    threads = [threading.Thread(target=side, args=(r, f)) for r, f in enumerate((sender, receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return results


@pytest.mark.parametrize("double_buffer", [True, False])
def test_push_over_gloo_round_trips_every_tensor(double_buffer):
    gen = torch.Generator().manual_seed(0)
    tensors = [("w1", torch.randn(33, 17, generator=gen).to(torch.bfloat16)),
               ("w2", torch.randn(700, generator=gen)), ("ids", torch.arange(5)),
               ("w3", torch.randn(64, 64, generator=gen).to(torch.bfloat16))]

    def receive_twice(g):
        return [g.recv() for _ in range(2)]
    results = _run_pair(lambda g: [g.send(v, tensors, 4096, double_buffer) for v in (7, 8)], receive_twice)
    sent, got = results[0], results[1]
    assert not isinstance(sent, Exception) and not isinstance(got, Exception), results
    for manifest, (rmanifest, buckets) in zip(sent, got):
        assert rmanifest == manifest and manifest.total_bytes == sum(manifest.bucket_sizes)
        assert manifest.checksum == _manifest_checksum(manifest.tensors, manifest.bucket_checksums,
                                                       manifest.version)
        views = named_views(rmanifest, buckets)
        assert [n for n, _ in views] == [n for n, _ in tensors]
        for (_, a), (_, b) in zip(views, tensors):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert [m.version for m in sent] == [7, 8]


def test_roles_are_enforced():
    results = _run_pair(lambda g: g.recv(), lambda g: g.send(1, [], 4096))
    assert isinstance(results[0], WeightTransferError) and "only rank 0 sends" not in str(results[0])
    assert isinstance(results[1], WeightTransferError) and "only rank 0 sends" in str(results[1])


def test_rank_zero_holds_its_store_port_from_the_moment_it_names_it_and_the_group_forms_there():
    from protocol.weight_transfer import open_sender_store

    store = open_sender_store(timeout_s=30.0)
    with socket.socket() as s, pytest.raises(OSError):  # nobody else can take the port it handed out
        s.bind(("0.0.0.0", store.port))
    tensors = [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4))]
    results: dict = {}

    def side(rank):
        try:
            group = WeightTransferGroup("127.0.0.1", store.port, rank, 2, "cpu", timeout_s=30.0,
                                        store=store if rank == 0 else None)
            try:
                results[rank] = group.send(3, tensors, 4096) if rank == 0 else group.recv()
            finally:
                group.close()
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            results[rank] = exc
    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(isinstance(r, Exception) for r in results.values()), results
    manifest, buckets = results[1]
    assert manifest == results[0] and manifest.version == 3
    assert torch.equal(dict(named_views(manifest, buckets))["w"], tensors[0][1])


def test_a_held_store_nobody_joins_fails_in_bounded_time_naming_the_group():
    from protocol.weight_transfer import open_sender_store

    store = open_sender_store()
    with pytest.raises(WeightTransferError, match=rf"group of 2 at 127.0.0.1:{store.port} did not form within 2s"):
        WeightTransferGroup("127.0.0.1", store.port, 0, 2, "cpu", timeout_s=2.0, store=store)
    with pytest.raises(ValueError, match="only rank 0 hosts"):
        WeightTransferGroup("127.0.0.1", store.port, 1, 2, "cpu", timeout_s=2.0, store=store)
