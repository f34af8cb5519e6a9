"""Shared by the protocol tests: a message's decoded wire map, writable, to corrupt field by field."""
from __future__ import annotations

import numpy as np

from protocol import encode
from protocol.codec import unpack_frame


def wire_map(msg) -> dict:
    """The decoded map of a message, with arrays copied to writable arrays."""
    def thaw(x):
        if isinstance(x, np.ndarray):
            return x.copy()
        if isinstance(x, dict):
            return {k: thaw(v) for k, v in x.items()}
        if isinstance(x, list):
            return [thaw(v) for v in x]
        return x
    return thaw(unpack_frame(encode(msg)))
