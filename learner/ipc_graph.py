"""A version's CUDA IPC export packed by one CUDA graph replay (colocated refit beside a generating engine).

Packing a version eagerly launches a few hundred small kernels (the HF conversion's copies, one copy per tensor
into its bucket, the checksums), one by one from Python. :class:`PackGraph` captures the whole pack once --
conversion, copies and checksums -- and replays it as one launch while the weights stay where they were
(:func:`weights_key`): 22 ms -> 6 ms for a 0.6B model on an H100, 29-38 ms -> 7-13 ms in the one-GPU async loop.
Its buckets belong to the graph, so the learner holds one more copy of the weights for as long as it exports this
way (``policy.refit_cuda_graph``). docs/benchmarks.md has the measurements (``bench/ipc_export_contention.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from learner.hybrid_weights import weight_tensors
from protocol import TensorSpec
from protocol.weight_transfer import dtype_name, plan_buckets

TensorsFn = Callable[[], Sequence[tuple[str, torch.Tensor]] | None]
"""Makes a version's HF-named tensors from the model's weights (on one GPU; the learner's export)."""

WeightsKey = tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...]
"""Each weight's name, address, shape and dtype: a graph replays only while these stay the same."""


def weights_key(model: torch.nn.Module) -> WeightsKey:
    """Where ``model``'s weights live (no kernel runs): a captured pack reads them at these addresses."""
    return tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in weight_tensors(model))


def graph_refusal(device: torch.device, world_size: int, has_vision_tower: bool) -> str:
    """Why a learner cannot pack its export in a CUDA graph ('' when it can)."""
    if device.type != "cuda":
        return f"the weights are on {device.type}, not a GPU"
    if world_size > 1:
        return f"{world_size} ranks gather the export (collectives are left out of the graph)"
    if has_vision_tower:
        return "the vision tower's untrained tensors are read from the checkpoint on the host"
    return ""


def pack_into_buckets(tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
                      ) -> tuple[list[TensorSpec], list[int], list[torch.Tensor]]:
    """``tensors`` (all on one device) copied into aligned byte buckets of at most ``bucket_bytes``
    (:func:`protocol.weight_transfer.plan_buckets`), the padding zero; returns the specs, the bucket sizes and
    the buckets."""
    if not tensors:
        raise ValueError("export: no tensors to pack")
    device = tensors[0][1].device
    if any(t.device != device for _, t in tensors):
        raise ValueError(f"export: tensors on several devices: {sorted({str(t.device) for _, t in tensors})}")
    specs, sizes = plan_buckets([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors], bucket_bytes)
    buckets = [torch.zeros(s, dtype=torch.uint8, device=device) for s in sizes]  # padding too: same sums every push
    for spec, (_, t) in zip(specs, tensors, strict=True):
        buckets[spec.bucket][spec.offset:spec.offset + spec.nbytes].copy_(
            t.detach().contiguous().view(-1).view(torch.uint8))
    return specs, sizes, buckets


@dataclass
class PackGraph:
    """A captured pack: replay it to refill :attr:`buckets` and :attr:`sums` from the weights' current values."""

    key: WeightsKey
    bucket_bytes: int
    graph: torch.cuda.CUDAGraph
    specs: list[TensorSpec]
    sizes: list[int]
    buckets: list[torch.Tensor]
    """Static: the graph writes them on every replay."""
    sums: torch.Tensor
    """Each bucket's ``row_checksum`` (int64, one per bucket)."""

    @classmethod
    def capture(cls, make_tensors: TensorsFn, key: WeightsKey, bucket_bytes: int,
                checksum: Callable[[torch.Tensor], torch.Tensor]) -> PackGraph:
        """Run the pack once eagerly on a side stream (lazy initialisations, the allocator), then capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _pack_and_sum(make_tensors, bucket_bytes, checksum)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            specs, sizes, buckets, sums = _pack_and_sum(make_tensors, bucket_bytes, checksum)
        return cls(key, bucket_bytes, graph, specs, sizes, buckets, sums)

    def replay(self) -> list[int]:
        """Pack the weights' current values; returns the buckets' checksums (waits for the replay)."""
        self.graph.replay()
        return self.sums.tolist()


def _pack_and_sum(make_tensors: TensorsFn, bucket_bytes: int, checksum: Callable[[torch.Tensor], torch.Tensor]
                  ) -> tuple[list[TensorSpec], list[int], list[torch.Tensor], torch.Tensor]:
    tensors = make_tensors()
    if tensors is None:
        raise ValueError("export: this rank has no tensors to pack")
    specs, sizes, buckets = pack_into_buckets(tensors, bucket_bytes)
    return specs, sizes, buckets, torch.stack([checksum(b) for b in buckets])
