"""Packed attention from sequence boundaries (sdpa, sdpa_batched, flex) and chunked log-probs equal the dense-mask path.

One float32 model per attention backend, same weights, on packed rows of mixed lengths (with a padding block):
log-probs and every parameter's gradient agree with Megatron's ``DotProductAttention`` under the block-diagonal
mask (``local``) to 1e-5; log-probs, entropies and gradients computed in chunks agree with the whole row at once,
tied output weights and TP=2 (two gloo processes, vocabulary split) included.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_ranks import become_rank, run_ranks

TOL = 1e-5
LENGTHS = (37, 5, 64, 2, 19, 11)
SIMILAR = (30, 8, 27, 7, 24, 21, 5, 19)  # sdpa_batched pads: rows (30, 27, 21) and (24, 19 | 8, 7, 5) in buckets
TIMEOUT_S = 180.0


def _rows(vocab: int, lengths=LENGTHS):
    from learner.packing import pack, pad_micro_batch

    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, vocab, n).astype(np.int64) for n in lengths]
    mbs, _ = pack(seqs, budget=80)
    assert len(mbs) > 1 and any(len(mb.segments) > 2 for mb in mbs)
    return mbs + [pad_micro_batch(mbs[-1], mbs[-1].num_tokens + 9)]  # a padding block at the end


def _model(model_dir: str, backend: str, tp: int = 1):
    from learner.config import MegatronConfig
    from learner.hf_weights import load_hf_weights
    from learner.model import build_gpt_model, init_distributed, read_hf_architecture

    megatron = MegatronConfig(precision="float32", attention_backend=backend, tensor_model_parallel_size=tp)
    init_distributed(megatron, seed=0)
    arch = read_hf_architecture(model_dir)
    gpt, _ = build_gpt_model(arch, megatron)
    load_hf_weights(gpt, arch, model_dir)
    return gpt


def _scores(gpt, mbs, chunk):
    """Per row: log-probs, entropies, and every parameter's gradient of Σ w·lp (fixed weights w)."""
    from learner.logprobs import token_scores

    out = []
    for mb in mbs:
        gpt.zero_grad(set_to_none=True)
        lp, ent = token_scores(gpt, mb, chunk)
        w = torch.linspace(-1.0, 1.0, lp.numel())
        (lp * w).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in gpt.named_parameters() if p.grad is not None}
        out.append((lp.detach(), ent, grads))
    return out


def _assert_close(got, want, what: str) -> None:
    for (lp, ent, grads), (lp0, ent0, grads0) in zip(got, want, strict=True):
        torch.testing.assert_close(lp, lp0, atol=TOL, rtol=TOL, msg=lambda m: f"{what}: log-probs: {m}")
        torch.testing.assert_close(ent, ent0, atol=TOL, rtol=TOL, msg=lambda m: f"{what}: entropy: {m}")
        assert grads.keys() == grads0.keys() and grads, what
        for name, g in grads.items():  # to 1e-5 of the tensor's largest entry (the random models' grads reach 1e9)
            scale = max(1.0, float(grads0[name].abs().max()))
            torch.testing.assert_close(g, grads0[name], atol=TOL * scale, rtol=TOL,
                                       msg=f"{what}: gradient of {name} differs")


@pytest.mark.parametrize("family", ["qwen3", "qwen2_tied"])
def test_boundaries_and_chunks_equal_the_dense_mask(family, family_models):
    model_dir = family_models(family)
    models = {b: _model(model_dir, b) for b in ("local", "sdpa", "sdpa_batched", "flex")}
    from learner.attention import PackedAttention
    assert all(isinstance(m.decoder.layers[0].self_attention.core_attention, PackedAttention) for m in models.values())
    vocab = models["local"].vocab_size
    mbs = _rows(vocab)
    dense = _scores(models["local"], mbs, chunk=None)
    _assert_close(_scores(models["sdpa"], mbs, chunk=None), dense, "sdpa vs dense mask")
    similar = _rows(vocab, SIMILAR)
    for what, rows, want in (("", mbs, dense), (", similar lengths", similar, _scores(models["local"], similar, None))):
        _assert_close(_scores(models["sdpa_batched"], rows, chunk=None), want, f"sdpa_batched vs dense mask{what}")
    from learner.logprobs import token_logprobs
    with torch.no_grad():  # torch's flex_attention has no backward on the CPU
        for mb, (lp0, _, _) in zip(mbs, dense, strict=True):
            torch.testing.assert_close(token_logprobs(models["flex"], mb), lp0, atol=TOL, rtol=TOL)
    _assert_close(_scores(models["sdpa"], mbs, chunk=7), dense, "sdpa, chunks of 7 vs dense mask, whole row")
    # the entropy is that of the model's logits (computed before the cross entropy, which works in place)
    from learner.attention import packed_row
    with torch.no_grad():
        logits = models["sdpa"](mbs[0].tokens, mbs[0].position_ids, None,
                                packed_seq_params=packed_row(mbs[0].blocks, mbs[0].tokens.device))[0]
        logp = logits.float().log_softmax(-1)
    torch.testing.assert_close(dense[0][1], -(logp.exp() * logp).sum(-1), atol=TOL, rtol=TOL)
    # the packed row scores each sequence as if alone
    from learner.packing import build_micro_batch
    alone = build_micro_batch([mbs[0].tokens[0].numpy()[: mbs[0].segments[0].length]], [0])
    lp_alone = _scores(models["sdpa"], [alone], chunk=None)[0][0]
    torch.testing.assert_close(dense[0][0][: alone.num_tokens], lp_alone, atol=TOL, rtol=TOL)


def _tp_worker(rank: int, port: int, model_dir: str, out_path: str) -> None:
    become_rank(rank, 2, port)
    from learner.model import shutdown_distributed

    gpt = _model(model_dir, "sdpa", tp=2)
    mbs = _rows(gpt.vocab_size)
    whole, chunked = _scores(gpt, mbs, chunk=None), _scores(gpt, mbs, chunk=6)
    _assert_close(chunked, whole, f"TP=2 rank {rank}: chunks of 6 vs whole row")
    if rank == 0:
        torch.save([(lp, ent) for lp, ent, _ in whole], out_path)
    shutdown_distributed()


def test_chunked_logprobs_tensor_parallel(tiny_model_dir, tmp_path):
    out = str(tmp_path / "rank0.pt")
    run_ranks(_tp_worker, tiny_model_dir, out, timeout_s=TIMEOUT_S,
              what="TP=2 ranks")
    tp2 = torch.load(out)
    gpt = _model(tiny_model_dir, "sdpa")
    single = _scores(gpt, _rows(gpt.vocab_size), chunk=None)
    for (lp, ent), (lp1, ent1, _) in zip(tp2, single, strict=True):
        torch.testing.assert_close(lp, lp1, atol=TOL, rtol=TOL)
        torch.testing.assert_close(ent, ent1, atol=TOL, rtol=TOL)

