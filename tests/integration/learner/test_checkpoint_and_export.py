"""Save → restore → next step is bit-identical; exported buckets reproduce the learner in transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner_batches import groups, hf_response_logprobs, load_hf, make_learner, sequences
from protocol.weights import unpack_buckets

TIMINGS = ("policy_training_s", "tokens_per_s")


def test_save_restore_next_step_is_bit_identical(tiny_model_dir, tmp_path):
    a = make_learner(tiny_model_dir, lr=3e-3)
    batch1, batch2 = groups(a, seed=0), groups(a, seed=1)
    a.train_step(batch1)
    extra = {"data_position": 7, "buffered": [b"\x00\x01", "g3"]}
    a.save_checkpoint(str(tmp_path / "ckpt"), extra=extra)
    rng_draw = (np.random.rand(), torch.rand(1))
    m_a = a.train_step(batch2)
    params_a = {k: v.detach().clone() for k, v in a.gpt.named_parameters()}
    a.shutdown()

    b = make_learner(tiny_model_dir, lr=3e-3)
    assert b.load_checkpoint(str(tmp_path / "ckpt")) == extra
    assert (b.step, b.policy_version) == (1, 1)
    assert (np.random.rand(), torch.rand(1)) == rng_draw
    m_b = b.train_step(batch2)
    for k, v in b.gpt.named_parameters():
        assert torch.equal(v, params_a[k]), k
    assert {k: v for k, v in m_a.items() if k not in TIMINGS} == {k: v for k, v in m_b.items() if k not in TIMINGS}
    b.shutdown()


def test_checkpoint_from_another_layout_is_rejected(tiny_model_dir, tmp_path):
    import json

    a = make_learner(tiny_model_dir)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    meta = tmp_path / "ckpt" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "tp": 2}))
    with pytest.raises(ValueError, match="layout"):
        a.load_checkpoint(str(tmp_path / "ckpt"))
    a.shutdown()


def test_export_buckets_reproduce_megatron_logprobs_in_transformers(tiny_model_dir, tmp_path):
    learner = make_learner(tiny_model_dir, lr=3e-3)
    learner.train_step(groups(learner))
    bucket_bytes = 64 * 1024
    manifest, buckets = learner.export_weights(bucket_bytes)
    assert manifest.version == learner.policy_version == 1
    for spec_bucket, size in enumerate(manifest.bucket_sizes):
        in_bucket = [s for s in manifest.tensors if s.bucket == spec_bucket]
        assert size <= bucket_bytes or len(in_bucket) == 1  # a bigger tensor travels alone
    model = load_hf(tiny_model_dir)
    source = model.state_dict()
    state = {}
    for spec, raw in unpack_buckets(manifest, buckets):
        assert spec.dtype == "float32" and tuple(source[spec.name].shape) == spec.shape
        state[spec.name] = torch.from_numpy(raw.copy()).view(torch.float32).reshape(spec.shape)
    assert state.keys() == {k for k in source if k in state} and len(state) == len(learner.hf_metas)
    model.load_state_dict(state, strict=True)
    prompts, responses = sequences(4, seed=5)
    np.testing.assert_allclose(np.concatenate(hf_response_logprobs(model, prompts, responses)),
                               np.concatenate(learner.logprobs(prompts, responses)), atol=1e-4, rtol=0)

    learner.save_hf(str(tmp_path / "hf"))
    from transformers import AutoTokenizer
    saved = load_hf(str(tmp_path / "hf"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).vocab_size > 0
    for k, v in saved.state_dict().items():
        assert torch.equal(v, state[k]), k
    learner.shutdown()
