"""Weight pushes from a learner's GPU to rollout engines' GPUs over one NCCL group (gloo on CPU).

Rank 0 is the learner (the sender), ranks 1..N-1 are engine workers; each side
builds a :class:`WeightTransferGroup` from a ``TCPStore`` on rank 0 and a
process group of its own (never ``torch.distributed``'s default group).
:meth:`WeightTransferGroup.send` packs the tensors into aligned buckets
(:func:`plan_buckets`), publishes the layout in the store and broadcasts each
bucket (double-buffered); :meth:`WeightTransferGroup.recv` receives them and
compares :func:`device_checksum` sums computed on the device. Every wait is
bounded by ``timeout_s``. docs/protocol.md ("Weight transfer group") has the details.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage] -- public API

from protocol.messages import TensorSpec, WeightManifest, dtype_itemsize
from protocol.weights import _manifest_checksum

ALIGN = 1024
"""Byte alignment of every tensor and bucket size (a row of the checksum)."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
           "bool": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


class WeightTransferError(RuntimeError):
    """A push could not be sent or received intact."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise WeightTransferError(f"dtype {dtype} cannot be pushed; expected one of {sorted(_DTYPES)}")
    return _NAMES[dtype]


def plan_buckets(entries: Sequence[tuple[str, str, tuple[int, ...]]], bucket_bytes: int
                 ) -> tuple[list[TensorSpec], list[int]]:
    """Place ``(name, dtype, shape)`` entries in buckets; returns the specs and the bucket sizes.

    Tensors go end to end at :data:`ALIGN`-aligned offsets; a bucket is closed
    when the next tensor would overflow ``bucket_bytes``; sizes are multiples of
    :data:`ALIGN`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes: expected >= {ALIGN}, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    fill = 0
    for name, dtype, shape in entries:
        nbytes = dtype_itemsize(dtype)
        for dim in shape:
            nbytes *= int(dim)
        if not sizes or (fill and fill + nbytes > bucket_bytes):
            if sizes:
                sizes[-1] = fill
            sizes.append(0)
            fill = 0
        specs.append(TensorSpec(name, dtype, tuple(int(d) for d in shape), len(sizes) - 1, fill, nbytes))
        fill = _align(fill + nbytes)
    if sizes:
        sizes[-1] = fill
    return specs, sizes


def device_checksum(buf: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of a uint8 buffer (length a multiple of :data:`ALIGN`), as a 0-d int64 tensor
    on its device; computed without a host sync."""
    words = buf.view(torch.int32).view(-1, ALIGN // 4)
    rows = words.sum(1, dtype=torch.int64)
    cols = words.sum(0, dtype=torch.int64)
    row_w = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=buf.device)
    col_w = torch.arange(1, cols.numel() + 1, dtype=torch.int64, device=buf.device)
    return (rows * row_w).sum() + (cols * col_w).sum()


def _manifest(version: int, specs: list[TensorSpec], sizes: list[int], sums: list[int]) -> WeightManifest:
    text = [f"wsum64:{s & 0xFFFFFFFFFFFFFFFF:016x}" for s in sums]
    return WeightManifest(version, specs, sizes, text, sum(sizes), _manifest_checksum(specs, text, version))


def named_views(manifest: WeightManifest, buckets: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of a received push: views into ``buckets``, no copies."""
    out = []
    for s in manifest.tensors:
        raw = buckets[s.bucket][s.offset:s.offset + s.nbytes]
        out.append((s.name, raw.view(_DTYPES[s.dtype]).view(s.shape)))
    return out


def open_sender_store(timeout_s: float = 300.0) -> TCPStore:
    """Rank 0's store, listening at once on a port the OS picks (``.port``): held open from the moment the port is
    chosen until :class:`WeightTransferGroup` takes it, so no other process can take the port between (a port
    found free and closed again could be: EADDRINUSE under load)."""
    return TCPStore("0.0.0.0", 0, None, is_master=True, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


class WeightTransferGroup:
    """One learner (rank 0) and its engines, joined for pushing weights GPU to GPU."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device | str,
                 timeout_s: float = 300.0, store: TCPStore | None = None):
        """``store``: rank 0's, already listening at ``host:port`` (:func:`open_sender_store`); without it rank 0
        opens one there and waits for every member to reach it."""
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}: expected 0 <= rank < world_size, "
                             f"world_size >= 2")
        if store is not None and rank != 0:
            raise ValueError(f"rank {rank}: only rank 0 hosts the group's store; the others reach it at host:port")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        try:
            self._store = store if store is not None else TCPStore(
                host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightTransferError(f"weight transfer rank {rank}: could not reach the group's store at "
                                      f"{host}:{port} within {timeout_s:g}s: {exc}") from exc
        self._store.set_timeout(timeout)
        pg_store = PrefixStore("pg", self._store)
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(pg_store, rank, world_size, opts)
            else:
                self._pg = dist.ProcessGroupGloo(pg_store, rank, world_size, timeout)
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightTransferError(f"weight transfer rank {rank}: the group of {world_size} at {host}:{port} "
                                      f"did not form within {timeout_s:g}s: {exc}") from exc
        self._pushes = 0
        self._staging: list[torch.Tensor] = []
        self._broadcast(torch.zeros(1, device=self.device)).wait()

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg: Any = self._pg  # Backend.broadcast exists at runtime; torch's stub declares it on ProcessGroup only
        return pg.broadcast([tensor], opts)

    def _staging_buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        if len(self._staging) < count or self._staging[0].numel() < nbytes:
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        return self._staging[:count]

    def send(self, version: int, tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int,
             double_buffer: bool = True) -> WeightManifest:
        """Push ``tensors`` (on this rank's device) to every other rank as version ``version``.

        Returns when every broadcast is enqueued and the sums are computed (one host sync); the
        receivers' :meth:`recv` return the same manifest."""
        if self.rank != 0:
            raise WeightTransferError(f"weight transfer rank {self.rank}: only rank 0 sends")
        specs, sizes = plan_buckets([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors], bucket_bytes)
        key = f"push/{self._pushes}"
        self._store.set(key, json.dumps({"version": version, "sizes": sizes,
                                         "tensors": [s.to_wire() for s in specs]}))
        if self._pushes:
            self._store.delete_key(f"push/{self._pushes - 1}")  # every receiver took it: that push completed
        self._pushes += 1
        by_bucket: list[list[tuple[TensorSpec, torch.Tensor]]] = [[] for _ in sizes]
        for spec, (_, t) in zip(specs, tensors, strict=True):
            by_bucket[spec.bucket].append((spec, t))
        staging = self._staging_buffers(max(sizes, default=0), 2 if double_buffer else 1)
        sums = torch.empty(len(sizes), dtype=torch.int64, device=self.device)
        works: list[dist.Work | None] = [None] * len(staging)
        for b, size in enumerate(sizes):
            slot = b % len(staging)
            if (previous := works[slot]) is not None:
                previous.wait()  # the buffer's previous broadcast must be done before it is refilled
            buf = staging[slot][:size]
            for spec, t in by_bucket[b]:
                buf[spec.offset:spec.offset + spec.nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            sums[b] = device_checksum(buf)
            works[slot] = self._broadcast(buf)
        for w in works:
            if w is not None:
                w.wait()
        self._broadcast(sums).wait()
        return _manifest(version, specs, sizes, sums.tolist())

    def recv(self) -> tuple[WeightManifest, list[torch.Tensor]]:
        """Receive the next push into new buffers on this rank's device; verified before returning."""
        if self.rank == 0:
            raise WeightTransferError("weight transfer rank 0 sends; it cannot receive")
        key = f"push/{self._pushes}"
        try:
            layout = json.loads(self._store.get(key))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightTransferError(f"weight transfer rank {self.rank}: no push announced within "
                                      f"{self.timeout_s:g}s ({exc})") from exc
        self._pushes += 1
        specs = [TensorSpec.from_wire(t, f"push.tensors[{i}]") for i, t in enumerate(layout["tensors"])]
        sizes = [int(s) for s in layout["sizes"]]
        buckets = [torch.empty(s, dtype=torch.uint8, device=self.device) for s in sizes]
        mine = torch.empty(len(sizes), dtype=torch.int64, device=self.device)
        for b, buf in enumerate(buckets):
            self._broadcast(buf).wait()
            mine[b] = device_checksum(buf)
        theirs = torch.empty(len(sizes), dtype=torch.int64, device=self.device)
        self._broadcast(theirs).wait()
        sent = theirs.tolist()
        bad = [b for b, (x, y) in enumerate(zip(mine.tolist(), sent, strict=True)) if x != y]
        if bad:
            raise WeightTransferError(f"weight transfer rank {self.rank}: push v{layout['version']}: "
                                      f"{len(bad)} of {len(sizes)} buckets differ from what was sent: {bad[:8]}")
        return _manifest(int(layout["version"]), specs, sizes, sent), buckets

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort the communicator without waiting for the peers (they may be dead: a graceful NCCL
        shutdown then waits for them forever, measured), at most ``timeout_s``; the store closes with
        the object."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        stop = getattr(pg, "abort", None) or pg.shutdown
        t = threading.Thread(target=stop, name="weight-group-close", daemon=True)
        t.start()
        t.join(timeout_s)
