"""``policy.megatron_cfg.gpu_memory_fraction``: each learner rank caps its CUDA caching allocator as it picks its
device (the learner's memory budget beside an engine on the same GPU, ``rollout_pool.share_gpu``)."""
from __future__ import annotations

import torch

from learner import cpu_compat, model
from learner.config import MegatronConfig


def test_the_budget_caps_the_allocator_of_the_current_device(monkeypatch):
    calls: list = []
    monkeypatch.setattr(cpu_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    model.limit_gpu_memory(MegatronConfig(gpu_memory_fraction=0.45))
    assert calls == [(0.45, 3)]
    model.limit_gpu_memory(MegatronConfig())  # no budget: no cap
    assert calls == [(0.45, 3)]


def test_no_cap_without_a_gpu(monkeypatch):
    calls: list = []
    monkeypatch.setattr(cpu_compat, "has_gpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    model.limit_gpu_memory(MegatronConfig(gpu_memory_fraction=0.45))
    assert calls == []
