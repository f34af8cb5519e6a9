"""Nemotron-H config.json → HFArchitecture: both layer-pattern spellings, the older field names, and the refusals
(each names the field, the value and what is supported). No torch, no Megatron."""
from __future__ import annotations

import copy

import pytest

from learner.hf_config import parse_hf_config

# Nemotron-3-Nano-30B-A3B's language model, as published (hybrid_override_pattern, transformers 4.x names).
NANO3 = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
    "hidden_size": 2688, "num_hidden_layers": 52,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
    "intermediate_size": 1856, "mlp_hidden_act": "relu2", "mlp_bias": False,
    "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "chunk_size": 128, "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
    "mamba_proj_bias": False, "time_step_min": 0.001, "time_step_max": 0.1, "time_step_limit": [0.0, 1e30],
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "n_shared_experts": 1, "layer_norm_epsilon": 1e-05,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "rescale_prenorm_residual": True, "residual_in_fp32": False}
BLOCK_NAMES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
NEW_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _with(**changes) -> dict:
    cfg = copy.deepcopy(NANO3)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def test_nano3_published_config():
    arch = parse_hf_config(NANO3)
    h = arch.hybrid
    assert h is not None and h.pattern == NANO3["hybrid_override_pattern"]
    assert (h.count("M"), h.count("E"), h.count("*"), h.count("-")) == (23, 23, 6, 0)
    assert arch.num_layers == 52 and arch.num_experts == 128 and arch.moe_top_k == 6
    assert (h.mamba_num_heads, h.mamba_head_dim, h.ssm_state_size, h.n_groups) == (64, 64, 128, 8)
    assert h.mamba_inner_size == 4096 and h.shared_expert_intermediate_size == 3712
    assert h.routed_scaling_factor == 2.5 and arch.rms_norm_eps == 1e-5 and not arch.qk_norm
    line = arch.describe()
    assert line.startswith("nemotron_h: 52 layers") and NANO3["hybrid_override_pattern"] in line
    assert "no RoPE" in line and "128 experts top-6" in line


@pytest.mark.parametrize("names", [BLOCK_NAMES, NEW_NAMES])
def test_layers_block_type_spelling(names):
    """What transformers ≥ 5 writes (and its older block names) gives the same architecture."""
    blocks = [names[s] for s in NANO3["hybrid_override_pattern"]]
    cfg = _with(hybrid_override_pattern=None, num_hidden_layers=None, layers_block_type=blocks)
    assert parse_hf_config(cfg) == parse_hf_config(NANO3)
    both = _with(layers_block_type=blocks)  # both spellings, agreeing
    assert parse_hf_config(both) == parse_hf_config(NANO3)


def test_older_mamba_field_names():
    old = _with(n_groups=None, conv_kernel=None, chunk_size=None, use_conv_bias=None)
    old.update(mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=64, mamba_conv_bias=False)
    h = parse_hf_config(old).hybrid
    assert h is not None and (h.n_groups, h.conv_kernel, h.chunk_size, h.use_conv_bias) == (4, 3, 64, False)


def test_dense_pattern_has_no_experts():
    arch = parse_hf_config(_with(hybrid_override_pattern="M*M-", num_hidden_layers=4))
    assert not arch.is_moe and arch.intermediate_size == 1856 and arch.hybrid is not None
    assert arch.hybrid.shared_expert_intermediate_size == 0


@pytest.mark.parametrize("changes, field, supported", [
    (dict(hybrid_override_pattern="M*X-", num_hidden_layers=4), "hybrid_override_pattern", "M (Mamba2)"),
    (dict(hybrid_override_pattern=None, layers_block_type=["mamba", "sliding_attention"]), "layers_block_type",
     "linear_attention"),
    (dict(layers_block_type=["mamba"] * 52), "hybrid_override_pattern", "the pattern layers_block_type gives"),
    (dict(hybrid_override_pattern=None), "config.json: nemotron_h needs", "layers_block_type"),
    (dict(num_hidden_layers=50), "num_hidden_layers", "the pattern's length (52)"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act", "relu2"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act", "silu"),
    (dict(use_bias=True), "use_bias", "false"),
    (dict(attention_bias=True), "attention_bias", "false"),
    (dict(sliding_window=4096), "sliding_window", "null"),
    (dict(moe_latent_size=1024), "moe_latent_size", "null"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers", "0"),
    (dict(n_group=8, topk_group=4), "topk_group", "every group kept"),
    (dict(norm_topk_prob=False), "norm_topk_prob", "true"),
    (dict(n_groups=6), "n_groups", "a divisor of mamba_num_heads=64"),
    (dict(num_key_value_heads=3), "num_key_value_heads", "a divisor of num_attention_heads=32"),
    (dict(mamba_num_heads=None), "required field", "mamba_num_heads"),
])
def test_refusals_name_the_field(changes, field, supported):
    with pytest.raises(ValueError) as err:
        parse_hf_config(_with(**changes))
    message = str(err.value)
    assert field in message and supported in message


def test_group_routing_with_every_group_kept_is_accepted():
    """n_group > 1 with topk_group == n_group keeps every group: plain top-k, which Megatron computes alike."""
    assert parse_hf_config(_with(n_group=8, topk_group=8)).moe_top_k == 6


def test_validate_names_the_family_and_its_pattern(tmp_path):
    """``inflight validate`` (services.models.source.check_model) on a Nemotron-H directory: the family and its
    layer pattern; an unsupported field is refused naming it."""
    import json

    from services.models.source import check_model

    (tmp_path / "config.json").write_text(json.dumps(NANO3))
    line = check_model(str(tmp_path))
    assert line.startswith("nemotron_h:") and f"layers {NANO3['hybrid_override_pattern']!r}" in line
    (tmp_path / "config.json").write_text(json.dumps(_with(moe_latent_size=1024)))
    with pytest.raises(ValueError, match="policy.model_name.*moe_latent_size: 1024"):
        check_model(str(tmp_path))


def test_moe_layers_under_tensor_parallelism_are_refused_up_front():
    """Megatron's MoELayer refuses to train under TP without sequence parallelism (mid-step); the learner says so
    when it builds the config."""
    from learner.config import MegatronConfig
    from learner.hybrid_model import hybrid_transformer_config

    with pytest.raises(ValueError, match="tensor_model_parallel_size=2: Nemotron-H MoE layers"):
        hybrid_transformer_config(parse_hf_config(NANO3), MegatronConfig(tensor_model_parallel_size=2))
