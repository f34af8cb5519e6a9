"""Shared by the protocol tests: a message's decoded wire map, writable, to corrupt field by field, and the check
that a corrupted map is rejected where it should be."""
from __future__ import annotations

import numpy as np
import pytest

from protocol import ProtocolError, decode, encode
from protocol.codec import pack_frame, unpack_frame


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


def reject(m: dict, path: str, *fragments: str) -> ProtocolError:
    """Decoding the (corrupted) wire map ``m`` fails at ``path`` with a message holding every fragment."""
    with pytest.raises(ProtocolError) as err:
        decode(pack_frame(m))
    assert err.value.path == path, str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return err.value
