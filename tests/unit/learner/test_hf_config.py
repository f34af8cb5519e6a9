"""config.json → HFArchitecture for every supported family, both RoPE spellings, and the refusals (each names
the field, the value and what is supported). No torch, no Megatron."""
from __future__ import annotations

import copy
import json

import pytest

from learner.hf_config import Llama3RopeScaling, parse_hf_config, read_hf_architecture

# Published config.json files (as on the hub, written by transformers 4.x: rope_theta / rope_scaling).
QWEN25_15B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
    "intermediate_size": 8960, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 151936}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
    "use_cache": True, "vocab_size": 32768}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
PUBLISHED = {"qwen2": QWEN25_15B, "qwen3": QWEN3_06B, "llama": LLAMA32_1B, "mistral": MISTRAL_7B_V03,
             "qwen3_moe": QWEN3_30B_A3B}


def with_rope_parameters(cfg: dict) -> dict:
    """The same config as transformers ≥ 5 writes it: rope_theta and rope_scaling folded into rope_parameters."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    out["rope_parameters"] = {"rope_type": "default", **(cfg.get("rope_scaling") or {}),
                              "rope_theta": cfg["rope_theta"]}
    return out


def edited(cfg: dict, **changes) -> dict:
    out = copy.deepcopy(cfg)
    out.update(changes)
    return out


def test_qwen25_tied_maps_qkv_bias_and_tied_embeddings():
    a = parse_hf_config(QWEN25_15B)
    assert (a.model_type, a.qkv_bias, a.qk_norm, a.tie_word_embeddings) == ("qwen2", True, False, True)
    assert (a.head_dim, a.num_key_value_heads, a.rope_theta, a.rope_scaling) == (128, 2, 1e6, None)


def test_qwen3_has_qk_norm_and_an_explicit_head_dim_unlike_hidden_over_heads():
    a = parse_hf_config(QWEN3_06B)
    assert (a.qk_norm, a.qkv_bias, a.head_dim, a.hidden_size // a.num_attention_heads) == (True, False, 128, 64)
    assert a.tie_word_embeddings and not a.is_moe


def test_llama32_reads_all_four_llama3_rope_values():
    a = parse_hf_config(LLAMA32_1B)
    assert a.rope_scaling == Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)
    assert (a.rope_theta, a.head_dim, a.qkv_bias, a.qk_norm) == (500000.0, 64, False, False)


def test_mistral_without_a_window_maps_like_llama():
    a = parse_hf_config(MISTRAL_7B_V03)
    assert (a.model_type, a.head_dim, a.qkv_bias, a.qk_norm, a.rope_scaling) == ("mistral", 128, False, False, None)


def test_qwen3_moe_maps_the_experts():
    a = parse_hf_config(QWEN3_30B_A3B)
    assert (a.num_experts, a.moe_top_k, a.moe_intermediate_size, a.norm_topk_prob) == (128, 8, 768, True)
    assert a.qk_norm and a.experts_per_rank(4) == 32


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_both_rope_spellings_give_the_same_architecture(family):
    cfg = PUBLISHED[family]
    assert parse_hf_config(with_rope_parameters(cfg)) == parse_hf_config(cfg)


def test_read_hf_architecture_reads_the_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    assert read_hf_architecture(tmp_path).describe().startswith("qwen3: 28 layers, hidden 1024")
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_architecture(tmp_path / "nowhere")


REFUSED = [  # (config, message fragments: the field, the value, what is supported)
    (edited(QWEN25_15B, model_type="gpt2"),
     ["model_type: 'gpt2'", "qwen2, qwen3, qwen3_moe, llama, mistral"]),
    (edited(LLAMA32_1B, hidden_act="gelu"), ["hidden_act: 'gelu'", "silu"]),
    (edited(LLAMA32_1B, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     ["rope_scaling.rope_type: 'yarn'", "default, llama3"]),
    (edited(QWEN25_15B, rope_scaling={"type": "linear", "factor": 2.0}),
     ["rope_scaling.type: 'linear'", "default, llama3"]),
    (with_rope_parameters(edited(LLAMA32_1B, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
     ["rope_parameters.rope_type: 'dynamic'", "default, llama3"]),
    (edited(LLAMA32_1B, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     ["rope_scaling", "low_freq_factor, high_freq_factor, original_max_position_embeddings"]),
    (edited(MISTRAL_7B_V03, sliding_window=4096), ["sliding_window: 4096", "null for mistral"]),  # Mistral 7B v0.1
    (edited(QWEN3_06B, use_sliding_window=True, sliding_window=4096), ["use_sliding_window: True", "false"]),
    (edited(QWEN3_06B, layer_types=["full_attention", "sliding_attention"]),
     ["layer_types: ['full_attention', 'sliding_attention']", "only 'full_attention'"]),
    (edited(LLAMA32_1B, attention_bias=True), ["attention_bias: True", "false for llama"]),
    (edited(LLAMA32_1B, mlp_bias=True), ["mlp_bias: True", "false"]),
    (edited(LLAMA32_1B, partial_rotary_factor=0.5), ["partial_rotary_factor: 0.5", "1.0"]),
    (edited(QWEN3_30B_A3B, mlp_only_layers=[0]), ["mlp_only_layers: [0]", "every layer MoE"]),
    (edited(QWEN3_30B_A3B, decoder_sparse_step=2), ["decoder_sparse_step: 2", "every layer MoE"]),
    (edited(QWEN3_06B, rope_theta=10000.5), ["rope_theta: 10000.5"]),
    ({k: v for k, v in QWEN3_06B.items() if k != "vocab_size"}, ["required field 'vocab_size' is missing"]),
]


@pytest.mark.parametrize("cfg,fragments", REFUSED, ids=[f[0] for _, f in REFUSED])
def test_unsupported_configs_are_refused_naming_the_field(cfg, fragments):
    with pytest.raises(ValueError) as err:
        parse_hf_config(cfg)
    message = str(err.value)
    assert message.startswith("config.json")
    for fragment in fragments:
        assert fragment in message, message


def test_qwen_sliding_window_size_is_ignored_while_use_sliding_window_is_false():
    assert parse_hf_config(edited(QWEN3_06B, sliding_window=4096)) == parse_hf_config(QWEN3_06B)


TINY = {"qwen2": QWEN25_15B, "qwen2_tied": QWEN25_15B, "qwen3": QWEN3_06B, "llama3": LLAMA32_1B,
        "mistral": MISTRAL_7B_V03, "qwen3_moe": QWEN3_30B_A3B}
NOT_WRITTEN = {"torch_dtype", "transformers_version", "rope_theta", "rope_scaling",  # transformers 5: dtype,
               "use_mrope", "max_window_layers", "num_experts"}  # rope_parameters, num_local_experts; no mrope,
                                                                 # no max_window_layers for Qwen3-MoE


@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_configs_carry_the_published_keys(family_models, family):
    """``make-tiny-model`` writes what ``save_pretrained`` writes: every key of the family's published file."""
    cfg = json.loads(open(f"{family_models(family)}/config.json").read())
    published = TINY[family]
    assert set(published) - NOT_WRITTEN - set(cfg) == set()
    assert cfg["model_type"] == published["model_type"] and cfg["architectures"] == published["architectures"]
    assert cfg["tie_word_embeddings"] is (family == "qwen2_tied")
    rope = cfg["rope_parameters"]
    assert set(published.get("rope_scaling") or {"rope_type": 1}) <= set(rope) and "rope_theta" in rope
    arch = read_hf_architecture(family_models(family))
    assert (arch.qk_norm, arch.qkv_bias) == (family.startswith("qwen3"), family.startswith("qwen2"))
    if family == "qwen3":
        assert arch.head_dim == 2 * arch.hidden_size // arch.num_attention_heads
    if family == "llama3":
        assert rope["rope_type"] == "llama3"
        assert rope["original_max_position_embeddings"] < cfg["max_position_embeddings"]
    if family == "qwen3_moe":
        assert cfg["num_local_experts"] == arch.num_experts
