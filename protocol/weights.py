"""Cutting a model's tensors into :class:`WeightBucket` s and putting them back.

The sender lays tensors end to end into buckets of at most ``bucket_bytes``
(a tensor larger than that gets a bucket of its own), computes a CRC32 per
bucket and one over the manifest, and sends the manifest first. The receiver
calls :func:`unpack_buckets`, which checks completeness, versions, sizes and
checksums of everything *before* returning any tensor, so a bad push is
rejected whole.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from protocol.errors import ProtocolError
from protocol.messages import TensorSpec, WeightBucket, WeightManifest, dtype_itemsize


def checksum_of(data) -> str:
    return f"crc32:{zlib.crc32(memoryview(data).cast('B')) & 0xFFFFFFFF:08x}"


def _manifest_checksum(specs: list[TensorSpec], bucket_sums: list[str], version: int) -> str:
    crc = zlib.crc32(str(version).encode())
    for s in specs:
        crc = zlib.crc32(f"{s.name}|{s.dtype}|{s.shape}|{s.bucket}|{s.offset}|{s.nbytes}".encode(), crc)
    for b in bucket_sums:
        crc = zlib.crc32(b.encode(), crc)
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def pack_buckets(tensors: Iterable[tuple[str, str, tuple[int, ...], np.ndarray]], version: int,
                 bucket_bytes: int) -> tuple[WeightManifest, list[WeightBucket]]:
    """``tensors`` yields ``(name, dtype, shape, raw uint8 bytes)``; returns the
    manifest and the buckets."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    parts: list[list[np.ndarray]] = [[]]
    fill = 0
    for name, dtype, shape, raw in tensors:
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        expect = int(np.prod(shape, dtype=np.int64)) * dtype_itemsize(dtype)
        if raw.size != expect:
            raise ValueError(f"tensor {name}: {raw.size} bytes, expected {expect} for {dtype}{tuple(shape)}")
        if fill and fill + raw.size > bucket_bytes:
            parts.append([])
            fill = 0
        specs.append(TensorSpec(name, dtype, tuple(int(s) for s in shape), len(parts) - 1, fill, int(raw.size)))
        parts[-1].append(raw)
        fill += raw.size
    datas = [np.concatenate(p) if p else np.zeros(0, np.uint8) for p in parts]
    sums = [checksum_of(d) for d in datas]
    buckets = [WeightBucket(version, i, d, s) for i, (d, s) in enumerate(zip(datas, sums, strict=True))]
    manifest = WeightManifest(version, specs, [int(d.size) for d in datas], sums,
                              int(sum(d.size for d in datas)), _manifest_checksum(specs, sums, version))
    return manifest, buckets


def verify_buckets(manifest: WeightManifest, buckets: list[WeightBucket]) -> list[WeightBucket]:
    """Check that the push is complete and intact; returns buckets by index."""
    want = _manifest_checksum(manifest.tensors, manifest.bucket_checksums, manifest.version)
    if manifest.checksum != want:
        raise ProtocolError("manifest.checksum", want, manifest.checksum)
    by_index: dict[int, WeightBucket] = {}
    for b in buckets:
        if b.version != manifest.version:
            raise ProtocolError(f"bucket[{b.index}].version", str(manifest.version), b.version)
        if b.index in by_index:
            raise ProtocolError(f"bucket[{b.index}]", "each bucket once", "a duplicate")
        by_index[b.index] = b
    n = len(manifest.bucket_sizes)
    missing = [i for i in range(n) if i not in by_index]
    if missing:
        raise ProtocolError("buckets", f"all {n} buckets", f"missing {missing[:8]}")
    extra = sorted(i for i in by_index if i >= n)
    if extra:
        raise ProtocolError("buckets", f"bucket indices < {n}", extra[:8])
    ordered = [by_index[i] for i in range(n)]
    for i, b in enumerate(ordered):
        if b.data.size != manifest.bucket_sizes[i]:
            raise ProtocolError(f"bucket[{i}].data", f"{manifest.bucket_sizes[i]} bytes", f"{b.data.size} bytes")
        got = checksum_of(b.data)
        if got != manifest.bucket_checksums[i] or got != b.checksum:
            raise ProtocolError(f"bucket[{i}].checksum", manifest.bucket_checksums[i], got)
    return ordered


def unpack_buckets(manifest: WeightManifest, buckets: list[WeightBucket]
                   ) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """Verify everything, then yield ``(spec, raw uint8 view)`` per tensor."""
    ordered = verify_buckets(manifest, buckets)

    def gen():
        for spec in manifest.tensors:
            yield spec, ordered[spec.bucket].data[spec.offset:spec.offset + spec.nbytes]
    return gen()
