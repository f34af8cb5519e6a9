"""The grouped GEMM of learner.grouped_experts equals a loop of per-expert GEMMs (values and gradients, empty
experts included), and the stacked weights map to and from the HF experts exactly."""
from __future__ import annotations

import torch

from learner.grouped_experts import grouped_mm, hf_from_whole, shard_from_hf


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


def test_stacked_weights_map_to_and_from_the_hf_experts():
    gen = torch.Generator().manual_seed(1)
    hf = {}
    for e in range(4):
        for name, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
            hf[f"model.layers.1.mlp.experts.{e}.{name}.weight"] = torch.randn(shape, generator=gen)
    p = "model.layers.1."
    w1 = [shard_from_hf("mlp.experts.weight1", p, hf.__getitem__, 2 * r, 2) for r in range(2)]  # EP = 2
    w2 = [shard_from_hf("mlp.experts.weight2", p, hf.__getitem__, 2 * r, 2) for r in range(2)]
    assert w1[0].shape == (2, 12, 8) and w2[1].shape == (2, 8, 6)
    assert torch.equal(w1[1][0, :6], hf["model.layers.1.mlp.experts.2.gate_proj.weight"])
    back = dict(hf_from_whole("mlp.experts.weight1", p, w1) + hf_from_whole("mlp.experts.weight2", p, w2))
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
