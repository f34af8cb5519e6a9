"""Per-token log-probabilities of given sequences under a Megatron ``GPTModel``.

Megatron's ``GPTModel`` called with ``labels`` returns the per-token cross
entropy computed by ``vocab_parallel_cross_entropy`` (each TP rank holds a
slice of the vocabulary; the softmax normaliser is all-reduced), so
``log p(target_t | tokens_≤t) = -model(tokens, pos, mask, labels=targets)``
without ever gathering the full-vocabulary logits (design.md §6: equal to
gather + log_softmax to 5e-7).

For a sequence of ``P`` prompt tokens and ``R`` response tokens, the response
log-probs are the outputs at positions ``P-1 … P+R-2`` of its segment.
"""
from __future__ import annotations

import torch

from learner.packing import MicroBatch


def token_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``[T]`` float32 log-prob of ``mb.targets`` at every position; differentiable."""
    neg = model(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.targets)
    return -neg.reshape(-1).float()


def response_slices(mb: MicroBatch, prompt_lengths: list[int]) -> list[slice]:
    """For each segment of ``mb``, the slice of :func:`token_logprobs` that scores its response.

    ``prompt_lengths`` is indexed by the segment's sequence index."""
    out = []
    for seg in mb.segments:
        p = prompt_lengths[seg.index]
        if not 1 <= p < seg.length:
            raise ValueError(f"sequence {seg.index}: prompt length {p} must be in [1, {seg.length - 1}]")
        out.append(slice(seg.start + p - 1, seg.start + seg.length - 1))
    return out


@torch.no_grad()
def response_logprobs_no_grad(model: torch.nn.Module, micro_batches: list[MicroBatch],
                              prompt_lengths: list[int], num_sequences: int) -> list[torch.Tensor]:
    """Response log-probs of every sequence (by input index) without building a graph."""
    result: list[torch.Tensor | None] = [None] * num_sequences
    for mb in micro_batches:
        lp = token_logprobs(model, mb)
        for seg, sl in zip(mb.segments, response_slices(mb, prompt_lengths), strict=True):
            result[seg.index] = lp[sl].detach().cpu()
    missing = [i for i, r in enumerate(result) if r is None]
    if missing:
        raise ValueError(f"sequences {missing[:5]} are in no micro-batch")
    return [r for r in result if r is not None]  # all present (checked above)
