"""The learner: one GRPO step per call on a global batch of trajectory groups.

:meth:`Learner.train_step` keeps the valid samples and their group-relative advantages (overlong ones
filtered out of the loss when asked), splits them into ``train_global_batch_size``-trajectory optimizer steps
(one by default), packs each into micro-batches dealt over data-parallel ranks, runs forward/backward of
``Σ loss_t / N`` per micro-batch through the pipeline stages (:mod:`learner.pipeline`; π_prev: that same
forward, detached, with one optimizer step; a no-grad forward of the whole batch before the first update with
several; π_ref from a frozen copy when the KL penalty is on), and applies a Megatron optimizer step only if its
loss and every gradient are finite; otherwise that optimizer step is skipped and changes nothing. A
vision-language policy also takes each prompt's images (docs/multimodal_learner.md).

One process per rank (Ray actors in production, spawned processes in tests); every method that touches
weights is collective over the model's ranks. The step in detail: docs/learner.md, "A step" and "The loss".
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist

from learner import checkpoint, hf_export, hf_weights, router_replay, seq_filter
from learner.batch import Sample, StepBatch, collect, split, summary_stats, token_inputs, trained_positions
from learner.config import LossConfig, MegatronConfig, SequencePackingConfig, TrainStepConfig
from learner.hf_export import export_hf_state_dict, pack_hf_buckets
from learner.hf_weights import load_hf_weights
from learner.logprobs import head_scores, logprob_chunk
from learner.loss import LossStats, TokenInputs, per_token_loss
from learner.mismatch_stats import MismatchStats
from learner.model import any_nonfinite_grad, build_gpt_model, init_distributed, read_hf_architecture
from learner.mrope_positions import ImageInputs, with_images
from learner.optimizer import OptimizerStack, build_optimizer, wrap_ddp
from learner.packing import MicroBatch, deal, pack
from learner.pipeline import finish_grads, from_last_stage, pipeline_group, response_logprobs, run_micro_batches
from protocol.messages import TrajectoryGroup, WeightBucket, WeightManifest

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """One optimizer step's samples packed and dealt to this rank."""

    samples: list[Sample]
    mine: list[MicroBatch]
    fill: float
    num_micro_batches: int
    pad_tokens: int

    @property
    def local_tokens(self) -> int:  # trained tokens (sampled, not filtered out) of this rank's micro-batches
        return sum(self.samples[seg.index].num_trained for mb in self.mine for seg in mb.segments)


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    applied: bool
    grad_norm: float
    reason: str
    nonfinite_loss: bool
    nonfinite_grad: bool


class Learner:
    """GRPO learner on Megatron-Core; see the module docstring for what a step does."""

    gpt: GPTModel
    """The Megatron model (unwrapped): its parameters are the policy's weights."""
    model: DistributedDataParallel
    """``gpt`` in the precision wrapper and Megatron DDP: what the step trains."""
    optim: OptimizerStack
    reference: torch.nn.Module | None
    """The frozen initial policy for the KL penalty (None when the penalty is off)."""

    def __init__(self, model_path: str, megatron: MegatronConfig, loss: LossConfig, packing: SequencePackingConfig,
                 max_total_sequence_length: int, normalize_rewards: bool = True, seed: int = 42,
                 step_config: TrainStepConfig | None = None, freeze_vision_tower: bool = True):
        if packing.enabled and packing.train_mb_tokens < max_total_sequence_length:
            raise ValueError(f"sequence_packing.train_mb_tokens ({packing.train_mb_tokens}) must be >= "
                             f"max_total_sequence_length ({max_total_sequence_length})")
        self.model_path = model_path
        self.loss_cfg, self.packing, self.megatron = loss, packing, megatron
        self.max_total_sequence_length = max_total_sequence_length
        self.normalize_rewards = normalize_rewards
        self.step_cfg = step_config if step_config is not None else TrainStepConfig()
        self.policy_version = 0
        self.step = 0
        self.last_skip_reason = ""

        init_distributed(megatron, seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.arch = read_hf_architecture(model_path)
        self.bf16 = megatron.precision == "bfloat16"
        self.gpt, self.config = build_gpt_model(self.arch, megatron, freeze_vision_tower)
        self.hf_metas = load_hf_weights(self.gpt, self.arch, model_path)
        router_replay.set_up_routers(self.gpt, megatron, model_path)  # frozen, replaying the engine's experts
        self.model = wrap_ddp(self._precision_wrap(self.gpt), self.config,
                              megatron.optimizer.use_distributed_optimizer)
        self.optim = build_optimizer(self.model, megatron.optimizer, self.bf16)
        self.reference = self._build_reference() if loss.reference_policy_kl_penalty > 0 else None
        self.logprob_chunk = logprob_chunk(megatron)  # positions per log-prob chunk (learner.logprobs)

    # ------------------------------------------------------------------ construction helpers

    def _precision_wrap(self, gpt: torch.nn.Module) -> torch.nn.Module:
        if not self.bf16:
            return gpt
        from megatron.core.transformer.module import Float16Module
        return Float16Module(self.config, gpt)

    def _build_reference(self) -> torch.nn.Module:
        """A frozen copy of the initial policy for the KL penalty."""
        gpt, _ = build_gpt_model(self.arch, self.megatron)
        load_hf_weights(gpt, self.arch, self.model_path)
        ref = self._precision_wrap(gpt).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # ------------------------------------------------------------------ parallel layout

    @staticmethod
    def _dp() -> tuple[int, int, object]:
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    # ------------------------------------------------------------------ batch preparation

    def _collect(self, groups: list[TrajectoryGroup], images: dict[str, ImageInputs] | None = None) -> StepBatch:
        return collect(groups, self.max_total_sequence_length, self.normalize_rewards, self.step_cfg, images,
                       self.arch.vision)

    def _prepare(self, samples: list[Sample]) -> Prepared:
        dp_rank, dp_size, _ = self._dp()
        micro_batches, fill = self._pack([s.tokens for s in samples]) if samples else ([], 0.0)
        ep = hf_weights.ParallelLayout.current().ep_size
        mine, pad_tokens = deal(micro_batches, dp_rank, dp_size, equal_shapes=ep > 1)
        mine = with_images(mine, [s.prompt_len for s in samples], [s.images for s in samples], self.arch.vision)
        mine = router_replay.attach(self.gpt, [mb.to(self.device) for mb in mine], [s.routed_experts for s in samples])
        return Prepared(samples, mine, fill, len(micro_batches), pad_tokens)

    def _pack(self, sequences: list[np.ndarray]) -> tuple[list[MicroBatch], float]:
        return pack(sequences, self.packing.train_mb_tokens, self.packing.enabled)

    @property
    def device(self) -> torch.device:
        """The device the model's parameters live on."""
        return next(self.gpt.parameters()).device

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[TrajectoryGroup],
                   images: dict[str, ImageInputs] | None = None) -> dict[str, float]:
        """One GRPO step on all ``groups`` (the global batch): one optimizer step, or one per
        ``train_global_batch_size`` trajectories; returns the step's metrics. ``images``: by ``prompt_id``."""
        t_start = time.perf_counter()
        batch = self._collect(groups, images)
        _, _, dp_group = self._dp()
        self.model.train()
        minis = split(batch, self.step_cfg.train_global_batch_size)
        if self.loss_cfg.force_on_policy_ratio and len(minis) > 1:
            raise ValueError(f"loss_fn.force_on_policy_ratio needs one optimizer step per rollout batch, got "
                             f"{len(minis)} (policy.train_global_batch_size={self.step_cfg.train_global_batch_size}); "
                             "expected None or the whole batch")
        preps = [self._prepare(samples) for samples in minis]
        threshold = self.step_cfg.seq_logprob_error_threshold
        filtering = seq_filter.active(self.loss_cfg, threshold)
        prev: list[dict[int, torch.Tensor] | None] = [None] * len(preps)
        prev_s = 0.0
        if len(preps) > 1 or filtering:
            # pi_prev: optimizer steps after the first run on updated weights, sequence filters judge before any
            # training forward: so it comes from one no-grad forward of the whole batch, before any update
            t0 = time.perf_counter()
            prev = [self._logprobs_by_index(self.model, p.mine, p.samples) for p in preps]
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            prev_s = time.perf_counter() - t0
        mm = MismatchStats.of(groups, self.policy_version, threshold, [p.samples for p in preps], prev)
        seq_stats = seq_filter.apply([p.samples for p in preps], prev, self.loss_cfg, threshold, filtering)
        n_global = torch.tensor([p.local_tokens for p in preps], dtype=torch.float64,
                                device=self.device)  # NCCL: on the GPU
        dist.all_reduce(n_global, group=dp_group)
        n_mini = [float(v) for v in n_global.tolist()]
        n_total = sum(n_mini)
        stats = LossStats()
        shares = [n / n_total if len(preps) > 1 and n_total > 0 else 1.0 for n in n_mini]
        outcomes = [self._optimizer_step(p, n, share, lp_prev, stats, mm)
                    for p, n, share, lp_prev in zip(preps, n_mini, shares, prev, strict=True)]
        stats.all_reduce(pipeline_group(), self.device)  # the last stage's (the others have none)
        stats.all_reduce(dp_group, self.device)
        seq_stats.all_reduce(dp_group, self.device)
        mm.reduce((pipeline_group(), dp_group), self.device)  # the per-sequence mismatch (learner.mismatch_stats)
        applied = [o for o in outcomes if o.applied]
        skipped = [o for o in outcomes if not o.applied]
        if applied:
            self.policy_version += 1
            self.last_skip_reason = ""
            for o in skipped:
                log.warning("learner step %d: an optimizer step of %d skipped: %s", self.step, len(outcomes),
                            o.reason)
        else:
            self.last_skip_reason = skipped[-1].reason
            log.warning("learner step %d skipped: %s", self.step, self.last_skip_reason)
        self.step += 1
        elapsed = time.perf_counter() - t_start
        total_tokens = float(sum(s.tokens.size for s in batch.samples))
        num_micro = sum(p.num_micro_batches for p in preps)
        fill = preps[0].fill if len(preps) == 1 else (sum(p.fill * p.num_micro_batches for p in preps) / num_micro
                                                     if num_micro else 0.0)
        valid = max(len(batch.rewards), 1)
        metrics = {**stats.metrics(), **(seq_stats.metrics() if filtering else {}), **mm.metrics(),
                   **router_replay.step_metrics(self.gpt, (pipeline_group(), dp_group), self.device)}
        metrics.update({
            "reward_mean": float(np.mean(batch.rewards)) if batch.rewards else 0.0,
            **{k: v for k, v in summary_stats(batch.rewards, "reward").items() if k != "reward_mean"},
            **batch.reward_metrics(),
            **summary_stats([float(n) for n in batch.response_lengths], "response_length"),
            "truncation_rate": batch.length_finished / valid if batch.rewards else 0.0,
            "overlong_filtered_samples": float(batch.overlong_filtered),
            "zero_advantage_groups": float(batch.zero_advantage_groups),
            "failed_samples": float(batch.failed_samples),
            "truncated_samples": float(batch.truncated_samples),
            "env_tokens": float(batch.env_tokens),
            "grad_norm": float(np.mean([o.grad_norm for o in applied])) if applied else float("nan"),
            "step_skipped": float(not applied),
            "optimizer_steps": float(len(applied)),
            "skipped_optimizer_steps": float(len(skipped)),
            "nonfinite_loss": float(any(o.nonfinite_loss for o in outcomes)),
            "nonfinite_grad": float(any(o.nonfinite_grad for o in outcomes)),
            "lr": self.optim.lr,
            "policy_version": float(self.policy_version),
            "policy_training_s": elapsed,
            "prev_logprobs_s": prev_s,
            "tokens_per_s": total_tokens / elapsed if elapsed > 0 else 0.0,
            "fill_ratio": fill,
            "num_micro_batches": float(num_micro),
            "pad_tokens": float(sum(p.pad_tokens for p in preps)),
        })
        return metrics

    def _optimizer_step(self, prep: Prepared, n_global: float, loss_share: float,
                        lp_prev: dict[int, torch.Tensor] | None, stats: LossStats, mm: MismatchStats) -> StepOutcome:
        """Forward/backward of ``Σ loss_t / n_global`` over ``prep`` and one optimizer step if everything is
        finite. ``lp_prev`` None: π_prev is the training forward, detached (a single optimizer step per batch).
        ``loss_share`` (n_global / the batch's tokens) weights this step's loss in the ``loss`` metric."""
        mine, samples = prep.mine, prep.samples
        lp_ref = self._logprobs_by_index(self.reference, mine, samples) if self.reference is not None else None
        self.model.zero_grad_buffer()
        self.optim.zero_grad()
        local_loss = [0.0]

        def head(mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:  # on the last pipeline stage
            lp, ents = head_scores(self.model, hidden, mb, self.logprob_chunk, True, self.step_cfg.sampling)
            if not mb.segments:  # all padding (EP > 1): the backward runs the MoE collectives, the loss is 0
                return lp[:0].sum()
            at = torch.cat(trained_positions(mb, samples)).to(lp.device)  # sampled tokens only (learner.batch)
            lp_resp = lp[at]
            # one optimizer step: every forward of the step runs on the weights the step started from, so
            # pi_prev is this forward, detached (a separate no-grad pass gives the same numbers)
            prev = lp_resp.detach() if lp_prev is None else torch.cat([lp_prev[seg.index] for seg in mb.segments])
            mm.add_trained(mb, samples, prev)  # the per-sequence mismatch, unless measured before the filters
            x = self._token_inputs(mb, samples, prev, lp_ref)
            loss_t, parts = per_token_loss(lp_resp, x, self.loss_cfg)
            parts["entropy"] = torch.cat(ents)[at.to(ents[0].device)].to(lp_resp.dtype)
            mb_loss = loss_t.sum() / n_global
            value = float(mb_loss.detach())
            local_loss[0] += value
            stats.add(parts, value * loss_share)
            return mb_loss

        run_micro_batches(self.model, mine, head, forward_only=False)
        finish_grads(self.model)

        loss = torch.tensor(local_loss, dtype=torch.float64, device=self.device)  # the last stage's
        _, dp_size, dp_group = self._dp()
        for group in (pipeline_group(), cast(dist.ProcessGroup, dp_group)):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(loss, group=group)
        nonfinite_loss = not bool(torch.isfinite(loss).all())
        nonfinite_grad = any_nonfinite_grad(self.model, self.device)
        applied, grad_norm = False, float("nan")
        if n_global == 0:
            reason = "no valid response tokens in the batch"
        elif nonfinite_loss or nonfinite_grad:
            reason = f"non-finite {'loss' if nonfinite_loss else 'gradient'}"
        else:
            applied, grad_norm = self.optim.step()
            reason = "" if applied else "optimizer rejected the step"
        return StepOutcome(applied, grad_norm, reason, nonfinite_loss, nonfinite_grad)

    def _logprobs_by_index(self, model, micro_batches: list[MicroBatch],
                           samples: list[Sample]) -> dict[int, torch.Tensor]:
        """No-grad log-probs of each sequence's trained tokens, by sequence index (on every pipeline stage)."""
        out: dict[int, torch.Tensor] = {}

        def head(mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
            lp = head_scores(model, hidden, mb, self.logprob_chunk, False, self.step_cfg.sampling)[0]
            for seg, at in zip(mb.segments, trained_positions(mb, samples), strict=True):
                out[seg.index] = lp[at.to(lp.device)]
            return lp.sum()

        with torch.no_grad():
            run_micro_batches(model, micro_batches, head, forward_only=True)
        sizes = {seg.index: samples[seg.index].num_trained for mb in micro_batches for seg in mb.segments}
        return from_last_stage(out, sizes, self.device)

    def _token_inputs(self, mb: MicroBatch, samples: list[Sample], lp_prev: torch.Tensor,
                      lp_ref: dict[int, torch.Tensor] | None) -> TokenInputs:
        return token_inputs(mb, samples, lp_prev, lp_ref, self.device)

    # ------------------------------------------------------------------ inference / parity

    def logprobs(self, prompt_ids: list[np.ndarray], response_ids: list[np.ndarray],
                 images: list[ImageInputs | None] | None = None) -> list[np.ndarray]:
        """Response log-probs (float32) of each prompt/response pair under the current weights, with each
        prompt's ``images`` (vision-language policies; None: no images); no grad."""
        pics: list[ImageInputs | None] = list(images) if images is not None else [None] * len(prompt_ids)
        if not len(prompt_ids) == len(response_ids) == len(pics):
            raise ValueError(f"{len(prompt_ids)} prompt_ids, {len(response_ids)} response_ids, {len(pics)} images")
        seqs = [np.concatenate([np.asarray(p, np.int64), np.asarray(r, np.int64)])
                for p, r in zip(prompt_ids, response_ids, strict=True)]
        budget = max(self.packing.train_mb_tokens, max((s.size for s in seqs), default=1))
        micro_batches, _ = pack(seqs, budget, self.packing.enabled)
        micro_batches = with_images(micro_batches, [len(p) for p in prompt_ids], pics, self.arch.vision)
        self.model.eval()
        lps = response_logprobs(self.model, [mb.to(self.device) for mb in micro_batches], [len(p) for p in prompt_ids],
                                [len(r) for r in response_ids], self.logprob_chunk)
        return [lp.float().numpy() for lp in lps]

    # ------------------------------------------------------------------ weights out

    def export_weights(self, bucket_bytes: int) -> tuple[WeightManifest, list[WeightBucket]] | None:
        """HF-named weights of version ``policy_version`` in buckets; collective, rank 0 gets them (others None)."""
        state = export_hf_state_dict(self.gpt, self.arch, self.hf_metas, source=self.model_path)
        if state is None:
            return None
        return pack_hf_buckets(state, self.hf_metas, self.policy_version, bucket_bytes)

    def export_weight_tensors(self) -> list[tuple[str, torch.Tensor]] | None:
        """HF-named weights of version ``policy_version`` on the model's device, in the source checkpoint's
        order, for a collective push; collective, rank 0 gets them (others None). They may be views of the
        parameters: send them before the next :meth:`train_step`."""
        state = export_hf_state_dict(self.gpt, self.arch, self.hf_metas, on_device=True,
                                     source=self.model_path)
        return None if state is None else list(state.items())

    def save_hf(self, path: str) -> None:
        """Write a transformers/vLLM-loadable HF directory (collective; rank 0 writes)."""
        state = export_hf_state_dict(self.gpt, self.arch, self.hf_metas, source=self.model_path)
        if state is not None:
            hf_export.save_hf(state, self.model_path, path)
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        """Model shard, optimizer, scheduler, RNG, counters and ``extra`` of this rank (collective)."""
        payload = {"model": self.gpt.state_dict(), "optimizer": self.optim.inner_state(),
                   "rng": checkpoint.capture_rng(), "step": self.step, "policy_version": self.policy_version,
                   "extra": extra or {}}
        checkpoint.save(path, payload, {"step": self.step, "policy_version": self.policy_version})

    def load_checkpoint(self, path: str) -> dict:
        """Restore everything :meth:`save_checkpoint` wrote; returns its ``extra``."""
        payload, _ = checkpoint.load(path, self.gpt.state_dict())  # another model's: one line, not a traceback
        with torch.no_grad():
            self.gpt.load_state_dict(payload["model"], strict=True)
        self.optim.load_inner_state(payload["optimizer"])
        checkpoint.restore_rng(payload["rng"])
        self.step, self.policy_version = int(payload["step"]), int(payload["policy_version"])
        dist.barrier()
        return payload["extra"]

    def shutdown(self) -> None:
        """Release the model, optimizer and reference copy. The process group stays (see
        :func:`learner.model.shutdown_distributed` for the process-wide teardown)."""
        # a shut-down learner is dead: every later call fails on None
        self.model = self.optim = self.reference = self.gpt = None  # pyright: ignore[reportAttributeAccessIssue]
