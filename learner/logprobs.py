"""Per-token log-probabilities of given sequences under a Megatron ``GPTModel``.

Megatron's ``GPTModel`` called with ``labels`` returns the per-token cross
entropy computed by ``vocab_parallel_cross_entropy`` (each TP rank holds a
slice of the vocabulary; the softmax normaliser is all-reduced), so
``log p(target_t | tokens_≤t) = -model(tokens, pos, mask, labels=targets)``
without ever gathering the full-vocabulary logits (design.md §6: equal to
gather + log_softmax to 5e-7).

For a sequence of ``P`` prompt tokens and ``R`` response tokens, the response
log-probs are the outputs at positions ``P-1 … P+R-2`` of its segment. An
:class:`~learner.mrope_positions.ImageMicroBatch` also hands its images to the
model (a :class:`~learner.vision.VisionLanguageGPT`).

:class:`EntropyTap` hooks the model's output layer and, while armed, computes
the full-vocabulary entropy at every position of that forward (no grad, in row
chunks, vocab-parallel over TP) without changing the forward's outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from learner.mrope_positions import ImageMicroBatch
from learner.packing import MicroBatch


def token_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``[T]`` float32 log-prob of ``mb.targets`` at every position; differentiable."""
    images = {"images": mb.images} if isinstance(mb, ImageMicroBatch) else {}
    neg = model(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.targets, **images)
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


ENTROPY_CHUNK_ROWS = 1024
"""Positions per chunk of the entropy computation (bounds its transient ``[rows, V]`` tensors)."""


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``[N]`` float32 entropy of softmax(logits) per row of ``logits`` ``[N, V_local]``; with a TP group
    the vocabulary is split over its ranks (max, Σ exp and Σ exp·z are all-reduced)."""
    tp = group is not None and dist.get_world_size(group) > 1
    out = []
    for start in range(0, logits.shape[0], ENTROPY_CHUNK_ROWS):
        z = logits[start:start + ENTROPY_CHUNK_ROWS].float()
        m = z.max(dim=-1).values
        if tp:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m[:, None]
        e = torch.exp(z)
        stats = torch.stack([e.sum(-1), (e * z).sum(-1)])
        del e, z
        if tp:
            dist.all_reduce(stats, group=group)
        out.append(torch.log(stats[0]) - stats[1] / stats[0])
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


class EntropyTap:
    """Forward hook on a GPTModel's ``output_layer``: while :meth:`arm` ed, records the per-position entropy
    ``[T]`` of the next forward (logits ``[s, b=1, V_local]``); the logits tensor itself is not kept."""

    def __init__(self, gpt: torch.nn.Module, tp_group=None):
        self.tp_group = tp_group
        self._armed = False
        self.entropy: torch.Tensor | None = None
        layer = gpt.output_layer
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"EntropyTap: the model's output_layer is a {type(layer).__name__}, not a module")
        layer.register_forward_hook(self._hook)

    def arm(self) -> None:
        self._armed, self.entropy = True, None

    def take(self) -> torch.Tensor:
        """The entropy recorded since :meth:`arm` (disarms)."""
        ent, self.entropy, self._armed = self.entropy, None, False
        if ent is None:
            raise RuntimeError("EntropyTap: no forward through the output layer since arm()")
        return ent

    def _hook(self, _module, _args, output) -> None:
        if not self._armed:
            return
        logits = output[0] if isinstance(output, tuple) else output
        self.entropy = vocab_parallel_entropy(logits.detach().reshape(-1, logits.shape[-1]), self.tp_group)
