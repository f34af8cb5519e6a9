"""Inflight wire protocol: typed messages and their msgpack codec.

Everything that crosses a process boundary between the rollout pool and the
learner is one of the message types below, encoded by :func:`encode` and read
back by :func:`decode`. Decoding validates every field and raises a single
error type, :class:`ProtocolError`, whose message names the field path and
what was expected versus what arrived.
"""
from protocol.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    decode,
    encode,
)
from protocol.errors import ProtocolError
from protocol.loss_mask import masked_fill
from protocol.messages import (
    FAILURE_KINDS,
    FINISH_REASONS,
    ControlMessage,
    Message,
    PromptRequest,
    TensorSpec,
    Trajectory,
    TrajectoryGroup,
    WeightBucket,
    WeightManifest,
)
from protocol.weights import checksum_of, pack_buckets, unpack_buckets

__all__ = [
    "ControlMessage", "DEFAULT_MAX_MESSAGE_BYTES", "FAILURE_KINDS", "FINISH_REASONS", "Message", "PromptRequest",
    "ProtocolError", "SCHEMA_VERSION", "TensorSpec", "Trajectory", "TrajectoryGroup",
    "WeightBucket", "WeightManifest", "checksum_of", "decode", "encode", "masked_fill", "pack_buckets",
    "unpack_buckets",
]
