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
released bucket's memory until the last process mapping it lets go. On one
GPU the pack can run as one CUDA graph replay (:mod:`learner.ipc_graph`).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from learner.ipc_graph import PackGraph, TensorsFn, WeightsKey, graph_refusal, pack_into_buckets, weights_key
from protocol import TensorSpec, WeightManifest
from protocol.ipc_share import BucketShare
from protocol.weights import _manifest_checksum

if TYPE_CHECKING:
    from learner.trainer import Learner

log = logging.getLogger(__name__)

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
    return manifest_of(version, specs, sizes, torch.stack([row_checksum(b) for b in buckets]).tolist())


def manifest_of(version: int, specs: list[TensorSpec], sizes: list[int], sums: list[int]) -> WeightManifest:
    """The manifest of buckets whose :func:`row_checksum` sums are ``sums``."""
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
        self._graph: PackGraph | None = None
        self._graph_refused = ""
        """Why the last export could not use a CUDA graph (logged when it changes)."""
        self.captures = 0
        """How many times :meth:`export_graphed` captured its pack."""

    def export(self, version: int, tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
               ) -> tuple[WeightManifest, list[BucketShare]]:
        """Pack ``tensors`` (all on one CUDA device) as version ``version`` and share the buckets; returns the
        manifest (with the buckets' device checksums) and one share per bucket."""
        if not tensors:
            raise ValueError("export: no tensors to share")
        if tensors[0][1].device.type != "cuda":
            raise ValueError(f"export: CUDA IPC shares tensors of one GPU; got devices "
                             f"{sorted({str(t.device) for _, t in tensors})}")
        self._check_free(version)
        specs, sizes, buckets = pack_into_buckets(tensors, bucket_bytes)
        manifest = ipc_manifest(version, specs, sizes, buckets)  # waits for the copies
        return manifest, self._share(version, buckets)

    def export_graphed(self, version: int, make_tensors: TensorsFn, key: WeightsKey, bucket_bytes: int
                       ) -> tuple[WeightManifest, list[BucketShare]]:
        """:meth:`export` of ``make_tensors()`` by one replay of a captured pack (:mod:`learner.ipc_graph`),
        captured again when the weights moved (``key``), the bucket size changed or an export not yet released
        still holds the pack's buckets (a replay would overwrite them under an engine's feet)."""
        self._check_free(version)
        graph = self._graph
        in_use = graph is not None and any(bs is graph.buckets for bs in self._held.values())
        if graph is None or in_use or graph.key != key or graph.bucket_bytes != bucket_bytes:
            self._graph = None  # its buckets go once no engine maps them
            graph = self._graph = PackGraph.capture(make_tensors, key, bucket_bytes, row_checksum)
            self.captures += 1
        sums = graph.replay()
        manifest = manifest_of(version, graph.specs, graph.sizes, sums)
        return manifest, self._share(version, graph.buckets)

    def export_learner(self, learner: Learner, world_size: int, bucket_bytes: int, cuda_graph: bool
                       ) -> tuple[WeightManifest, list[BucketShare]] | None:
        """``learner``'s current version, by :meth:`export_graphed` if ``cuda_graph`` and the learner can
        (:func:`learner.ipc_graph.graph_refusal`), else by :meth:`export`. Collective over the learner's
        ``world_size`` ranks (they gather the export); None on ranks other than 0."""
        why = graph_refusal(learner.device, world_size, learner.arch.radio is not None) if cuda_graph else ""
        if why and why != self._graph_refused:
            log.info("refit: the CUDA IPC export is packed eagerly: %s", why)
        self._graph_refused = why
        if cuda_graph and not why:
            return self.export_graphed(learner.policy_version, learner.export_weight_tensors,
                                       weights_key(learner.gpt), bucket_bytes)
        tensors = learner.export_weight_tensors()
        return None if tensors is None else self.export(learner.policy_version, tensors, bucket_bytes)

    def _check_free(self, version: int) -> None:
        if version in self._held:
            raise ValueError(f"export: v{version} is exported already and not released")

    def _share(self, version: int, buckets: list[torch.Tensor]) -> list[BucketShare]:
        self._held[version] = buckets
        return [share_bucket(b) for b in buckets]

    @property
    def held(self) -> dict[int, int]:
        """Exported versions not yet released -> their bytes."""
        return {v: sum(b.numel() for b in bs) for v, bs in self._held.items()}

    def release(self, version: int | None = None, failed: bool = False) -> int:
        """Let go of ``version``'s buckets (all versions with None); returns the bytes released. Memory an
        engine still maps is freed when it lets go (torch counts the processes that map it). ``failed``: the
        push did not complete, so an engine may still be reading the captured pack's buckets; the next export
        captures new ones instead of overwriting them."""
        versions = list(self._held) if version is None else [version] if version in self._held else []
        released = sum(b.numel() for v in versions for b in self._held.pop(v))
        if failed:
            self._graph = None
        if released:
            torch.cuda.ipc_collect()
        return released
