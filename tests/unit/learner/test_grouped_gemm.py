"""The grouped GEMM of learner.grouped_experts equals a loop of per-expert GEMMs (values and gradients, empty
experts included), and the stacked weights map to and from the HF experts exactly."""
from __future__ import annotations

import pytest
import torch

from learner.grouped_experts import HFExperts, grouped_mm, hf_from_whole, shard_from_hf


def test_grouped_mm_equals_the_per_expert_loop_with_gradients():
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]  # an expert without tokens too
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), 16, 8, generator=gen, requires_grad=True)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    out = grouped_mm(x, w, offs)
    ref = torch.cat([xe @ w[e] for e, xe in enumerate(torch.split(x, counts))])
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    g = torch.randn(out.shape, generator=gen)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
    assert gw[1].abs().max() == 0  # the empty expert gets no gradient


@pytest.mark.parametrize("experts", [HFExperts("model.layers.1.mlp.experts.", ("gate_proj", "up_proj")),
                                     HFExperts("backbone.layers.1.mixer.experts.", ("up_proj",))],
                         ids=["swiglu", "squared_relu"])
def test_stacked_weights_map_to_and_from_the_hf_experts(experts):
    gen = torch.Generator().manual_seed(1)
    hf = {}
    for e in range(4):
        for name, shape in [(proj, (6, 8)) for proj in experts.fc1] + [("down_proj", (8, 6))]:
            hf[f"{experts.prefix}{e}.{name}.weight"] = torch.randn(shape, generator=gen)
    w1 = [shard_from_hf("mlp.experts.weight1", experts, hf.__getitem__, 2 * r, 2) for r in range(2)]  # EP = 2
    w2 = [shard_from_hf("mlp.experts.weight2", experts, hf.__getitem__, 2 * r, 2) for r in range(2)]
    assert w1[0].shape == (2, 6 * len(experts.fc1), 8) and w2[1].shape == (2, 8, 6)
    assert torch.equal(w1[1][0, :6], hf[f"{experts.prefix}2.{experts.fc1[0]}.weight"])
    back = dict(hf_from_whole("mlp.experts.weight1", experts, w1) + hf_from_whole("mlp.experts.weight2", experts, w2))
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_hf_experts_of_each_family():
    from dataclasses import replace

    from learner.hf_config import HFArchitecture
    from learner.nemotron_h_config import HybridSpec

    gpt = HFArchitecture(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=2, intermediate_size=12, rms_norm_eps=1e-6, rope_theta=1e4,
                         max_position_embeddings=32, tie_word_embeddings=False, qkv_bias=False, qk_norm=True,
                         num_experts=4, moe_top_k=2, moe_intermediate_size=6)
    hybrid = replace(gpt, model_type="nemotron_h", hybrid=HybridSpec(
        pattern="ME*E", mamba_num_heads=2, mamba_head_dim=4, ssm_state_size=4, n_groups=1, conv_kernel=4,
        chunk_size=8, use_conv_bias=True))
    assert HFExperts.of(hybrid, 3) == HFExperts("backbone.layers.3.mixer.experts.", ("up_proj",))
    assert HFExperts.of(gpt, 3) == HFExperts("model.layers.3.mlp.experts.", ("gate_proj", "up_proj"))
