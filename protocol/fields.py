"""Field readers used when decoding: each checks one value and raises a
:class:`ProtocolError` naming the field path on anything unexpected.

``req`` fetches a required key, ``as_str`` / ``as_int`` / ``as_float`` /
``as_list`` / ``as_dict`` / ``as_array`` check a value's type and bounds, and
the ``check_*`` helpers check token ids, log-probs and non-negative arrays.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocol.errors import ProtocolError

MAX_STRING_CHARS = 4096


def req(d: dict, key: str, path: str) -> Any:
    if key not in d:
        raise ProtocolError(_join(path, key), "a value (field is required)", "missing")
    return d[key]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def as_dict(v: Any, path: str) -> dict:
    if not isinstance(v, dict):
        raise ProtocolError(path, "a map", type(v).__name__)
    for k in v:
        if not isinstance(k, str):
            raise ProtocolError(path, "string keys", k)
    return v


def as_list(v: Any, path: str, max_len: int = 1 << 20) -> list:
    if not isinstance(v, (list, tuple)):
        raise ProtocolError(path, "a list", type(v).__name__)
    if len(v) > max_len:
        raise ProtocolError(path, f"at most {max_len} items", len(v))
    return list(v)


def as_str(v: Any, path: str, max_chars: int = MAX_STRING_CHARS, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise ProtocolError(path, "a string", type(v).__name__)
    if len(v) > max_chars:
        raise ProtocolError(path, f"a string of at most {max_chars} chars", f"{len(v)} chars")
    if not allow_empty and not v:
        raise ProtocolError(path, "a non-empty string", v)
    return v


def as_int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(path, "an integer", v if _small(v) else type(v).__name__)
    if lo is not None and v < lo:
        raise ProtocolError(path, f"an integer >= {lo}", v)
    if hi is not None and v > hi:
        raise ProtocolError(path, f"an integer <= {hi}", v)
    return v


def as_float(v: Any, path: str, finite: bool = True, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(path, "a number", v if _small(v) else type(v).__name__)
    v = float(v)
    if finite and not math.isfinite(v):
        raise ProtocolError(path, "a finite number", v)
    if hi is not None and v > hi:
        raise ProtocolError(path, f"a number <= {hi}", v)
    return v


def as_array(v: Any, path: str, dtype: str, length: int | None = None, ndim: int = 1) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise ProtocolError(path, f"an ndarray of {dtype}", type(v).__name__)
    if v.dtype != np.dtype(dtype):
        raise ProtocolError(path, f"dtype {dtype}", str(v.dtype))
    if v.ndim != ndim:
        raise ProtocolError(path, f"{ndim}-d array", f"{v.ndim}-d")
    if length is not None and v.shape[0] != length:
        raise ProtocolError(path, f"length {length}", v.shape[0])
    return v


def check_token_ids(arr: np.ndarray, path: str, vocab_size: int) -> None:
    if arr.size == 0:
        return
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ProtocolError(f"{path}[{i}]", f"a token id in [0, {vocab_size})", int(arr[i]))


def check_logprobs(arr: np.ndarray, path: str) -> None:
    bad = np.flatnonzero(~np.isfinite(arr) | (arr > 0))
    if bad.size:
        i = int(bad[0])
        raise ProtocolError(f"{path}[{i}]", "a finite log-probability <= 0", float(arr[i]))


def check_non_negative(arr: np.ndarray, path: str) -> None:
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        i = int(bad[0])
        raise ProtocolError(f"{path}[{i}]", "a non-negative integer", int(arr[i]))


def _small(v: Any) -> bool:
    return isinstance(v, (int, float, str, bytes, type(None))) and len(repr(v)) < 80
