"""Qwen2.5-VL's config.json → HFArchitecture: both layouts (the published file, transformers ≥ 5's
``text_config``) give the same architecture, with mrope sections and the vision tower's spec; refusals name the
field. No torch, no Megatron."""
from __future__ import annotations

import copy

import pytest

from learner.hf_config import parse_hf_config

# Qwen/Qwen2.5-VL-3B-Instruct's config.json as published (transformers 4.x layout: text fields at the top).
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}

TOP_LEVEL = {"architectures", "model_type", "image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id", "vision_token_id", "tie_word_embeddings", "vision_config", "torch_dtype",
             "transformers_version"}


def nested(cfg: dict) -> dict:
    """The same config as transformers ≥ 5 writes it: text fields under ``text_config``, ``rope_parameters``."""
    text = {k: v for k, v in cfg.items() if k not in TOP_LEVEL | {"rope_theta", "rope_scaling"}}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": cfg["rope_scaling"]["mrope_section"],
                               "rope_theta": cfg["rope_theta"]}
    return {**{k: v for k, v in cfg.items() if k in TOP_LEVEL}, "text_config": text}


def test_published_qwen25_vl_is_a_qwen2_language_model_with_mrope_and_a_vision_tower():
    a = parse_hf_config(QWEN25_VL_3B)
    assert (a.model_type, a.qkv_bias, a.tie_word_embeddings, a.head_dim) == ("qwen2_5_vl", True, True, 128)
    assert a.mrope_section == (16, 24, 24) and a.rope_theta == 1e6 and a.rope_scaling is None
    v = a.vision
    assert v is not None and (v.image_token_id, v.vision_start_token_id) == (151655, 151652)
    assert (v.spatial_merge_size, v.patch_dim, v.in_channels, v.depth) == (2, 3 * 2 * 14 * 14, 3, 32)
    assert v.config["fullatt_block_indexes"] == [7, 15, 23, 31]
    assert "mrope [16, 24, 24]" in a.describe() and "vision tower 32 blocks" in a.describe()


def test_the_transformers_5_layout_gives_the_same_architecture():
    assert parse_hf_config(nested(QWEN25_VL_3B)) == parse_hf_config(QWEN25_VL_3B)


@pytest.mark.parametrize("edit,field", [
    (lambda c: c["rope_scaling"].update(mrope_section=[16, 24, 20]), "mrope_section"),
    (lambda c: c["rope_scaling"].pop("mrope_section"), "rope_scaling.mrope_section"),
    (lambda c: c["vision_config"].update(out_hidden_size=1024), "vision_config.out_hidden_size"),
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
])
def test_refusals_name_the_field(edit, field):
    cfg = copy.deepcopy(QWEN25_VL_3B)
    edit(cfg)
    with pytest.raises(ValueError, match=rf"config.json {field}:"):
        parse_hf_config(cfg)


def test_nano_omni_is_its_nemotron_h_with_the_radio_side_and_plain_positions(tmp_path):
    import json

    from services.models.tiny_omni import make_tiny_omni

    cfg = json.loads((make_tiny_omni(tmp_path / "omni", seed=0) / "config.json").read_text())
    arch = parse_hf_config(cfg)
    text = parse_hf_config({**cfg["text_config"], "model_type": "nemotron_h"})
    assert arch.model_type == "nemotron_h_omni" and arch.hybrid == text.hybrid and arch.radio is not None
    assert (arch.hidden_size, arch.num_layers, arch.vocab_size) == (text.hidden_size, text.num_layers, text.vocab_size)
    v = arch.vision
    assert v is not None and not v.mrope and v.image_token_id == cfg["image_token_id"] == arch.radio.image_token_id
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size, v.patch_dim) == (16, 1, 2, 768)
    assert v.video_token_id == cfg["video_token_id"] and "RADIO tower" in arch.describe()
    # the published layout: llm_config, vit_hidden_size, img_context_token_id; an audio tower is read past
    published = {k: v for k, v in cfg.items() if k not in ("text_config", "image_token_id", "vision_hidden_size")}
    published.update(llm_config=cfg["text_config"], img_context_token_id=cfg["image_token_id"],
                     vit_hidden_size=cfg["vision_hidden_size"], audio_config={"model_type": "parakeet"})
    assert parse_hf_config(published).radio == arch.radio
    with pytest.raises(ValueError, match="needs image_token_id"):
        parse_hf_config({k: v for k, v in cfg.items() if k != "image_token_id"})
