"""GPU: pushes through CUDA IPC into a real vLLM engine (``RolloutEngine.install_ipc``).

The test process plays the learner: it holds the model's tensors on the GPU and
exports them with :class:`learner.ipc_export.IpcExporter`; the engine's worker
(in vLLM's engine-core child process) maps the buckets, checks them on the
device and installs them (``rollout/install/ipc_receiver.py``). Checked here:

- dense (tiny Qwen2, bf16): after an IPC push of scaled weights the engine's
  log-probs of fixed sequences equal those after an object-store push of the same
  weights (the reload from a file, the reference path); pushing the originals
  back restores the first log-probs bit for bit, on the proving push and on the
  copy plan; a bucket changed after its checksum was taken is rejected before
  the pause, the old version serving unchanged;
- MoE with FlashInfer CUTLASS: the first IPC push proves plain ``load_weights``
  wrong for this model (the wrong path is caught and the engine ends on
  ``reload_weights``), the next ones reload, and the outputs match the
  object-store push of the same weights.

Skipped without a GPU (``-m gpu``).
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def _engine(model_dir: str, **vllm):
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process touches CUDA: no fork
    generation = GenerationConfig(max_new_tokens=24, request_timeout_s=300.0, max_retries=0,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="bfloat16", seed=0,
                                                      gpu_memory_utilization=0.3, **vllm))
    return RolloutEngine(model_dir, generation, 512, get_reward_fn("repeat_letter"), engine_id="ipc")


def _weights(model_dir: str):
    """The model's tensors on this process's GPU, and the same scaled by 1.5 (matrices only)."""
    from safetensors.torch import load_file

    original = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        original += sorted(load_file(str(f), device="cuda:0").items())
    return original, [(n, t * 1.5 if t.dim() > 1 else t) for n, t in original]


def _object_store_push(tensors, version: int):
    import torch

    from protocol import pack_buckets

    raw = [(n, "bfloat16", tuple(t.shape), t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1))
           for n, t in tensors]
    return pack_buckets(raw, version=version, bucket_bytes=64 << 20)


class _Run:
    """An engine on its own loop, fixed sequences to score, and the exporter that plays the learner."""

    def __init__(self, engine):
        from learner.ipc_export import IpcExporter
        from services.data.tasks import make_prompts

        self.engine, self.loop = engine, asyncio.new_event_loop()
        self.run(engine.start())
        requests = make_prompts("repeat_letter", engine.tokenizer, 4, seed=0)
        groups = [self.run(engine.generate_group(r, 1, temperature=0.0)) for r in requests]
        self.prompts = [r.prompt_ids.tolist() for r in requests]
        self.responses = [g.trajectories[0].response_ids.tolist() for g in groups]
        self.exporter = IpcExporter()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def logprobs(self) -> np.ndarray:
        return np.concatenate(self.run(self.engine.logprobs_of(self.prompts, self.responses)))

    def push_ipc(self, tensors, version: int, corrupt: bool = False) -> int:
        manifest, shares = self.exporter.export(version, tensors, 8 << 20)
        try:
            if corrupt:  # the learner's memory changes after its checksum was taken
                import torch

                self.exporter._held[version][-1][7] += 1
                torch.cuda.synchronize()
            return self.run(self.engine.install_ipc(manifest, [s.to_wire() for s in shares]))
        finally:
            assert self.exporter.release(version) == manifest.total_bytes  # held until the engine answered

    def close(self) -> None:
        self.run(self.engine.shutdown())
        self.loop.close()


def test_dense_ipc_pushes_are_correct_restore_bit_for_bit_and_reject_a_changed_bucket(tmp_path):
    from rollout.install.weight_receiver import WeightUpdateError
    from services.models.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "dense", arch="qwen2", size="small", dtype="bfloat16"))
    r = _Run(_engine(model_dir))
    try:
        base = r.logprobs()
        original, scaled = _weights(model_dir)
        assert r.run(r.engine.install(*_object_store_push(scaled, 1))) == 1   # the reference: reload from a file
        reference = r.logprobs()
        assert not np.array_equal(reference, base)
        assert r.push_ipc(original, 2) == 2
        stats = r.engine.stats()
        assert stats["install_path_last"] == "checked" and stats["phases_last"]["receive_s"] > 0
        np.testing.assert_array_equal(r.logprobs(), base)                      # restored bit for bit (proving)
        assert r.push_ipc(scaled, 3) == 3
        assert r.engine.stats()["install_path_last"] == "copy", r.engine.stats()["copy_plan_refused"]
        np.testing.assert_allclose(r.logprobs(), reference, rtol=0, atol=1e-6)  # what the reference installed
        assert r.push_ipc(original, 4) == 4
        np.testing.assert_array_equal(r.logprobs(), base)                      # restored bit for bit (copy plan)
        with pytest.raises(WeightUpdateError, match=r"1 of \d+ mapped buckets differ from the learner's checksums"):
            r.push_ipc(scaled, 5, corrupt=True)
        stats = r.engine.stats()
        assert r.engine.version == 4 and not stats["weights_broken"] and stats["refit_rejected"] == 1
        np.testing.assert_array_equal(r.logprobs(), base)                      # the old version, untouched
        print(f"\ndense IPC install phases (copy plan): {stats['phases_last']}")
    finally:
        r.close()


def test_moe_ipc_push_catches_the_wrong_plain_load_path_and_reloads(tmp_path):
    from services.models.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "moe", arch="qwen3_moe", size="small", dtype="bfloat16"))
    r = _Run(_engine(model_dir, moe_backend=os.environ.get("INFLIGHT_TEST_MOE_BACKEND", "flashinfer_cutlass")))
    try:
        base = r.logprobs()
        original, scaled = _weights(model_dir)
        assert r.run(r.engine.install(*_object_store_push(scaled, 1))) == 1
        reference = r.logprobs()
        assert r.push_ipc(original, 2) == 2
        stats = r.engine.stats()
        print(f"\nMoE first IPC push: {stats['install_path_last']}; plain load refused: {stats['direct_load_refused']}")
        assert stats["install_path_last"] == "checked"
        assert "plain load_weights differs from reload_weights" in stats["direct_load_refused"]  # caught
        assert np.abs(r.logprobs() - base).mean() < 1e-2           # FlashInfer varies run to run: not bitwise
        assert r.push_ipc(scaled, 3) == 3
        assert r.engine.stats()["install_path_last"] == "reload"
        diff = np.abs(r.logprobs() - reference)
        wrong = np.abs(reference - base).mean()
        print(f"MoE IPC vs object store, same weights: mean {diff.mean():.2e} max {diff.max():.2e} "
              f"(scaled vs original: mean {wrong:.2e})")
        assert diff.mean() < 1e-2 and diff.mean() < wrong / 10
    finally:
        r.close()
