"""Map a learner's exported weight buffers into a vLLM worker through CUDA IPC, check them, install them.

When a learner rank and an engine's only worker share a GPU, a push need not be
copied anywhere before the install: the learner packs the weights into buckets
on its GPU, computes their device checksums and exports one CUDA IPC share per
bucket (``learner/ipc_export.py``: torch's ``reduce_tensor`` of the bucket,
without its Python classes, so the share is plain data: no pickle of tensor
data or of code). This mixin of the worker extension
(:class:`rollout.install.collective_receiver.CollectiveWeightReceiver`) maps each share
with torch's ``rebuild_cuda_tensor`` (waiting on the learner's CUDA event, so
its writes are complete), checks the mapped bytes against the manifest's sums
(:func:`row_checksum`, one pass over the bytes) -- before any pause -- and
holds them as the received push; the install then copies straight out of the
learner's memory along the copy plan (or plain load / ``reload_weights``,
:mod:`rollout.install.direct_load`) and the worker lets go of the mapping once those
copies have finished on the device. The learner keeps the buffers until every
engine has answered (``services/refit/cuda_ipc.py``). docs/rollout.md ("Pushes
through CUDA IPC") has the steps.

The wire form of a share is :class:`protocol.ipc_share.BucketShare`'s.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from protocol.ipc_share import BucketShare

logger = logging.getLogger(__name__)


def map_share(share: BucketShare, device_index: int) -> Any:
    """The shared bucket as a uint8 tensor on this process's ``device_index``, backed by the learner's memory."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, (share.nbytes,), (1,), share.tensor_offset, torch.storage.TypedStorage,
                               torch.uint8, device_index, share.storage_handle, share.storage_size_bytes,
                               share.storage_offset_bytes, False, share.ref_counter_handle,
                               share.ref_counter_offset, share.event_handle, share.event_sync_required)


def gpu_uuid(device: Any) -> str:
    """The UUID of ``device`` (a CUDA ``torch.device``), as CUDA IPC shares name it; '' for other devices."""
    import torch

    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


ROW_WORDS = 128
"""64-bit words per row of :func:`row_checksum` (1 KiB)."""


def row_checksum(buf: Any) -> Any:
    """Position-weighted sum of a uint8 buffer (its length a multiple of 1 KiB) in one pass over the data: its
    64-bit words summed row by row, the row sums weighted by their position; a 0-d int64 tensor on the buffer's
    device, wrapping arithmetic. Twin of ``learner.ipc_export.row_checksum``, which the learner's manifest
    carries as ``rsum64:`` (the learner and the engine never import each other; a unit test checks that the
    two agree)."""
    import torch

    rows = buf.view(torch.int64).view(-1, ROW_WORDS).sum(1)
    return (rows * torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=buf.device)).sum()


def check_sums(manifest: Any, buckets: list) -> None:
    """Compare each mapped bucket's :func:`row_checksum` with the manifest's ``rsum64:`` sums; RuntimeError
    naming the buckets that differ."""
    import torch

    if not all(s.startswith("rsum64:") for s in manifest.bucket_checksums):
        raise RuntimeError(f"CUDA IPC push v{manifest.version}: expected rsum64 bucket checksums, got "
                           f"{manifest.bucket_checksums[:2]}")
    sums = torch.stack([row_checksum(b) for b in buckets]).tolist() if buckets else []
    mine = [f"rsum64:{s & 0xFFFFFFFFFFFFFFFF:016x}" for s in sums]
    bad = [i for i, (a, b) in enumerate(zip(mine, manifest.bucket_checksums, strict=True)) if a != b]
    if bad:
        raise RuntimeError(f"CUDA IPC push v{manifest.version}: {len(bad)} of {len(buckets)} mapped buckets differ "
                           f"from the learner's checksums: {bad[:8]}")


class IpcWeightReceiver:
    """Mixed into the worker extension: the CUDA IPC half (``collective_rpc`` methods ``inflight_gpu_uuid``,
    ``inflight_map_ipc``, ``inflight_install_mapped``, ``inflight_drop_mapped``)."""

    _inflight_mapped = None
    """The mapped buckets of the push being installed, kept until its copies have finished on the device."""

    if TYPE_CHECKING:  # provided by the worker extension and the vLLM worker class this is mixed into
        device: Any
        _inflight_received: Any

        def inflight_install_received(self, version: int, direct_load: bool = False) -> dict: ...

    def inflight_gpu_uuid(self) -> str:
        return gpu_uuid(getattr(self, "device", None) or "cpu")

    def inflight_map_ipc(self, manifest_bytes: bytes, shares: list) -> bytes:
        """Map the learner's buckets, check them on the device, hold them as the received push; returns the
        manifest (encoded), as ``inflight_receive_weights`` does."""
        from protocol import WeightManifest, decode, encode

        self.inflight_drop_mapped()
        manifest = decode(manifest_bytes, expect=WeightManifest)
        parsed = [BucketShare.from_wire(s, f"shares[{i}]") for i, s in enumerate(shares)]
        if [s.nbytes for s in parsed] != list(manifest.bucket_sizes):
            raise RuntimeError(f"CUDA IPC push v{manifest.version}: shares of {[s.nbytes for s in parsed]} bytes "
                               f"for buckets of {list(manifest.bucket_sizes)}")
        device = getattr(self, "device", None)
        mine = self.inflight_gpu_uuid()
        for i, share in enumerate(parsed):
            if share.device_uuid != mine:
                raise RuntimeError(f"CUDA IPC push v{manifest.version}: bucket {i} is on GPU {share.device_uuid}, "
                                   f"this worker's device is {device} ({mine or 'no GPU'}); a CUDA IPC push needs "
                                   f"the learner rank and the engine on one GPU")
        assert device is not None  # a GPU worker: its uuid matched
        buckets = [map_share(share, device.index or 0) for share in parsed]
        self._inflight_mapped = buckets
        check_sums(manifest, buckets)
        self._inflight_received = (manifest, buckets)
        return encode(manifest)

    def inflight_install_mapped(self, version: int, direct_load: bool = False) -> dict:
        """Install the mapped push (``inflight_install_received``), then let go of the learner's buffers once
        the install's copies out of them have finished."""
        try:
            return self.inflight_install_received(version, direct_load)
        finally:
            self.inflight_drop_mapped()

    def inflight_drop_mapped(self) -> None:
        mapped, self._inflight_mapped = self._inflight_mapped, None
        self._inflight_received = None
        if mapped:
            import torch

            torch.cuda.synchronize(mapped[0].device)  # nothing reads the learner's memory after this returns
