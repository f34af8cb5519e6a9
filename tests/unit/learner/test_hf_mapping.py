"""HF ⇄ Megatron name/layout mapping on fake tensors, for TP and EP layouts (no Megatron needed)."""
from __future__ import annotations

import pytest
import torch

from learner.hf_config import HFArchitecture
from learner.hf_export import hf_tensors_from_shards
from learner.hf_weights import HFCheckpoint, ParallelLayout, _check_tied_output, megatron_shard_from_hf

ARCH = HFArchitecture(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=2, intermediate_size=12, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=32, tie_word_embeddings=False, qkv_bias=True, qk_norm=True,
                      num_experts=4, moe_top_k=2, moe_intermediate_size=6)

HF_SHAPES = {
    "model.embed_tokens.weight": (16, 8), "lm_head.weight": (16, 8), "model.norm.weight": (8,),
    "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
    "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
    "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.q_proj.bias": (8,),
    "model.layers.0.self_attn.k_proj.bias": (4,), "model.layers.0.self_attn.v_proj.bias": (4,),
    "model.layers.0.self_attn.o_proj.weight": (8, 8), "model.layers.0.self_attn.q_norm.weight": (2,),
    "model.layers.0.self_attn.k_norm.weight": (2,), "model.layers.0.mlp.gate_proj.weight": (12, 8),
    "model.layers.0.mlp.up_proj.weight": (12, 8), "model.layers.0.mlp.down_proj.weight": (8, 12),
    "model.layers.0.mlp.gate.weight": (4, 8),
    **{f"model.layers.0.mlp.experts.{e}.{n}.weight": s for e in range(4)
       for n, s in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6)))},
}
TP_SPLIT = {  # Megatron name -> whether tensor parallelism splits it
    "embedding.word_embeddings.weight": True, "output_layer.weight": True, "decoder.final_layernorm.weight": False,
    "decoder.layers.0.input_layernorm.weight": False, "decoder.layers.0.pre_mlp_layernorm.weight": False,
    "decoder.layers.0.self_attention.linear_qkv.weight": True, "decoder.layers.0.self_attention.linear_qkv.bias": True,
    "decoder.layers.0.self_attention.q_layernorm.weight": False,
    "decoder.layers.0.self_attention.k_layernorm.weight": False,
    "decoder.layers.0.self_attention.linear_proj.weight": True, "decoder.layers.0.mlp.linear_fc1.weight": True,
    "decoder.layers.0.mlp.linear_fc2.weight": True, "decoder.layers.0.mlp.router.weight": False,
}


@pytest.fixture(scope="module")
def hf():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in HF_SHAPES.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_round_trip_through_tp_shards(hf, tp):
    out = {}
    for name in TP_SPLIT:
        shards = [megatron_shard_from_hf(name, ARCH, hf.__getitem__, ParallelLayout(r, tp, 0, 1)) for r in range(tp)]
        if not TP_SPLIT[name]:
            assert all(torch.equal(s, shards[0]) for s in shards)
            shards = shards[:1]
        out.update(hf_tensors_from_shards(name, ARCH, shards))
    dense = {k: v for k, v in hf.items() if ".experts." not in k}
    assert out.keys() == dense.keys()
    for k in dense:
        assert torch.equal(out[k], dense[k]), k


def test_qkv_is_interleaved_per_group(hf):
    fused = megatron_shard_from_hf("decoder.layers.0.self_attention.linear_qkv.weight", ARCH, hf.__getitem__,
                                   ParallelLayout(0, 1, 0, 1))
    p = "model.layers.0.self_attn."
    q, k, v = hf[p + "q_proj.weight"], hf[p + "k_proj.weight"], hf[p + "v_proj.weight"]
    # group 0: q heads 0,1 (rows 0..3), k head 0, v head 0; then group 1
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    assert torch.equal(fused, expected)


def test_fc1_is_gate_then_up_per_tp_shard(hf):
    shard1 = megatron_shard_from_hf("decoder.layers.0.mlp.linear_fc1.weight", ARCH, hf.__getitem__,
                                    ParallelLayout(1, 2, 0, 1))
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(shard1, torch.cat([gate[6:12], up[6:12]]))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_experts_map_to_their_ep_rank(hf, ep):
    per_rank = 4 // ep
    out = {}
    for ep_rank in range(ep):
        for j in range(per_rank):
            for kind in ("linear_fc1", "linear_fc2"):
                name = f"decoder.layers.0.mlp.experts.local_experts.{j}.{kind}.weight"
                t = megatron_shard_from_hf(name, ARCH, hf.__getitem__, ParallelLayout(0, 1, ep_rank, ep))
                out.update(hf_tensors_from_shards(name, ARCH, [t], expert=ep_rank * per_rank + j))
    experts = {k: v for k, v in hf.items() if ".experts." in k}
    assert out.keys() == experts.keys()
    assert all(torch.equal(out[k], experts[k]) for k in experts)


def test_unknown_parameter_names_are_reported(hf):
    with pytest.raises(KeyError, match="decoder.layers.0.mystery.weight"):
        megatron_shard_from_hf("decoder.layers.0.mystery.weight", ARCH, hf.__getitem__, ParallelLayout(0, 1, 0, 1))


def test_tp_that_does_not_divide_is_an_error(hf):
    with pytest.raises(ValueError, match="cannot split"):
        megatron_shard_from_hf("output_layer.weight", ARCH, hf.__getitem__, ParallelLayout(0, 3, 0, 1))


def test_a_tied_checkpoints_lm_head_copy_must_equal_the_embedding(tmp_path):
    from safetensors.torch import save_file

    embed = torch.randn(16, 8)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}, str(tmp_path / "model.safetensors"))
    _check_tied_output(HFCheckpoint(tmp_path))  # equal: accepted (export writes the embedding back)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": embed + 1}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tie_word_embeddings is true but lm_head.weight differs from "
                                         "model.embed_tokens.weight"):
        _check_tied_output(HFCheckpoint(tmp_path))
