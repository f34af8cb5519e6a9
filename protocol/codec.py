"""Framed msgpack codec for protocol messages, with out-of-band numpy arrays.

A frame is a magic, a msgpack header (``schema``, ``kind`` and the fields;
each ndarray is an extension reference ``[dtype, shape, offset]``) and the
arrays' raw bytes, 64-byte aligned, after it. Decoding views the arrays in the
input buffer (no copy, read-only), accepts only the canonical layout
(``encode(decode(b)) == b``) and raises nothing but :class:`ProtocolError`,
with the field path. docs/protocol.md ("Wire layout", "Validation and limits")
has the layout and the rules.
"""
from __future__ import annotations

import math
import struct
from typing import Any, TypeVar, cast, overload

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.messages import (
    MESSAGE_TYPES,
    ControlMessage,
    Message,
    PromptRequest,
    TrajectoryGroup,
    WeightBucket,
    WeightManifest,
)

M = TypeVar("M", TrajectoryGroup, PromptRequest, WeightManifest, WeightBucket, ControlMessage)

SCHEMA_VERSION = 3
"""The newest schema version (2: the trajectory's per-token ``loss_mask`` and ``turn_finish_reasons``; 3: its
optional ``routed_experts``, :mod:`protocol.routing`)."""
KIND_SCHEMAS: dict[str, tuple[int, ...]] = {"trajectory_group": (1, 2, 3), "prompt": (1,), "weight_manifest": (1,),
                                            "weight_bucket": (1,), "control": (1,)}
"""The schema versions each kind is read at, oldest first; it is written at the last. A kind is written at the
version that last changed its layout (only ``trajectory_group`` changed in 2), so that a pool of the previous
version still reads this learner's prompts and weight pushes during a rolling upgrade, and a schema 1 group
(from such a pool, or in a checkpoint) is read with every token sampled. A trajectory group is written at 3 only
when it carries routing (``TrajectoryGroup.schema``), else at 2, so a schema 2 reader still reads it."""
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
MAGIC = b"INFL"
ALIGN = 64
EXT_NDARRAY = 1
ARRAY_DTYPES = {"uint8", "uint16", "int32", "int64", "float32", "float64"}
MAX_ARRAY_DIMS = 8
_PREFIX = struct.Struct("<4sI")
_ZEROS = bytes(ALIGN)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------- encoding

class _ArrayCollector:
    """msgpack ``default`` hook: replaces each ndarray by a reference and
    remembers its bytes for the data section."""

    def __init__(self):
        self.buffers: list[memoryview] = []
        self.cursor = 0

    def __call__(self, obj):
        if isinstance(obj, np.ndarray):
            dt = obj.dtype.newbyteorder("<") if obj.dtype.byteorder == ">" else obj.dtype
            if dt.name not in ARRAY_DTYPES:
                raise TypeError(f"ndarray dtype {obj.dtype} is not in {sorted(ARRAY_DTYPES)}")
            arr = np.ascontiguousarray(obj, dtype=dt)
            offset = _align(self.cursor)
            self.buffers.append(arr.data.cast("B") if arr.size else memoryview(b""))
            self.cursor = offset + arr.nbytes
            ref = msgpack.packb([dt.name, list(arr.shape), offset])
            return msgpack.ExtType(EXT_NDARRAY, ref)
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot encode {type(obj).__name__}")


def pack_frame(body: dict) -> bytes:
    """Frame a plain map (arrays allowed as values). :func:`encode` uses this;
    tests and tools use it to build frames with arbitrary, even invalid, content."""
    arrays = _ArrayCollector()
    header = cast(bytes, msgpack.packb(body, default=arrays, use_bin_type=True))  # the stub allows None
    parts: list[Any] = [_PREFIX.pack(MAGIC, len(header)), header]
    if arrays.buffers:
        pos = _align(_PREFIX.size + len(header))
        parts.append(_ZEROS[:pos - _PREFIX.size - len(header)])
        written = 0
        for buf in arrays.buffers:
            start = _align(written)
            parts.append(_ZEROS[:start - written])
            parts.append(buf)
            written = start + buf.nbytes
    return b"".join(parts)


def encode(msg: Message) -> bytes:
    """Encode a message (adds ``schema`` and ``kind``); array bytes are copied once."""
    body = msg.to_wire()
    body["schema"] = msg.schema if isinstance(msg, TrajectoryGroup) else KIND_SCHEMAS[msg.KIND][-1]
    body["kind"] = msg.KIND
    return pack_frame(body)


# ----------------------------------------------------------------------------- decoding

class _ArrayResolver:
    """msgpack ``ext_hook``: turns each array reference into a read-only view
    of the frame's data section, checking that the references are in
    canonical order and inside the frame."""

    def __init__(self, frame: memoryview, data_start: int):
        self.frame = frame
        self.data_start = data_start
        self.data_len = len(frame) - data_start
        self.cursor = 0
        self.count = 0

    def __call__(self, code: int, payload: bytes) -> np.ndarray:
        path = f"<frame>.arrays[{self.count}]"
        if code != EXT_NDARRAY:
            raise ProtocolError(path, f"msgpack extension type {EXT_NDARRAY} (ndarray)", code)
        try:
            ref = msgpack.unpackb(payload, raw=False)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is a protocol error
            raise ProtocolError(path, "a [dtype, shape, offset] reference", f"{type(exc).__name__}: {exc}") from None
        if not isinstance(ref, list) or len(ref) != 3:
            raise ProtocolError(path, "a [dtype, shape, offset] reference", ref)
        dtype, shape, offset = ref
        if not isinstance(dtype, str) or dtype not in ARRAY_DTYPES:
            raise ProtocolError(f"{path}.dtype", f"one of {sorted(ARRAY_DTYPES)}", dtype)
        if not isinstance(shape, list) or len(shape) > MAX_ARRAY_DIMS or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ProtocolError(f"{path}.shape", f"a list of at most {MAX_ARRAY_DIMS} sizes >= 0", shape)
        dt = np.dtype(dtype).newbyteorder("<")
        count = math.prod(shape)
        nbytes = count * dt.itemsize
        expect_offset = _align(self.cursor)
        if type(offset) is not int or offset != expect_offset:
            raise ProtocolError(f"{path}.offset", f"{expect_offset} (next aligned position)", offset)
        if offset + nbytes > self.data_len:
            raise ProtocolError(path, f"{nbytes} bytes for {dtype}{shape} at offset {offset}",
                                f"{max(self.data_len - offset, 0)} bytes left in the frame")
        gap = self.frame[self.data_start + self.cursor:self.data_start + offset]
        if gap != _ZEROS[:len(gap)]:
            raise ProtocolError(f"{path}.padding", "zero bytes", bytes(gap))
        arr = np.frombuffer(self.frame, dtype=dt, count=count, offset=self.data_start + offset)
        arr.flags.writeable = False  # also for writable inputs (bytearray, shared memory)
        self.cursor = offset + nbytes
        self.count += 1
        return arr.reshape(shape)


def unpack_frame(data: bytes | bytearray | memoryview,
                 max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Parse a frame into its header object (arrays resolved) without
    validating the message. Raises :class:`ProtocolError` on a broken frame."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("<message>", "bytes", type(data).__name__)
    try:
        frame = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError("<message>", "a contiguous byte buffer", str(exc)) from None
    size = len(frame)
    if size > max_bytes:
        raise ProtocolError("<message>", f"at most {max_bytes} bytes", f"{size} bytes")
    if size < _PREFIX.size:
        raise ProtocolError("<frame>", f"at least {_PREFIX.size} bytes", f"{size} bytes")
    magic, header_len = _PREFIX.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError("<frame>.magic", repr(MAGIC), magic)
    header_end = _PREFIX.size + header_len
    if header_end > size:
        raise ProtocolError("<frame>.header_length", f"at most {size - _PREFIX.size} (frame size - 8)", header_len)
    resolver = _ArrayResolver(frame, _align(header_end))
    try:
        obj = msgpack.unpackb(frame[_PREFIX.size:header_end], raw=False, ext_hook=resolver,
                              strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - any msgpack failure is a protocol error
        raise ProtocolError("<frame>.header", "valid msgpack", f"{type(exc).__name__}: {exc}") from None
    if resolver.count:
        pad = frame[header_end:resolver.data_start]
        if pad != _ZEROS[:len(pad)]:
            raise ProtocolError("<frame>.padding", "zero bytes", bytes(pad))
        expect_size = resolver.data_start + resolver.cursor
    else:
        expect_size = header_end
    if size != expect_size:
        raise ProtocolError("<frame>", f"{expect_size} bytes (header + arrays)", f"{size} bytes")
    return obj


@overload
def decode(data: bytes | bytearray | memoryview, expect: type[M], max_bytes: int = ...) -> M: ...
@overload
def decode(data: bytes | bytearray | memoryview, expect: None = None, max_bytes: int = ...) -> Message: ...
def decode(data: bytes | bytearray | memoryview, expect: type | None = None,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate one message; ``expect`` restricts the kind.

    Arrays in the result are read-only views of ``data``: keep a writable
    buffer (bytearray, shared memory) unchanged while the message is in use.
    """
    obj = unpack_frame(data, max_bytes)
    if not isinstance(obj, dict):
        raise ProtocolError("<message>", "a map", type(obj).__name__)
    schema = obj.get("schema")
    if type(schema) is not int or not 1 <= schema <= SCHEMA_VERSION:  # not 1.0, True or an array
        raise ProtocolError("schema", f"a schema version in 1..{SCHEMA_VERSION}", schema)
    kind = obj.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("kind", f"one of {sorted(MESSAGE_TYPES)}", kind)
    if expect is not None and cls is not expect:
        raise ProtocolError("kind", repr(expect.KIND), kind)
    versions = KIND_SCHEMAS[cls.KIND]
    if schema not in versions:
        raise ProtocolError("schema", f"schema version {' or '.join(map(str, versions))} for a {cls.KIND} message",
                            schema)
    try:
        if cls is TrajectoryGroup:
            return TrajectoryGroup.from_wire(obj, "", schema)
        return cls.from_wire(obj, "")
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - a validator bug must still not escape as another type
        raise ProtocolError(str(kind), "a well-formed message", f"{type(exc).__name__}: {exc}") from None
