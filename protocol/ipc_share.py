"""A CUDA IPC share of one weight bucket as plain data: what a learner on a GPU hands an engine on the same GPU.

The learner (``learner/ipc_export.py``) makes one per bucket from torch's ``reduce_tensor`` of the bucket, without
its Python classes; the engine's worker (``rollout/install/ipc_receiver.py``) maps it with ``rebuild_cuda_tensor``. The
wire form is the list ``[nbytes, device_uuid, tensor_offset, storage_device, storage_handle, storage_size_bytes,
storage_offset_bytes, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required]``: the arguments
of ``rebuild_cuda_tensor`` that are data, in its order, after the bucket's size and the UUID of its GPU. No pickle
of tensor data or of code.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

WIRE_FIELDS = ("nbytes", "device_uuid", "tensor_offset", "storage_device", "storage_handle", "storage_size_bytes",
               "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle",
               "event_sync_required")
"""The fields of a share's wire form, in order."""


@dataclass(frozen=True)
class BucketShare:
    """One bucket of a push, shared by the learner's process through CUDA IPC."""

    nbytes: int
    """Bytes of the bucket (its manifest's ``bucket_sizes`` entry)."""
    device_uuid: str
    """UUID of the GPU the bucket lives on (``torch.cuda.get_device_properties(...).uuid``)."""
    tensor_offset: int
    storage_device: int
    storage_handle: bytes
    """The ``cudaIpcMemHandle_t`` of the allocation holding the bucket."""
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    """The learner's shared-memory counter of the processes that still map the bucket."""
    ref_counter_offset: int
    event_handle: bytes | None
    """The ``cudaIpcEventHandle_t`` recorded after the learner's last write (None: nothing to wait for)."""
    event_sync_required: bool

    def to_wire(self) -> list:
        return list(astuple(self))

    @classmethod
    def from_wire(cls, item: Any, path: str) -> BucketShare:
        """Parse the wire form (see the module docstring); ``ValueError`` naming ``path`` and the field."""
        if not isinstance(item, (list, tuple)) or len(item) != len(WIRE_FIELDS):
            raise ValueError(f"{path}: expected a list of {len(WIRE_FIELDS)} fields {WIRE_FIELDS}, got "
                             f"{type(item).__name__} of {len(item) if isinstance(item, (list, tuple)) else '?'}")
        values = dict(zip(WIRE_FIELDS, item, strict=True))
        for name in ("nbytes", "tensor_offset", "storage_device", "storage_size_bytes", "storage_offset_bytes",
                     "ref_counter_offset"):
            if isinstance(values[name], bool) or not isinstance(values[name], int) or values[name] < 0:
                raise ValueError(f"{path}.{name}: expected an int >= 0, got {values[name]!r}")
        for name in ("storage_handle", "ref_counter_handle"):
            if not isinstance(values[name], bytes) or not values[name]:
                raise ValueError(f"{path}.{name}: expected non-empty bytes, got {type(values[name]).__name__}")
        if values["event_handle"] is not None and not isinstance(values["event_handle"], bytes):
            raise ValueError(f"{path}.event_handle: expected bytes or None, got "
                             f"{type(values['event_handle']).__name__}")
        if not isinstance(values["device_uuid"], str) or not values["device_uuid"]:
            raise ValueError(f"{path}.device_uuid: expected a GPU UUID, got {values['device_uuid']!r}")
        if not isinstance(values["event_sync_required"], bool):
            raise ValueError(f"{path}.event_sync_required: expected a bool, got {values['event_sync_required']!r}")
        return cls(**values)
