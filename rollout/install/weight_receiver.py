"""In-flight weight receiver: verify a weight push, then stage it for vLLM to load.

:func:`verify_push` checks, before anything touches the engine, that a push
(manifest + buckets) is complete and intact, moves the version forward
(unless re-syncing), and names exactly the model's parameters with their
checkpoint shapes and dtypes (:class:`ExpectedParams`, read from the
safetensors headers); any failure raises :class:`WeightUpdateError`.
:func:`stage_push` writes a verified push as one ``model.safetensors`` under
``/dev/shm`` straight from the bucket bytes, for ``reload_weights``.
:func:`verify_manifest` applies the version and parameter checks to a push
that arrived over a weight group. docs/rollout.md ("In-flight weight update").
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol import ProtocolError, TensorSpec, WeightBucket, WeightManifest, unpack_buckets

SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                      "int64": "I64", "int32": "I32", "uint8": "U8", "bool": "BOOL"}
"""Protocol dtype name -> safetensors dtype tag."""
PROTOCOL_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
SHM_ROOT = "/dev/shm"


class WeightUpdateError(RuntimeError):
    """A weight push was rejected or could not be installed; the reason says which and why."""


@dataclass(frozen=True)
class ParamSpec:
    """Shape and dtype (protocol name) of one model parameter."""

    shape: tuple[int, ...]
    dtype: str


class ExpectedParams:
    """The HF-named parameters a push must contain, read from a model directory's safetensors headers."""

    def __init__(self, params: dict[str, ParamSpec]):
        if not params:
            raise ValueError("expected parameters: the model has no tensors")
        self.params = params

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> ExpectedParams:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir}")
        params: dict[str, ParamSpec] = {}
        for path in files:
            for name, entry in read_safetensors_header(path).items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in PROTOCOL_DTYPES:
                    raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, "
                                     f"expected one of {sorted(PROTOCOL_DTYPES)}")
                params[name] = ParamSpec(tuple(entry["shape"]), PROTOCOL_DTYPES[entry["dtype"]])
        return cls(params)

    @property
    def total_bytes(self) -> int:
        from protocol.messages import dtype_itemsize
        return sum(int(np.prod(p.shape, dtype=np.int64)) * dtype_itemsize(p.dtype) for p in self.params.values())


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file (names -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def verify_push(manifest: WeightManifest, buckets: list[WeightBucket], expected: ExpectedParams,
                current_version: int | None) -> list[tuple[TensorSpec, np.ndarray]]:
    """Check a push completely; returns ``(spec, raw bytes)`` per tensor or raises :class:`WeightUpdateError`.

    ``current_version=None`` skips the version-order check (a learner re-syncing the engine)."""
    _check_version(manifest, current_version)
    try:
        tensors = list(unpack_buckets(manifest, buckets))
    except ProtocolError as exc:
        raise WeightUpdateError(f"weight push v{manifest.version} rejected: {exc}") from exc
    verify_manifest(manifest, expected, current_version)
    return tensors


def verify_manifest(manifest: WeightManifest, expected: ExpectedParams, current_version: int | None) -> None:
    """Checks 2 and 3 above on the manifest alone (a collective push checked its bytes on the device)."""
    _check_version(manifest, current_version)
    seen: set[str] = set()
    for spec in manifest.tensors:
        want = expected.params.get(spec.name)
        if want is None:
            raise WeightUpdateError(f"weight push v{manifest.version} rejected: tensor {spec.name!r} "
                                    f"is not a parameter of the model")
        if spec.name in seen:
            raise WeightUpdateError(f"weight push v{manifest.version} rejected: tensor {spec.name!r} appears twice")
        seen.add(spec.name)
        if tuple(spec.shape) != want.shape:
            raise WeightUpdateError(f"weight push v{manifest.version} rejected: tensor {spec.name!r} has shape "
                                    f"{tuple(spec.shape)}, the model expects {want.shape}")
        if spec.dtype != want.dtype:
            raise WeightUpdateError(f"weight push v{manifest.version} rejected: tensor {spec.name!r} has dtype "
                                    f"{spec.dtype}, the model expects {want.dtype}")
    missing = sorted(set(expected.params) - seen)
    if missing:
        raise WeightUpdateError(f"weight push v{manifest.version} rejected: {len(missing)} model parameters "
                                f"missing, e.g. {missing[:4]}")


def _check_version(manifest: WeightManifest, current_version: int | None) -> None:
    if current_version is not None and manifest.version <= current_version:
        raise WeightUpdateError(f"weight push rejected: manifest.version {manifest.version} must be greater "
                                f"than the version being served ({current_version})")


def write_safetensors(path: str | os.PathLike, tensors: list[tuple[TensorSpec, np.ndarray]]) -> int:
    """Write ``tensors`` (raw bytes) as one safetensors file; returns the bytes written."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec, raw in tensors:
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + int(raw.size)]}
        offset += int(raw.size)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, raw in tensors:
            f.write(np.ascontiguousarray(raw).data.cast("B"))
    return 8 + len(blob) + offset


def stage_push(tensors: list[tuple[TensorSpec, np.ndarray]], version: int, tag: str = "engine") -> Path:
    """Write a verified push into a fresh directory under /dev/shm (or the temp dir without it); returns it.

    The caller removes it with :func:`remove_staged` once the engine has loaded it."""
    root = SHM_ROOT if os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK) else tempfile.gettempdir()
    staged = Path(tempfile.mkdtemp(prefix=f"inflight-weights-{tag}-v{version}-", dir=root))
    try:
        write_safetensors(staged / "model.safetensors", tensors)
    except BaseException:
        remove_staged(staged)
        raise
    return staged


def remove_staged(staged: Path) -> None:
    shutil.rmtree(staged, ignore_errors=True)
