"""msgpack codec for protocol messages.

Layout of one message: a msgpack map ``{"schema": SCHEMA_VERSION, "kind": K,
...fields}``. numpy arrays travel as msgpack extension type 1 whose payload is
``u16 header length | msgpack [dtype, shape] | raw little-endian bytes``; on
decode the array is ``np.frombuffer`` over the payload (no copy, read-only).

Decoding never raises anything but :class:`ProtocolError`: oversize input,
broken msgpack, unknown kinds, unsupported schema versions, wrong types and
invalid values are all reported with the field path.
"""
from __future__ import annotations

import struct

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.messages import MESSAGE_TYPES, Message

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
EXT_NDARRAY = 1
ARRAY_DTYPES = {"uint8", "int32", "int64", "float32", "float64"}
_HDR = struct.Struct("<H")


def _default(obj):
    if isinstance(obj, np.ndarray):
        dt = obj.dtype.newbyteorder("<") if obj.dtype.byteorder == ">" else obj.dtype
        if dt.name not in ARRAY_DTYPES:
            raise TypeError(f"ndarray dtype {obj.dtype} is not in {sorted(ARRAY_DTYPES)}")
        header = msgpack.packb([dt.name, list(obj.shape)])
        body = np.ascontiguousarray(obj, dtype=dt).tobytes()
        return msgpack.ExtType(EXT_NDARRAY, _HDR.pack(len(header)) + header + body)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes):
    if code != EXT_NDARRAY:
        raise ProtocolError("<ext>", f"extension type {EXT_NDARRAY} (ndarray)", code)
    if len(data) < _HDR.size:
        raise ProtocolError("<ndarray>", "a header", f"{len(data)} bytes")
    (hlen,) = _HDR.unpack_from(data)
    try:
        dtype, shape = msgpack.unpackb(data[_HDR.size:_HDR.size + hlen], raw=False)
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a protocol error
        raise ProtocolError("<ndarray>", "a [dtype, shape] header", repr(exc)) from None
    if not isinstance(dtype, str) or dtype not in ARRAY_DTYPES:
        raise ProtocolError("<ndarray>.dtype", f"one of {sorted(ARRAY_DTYPES)}", dtype)
    if not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < (1 << 40) for s in shape):
        raise ProtocolError("<ndarray>.shape", "a list of at most 8 sizes", shape)
    dt = np.dtype(dtype).newbyteorder("<")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    start = _HDR.size + hlen
    if len(data) - start != count * dt.itemsize:
        raise ProtocolError("<ndarray>", f"{count * dt.itemsize} data bytes for {dtype}{shape}",
                            f"{len(data) - start} bytes")
    arr = np.frombuffer(data, dtype=dt, count=count, offset=start)
    return arr.reshape(shape)


def encode(msg: Message) -> bytes:
    """Encode a message (adds ``schema`` and ``kind``)."""
    body = msg.to_wire()
    body["schema"] = SCHEMA_VERSION
    body["kind"] = msg.KIND
    return msgpack.packb(body, default=_default, use_bin_type=True)


def decode(data: bytes | bytearray | memoryview, expect: type | None = None,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate one message; ``expect`` restricts the kind."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("<message>", "bytes", type(data).__name__)
    if len(data) > max_bytes:
        raise ProtocolError("<message>", f"at most {max_bytes} bytes", f"{len(data)} bytes")
    try:
        obj = msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - any msgpack failure is a protocol error
        raise ProtocolError("<message>", "valid msgpack", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("<message>", "a map", type(obj).__name__)
    schema = obj.get("schema")
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise ProtocolError("schema", f"schema version {SCHEMA_VERSION}", schema)
    kind = obj.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("kind", f"one of {sorted(MESSAGE_TYPES)}", kind)
    if expect is not None and cls is not expect:
        raise ProtocolError("kind", repr(expect.KIND), kind)
    try:
        return cls.from_wire(obj, "")
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - a validator bug must still not escape as another type
        raise ProtocolError(kind, "a well-formed message", f"{type(exc).__name__}: {exc}") from None
