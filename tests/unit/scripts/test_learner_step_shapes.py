"""bench/learner_step.py's Nemotron-H shapes and its MoE MFU count: the config the bench writes parses as the
learner's hybrid family with Nano 3's layer kinds, and active parameters count top-k / experts of the routed
experts only (shared expert, router, attention, Mamba, embeddings whole). No Megatron, no model build."""
from __future__ import annotations

import torch
from repo_scripts import load_script

from learner.hf_config import parse_hf_config


def _bench():
    return load_script("bench/learner_step.py", "learner_step_bench")


def test_nemotron_h_shapes_parse_as_the_hybrid_family():
    from transformers import NemotronHConfig

    bench = _bench()
    for shape, kwargs in bench.NEMOTRON_H_SHAPES.items():
        cfg = NemotronHConfig(**kwargs, n_group=1, topk_group=1, norm_topk_prob=True, tie_word_embeddings=False,
                              num_nextn_predict_layers=0).to_dict()
        cfg["model_type"] = "nemotron_h"
        arch = parse_hf_config(cfg)
        h = arch.hybrid
        assert h is not None, shape
        assert (h.count("M"), h.count("E"), h.count("*"), h.count("-")) == (8, 8, 2, 0), shape
        assert arch.moe_top_k == kwargs["num_experts_per_tok"] and arch.num_experts == kwargs["n_routed_experts"]
    big = bench.NEMOTRON_H_SHAPES["nemotron-h-2b"]
    assert big["hidden_size"] == 2048 and big["num_experts_per_tok"] == 6 and big["n_routed_experts"] == 32


class _Moe(torch.nn.Module):
    """Parameter names as Megatron's MoE layer has them: 4 routed experts, a shared expert, a router."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleDict({"local_experts": torch.nn.ModuleList(
            [torch.nn.Linear(10, 10, bias=False) for _ in range(4)])})  # 4 x 100
        self.shared_experts = torch.nn.Linear(10, 7, bias=False)  # 70
        self.router = torch.nn.Linear(10, 4, bias=False)  # 40


def test_active_parameters_count_top_k_of_the_routed_experts():
    bench = _bench()
    model = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(5, 10), "mlp": _Moe()})  # 50 + 510
    assert sum(p.numel() for p in model.parameters()) == 560
    assert bench.active_parameters(model, 1, 4) == 560 - 400 + 100
    assert bench.active_parameters(model, 2, 4) == 560 - 400 + 200
    assert bench.active_parameters(model, None, None) == 560  # dense: every parameter
