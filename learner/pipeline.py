"""Micro-batches through the model's pipeline stages; what the last stage computed, on every stage.

With ``pipeline_model_parallel_size`` P > 1 each rank holds a slice of the layers (the first stage also the
embedding, the last the final norm and the output layer). :func:`run_micro_batches` runs a rank's micro-batches
through Megatron-Core's non-interleaved 1F1B schedule (``forward_backward_pipelining_without_interleaving``:
activations and their gradients go stage to stage, with their shapes, since packed rows differ in length), and
the ``head`` (output layer, log-probs, loss: :mod:`learner.logprobs`) runs on the last stage only. With P = 1 it is
the plain loop: forward, head, backward per micro-batch. Every stage of a pipeline has the same micro-batches (all
ranks pack the whole batch; the data-parallel rank deals them), so the stages agree on the schedule.

What the head computes lives on the last stage; :func:`from_last_stage` broadcasts per-sequence values (π_prev,
the reference's log-probs, the log-probs of :meth:`~learner.trainer.Learner.logprobs`) over the pipeline group so
that every rank continues with the same numbers, and the loss statistics are all-reduced over it (the other
stages contribute nothing). docs/learner.md, "Pipeline parallelism".
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from learner.cpu_compat import device_redirect
from learner.logprobs import forward_hidden, head_scores, response_slices
from learner.packing import MicroBatch

Head = Callable[[MicroBatch, torch.Tensor], torch.Tensor]
"""The last stage's work on one micro-batch, given its final hidden states ``[T, 1, h]``: returns the scalar to
backpropagate (its value is not used by a forward-only run)."""


def stages() -> int:
    """The pipeline-parallel size P."""
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    """Whether this rank holds the output layer (always with P = 1)."""
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_last_stage()


def run_micro_batches(model: torch.nn.Module, micro_batches: Sequence[MicroBatch], head: Head,
                      forward_only: bool) -> None:
    """Forward (and, unless ``forward_only``, backward) of every micro-batch through ``model``'s stages, calling
    ``head`` on the last stage. Collective over the pipeline group; the caller sets grad mode and syncs grads."""
    if stages() == 1:
        for mb in micro_batches:
            out = head(mb, forward_hidden(model, mb))
            if not forward_only:
                out.backward()
        return
    if not micro_batches:  # the same on every stage of this pipeline (same data-parallel rank)
        return
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    def last_stage(mb: MicroBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        # Megatron's (loss, num_tokens, data): with calculate_per_token_loss it divides by nothing; the head's
        # loss is already over the global batch's token count
        return head(mb, hidden), torch.tensor(1, dtype=torch.int), {}

    def step(data_iterator, stage_model):
        mb = next(data_iterator)
        return forward_hidden(stage_model, mb), functools.partial(last_stage, mb)

    with device_redirect():  # the schedule counts tokens in a tensor made with device="cuda"
        forward_backward_pipelining_without_interleaving(
            forward_step_func=step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=len(micro_batches), seq_length=max(mb.tokens.shape[-1] for mb in micro_batches),
            micro_batch_size=1, forward_only=forward_only)


def from_last_stage(values: dict[int, torch.Tensor], sizes: dict[int, int],
                    device: torch.device) -> dict[int, torch.Tensor]:
    """``values`` (1-D float32 tensors by key, filled on the last stage) on every stage of the pipeline: the other
    stages pass what they have (nothing) and get the last stage's, shaped by ``sizes`` (known everywhere)."""
    if stages() == 1:
        return values
    from megatron.core import parallel_state as ps

    keys = sorted(sizes)
    if ps.is_pipeline_last_stage():
        missing = [k for k in keys if k not in values]
        if missing:
            raise ValueError(f"last pipeline stage: no values for sequences {missing[:5]}")
        flat = torch.cat([values[k].reshape(-1).float() for k in keys]).to(device) if keys else \
            torch.zeros(0, device=device)
    else:
        flat = torch.empty(sum(sizes[k] for k in keys), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=pipeline_group())
    return dict(zip(keys, torch.split(flat, [sizes[k] for k in keys]), strict=True))


def pipeline_group() -> dist.ProcessGroup:
    """The pipeline-parallel process group of this rank (size 1 with P = 1)."""
    from megatron.core import parallel_state as ps
    return cast(dist.ProcessGroup, ps.get_pipeline_model_parallel_group())


def finish_grads(model: torch.nn.Module) -> None:
    """After the backward of every micro-batch: gradients summed over data-parallel ranks and, with P > 1 and tied
    embeddings, the embedding's and the output layer's (first and last stage) summed too (Megatron's
    ``finalize_model_grads``, without its token scaling: the loss is already divided by the batch's tokens)."""
    if stages() == 1:
        model.finish_grad_sync()  # pyright: ignore[reportCallIssue]  (Megatron DDP's)
        return
    from megatron.core.distributed import finalize_model_grads
    finalize_model_grads([model])


@torch.no_grad()
def response_logprobs(model: torch.nn.Module, micro_batches: list[MicroBatch], prompt_lengths: list[int],
                      response_lengths: list[int], chunk: int | None = None) -> list[torch.Tensor]:
    """Response log-probs (CPU) of every sequence, by input index, on every stage; no graph."""
    out: dict[int, torch.Tensor] = {}

    def head(mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        lp = head_scores(model, hidden, mb, chunk, entropy=False)[0]
        for seg, sl in zip(mb.segments, response_slices(mb, prompt_lengths), strict=True):
            out[seg.index] = lp[sl]
        return lp.sum()

    run_micro_batches(model, micro_batches, head, forward_only=True)
    placed = {seg.index for mb in micro_batches for seg in mb.segments}
    missing = [i for i in range(len(prompt_lengths)) if i not in placed]
    if missing:
        raise ValueError(f"sequences {missing[:5]} are in no micro-batch")
    device = micro_batches[0].tokens.device if micro_batches else torch.device("cpu")
    got = from_last_stage(out, dict(enumerate(response_lengths)), device)
    return [got[i].detach().cpu() for i in range(len(prompt_lengths))]
