"""HF → Megatron → HF is exact; Megatron log-probs equal transformers (every model family); packing does not
change them; Llama-3 RoPE scaling takes all four config values; a tied checkpoint's lm_head.weight comes back."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from learner_batches import hf_response_logprobs, load_hf, make_learner, sequences

ARCHS = ["qwen2", "qwen2_tied", "qwen3", "llama", "llama3", "qwen3_moe", "mistral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_round_trip_is_exact(frozen_learners, arch):
    from learner.hf_export import export_hf_state_dict

    model_dir, learner = frozen_learners[arch]
    source = load_file(f"{model_dir}/model.safetensors")
    exported = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    assert list(exported) == [m.name for m in learner.hf_metas]
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and exported[name].shape == tensor.shape, name
        assert (exported[name] == tensor).all(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(frozen_learners, arch):
    model_dir, learner = frozen_learners[arch]
    prompts, responses = sequences(6, seed=1)
    ours = learner.logprobs(prompts, responses)
    ref = hf_response_logprobs(load_hf(model_dir), prompts, responses)
    for a, b, r in zip(ours, ref, responses):
        assert a.shape == (r.size,)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    print(f"\n{arch}: max |Δ logprob| vs transformers {max(np.abs(a - b).max() for a, b in zip(ours, ref)):.2e}")


def test_llama3_rope_frequencies_are_transformers_and_matter_at_test_lengths(frozen_learners):
    """All four llama3 values reach the frequencies (Megatron's own path fixes three of them), and at these
    sequence lengths the scaling changes the log-probs by far more than the parity tolerance."""
    model_dir, learner = frozen_learners["llama3"]
    arch, hf = learner.arch, load_hf(model_dir)
    assert arch.rope_scaling is not None and arch.rope_scaling.original_max_position_embeddings == 256
    ours, theirs = learner.gpt.rotary_pos_emb.inv_freq, hf.model.rotary_emb.inv_freq
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    unscaled_freqs = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
    megatron_default = learner.gpt.rotary_pos_emb._apply_scaling(unscaled_freqs, factor=arch.rope_scaling.factor)
    assert (megatron_default - theirs).abs().max() > 1e-3  # its fixed low 1, high 4, original 8192
    prompts, responses = sequences(6, seed=1)
    scaled = hf_response_logprobs(hf, prompts, responses)
    hf.model.rotary_emb.inv_freq = unscaled_freqs
    unscaled = hf_response_logprobs(hf, prompts, responses)
    assert max(np.abs(a - b).max() for a, b in zip(scaled, unscaled)) > 1e-2


def test_tied_checkpoint_with_an_lm_head_copy_exports_it_back(family_models, tmp_path):
    """Some tied checkpoints carry lm_head.weight (equal to the embedding): export gives it back, exactly."""
    src = family_models("qwen2_tied")
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(f"{src}/model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    from learner.hf_export import export_hf_state_dict

    learner = make_learner(str(tmp_path / "m"))
    try:
        assert "output_layer.weight" not in dict(learner.gpt.named_parameters())  # Megatron shares the embedding
        exported = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    finally:
        learner.shutdown()
    assert exported is not None and exported.keys() == tensors.keys()
    assert all(torch.equal(exported[k], tensors[k]) for k in tensors)
    assert exported["lm_head.weight"].data_ptr() != exported["model.embed_tokens.weight"].data_ptr()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_packed_logprobs_equal_unpacked(frozen_learners, arch):
    _, learner = frozen_learners[arch]
    prompts, responses = sequences(8, seed=2)
    packed = learner.logprobs(prompts, responses)
    unpacked = [learner.logprobs([p], [r])[0] for p, r in zip(prompts, responses)]
    for a, b in zip(packed, unpacked):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)  # float32 GEMMs of other shapes
