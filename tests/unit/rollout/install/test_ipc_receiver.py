"""The worker's CUDA IPC half (rollout.install.ipc_receiver) without a GPU: the wire form of a share is checked field by
field, a share of another GPU is refused before anything is mapped, and mapped bytes are checked against the
learner's device sums (here on CPU tensors, with the same checksum)."""
from __future__ import annotations

import pytest
import torch

from learner import ipc_export
from protocol import encode
from protocol.ipc_share import WIRE_FIELDS, BucketShare
from protocol.weight_transfer import plan_buckets
from rollout.install import ipc_receiver
from rollout.install.ipc_receiver import IpcWeightReceiver, check_sums

WIRE = [2048, "GPU-1234", 0, 0, b"h" * 64, 4096, 1024, b"/torch_1_2", 8, b"e" * 64, True]


def test_a_share_is_read_from_its_wire_form_and_each_bad_field_is_named():
    share = BucketShare.from_wire(WIRE, "shares[0]")
    assert share.nbytes == 2048 and share.device_uuid == "GPU-1234" and share.storage_offset_bytes == 1024
    assert BucketShare.from_wire([*WIRE[:9], None, False], "s").event_handle is None
    assert share.to_wire() == WIRE and BucketShare.from_wire(share.to_wire(), "s") == share  # the learner writes it
    with pytest.raises(ValueError, match=r"shares\[1\]: expected a list of 11 fields"):
        BucketShare.from_wire(WIRE[:5], "shares[1]")
    for field, value, expect in [("nbytes", -1, "an int >= 0"), ("storage_handle", "h", "non-empty bytes"),
                                 ("device_uuid", "", "a GPU UUID"), ("event_handle", 7, "bytes or None"),
                                 ("event_sync_required", 1, "a bool"), ("ref_counter_offset", True, "an int")]:
        bad = list(WIRE)
        bad[WIRE_FIELDS.index(field)] = value
        with pytest.raises(ValueError, match=rf"s\.{field}: expected {expect}"):
            BucketShare.from_wire(bad, "s")


def pushed(tensors, version=3):
    specs, sizes = plan_buckets([(n, "float32", tuple(t.shape)) for n, t in tensors], 4096)
    buckets = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
    for spec, (_, t) in zip(specs, tensors, strict=True):
        buckets[spec.bucket][spec.offset:spec.offset + spec.nbytes] = t.view(-1).view(torch.uint8)
    return ipc_export.ipc_manifest(version, specs, sizes, buckets), buckets


def test_the_learners_and_the_engines_checksums_agree_and_see_moved_words():
    """``row_checksum`` lives twice (learner and rollout never import each other): the same value, and a swap
    of two 1 KiB rows changes it (a swap of two words within one row does not: 1 KiB is its grain)."""
    buf = torch.randint(0, 256, (64 << 10,), dtype=torch.uint8)
    assert int(ipc_export.row_checksum(buf)) == int(ipc_receiver.row_checksum(buf))
    rows = buf.view(-1, 1024).clone()
    rows[[3, 9]] = rows[[9, 3]]
    assert int(ipc_receiver.row_checksum(rows.view(-1))) != int(ipc_receiver.row_checksum(buf))


def test_mapped_bytes_are_checked_against_the_learners_sums():
    manifest, buckets = pushed([("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(1000))])
    check_sums(manifest, buckets)
    buckets[1][5] ^= 1  # one flipped bit in the second bucket
    with pytest.raises(RuntimeError, match=r"1 of 2 mapped buckets differ from the learner's checksums: \[1\]"):
        check_sums(manifest, buckets)


class CpuWorker(IpcWeightReceiver):
    device = torch.device("cpu")
    _inflight_received = None


def test_a_share_of_another_gpu_or_size_is_refused_before_anything_is_mapped():
    manifest, _ = pushed([("a", torch.ones(256))])
    worker = CpuWorker()
    assert worker.inflight_gpu_uuid() == ""
    share = [manifest.bucket_sizes[0], *WIRE[1:]]
    with pytest.raises(RuntimeError, match="bucket 0 is on GPU GPU-1234, this worker's device is cpu \\(no GPU\\); "
                                           "a CUDA IPC push needs the learner rank and the engine on one GPU"):
        worker.inflight_map_ipc(encode(manifest), [share])
    with pytest.raises(RuntimeError, match=r"shares of \[2048\] bytes for buckets of \[1024\]"):
        worker.inflight_map_ipc(encode(manifest), [WIRE])
    assert worker._inflight_mapped is None and worker._inflight_received is None
