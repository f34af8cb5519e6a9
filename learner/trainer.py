"""The learner: one GRPO optimizer step per call on a global batch of trajectory groups.

:meth:`Learner.train_step` keeps the valid samples and their group-relative
advantages, packs them into micro-batches dealt over data-parallel ranks, runs
forward/backward of ``Σ loss_t / N`` per micro-batch (π_prev is that same
forward, detached; π_ref from a frozen copy when the KL penalty is on), and
applies one Megatron optimizer step only if the loss and every gradient are
finite; otherwise the step is skipped and nothing changes.

One process per rank (Ray actors in production, spawned processes in tests);
every method that touches weights is collective over the model's ranks. The
step in detail: docs/learner.md, "A step" and "The loss".
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from learner import checkpoint, hf_weights
from learner.config import LossConfig, MegatronConfig, SequencePackingConfig
from learner.hf_weights import export_hf_state_dict, load_hf_weights, pack_hf_buckets
from learner.logprobs import response_logprobs_no_grad, response_slices, token_logprobs
from learner.loss import LossStats, TokenInputs, group_advantages, per_token_loss
from learner.model import build_gpt_model, init_distributed, read_hf_architecture
from learner.optimizer import OptimizerStack, build_optimizer, wrap_ddp
from learner.packing import MicroBatch, deal, pack
from protocol.messages import Trajectory, TrajectoryGroup, WeightBucket, WeightManifest

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel

log = logging.getLogger(__name__)


def _reward(t: Trajectory) -> float:
    if t.reward is None:
        raise ValueError("a valid trajectory (finish_reason != 'error') must carry a reward, got None")
    return float(t.reward)


@dataclass
class Sample:
    """One valid trajectory, ready to pack: prompt+response tokens and its per-token inputs."""

    tokens: np.ndarray
    prompt_len: int
    lp_gen: np.ndarray
    advantage: float


@dataclass
class StepBatch:
    """The samples of one global batch and the group-level counts."""

    samples: list[Sample]
    rewards: list[float]
    zero_advantage_groups: int
    failed_samples: int
    truncated_samples: int


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
                 max_total_sequence_length: int, normalize_rewards: bool = True, seed: int = 42):
        if packing.enabled and packing.train_mb_tokens < max_total_sequence_length:
            raise ValueError(f"sequence_packing.train_mb_tokens ({packing.train_mb_tokens}) must be >= "
                             f"max_total_sequence_length ({max_total_sequence_length})")
        self.model_path = model_path
        self.loss_cfg, self.packing, self.megatron = loss, packing, megatron
        self.max_total_sequence_length = max_total_sequence_length
        self.normalize_rewards = normalize_rewards
        self.policy_version = 0
        self.step = 0
        self.last_skip_reason = ""

        init_distributed(megatron, seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.arch = read_hf_architecture(model_path)
        self.bf16 = megatron.precision == "bfloat16"
        self.gpt, self.config = build_gpt_model(self.arch, megatron)
        self.hf_metas = load_hf_weights(self.gpt, self.arch, model_path)
        self.model = wrap_ddp(self._precision_wrap(self.gpt), self.config,
                              megatron.optimizer.use_distributed_optimizer)
        self.optim = build_optimizer(self.model, megatron.optimizer, self.bf16)
        self.reference = self._build_reference() if loss.reference_policy_kl_penalty > 0 else None

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

    @staticmethod
    def _ep() -> int:
        from megatron.core import parallel_state as ps
        return ps.get_expert_model_parallel_world_size()

    # ------------------------------------------------------------------ batch preparation

    def _collect(self, groups: list[TrajectoryGroup]) -> StepBatch:
        samples, rewards = [], []
        zero_groups = failed = truncated = 0
        limit = self.max_total_sequence_length
        for g in groups:
            valid = g.valid
            failed += len(g.trajectories) - len(valid)
            if not valid:
                continue
            group_rewards = [_reward(t) for t in valid]
            advantages, no_signal = group_advantages(group_rewards, self.normalize_rewards)
            zero_groups += int(no_signal)
            prompt = np.asarray(g.prompt_ids, dtype=np.int64)
            if prompt.size < 1 or prompt.size >= limit:
                raise ValueError(f"group {g.group_id}: prompt has {prompt.size} tokens, must be in "
                                 f"[1, max_total_sequence_length={limit})")
            for t, reward, adv in zip(valid, group_rewards, advantages, strict=True):
                rewards.append(reward)
                room = limit - prompt.size
                resp, lp_gen = t.response_ids[:room], t.logprobs[:room]
                truncated += int(resp.size < t.response_ids.size)
                if resp.size == 0:
                    continue
                samples.append(Sample(np.concatenate([prompt, resp.astype(np.int64)]), int(prompt.size),
                                      np.asarray(lp_gen, dtype=np.float32), float(adv)))
        return StepBatch(samples, rewards, zero_groups, failed, truncated)

    def _pack(self, sequences: list[np.ndarray]) -> tuple[list[MicroBatch], float]:
        budget = self.packing.train_mb_tokens
        return pack(sequences, budget, self.packing.enabled)

    @property
    def device(self) -> torch.device:
        """The device the model's parameters live on."""
        return next(self.gpt.parameters()).device

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One optimizer step on all ``groups`` (the global batch); returns the step's metrics."""
        t_start = time.perf_counter()
        batch = self._collect(groups)
        dp_rank, dp_size, dp_group = self._dp()
        micro_batches, fill = self._pack([s.tokens for s in batch.samples]) if batch.samples else ([], 0.0)
        mine, pad_tokens = deal(micro_batches, dp_rank, dp_size, equal_shapes=self._ep() > 1)
        mine = [mb.to(self.device) for mb in mine]
        prompt_lens = [s.prompt_len for s in batch.samples]

        self.model.train()
        lp_ref = self._logprobs_by_index(self.reference, mine, prompt_lens) if self.reference is not None else None
        local_tokens = sum(sl.stop - sl.start for mb in mine for sl in response_slices(mb, prompt_lens))
        n_global = torch.tensor([local_tokens], dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        dist.all_reduce(n_global, group=dp_group)
        n_global_f = float(n_global.item())

        self.model.zero_grad_buffer()
        self.optim.zero_grad()
        stats = LossStats()
        for mb in mine:
            lp = token_logprobs(self.model, mb)
            if not mb.segments:  # all padding (EP > 1): the backward runs the MoE collectives, the loss is 0
                lp[:0].sum().backward()
                continue
            lp_resp = torch.cat([lp[s] for s in response_slices(mb, prompt_lens)])
            # pi_prev: the whole batch is one optimizer step, so every forward of this step runs on the
            # weights the step started from -- pi_prev is this forward, detached (a separate no-grad pass
            # gives the same numbers and costs a third of the step; measured in bench/learner_step.py).
            x = self._token_inputs(mb, batch.samples, lp_resp.detach(), lp_ref)
            loss_t, parts = per_token_loss(lp_resp, x, self.loss_cfg)
            mb_loss = loss_t.sum() / n_global_f
            mb_loss.backward()
            stats.add(parts, float(mb_loss.detach()))
        self.model.finish_grad_sync()
        stats.all_reduce(dp_group, self.device)

        nonfinite_loss = not np.isfinite(stats.loss)
        nonfinite_grad = self._any_nonfinite_grad()
        applied, grad_norm = False, float("nan")
        if n_global_f == 0:
            self.last_skip_reason = "no valid response tokens in the batch"
        elif nonfinite_loss or nonfinite_grad:
            self.last_skip_reason = f"non-finite {'loss' if nonfinite_loss else 'gradient'}"
        else:
            applied, grad_norm = self.optim.step()
            self.last_skip_reason = "" if applied else "optimizer rejected the step"
        if applied:
            self.policy_version += 1
        else:
            log.warning("learner step %d skipped: %s", self.step, self.last_skip_reason)
        self.step += 1

        elapsed = time.perf_counter() - t_start
        total_tokens = float(sum(s.tokens.size for s in batch.samples))
        metrics = stats.metrics()
        metrics.update({
            "reward_mean": float(np.mean(batch.rewards)) if batch.rewards else 0.0,
            "zero_advantage_groups": float(batch.zero_advantage_groups),
            "failed_samples": float(batch.failed_samples),
            "truncated_samples": float(batch.truncated_samples),
            "grad_norm": grad_norm,
            "step_skipped": float(not applied),
            "nonfinite_loss": float(nonfinite_loss),
            "nonfinite_grad": float(nonfinite_grad),
            "lr": self.optim.lr,
            "policy_version": float(self.policy_version),
            "policy_training_s": elapsed,
            "tokens_per_s": total_tokens / elapsed if elapsed > 0 else 0.0,
            "fill_ratio": fill,
            "num_micro_batches": float(len(micro_batches)),
            "pad_tokens": float(pad_tokens),
        })
        return metrics

    def _logprobs_by_index(self, model, micro_batches: list[MicroBatch],
                           prompt_lens: list[int]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb in micro_batches:
                lp = token_logprobs(model, mb)
                for seg, sl in zip(mb.segments, response_slices(mb, prompt_lens), strict=True):
                    out[seg.index] = lp[sl]
        return out

    def _token_inputs(self, mb: MicroBatch, samples: list[Sample], lp_prev: torch.Tensor,
                      lp_ref: dict[int, torch.Tensor] | None) -> TokenInputs:
        dev = self.device
        idx = [seg.index for seg in mb.segments]
        lp_gen = torch.cat([torch.from_numpy(samples[i].lp_gen) for i in idx]).to(dev)
        adv = torch.cat([torch.full((samples[i].lp_gen.size,), samples[i].advantage) for i in idx]).to(dev)
        return TokenInputs(lp_prev=lp_prev, lp_gen=lp_gen, advantages=adv,
                           lp_ref=torch.cat([lp_ref[i] for i in idx]) if lp_ref is not None else None)

    def _any_nonfinite_grad(self) -> bool:
        bad = torch.zeros(1, device=self.device)
        # DDP's `buffers` list shadows nn.Module.buffers(), which is what the stubs see
        for buf in self.model.buffers + self.model.expert_parallel_buffers:  # pyright: ignore[reportOperatorIssue]
            if not torch.isfinite(buf.grad_data).all():
                bad.fill_(1.0)
                break
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    # ------------------------------------------------------------------ inference / parity

    def logprobs(self, prompt_ids: list[np.ndarray], response_ids: list[np.ndarray]) -> list[np.ndarray]:
        """Response log-probs (float32) of each prompt/response pair under the current weights; no grad."""
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"prompt_ids has {len(prompt_ids)} entries, response_ids {len(response_ids)}")
        seqs = [np.concatenate([np.asarray(p, np.int64), np.asarray(r, np.int64)])
                for p, r in zip(prompt_ids, response_ids, strict=True)]
        budget = max(self.packing.train_mb_tokens, max((s.size for s in seqs), default=1))
        micro_batches, _ = pack(seqs, budget, self.packing.enabled)
        self.model.eval()
        lps = response_logprobs_no_grad(self.model, [mb.to(self.device) for mb in micro_batches],
                                        [len(p) for p in prompt_ids], len(seqs))
        return [lp.float().numpy() for lp in lps]

    # ------------------------------------------------------------------ weights out

    def export_weights(self, bucket_bytes: int) -> tuple[WeightManifest, list[WeightBucket]] | None:
        """HF-named weights of version ``policy_version`` in buckets; collective, rank 0 gets them (others None)."""
        state = export_hf_state_dict(self.gpt, self.arch, self.hf_metas)
        if state is None:
            return None
        return pack_hf_buckets(state, self.hf_metas, self.policy_version, bucket_bytes)

    def export_weight_tensors(self) -> list[tuple[str, torch.Tensor]] | None:
        """HF-named weights of version ``policy_version`` on the model's device, in the source checkpoint's
        order, for a collective push; collective, rank 0 gets them (others None). They may be views of the
        parameters: send them before the next :meth:`train_step`."""
        state = export_hf_state_dict(self.gpt, self.arch, self.hf_metas, on_device=True)
        return None if state is None else list(state.items())

    def save_hf(self, path: str) -> None:
        """Write a transformers/vLLM-loadable HF directory (collective; rank 0 writes)."""
        state = export_hf_state_dict(self.gpt, self.arch, self.hf_metas)
        if state is not None:
            hf_weights.save_hf(state, self.model_path, path)
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
        payload, _ = checkpoint.load(path)
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
