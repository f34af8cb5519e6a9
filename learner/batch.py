"""One rollout batch as the learner trains it: valid samples, advantages, optimizer-step split.

:func:`collect` keeps the valid samples of every group with their group-relative
advantages (group mean or leave-one-out baseline) of their scaled and shaped
rewards (:mod:`learner.reward_shaping`), drops overlong samples from the loss when
``overlong_filtering`` is on (their reward stays in the baseline) and counts what
the metrics report; :func:`split` cuts the batch into the
samples of each optimizer step (trajectory positions ``[j·B, (j+1)·B)``).

A multi-turn sample keeps its environment tokens in the sequence (context for the tokens after them) but
only its sampled tokens (``loss_mask`` 1) are trained: :func:`trained_positions` gives, per packed sequence,
the log-prob positions of those tokens, and :func:`token_inputs` their per-token loss inputs, so that an
environment token never reaches the loss, its IS weight, N or any token metric.
A vision-language policy's samples carry their prompt's images (:class:`~learner.mrope_positions.ImageInputs`,
by ``prompt_id``), checked against the prompt's image tokens when collected (docs/multimodal_learner.md).
See docs/learner.md, "A step", "Multi-turn samples" and "Several optimizer steps per batch".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from learner.config import TrainStepConfig
from learner.hf_config import VisionSpec
from learner.logprobs import response_slices
from learner.loss import TokenInputs, group_advantages
from learner.mrope_positions import ImageInputs, image_runs
from learner.packing import MicroBatch
from learner.reward_shaping import shaped_group_rewards
from protocol.messages import Trajectory, TrajectoryGroup


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
    """The engine's log-prob of every response token in ``tokens`` (0.0 at environment tokens)."""
    loss_mask: np.ndarray
    """bool, one per response token in ``tokens``: True where the engine sampled it (trained)."""
    advantage: float
    position: int = 0
    """Its index among all the batch's trajectories (groups in order, failed ones counted): which
    optimizer step trains it (:func:`split`)."""
    images: ImageInputs | None = None
    """The images of its prompt (vision-language policies), or None."""
    is_weight_scale: float = 1.0
    """Factor of its tokens' importance weights: 0 for a sequence ``seq-mask-tis`` masked (learner.seq_filter)."""
    routed_experts: np.ndarray | None = None
    """The engine's experts per position of ``tokens`` (``[P, MoE layers, top_k]``, P <= len(tokens)), for routing
    replay (:mod:`learner.router_replay`); None: the learner routes it itself."""

    @property
    def num_trained(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


@dataclass
class StepBatch:
    """The samples of one global batch and the group-level counts."""

    samples: list[Sample]
    rewards: list[float]
    zero_advantage_groups: int
    failed_samples: int
    truncated_samples: int
    num_trajectories: int = 0
    """Every trajectory of the batch, failed ones included."""
    response_lengths: list[int] = field(default_factory=list)
    """Response length of every valid sample, as generated."""
    length_finished: int = 0
    """Valid samples with ``finish_reason == "length"``."""
    overlong_filtered: int = 0
    """Of those, the ones kept out of the loss (``overlong_filtering``)."""
    shaped_rewards: list[float] = field(default_factory=list)
    """The rewards the advantages were computed from (``grpo.reward_scaling`` / ``reward_shaping``), in the
    order of ``rewards``; equal to them when both are off."""
    reshaped: bool = False
    """Whether scaling or shaping was on (the metrics then report ``shaped_reward_*``)."""
    env_tokens: int = 0
    """Environment (loss mask 0) response tokens of ``samples``: in the sequences as context, never trained."""

    def reward_metrics(self) -> dict[str, float]:
        """``shaped_reward_{mean,min,max,std}`` when the rewards were scaled or shaped, else nothing."""
        return summary_stats(self.shaped_rewards, "shaped_reward") if self.reshaped else {}


def prompt_images(group: TrajectoryGroup, images: dict[str, ImageInputs] | None,
                  vision: VisionSpec | None) -> ImageInputs | None:
    """The images of ``group``'s prompt (``images`` by ``prompt_id``), checked against its image tokens when the
    policy has a vision tower (``vision``); ``ValueError`` naming the group otherwise."""
    mine = (images or {}).get(group.prompt_id)
    if vision is None:
        if mine is not None:
            raise ValueError(f"group {group.group_id}: prompt {group.prompt_id!r} has images, but the model has "
                             f"no vision tower (model_type without vision_config)")
        return None
    where = f"group {group.group_id} (prompt {group.prompt_id!r})"
    if mine is not None:
        mine.check(vision, where)
    try:
        image_runs(group.prompt_ids, int(group.prompt_ids.size), mine, vision)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return mine


def collect(groups: list[TrajectoryGroup], max_total_sequence_length: int, normalize_rewards: bool,
            cfg: TrainStepConfig, images: dict[str, ImageInputs] | None = None,
            vision: VisionSpec | None = None) -> StepBatch:
    """The valid samples of ``groups`` with their advantages, and the batch's counts; with a vision tower
    (``vision``) each sample carries its prompt's ``images`` (by ``prompt_id``, :func:`prompt_images`)."""
    samples, rewards, lengths, shaped_all = [], [], [], []
    zero_groups = failed = truncated = length_finished = filtered = env_tokens = 0
    limit = max_total_sequence_length
    position = 0
    for g in groups:
        base = position
        position += len(g.trajectories)
        valid_at = [i for i, t in enumerate(g.trajectories) if t.ok]
        failed += len(g.trajectories) - len(valid_at)
        if not valid_at:
            continue
        valid = [g.trajectories[i] for i in valid_at]
        group_rewards = [_reward(t) for t in valid]
        shaped = shaped_group_rewards(group_rewards, [int(t.response_ids.size) for t in valid],
                                      [t.finish_reason == "length" for t in valid], cfg.reward_scaling,
                                      cfg.reward_shaping)
        shaped_all.extend(float(v) for v in shaped)
        advantages, no_signal = group_advantages(shaped, normalize_rewards, cfg.use_leave_one_out_baseline)
        zero_groups += int(no_signal)
        prompt = np.asarray(g.prompt_ids, dtype=np.int64)
        if prompt.size < 1 or prompt.size >= limit:
            raise ValueError(f"group {g.group_id}: prompt has {prompt.size} tokens, must be in "
                             f"[1, max_total_sequence_length={limit})")
        pixels = prompt_images(g, images, vision)
        for i, t, reward, adv in zip(valid_at, valid, group_rewards, advantages, strict=True):
            rewards.append(reward)
            lengths.append(int(t.response_ids.size))
            overlong = t.finish_reason == "length"
            length_finished += int(overlong)
            if overlong and cfg.overlong_filtering:
                filtered += 1  # its reward is in the group's baseline above; no token in the loss
                continue
            if not t.response_ids.size == t.logprobs.size == t.loss_mask.size:
                raise ValueError(f"group {g.group_id}: trajectory {i} has {t.response_ids.size} response ids, "
                                 f"{t.logprobs.size} log-probs and {t.loss_mask.size} loss-mask entries")
            room = limit - prompt.size
            resp, lp_gen, mask = t.response_ids[:room], t.logprobs[:room], t.sampled[:room]
            truncated += int(resp.size < t.response_ids.size)
            if not mask.any():  # empty, or cut before its first sampled token: nothing to train
                continue
            env_tokens += int(mask.size - np.count_nonzero(mask))
            routed = t.routed_experts[:prompt.size + resp.size] if t.routed_experts is not None else None
            samples.append(Sample(np.concatenate([prompt, resp.astype(np.int64)]), int(prompt.size),
                                  np.asarray(lp_gen, dtype=np.float32), mask, float(adv), base + i, pixels,
                                  routed_experts=routed))
    return StepBatch(samples, rewards, zero_groups, failed, truncated, position, lengths, length_finished,
                     filtered, shaped_all, cfg.reward_scaling.enabled or cfg.reward_shaping.enabled, env_tokens)


def split(batch: StepBatch, size: int | None) -> list[list[Sample]]:
    """The samples of each optimizer step: trajectories ``[j·B, (j+1)·B)`` of the batch (groups in order,
    then samples in order, failed ones counted) form step j; ``B = train_global_batch_size``."""
    total = batch.num_trajectories
    if size is None or size >= total:
        return [batch.samples]
    if total % size:
        raise ValueError(f"train_global_batch_size ({size}) must divide the batch's {total} trajectories "
                         f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt)")
    minis: list[list[Sample]] = [[] for _ in range(total // size)]
    for smp in batch.samples:
        minis[smp.position // size].append(smp)
    return minis


def trained_positions(mb: MicroBatch, samples: list[Sample]) -> list[torch.Tensor]:
    """For each segment of ``mb`` (``samples`` indexed by the segment's sequence index), the positions in
    ``token_logprobs(mb)`` of its trained response tokens (int64, on the CPU); all of its response with an
    all-ones mask, equal then to :func:`learner.logprobs.response_slices`."""
    slices = response_slices(mb, [s.prompt_len for s in samples])
    return [torch.arange(sl.start, sl.stop)[torch.from_numpy(samples[seg.index].loss_mask)]
            for seg, sl in zip(mb.segments, slices, strict=True)]


def token_inputs(mb: MicroBatch, samples: list[Sample], lp_prev: torch.Tensor,
                 lp_ref: dict[int, torch.Tensor] | None, device: torch.device) -> TokenInputs:
    """The loss inputs of ``mb``'s trained tokens, in the order of :func:`trained_positions`: ``lp_prev`` and the
    reference's log-probs (by sequence index) at those tokens, the engine's log-probs, the advantages and, where a
    sequence is ``seq-mask-tis`` masked, the importance-weight factors."""
    idx = [seg.index for seg in mb.segments]
    lp_gen = torch.cat([torch.from_numpy(samples[i].lp_gen[samples[i].loss_mask]) for i in idx]).to(device)
    adv = torch.cat([torch.full((samples[i].num_trained,), samples[i].advantage) for i in idx]).to(device)
    scale = None
    if any(samples[i].is_weight_scale != 1.0 for i in idx):
        scale = torch.cat([torch.full((samples[i].num_trained,), samples[i].is_weight_scale) for i in idx]).to(device)
    return TokenInputs(lp_prev=lp_prev, lp_gen=lp_gen, advantages=adv,
                       lp_ref=torch.cat([lp_ref[i] for i in idx]) if lp_ref is not None else None,
                       is_weight_scale=scale)


def summary_stats(values: list[float], prefix: str) -> dict[str, float]:
    """``{prefix}_mean/min/max/std`` (population std) of ``values``; zeros when empty."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {f"{prefix}_{k}": 0.0 for k in ("mean", "min", "max", "std")}
    return {f"{prefix}_mean": float(a.mean()), f"{prefix}_min": float(a.min()), f"{prefix}_max": float(a.max()),
            f"{prefix}_std": float(a.std())}
