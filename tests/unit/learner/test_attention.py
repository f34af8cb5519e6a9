"""learner.attention: the boundaries of a packed row, and the sdpa / sdpa_batched / flex core attention against
masked softmax attention written out here (GQA, float32, values and gradients)."""
from __future__ import annotations

import pytest
import torch

from learner.attention import (PackedAttention, block_diagonal_causal_mask, core_attention_class, packed_row,
                               resolve_backend)

BLOCKS = (7, 1, 12, 4)
UNEVEN = (7, 1, 12, 4, 6, 11)  # sdpa_batched's buckets: [12, 11, 7] and [6, 4] padded, [1]
ONE = (24,)  # sdpa_batched: one bucket, a view of the row
EQUAL = (6, 6, 2)  # sdpa_batched: [6, 6] a view of the row's start, [2] a view of its end
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs an NVIDIA GPU")])
HEADS, GROUPS, DIM = 4, 2, 16


def test_block_diagonal_mask_blocks_other_sequences_and_the_future():
    allowed = ~block_diagonal_causal_mask([2, 3])[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_packed_row_carries_cu_seqlens_and_the_row_length():
    row = packed_row(BLOCKS, torch.device("cpu"))
    assert row.cu_seqlens_q.tolist() == [0, 7, 8, 20, 24] and row.cu_seqlens_q.dtype == torch.int32
    assert row.max_seqlen_q == row.max_seqlen_kv == 24 and row.blocks == BLOCKS
    assert row.qkv_format == "sbhd"  # Megatron's THD handling (RoPE per sequence) stays off
    with pytest.raises(ValueError, match=r"blocks of at least 1 token, got \[3, 0\]"):
        packed_row([3, 0], torch.device("cpu"))


def _reference(q, k, v, blocks):
    """Softmax attention under the block-diagonal causal mask; ``[s, 1, h, d]`` in, ``[s, 1, h·d]`` out."""
    s, _, heads, d = q.shape
    rep = heads // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / d ** 0.5
    scores = scores.masked_fill(block_diagonal_causal_mask(blocks, q.device), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(s, 1, heads * d)


def _module(backend) -> PackedAttention:
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0, hidden_dropout=0.0)
    return core_attention_class(backend)(config, 1, None, "self")


def _inputs(blocks=BLOCKS, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    total = sum(blocks)
    return [torch.randn(total, 1, n, DIM, generator=gen).to(device).requires_grad_() for n in (HEADS, GROUPS, GROUPS)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_batched"])
@pytest.mark.parametrize("blocks", [BLOCKS, UNEVEN, ONE, EQUAL])
def test_sdpa_equals_masked_attention_with_gradients(backend, blocks, device):
    q, k, v = _inputs(blocks, device)  # float32: on a GPU the memory-efficient or math kernel
    row = packed_row(blocks, q.device)
    out = _module(backend).to(device)(q, k, v, None, packed_seq_params=row)
    assert (row.buckets is not None) == (backend == "sdpa_batched")  # built once, for the row's other layers
    if backend == "sdpa_batched" and blocks == UNEVEN:
        assert [(b.count, b.length) for b in row.buckets.buckets] == [(3, 12), (2, 6), (1, 1)]
    if backend == "sdpa_batched" and blocks in (ONE, EQUAL):
        assert [b.span for b in row.buckets.buckets] == ([(0, 24)] if blocks == ONE else [(0, 12), (12, 14)])
        assert row.buckets.order is None
    ref = _reference(q, k, v, blocks)
    # CPU: the bound of issue 35 (fp32, 1e-5). A first query sees one key, so its gradient is 0 in the reference and
    # ~1e-6 from SDPA, run to run (threads): 1e-6 failed 2 runs of 10. GPU kernels round differently.
    tol = dict(atol=1e-5, rtol=1e-5) if device == "cpu" else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **tol)


def test_flex_document_mask_equals_masked_attention():
    q, k, v = (t.detach() for t in _inputs())
    out = _module("flex")(q, k, v, None, packed_seq_params=packed_row(BLOCKS, q.device))
    torch.testing.assert_close(out, _reference(q, k, v, BLOCKS), atol=1e-6, rtol=1e-5)


def test_refuses_a_mask_and_a_row_of_the_wrong_length():
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(ValueError, match="not a mask"):
        _module("sdpa")(q, k, v, block_diagonal_causal_mask(BLOCKS))
    with pytest.raises(ValueError, match="sum\\(blocks\\)=23 tokens, got query \\[s=24, b=1\\]"):
        _module("sdpa")(q, k, v, None, packed_seq_params=packed_row((7, 1, 12, 3), q.device))


def test_auto_is_sdpa_batched_on_a_gpu_and_sdpa_on_the_cpu():
    """Measured: on an H100 sdpa_batched trained at 1.31-1.59x sdpa's tokens/s; on 2 CPU cores at 0.96x."""
    assert resolve_backend("auto", on_gpu=True) == "sdpa_batched"
    assert resolve_backend("auto", on_gpu=False) == "sdpa"
    for named in ("flex", "sdpa", "sdpa_batched", "local"):
        assert resolve_backend(named, on_gpu=True) == resolve_backend(named, on_gpu=False) == named
