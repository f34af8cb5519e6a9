"""GPU: the CUDA IPC export packed by one CUDA graph replay (``IpcExporter.export_graphed``) equals the eager
pack, byte for byte, on every push: after the weights change in place (the graph reads them where they are),
after a weight moves (captured again) and after a failed push (captured again, the old buckets left to the
engine that may still read them). The engine's side of the same buckets: test_ipc_refit_gpu.py. Skipped without
a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from learner.ipc_export import IpcExporter
from learner.ipc_graph import weights_key

pytestmark = [pytest.mark.gpu]

BUCKET = 32 << 10
"""Smaller than the ~62 KiB of the model's tensors: the pack spans buckets."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.Linear(192, 64, bias=False)).cuda().bfloat16()


def _hf_tensors(model: torch.nn.Module):
    """A conversion like the learner's: views, a split made contiguous (a copy) and a dtype change (a copy)."""
    first, second = model[0], model[1]
    up, gate = first.weight.detach().chunk(2, dim=0)
    return [("up", up), ("gate", gate.t().contiguous()), ("bias", first.bias.detach().float()),
            ("down", second.weight.detach())]


def _bytes(exporter: IpcExporter, version: int) -> list[bytes]:
    return [b.cpu().numpy().tobytes() for b in exporter._held[version]]


def _eager(model: torch.nn.Module, version: int):
    eager = IpcExporter()
    manifest, _ = eager.export(version, _hf_tensors(model), BUCKET)
    return manifest, _bytes(eager, version)


def test_the_replayed_pack_equals_the_eager_one_as_the_weights_change_and_move():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model, graphed = _model(), IpcExporter()

    def push(version: int, failed: bool = False):
        manifest, shares = graphed.export_graphed(version, lambda: _hf_tensors(model), weights_key(model), BUCKET)
        want_manifest, want_bytes = _eager(model, version)
        assert manifest == want_manifest and _bytes(graphed, version) == want_bytes
        assert len(shares) == len(want_bytes) > 1
        graphed.release(version, failed=failed)

    push(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5).add_(0.25)                   # an optimizer step: same storage, new values
    push(2)
    assert graphed.captures == 1
    model[1].weight = torch.nn.Parameter(torch.randn(64, 192, device="cuda", dtype=torch.bfloat16))
    push(3, failed=True)                          # the weight moved: captured again
    assert graphed.captures == 2
    push(4)                                       # after a failed push: new buckets
    assert graphed.captures == 3
    push(5)
    assert graphed.captures == 3
