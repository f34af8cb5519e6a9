"""Export a version's weights to processes on the same GPU through CUDA IPC (colocated refit, the learner's side).

:class:`IpcExporter` packs HF-named tensors on the learner's GPU into aligned
buckets (:func:`protocol.weight_transfer.plan_buckets`, one device copy), sums
each on the device in one pass over its bytes (:func:`row_checksum`; one host
sync for all) and shares each bucket with torch's ``reduce_tensor``: a CUDA IPC
handle of its allocation, a shared-memory reference counter and a CUDA event
recorded after the writes. What leaves the process is plain data
(:class:`protocol.ipc_share.BucketShare`); the engine
maps the buckets and copies out of them. The exporter keeps every bucket of a
version alive until :meth:`IpcExporter.release` (the learner job calls it once
every engine has answered, whether the push succeeded or not); torch keeps a
released bucket's memory until the last process mapping it lets go.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from protocol import TensorSpec, WeightManifest
from protocol.ipc_share import BucketShare
from protocol.weight_transfer import dtype_name, plan_buckets
from protocol.weights import _manifest_checksum

ROW_WORDS = 128
"""64-bit words per row of :func:`row_checksum` (1 KiB: bucket sizes are multiples of it)."""


def row_checksum(buf: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of a uint8 buffer (its length a multiple of 1 KiB) in one pass over the data: its
    64-bit words summed row by row (1 KiB rows), the row sums weighted by their position; a 0-d int64 tensor on
    the buffer's device, wrapping arithmetic. Twin of ``rollout.install.ipc_receiver.row_checksum`` (the learner and
    the engine never import each other; a unit test checks that the two agree)."""
    rows = buf.view(torch.int64).view(-1, ROW_WORDS).sum(1)
    return (rows * torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=buf.device)).sum()


def ipc_manifest(version: int, specs: list[TensorSpec], sizes: list[int], buckets: list[torch.Tensor]
                 ) -> WeightManifest:
    """The manifest of packed ``buckets``, with their :func:`row_checksum` sums (``rsum64:``; one host sync)."""
    sums = torch.stack([row_checksum(b) for b in buckets]).tolist()
    text = [f"rsum64:{s & 0xFFFFFFFFFFFFFFFF:016x}" for s in sums]
    return WeightManifest(version, specs, sizes, text, sum(sizes), _manifest_checksum(specs, text, version))


def gpu_uuid(device: torch.device | str) -> str:
    """The UUID of ``device`` as CUDA IPC shares name it ('' for a device that is not a GPU)."""
    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def share_bucket(bucket: torch.Tensor) -> BucketShare:
    """Share ``bucket`` (a contiguous uint8 CUDA tensor) as plain data."""
    from torch.multiprocessing.reductions import reduce_tensor

    args: Any = reduce_tensor(bucket)[1]  # rebuild_cuda_tensor's arguments (a CUDA tensor's reduction)
    (_, _, _, tensor_offset, _, _, device, handle, size, offset, _, counter, counter_offset, event,
     event_sync) = args
    return BucketShare(int(bucket.numel()), gpu_uuid(bucket.device), int(tensor_offset), int(device), bytes(handle),
                       int(size), int(offset), bytes(counter), int(counter_offset),
                       None if event is None else bytes(event), bool(event_sync))


class IpcExporter:
    """The learner's exported buckets, by version, alive until released."""

    def __init__(self) -> None:
        self._held: dict[int, list[torch.Tensor]] = {}

    def export(self, version: int, tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
               ) -> tuple[WeightManifest, list[BucketShare]]:
        """Pack ``tensors`` (all on one CUDA device) as version ``version`` and share the buckets; returns the
        manifest (with the buckets' device checksums) and one share per bucket."""
        if not tensors:
            raise ValueError("export: no tensors to share")
        device = tensors[0][1].device
        if device.type != "cuda" or any(t.device != device for _, t in tensors):
            raise ValueError(f"export: CUDA IPC shares tensors of one GPU; got devices "
                             f"{sorted({str(t.device) for _, t in tensors})}")
        if version in self._held:
            raise ValueError(f"export: v{version} is exported already and not released")
        specs, sizes = plan_buckets([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors], bucket_bytes)
        buckets = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]
        for spec, (_, t) in zip(specs, tensors, strict=True):
            buckets[spec.bucket][spec.offset:spec.offset + spec.nbytes].copy_(t.detach().contiguous().view(-1)
                                                                             .view(torch.uint8))
        manifest = ipc_manifest(version, specs, sizes, buckets)  # waits for the copies
        self._held[version] = buckets
        return manifest, [share_bucket(b) for b in buckets]

    @property
    def held(self) -> dict[int, int]:
        """Exported versions not yet released -> their bytes."""
        return {v: sum(b.numel() for b in bs) for v, bs in self._held.items()}

    def release(self, version: int | None = None) -> int:
        """Let go of ``version``'s buckets (all versions with None); returns the bytes released. Memory an
        engine still maps is freed when it lets go (torch counts the processes that map it)."""
        versions = list(self._held) if version is None else [version] if version in self._held else []
        released = sum(b.numel() for v in versions for b in self._held.pop(v))
        if released:
            torch.cuda.ipc_collect()
        return released
