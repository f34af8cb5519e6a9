"""Routing replay (R3): the policy's MoE routers use the experts the engine routed each token to.

The engine returns the experts it picked per position and MoE layer (``Trajectory.routed_experts``,
:mod:`protocol.routing`); a near tie in the router's logits can otherwise flip between the engine's kernels and
the learner's, and the learner then scores a token through experts the engine never used. With
``policy.megatron_cfg.moe_enable_routing_replay`` on, :func:`install` gives every router of the policy a
:class:`TokenReplay` through Megatron-Core's own hook (``TopKRouter.router_replay``, which
``topk_routing_with_score_function`` consults for its top-k); :func:`attach` lays each sample's routing into its
micro-batch's packed row (``MicroBatch.routing``, ``[T, MoE layers, top_k]``, -1 where there is none) and
:func:`set_targets` (called by ``forward_hidden`` before every forward of the policy) hands each router its
layer's rows. A replayed position takes the engine's experts and gathers the learner's own scores for them (the
gate weights stay differentiable, Megatron's ``REPLAY_FORWARD``); a position without engine routing (past the
engine's positions, padding, a trajectory that carries none) keeps the learner's own top-k. The reference policy
routes itself. With full activation recompute the backward re-runs the forward under the targets still set (the
micro-batch's backward follows its forward), so replay and pipeline stages with recompute are refused at config.
docs/learner.md, "Routing replay".
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from protocol.routing import moe_layers

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

    from learner.config import MegatronConfig
    from learner.packing import MicroBatch

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_REPLAYS, _SHAPE = "routing_replays", "routing_shape"
"""The attributes :func:`install` sets on the model: its :class:`TokenReplay` list, (MoE layers, top_k, experts)."""


class TokenReplay(RouterReplay):
    """One router's replay: ``target`` ``[tokens, top_k]`` int64 with -1 on rows the router chooses itself.
    Not in Megatron's global instance list (the reference policy and other models in the process keep their own
    routing)."""

    def __init__(self, ordinal: int):
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []
        self.ordinal = ordinal
        """The router's index among the model's MoE layers (the ``L`` axis of the routing)."""
        self.replayed: torch.Tensor | int = 0
        """Rows replayed since the last :meth:`clear_indices` (a device tensor once counting; the tests read it)."""
        self.flipped: torch.Tensor | int = 0
        """Replayed rows whose expert set differs from the learner's own choice."""

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: TopK | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if default_compute_topk is None:
            raise ValueError("TokenReplay needs Megatron's default top-k")
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.router_replay_action == RouterReplayAction.RECORD:  # what a test plays the engine with
            self.record_indices(own)
        target = self.target_topk_idx
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or target is None:
            return own_probs, own
        if target.shape != own.shape:
            raise ValueError(f"routing replay, MoE layer {self.ordinal}: the router sees {tuple(own.shape)} "
                             f"(tokens, top_k) but the routing has {tuple(target.shape)}")
        target = target.to(own.device)
        known = target[:, 0] >= 0
        idx = torch.where(known[:, None], target, own)
        same = (idx.sort(dim=1).values == own.sort(dim=1).values).all(dim=1)
        self.replayed = self.replayed + known.sum()  # device tensors: no sync in the forward
        self.flipped = self.flipped + (~same & known).sum()
        return scores.gather(1, idx), idx

    def clear_indices(self) -> None:
        super().clear_indices()
        self.replayed = self.flipped = 0


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The MoE routers of ``model`` (Megatron ``TopKRouter``), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def install(model: torch.nn.Module, model_path: str) -> list[TokenReplay]:
    """Give every router of ``model`` (the policy's ``GPTModel`` or hybrid model, this pipeline stage's layers) a
    :class:`TokenReplay`; returns them. Its layer's ordinal among the MoE layers of ``model_path``'s config.json
    comes from the router's global layer number (Megatron numbers layers from 1)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    layers = moe_layers(cfg)
    found = routers(model)
    if not layers:
        raise ValueError("routing replay: the policy has no MoE layer (a dense model); turn "
                         "policy.megatron_cfg.moe_enable_routing_replay off")
    out = []
    for i, router in enumerate(found):
        number = getattr(router, "layer_number", None)
        ordinal = layers.index(number - 1) if isinstance(number, int) and number - 1 in layers else i
        replay = TokenReplay(ordinal)
        router.router_replay = replay  # Megatron's hook, typed for its own RouterReplay
        out.append(replay)
    setattr(model, _REPLAYS, out)
    if found:  # a pipeline stage of Mamba and dense layers only has no router to replay
        config = found[0].config
        setattr(model, _SHAPE, (len(layers), config.moe_router_topk, config.num_moe_experts))
    return out


def set_up_routers(model: torch.nn.Module, megatron: MegatronConfig, model_path: str) -> None:
    """The policy's routers as ``megatron`` says: weights frozen (``freeze_moe_router``: out of the DDP buffers
    and the optimizer) and replaying the engine's experts (``moe_enable_routing_replay``, :func:`install`)."""
    if megatron.freeze_moe_router:
        for name, param in model.named_parameters():
            if ".mlp.router." in name:
                param.requires_grad_(False)
    if megatron.moe_enable_routing_replay:
        install(model, model_path)


def _installed_on(model: torch.nn.Module) -> object | None:
    """``model`` or the model inside its wrappers (DDP, ``Float16Module``) :func:`install` ran on; None if none."""
    inner: object = model
    while inner is not None and not hasattr(inner, _REPLAYS):
        inner = getattr(inner, "module", None)
    return inner


def replays_of(model: torch.nn.Module) -> list[TokenReplay]:
    """The replays :func:`install` put on ``model`` or the model inside its wrappers; [] when none (also on a
    pipeline stage without MoE layers)."""
    inner = _installed_on(model)
    return [] if inner is None else list(getattr(inner, _REPLAYS))


def set_targets(model: torch.nn.Module, routing: torch.Tensor | None) -> None:
    """Before a forward of ``model``: each installed router replays its layer of ``routing`` ``[T, L, K]`` (None:
    every router chooses itself). A no-op on a model without replays (the reference policy)."""
    for replay in replays_of(model):
        if routing is None:
            replay.target_topk_idx = None
            if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                replay.clear_router_replay_action()  # (a RECORD set by a test stays)
        else:
            replay.target_topk_idx = routing[:, replay.ordinal, :]
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def routing_row(mb: MicroBatch, routed: Sequence[np.ndarray | None], layers: int, top_k: int) -> torch.Tensor | None:
    """The ``[T, layers, top_k]`` int64 routing of ``mb``'s packed row from each sequence's ``routed`` (by sequence
    index; positions from the prompt's first token), -1 where there is none; None when no segment has any."""
    if not any(routed[seg.index] is not None for seg in mb.segments):
        return None
    row = torch.full((mb.num_tokens, layers, top_k), -1, dtype=torch.int64)
    for seg in mb.segments:
        r = routed[seg.index]
        if r is None:
            continue
        if r.shape[1:] != (layers, top_k):
            raise ValueError(f"sequence {seg.index}: routed experts of {r.shape[1]} MoE layers x top-{r.shape[2]}, "
                             f"but the policy has {layers} MoE layers x top-{top_k}")
        n = min(r.shape[0], seg.length)
        row[seg.start:seg.start + n] = torch.from_numpy(np.asarray(r[:n], dtype=np.int64))
    return row


def attach(model: torch.nn.Module, mbs: list[MicroBatch],
           routed: Sequence[np.ndarray | None]) -> list[MicroBatch]:
    """``mbs`` with their ``routing`` (:func:`routing_row`, from each sequence's ``routed``) when ``model`` has
    replays installed; as they are otherwise. Expert ids must lie below the model's experts."""
    shape = getattr(model, _SHAPE, None)
    if shape is None:
        return mbs
    layers, top_k, num_experts = shape
    out = []
    for mb in mbs:
        row = routing_row(mb, routed, layers, top_k)
        if row is not None and int(row.max()) >= num_experts:
            raise ValueError(f"routed experts: expert id {int(row.max())} but the policy has {num_experts} experts")
        out.append(replace(mb, routing=row.to(mb.tokens.device) if row is not None else None))
    return out


def step_metrics(model: torch.nn.Module, groups: Sequence[object], device: torch.device) -> dict[str, float]:
    """What :class:`TokenReplay` counted in the step's policy forwards, summed over ``groups`` (pipeline and data
    ranks), then cleared: ``router_replay_rows`` (replayed (token, MoE layer) rows) and ``router_replay_flip_rate``
    (their share whose engine experts differ from the learner's own choice: the flips replay caught). {} without
    replay; collective when replay is on."""
    inner = _installed_on(model)
    if inner is None:
        return {}
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for rep in getattr(inner, _REPLAYS):
        counts[0] += rep.replayed
        counts[1] += rep.flipped
        rep.replayed = rep.flipped = 0
    for group in groups:
        torch.distributed.all_reduce(counts, group=group)  # pyright: ignore[reportArgumentType]
    rows, flipped = counts.tolist()
    return {"router_replay_rows": rows, "router_replay_flip_rate": flipped / rows if rows else 0.0}
