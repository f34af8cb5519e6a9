"""The learner as a weight push sees it: :class:`LearnerPort`, and what its rank 0 answers a push with.

The learner halves of the transports take a :class:`LearnerPort` (the job's
``LearnerGroup`` implements it): one typed method per step of a push, each
answering with rank 0's value -- :class:`ExportedWeights` (object store),
:class:`SentPush` (collective), :class:`IpcExport` (CUDA IPC) -- which cross
Ray from the rank actors as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ExportedWeights:
    """An object-store push as rank 0 exported it."""

    manifest_bytes: bytes
    """The encoded ``protocol.WeightManifest``."""
    bucket_refs: list
    """Ray object refs of the encoded ``protocol.WeightBucket`` s, in the manifest's order."""


@dataclass(frozen=True)
class SentPush:
    """A collective push as rank 0 broadcast it to the weight group."""

    version: int
    bytes: int
    seconds: float
    """The broadcast, from the first bucket to the last."""


@dataclass(frozen=True)
class IpcExport:
    """A CUDA IPC push as rank 0 exported it: buckets on its GPU, kept until ``release_ipc``."""

    manifest_bytes: bytes
    """The encoded ``protocol.WeightManifest``."""
    shares: list[list]
    """The wire form of each bucket's CUDA IPC share (``protocol.ipc_share``)."""


class Joining(Protocol):
    """Rank 0 opening a weight group, started; :meth:`wait` returns once every engine worker has joined."""

    def wait(self) -> None:
        ...


class LearnerPort(Protocol):
    """What a push needs from the learner's ranks (every call runs on all of them; rank 0 answers)."""

    def export_weights(self, bucket_bytes: int) -> ExportedWeights:
        """This version's HF-named weights, CRC32-checked buckets of ``bucket_bytes`` in the Ray object store."""
        ...

    def stage_weights(self) -> None:
        """Gather this version's HF tensors on rank 0's device, ready for :meth:`send_staged`."""
        ...

    def send_staged(self, bucket_bytes: int) -> SentPush:
        """Broadcast the staged tensors to the weight group in buckets of ``bucket_bytes``."""
        ...

    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 will host the weight group's store: its node's address and a port free there."""
        ...

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> Joining:
        """Start rank 0 opening the weight group at ``host:port`` as its sender (the engines join meanwhile)."""
        ...

    def gpu_uuid(self) -> str:
        """The UUID of rank 0's GPU ('' on CPU)."""
        ...

    def export_ipc(self, bucket_bytes: int, cuda_graph: bool) -> IpcExport:
        """This version's HF tensors packed into buckets on rank 0's GPU, shared through CUDA IPC
        (``cuda_graph``: by one CUDA graph replay where the learner can)."""
        ...

    def release_ipc(self, failed: bool) -> int:
        """Free the exported buckets (the engines answered; ``failed``: not every one installed them);
        returns their bytes."""
        ...
