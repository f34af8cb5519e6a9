"""Per-token log-probabilities (and entropies) of given sequences under a Megatron ``GPTModel``.

The model runs on a packed row with its boundaries (:func:`learner.attention.packed_row`, no mask) and hands
back its final hidden states (``GPTModel.post_process`` off for that call); the output layer, the log-prob of
each target and the full-vocabulary entropy then run here, in chunks of ``chunk`` positions
(:func:`logprob_chunk`: ``policy.megatron_cfg.logprob_chunk_size`` / ``defer_fp32_logits``). Each chunk's
logits ``[chunk, V_local]`` exist only while it is computed: its backward recomputes them
(``torch.utils.checkpoint``), so the fp32 logits of a whole row never exist at once. Without a chunk size the
whole row is one piece, kept for the backward (the memory of the old path). The log-prob is Megatron's
``vocab_parallel_cross_entropy`` (each TP rank holds a slice of the vocabulary; the softmax normaliser is
all-reduced: equal to gather + log_softmax to 5e-7, design.md §6); the entropy is computed without a graph.

For a sequence of ``P`` prompt tokens and ``R`` response tokens, the response
log-probs are the outputs at positions ``P-1 … P+R-2`` of its segment. An
:class:`~learner.mrope_positions.ImageMicroBatch` also hands its images to the
model (a :class:`~learner.vision.VisionLanguageGPT`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from learner.attention import packed_row
from learner.config import MegatronConfig, SamplingDist
from learner.mrope_positions import ImageMicroBatch
from learner.packing import MicroBatch
from learner.router_replay import set_targets
from learner.sampling_dist import sampled_logits

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel

DEFAULT_CHUNK = 2048
"""Positions per chunk with ``defer_fp32_logits`` and no ``logprob_chunk_size``."""


def logprob_chunk(megatron: MegatronConfig) -> int | None:
    """Positions per log-prob chunk under ``megatron`` (None: the whole row at once)."""
    if megatron.logprob_chunk_size is not None:
        return megatron.logprob_chunk_size
    return DEFAULT_CHUNK if megatron.defer_fp32_logits else None


def _language_model(model: torch.nn.Module) -> GPTModel:
    """The ``GPTModel`` inside ``model``'s wrappers (DDP, ``Float16Module``); with pipeline parallelism the
    stage's slice of it (only the last stage has an ``output_layer``)."""
    inner = model
    while not hasattr(inner, "decoder"):
        nxt = getattr(inner, "module", None)
        if not isinstance(nxt, torch.nn.Module):
            raise TypeError(f"no GPTModel (a module with a decoder) inside {type(model).__name__}")
        inner = nxt
    return cast("GPTModel", inner)


@contextlib.contextmanager
def _hidden_states(gpt: GPTModel) -> Iterator[None]:
    """``gpt``'s forward returns its final hidden states ``[s, b, h]`` (no output layer) inside this context."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def forward_hidden(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``model``'s output on ``mb`` without the output layer: the final hidden states ``[T, 1, h]``, or with
    pipeline parallelism this stage's output (a non-first stage reads its input from ``set_input_tensor``)."""
    images = {"images": mb.images} if isinstance(mb, ImageMicroBatch) else {}
    set_targets(model, mb.routing)  # routing replay (learner.router_replay); a no-op without it
    with _hidden_states(_language_model(model)):
        return model(mb.tokens, mb.position_ids, None, packed_seq_params=packed_row(mb.blocks, mb.tokens.device),
                     **images)


def head_scores(model: torch.nn.Module, hidden: torch.Tensor, mb: MicroBatch, chunk: int | None,
                entropy: bool, sampling: SamplingDist | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """From the final hidden states ``[T, 1, h]`` of ``mb``: the ``[T]`` log-probs of :func:`token_scores` and,
    with ``entropy``, the entropy of each chunk (the output layer runs here, on the last pipeline stage); under
    ``sampling`` (the engine's temperature / top-k / top-p, :mod:`learner.sampling_dist`) instead of the plain
    softmax when it is given and not neutral."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gpt = _language_model(model)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    hidden = hidden.to(gpt.config.params_dtype)  # [T, 1, h] in the output layer's dtype (Float16Module gives fp32)
    targets = mb.targets.reshape(-1, 1)  # [s, b]
    tp_group = ps.get_tensor_model_parallel_group()

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, _ = gpt.output_layer(h, weight=weight)  # [c, 1, V_local]
        if sampling is not None and not sampling.neutral:
            logits = sampled_logits(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), sampling,
                                    cast(dist.ProcessGroup, tp_group)).reshape(logits.shape)
        # first: the cross entropy below works in place on fp32 logits
        ent = vocab_parallel_entropy(logits.detach().reshape(-1, logits.shape[-1]), tp_group) if entropy else None
        lp = -vocab_parallel_cross_entropy(logits, t).reshape(-1).float()
        return lp, ent

    total = hidden.shape[0]
    step = total if chunk is None else chunk
    recompute = chunk is not None and torch.is_grad_enabled() and hidden.requires_grad
    lps, ents = [], []
    for start in range(0, total, step):
        h, t = hidden[start:start + step], targets[start:start + step]
        lp, ent = checkpoint(piece, h, t, use_reentrant=False) if recompute else piece(h, t)
        lps.append(lp)
        ents.append(ent)
    return (lps[0] if len(lps) == 1 else torch.cat(lps)), [e for e in ents if e is not None]


def _scores(model: torch.nn.Module, mb: MicroBatch, chunk: int | None,
            entropy: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The ``[T]`` log-probs of :func:`token_scores` and, with ``entropy``, the entropy of each chunk."""
    return head_scores(model, forward_hidden(model, mb), mb, chunk, entropy)


def token_scores(model: torch.nn.Module, mb: MicroBatch, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` float32 log-prob of ``mb.targets`` at every position (differentiable) and the ``[T]`` float32
    entropy of the model's next-token distribution there (no grad); ``chunk``: module docstring."""
    lp, ents = _scores(model, mb, chunk, entropy=True)
    return lp, torch.cat(ents)


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, chunk: int | None = None) -> torch.Tensor:
    """``[T]`` float32 log-prob of ``mb.targets`` at every position; differentiable (no entropy)."""
    return _scores(model, mb, chunk, entropy=False)[0]


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


ENTROPY_CHUNK_ROWS = 1024
"""Positions per chunk of the entropy computation (bounds its transient ``[rows, V]`` tensors)."""


def _row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32 entropy of softmax(logits) per row, the whole vocabulary on this rank (the arithmetic of the
    chunked path of :func:`vocab_parallel_entropy`, written once for the compiler)."""
    z = logits.float()
    z = z - z.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    total = e.sum(-1)
    return torch.log(total) - torch.where(e > 0, e * z, 0.0).sum(-1) / total


_compiled_row_entropy = None
"""``torch.compile(_row_entropy)``, made at the first GPU call: a few fused reductions over the bf16 logits instead
of about ten eager passes over fp32 copies of them (0.14 s of a 4.6 s step of the 4B shape, docs/benchmarks.md)."""


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``[N]`` float32 entropy of softmax(logits) per row of ``logits`` ``[N, V_local]``; with a TP group
    the vocabulary is split over its ranks (max, Σ exp and Σ exp·z are all-reduced). On a GPU without TP the
    rows go through one compiled kernel (:data:`_compiled_row_entropy`); elsewhere in chunks of
    :data:`ENTROPY_CHUNK_ROWS` rows, eagerly."""
    global _compiled_row_entropy
    tp = group is not None and dist.get_world_size(group) > 1
    if logits.is_cuda and not tp:
        if _compiled_row_entropy is None:
            _compiled_row_entropy = torch.compile(_row_entropy, dynamic=True)
        return _compiled_row_entropy(logits)
    out = []
    for start in range(0, logits.shape[0], ENTROPY_CHUNK_ROWS):
        z = logits[start:start + ENTROPY_CHUNK_ROWS].float()
        m = z.max(dim=-1).values
        if tp:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m[:, None]
        e = torch.exp(z)
        stats = torch.stack([e.sum(-1), torch.where(e > 0, e * z, 0.0).sum(-1)])  # 0 · -inf: filtered tokens
        del e, z
        if tp:
            dist.all_reduce(stats, group=group)
        out.append(torch.log(stats[0]) - stats[1] / stats[0])
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)
