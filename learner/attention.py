"""Core attention over packed rows from their sequence boundaries: no ``[T, T]`` mask, memory linear in T.

A packed micro-batch row holds several sequences end to end (:mod:`learner.packing`). :func:`packed_row` turns
its block lengths into a :class:`PackedRow`, Megatron's ``PackedSeqParams`` (``cu_seqlens``, format ``"sbhd"`` so
that Megatron changes nothing else: RoPE still spans the whole row, as with a mask) carrying the lengths; the model
is called with it as ``packed_seq_params`` and no attention mask. :func:`core_attention_class` gives the module that
Megatron's local layer spec builds as ``core_attention`` (``DotProductAttention``'s signature) for a backend:

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` once per sequence, causal, GQA without repeating
  keys (flash / memory-efficient kernels on GPU, the CPU kernel in tests);
- ``sdpa_batched``: the same kernel once per bucket of similar lengths, each sequence right-padded to its bucket's
  longest (:mod:`learner.attention_buckets`): a few launches per layer instead of one per sequence;
- ``flex``: one ``flex_attention`` call over the row under a document-causal ``BlockMask`` (built once per row,
  compiled on GPU; torch has no flex backward on the CPU, so there it serves no-grad forwards only);
- ``local``: Megatron's own ``DotProductAttention`` under the dense block-diagonal mask, built here from the same
  boundaries — the reference the others are tested against, and the "before" of the GPU bench (``[T, T]``
  scores per head: quadratic memory).

``auto`` is ``sdpa_batched`` on a GPU and ``sdpa`` on the CPU: on one H100 (Qwen3-0.6B shape, bf16, ~16
sequences per micro-batch) ``sdpa_batched`` trained at 1.31× / 1.59× the tokens/s of ``sdpa`` at 4K / 8K-token
budgets, where ``sdpa`` was already 1.06–1.35× compiled flex (H200); on 2 CPU cores it ran at 0.96× ``sdpa``
(docs/benchmarks.md). Which runs where and why: docs/learner.md, "Packing".
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from learner.attention_buckets import BucketPlan, bucket_plan

AttentionBackend = Literal["auto", "flex", "sdpa", "sdpa_batched", "local"]
ResolvedBackend = Literal["flex", "sdpa", "sdpa_batched", "local"]


def resolve_backend(backend: AttentionBackend, on_gpu: bool) -> ResolvedBackend:
    """``backend`` with ``auto`` made concrete: ``sdpa_batched`` on a GPU, ``sdpa`` on the CPU (module docstring)."""
    if backend != "auto":
        return backend
    return "sdpa_batched" if on_gpu else "sdpa"


@dataclass
class PackedRow(PackedSeqParams):
    """The sequence boundaries of one packed row ``[T]`` (batch 1), as ``packed_seq_params``."""

    blocks: tuple[int, ...] = ()
    """Length of each block of the row, in order (a sequence, or the padding block); they sum to T."""
    block_mask: Any = None
    """The row's flex ``BlockMask``, built by the first layer that needs it and shared by the others."""
    dense_mask: torch.Tensor | None = None
    """The row's ``[1, 1, T, T]`` bool mask (True = masked), built by the first ``local`` layer."""
    buckets: BucketPlan | None = None
    """The row's length buckets, built by the first ``sdpa_batched`` layer and shared by the others."""


def packed_row(blocks: Sequence[int], device: torch.device) -> PackedRow:
    """The :class:`PackedRow` of a row made of ``blocks`` (lengths > 0) on ``device``."""
    if not blocks or min(blocks) < 1:
        raise ValueError(f"a packed row needs blocks of at least 1 token, got {list(blocks)}")
    cu = torch.zeros(len(blocks) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(blocks, dtype=torch.int32), 0)
    cu = cu.to(device)
    total = int(sum(blocks))
    return PackedRow(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=total,
                     max_seqlen_kv=total, blocks=tuple(int(n) for n in blocks))


def block_ids(blocks: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``[T]``: the index of the block each position of a row made of ``blocks`` lies in."""
    return torch.repeat_interleave(torch.arange(len(blocks), device=device), torch.tensor(list(blocks), device=device))


def block_diagonal_causal_mask(blocks: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``[1, 1, T, T]`` bool mask, True where position q may NOT attend to position k (``local`` only)."""
    seg = block_ids(blocks, device)
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(seg.numel(), seg.numel(), dtype=torch.bool, device=device).tril()
    return (~(same & causal))[None, None]


def _document_causal(doc: torch.Tensor) -> Callable[..., torch.Tensor]:
    """flex ``mask_mod``: q attends to kv in the same block at or before it."""
    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    return mask_mod


_compiled_flex: Callable[..., Any] | None = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: PackedRow, scale: float) -> torch.Tensor:
    """``flex_attention`` of ``[1, heads, T, d]`` tensors under ``row``'s document-causal mask (compiled on GPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if row.block_mask is None:
        doc = block_ids(row.blocks, q.device)
        total = int(doc.numel())
        row.block_mask = create_block_mask(_document_causal(doc), None, None, total, total, device=q.device,
                                           _compile=q.is_cuda)
    fn: Callable[..., Any] = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=row.block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[int], scale: float) -> torch.Tensor:
    """Causal SDPA of ``[b, heads, T, d]`` tensors, one call per block of ``blocks``."""
    gqa = q.shape[1] != k.shape[1]
    outs, start = [], 0
    for n in blocks:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                   scale=scale, enable_gqa=gqa))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _sdpa_batched(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: BucketPlan,
                  scale: float) -> torch.Tensor:
    """Causal SDPA of a packed row's ``[T, heads, d]`` tensors, one batched call per bucket of ``plan``; returns
    ``[T, heads, d]`` in row order."""
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for b in plan.buckets:
        if b.span is not None:
            qb, kb, vb = (t[b.span[0]:b.span[1]] for t in (query, key, value))
        else:
            assert b.gather is not None and b.keep is not None
            qb, kb, vb = (t.index_select(0, b.gather) for t in (query, key, value))
        qb, kb, vb = (t.unflatten(0, (b.count, b.length)).transpose(1, 2) for t in (qb, kb, vb))  # [n, heads, L, d]
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        out = out.transpose(1, 2).flatten(0, 1)
        outs.append(out if b.keep is None else out.index_select(0, b.keep))
    row = outs[0] if len(outs) == 1 else torch.cat(outs)
    return row if plan.order is None else row.index_select(0, plan.order)


class PackedAttention(MegatronModule):
    """Core attention from a :class:`PackedRow`'s boundaries (module docstring); ``DotProductAttention``'s
    constructor and forward signature. Without ``packed_seq_params`` every batch row is one causal sequence."""

    backend: ResolvedBackend = "sdpa"

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"PackedAttention runs without attention dropout, the config has {dropout}")
        if config.softmax_type != "vanilla" or config.apply_query_key_layer_scaling:
            raise ValueError(f"PackedAttention supports the vanilla softmax without query-key layer scaling "
                             f"(softmax_type={config.softmax_type!r}, "
                             f"apply_query_key_layer_scaling={config.apply_query_key_layer_scaling})")
        head_dim = config.kv_channels if config.kv_channels is not None else config.hidden_size // \
            config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dense: DotProductAttention | None = None
        if self.backend == "local":
            self.dense = DotProductAttention(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                                             softmax_scale, cp_comm_type, pg_collection)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """``[s, b, heads, d]`` query and ``[s, b, groups, d]`` key/value → ``[s, b, heads·d]``."""
        if attention_bias is not None or attention_mask is not None:
            raise ValueError("PackedAttention takes the rows' boundaries (packed_seq_params), not a mask or a bias")
        if packed_seq_params is not None and not isinstance(packed_seq_params, PackedRow):
            raise TypeError(f"PackedAttention needs a learner.attention.PackedRow, got "
                            f"{type(packed_seq_params).__name__}")
        s, b, heads, d = query.shape
        row = packed_seq_params
        if row is not None and (b != 1 or sum(row.blocks) != s):
            raise ValueError(f"a packed row is one batch row of sum(blocks)={sum(row.blocks)} tokens, "
                             f"got query [s={s}, b={b}]")
        if self.dense is not None:
            if row is None:
                return self.dense(query, key, value, None)
            if row.dense_mask is None:
                row.dense_mask = block_diagonal_causal_mask(row.blocks, query.device)
            return self.dense(query, key, value, row.dense_mask)
        if row is not None and self.backend == "sdpa_batched":
            if row.buckets is None:
                row.buckets = bucket_plan(row.blocks, query.device)
            return _sdpa_batched(query[:, 0], key[:, 0], value[:, 0], row.buckets,
                                 self.softmax_scale).reshape(s, b, heads * d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if row is None:
            out = _sdpa(q, k, v, [s], self.softmax_scale)
        elif self.backend == "flex":
            out = _flex(q, k, v, row, self.softmax_scale)
        else:
            out = _sdpa(q, k, v, row.blocks, self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class _Flex(PackedAttention):
    backend = "flex"


class _Sdpa(PackedAttention):
    backend = "sdpa"


class _SdpaBatched(PackedAttention):
    backend = "sdpa_batched"


class _Local(PackedAttention):
    backend = "local"


def core_attention_class(backend: ResolvedBackend) -> type[PackedAttention]:
    """The ``core_attention`` module class of the local layer spec for ``backend``."""
    return {"flex": _Flex, "sdpa": _Sdpa, "sdpa_batched": _SdpaBatched, "local": _Local}[backend]
