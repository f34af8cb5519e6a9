"""AdamW, gradient clipping and the learning-rate schedule through Megatron-Core.

The model is wrapped in Megatron's ``DistributedDataParallel`` (contiguous
gradient buffers, gradients summed over data-parallel ranks — the loss is
already divided by the global token count, so ``calculate_per_token_loss`` is
set on the model config and DDP does not average again). The optimizer is
``get_megatron_optimizer`` (AdamW with decoupled weight decay, global-norm
clipping at ``clip_grad``, torch's fused AdamW kernel; the ``DistributedOptimizer`` shards fp32 master
weights and Adam moments over data-parallel ranks when
``use_distributed_optimizer``), and the schedule is Megatron's
``OptimizerParamScheduler`` (linear warm-up from ``lr_warmup_init``, then constant / linear /
cosine decay to ``min_lr``).

Every Megatron optimizer call runs inside :func:`learner.cpu_compat.device_redirect`,
which is the CPU redirection on a CPU-only machine and nothing on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from learner.config import OptimizerConfig
from learner.cpu_compat import device_redirect

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig


def wrap_ddp(model: torch.nn.Module, config: TransformerConfig,
             use_distributed_optimizer: bool) -> DistributedDataParallel:
    """Megatron DDP around ``model`` (no overlap: one synchronous reduction per step)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer,
                                               check_for_nan_in_grad=False, bucket_size=None)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


@dataclass
class OptimizerStack:
    """The Megatron optimizer and its LR scheduler."""

    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler

    def step(self) -> tuple[bool, float]:
        """Apply one update; returns (applied, grad_norm before clipping)."""
        with device_redirect():
            # MegatronOptimizer.step is an unannotated abstract `pass`; the concrete ones return a 3-tuple
            applied, grad_norm, _ = self.optimizer.step()  # pyright: ignore[reportGeneralTypeIssues]
        if applied:
            self.scheduler.step(increment=1)
        return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")

    def zero_grad(self) -> None:
        with device_redirect():
            self.optimizer.zero_grad()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def inner_state(self) -> dict:
        """Exact per-rank optimizer state: the inner torch optimizer's state and its (master) parameters.

        The inner optimizer's parameters are the fp32 master weights (or the
        model's own parameters in plain fp32), so saving them plus its state
        restores every bit of the update that follows."""
        return {"optimizers": [
            {"torch_state": inner.state_dict(),
             "params": [p.detach().clone() for g in inner.param_groups for p in g["params"]]}
            for inner in torch_optimizers(self.optimizer)], "scheduler": self.scheduler.state_dict()}

    @torch.no_grad()
    def load_inner_state(self, state: dict) -> None:
        inners = torch_optimizers(self.optimizer)
        if len(inners) != len(state["optimizers"]):
            raise ValueError(f"checkpoint has {len(state['optimizers'])} optimizers, this learner {len(inners)}")
        for inner, saved in zip(inners, state["optimizers"], strict=True):
            params = [p for g in inner.param_groups for p in g["params"]]
            if len(params) != len(saved["params"]):
                raise ValueError(f"checkpoint optimizer has {len(saved['params'])} parameters, "
                                 f"this learner {len(params)}")
            for p, v in zip(params, saved["params"], strict=True):
                p.copy_(v)
            inner.load_state_dict(saved["torch_state"])
        self.scheduler.load_state_dict(state["scheduler"])


def torch_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer``: one per chained Megatron optimizer (dense and expert parameters
    each have theirs), or its only one."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def fuse_adam(optimizer: MegatronOptimizer) -> None:
    """Give each of ``optimizer``'s torch ``AdamW`` (Megatron's choice without Transformer Engine or Apex, whose
    fused Adam it would take) torch's fused kernel instead of its per-tensor ``foreach`` one: the same update in
    one pass over the weights, gradients and moments. Before the first step only (a fused step keeps its count on
    the parameters' device)."""
    for inner in torch_optimizers(optimizer):
        if type(inner) is torch.optim.AdamW:
            if inner.state:
                raise RuntimeError("fuse_adam: the optimizer has stepped already")
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False


def build_optimizer(ddp_model, cfg: OptimizerConfig, bf16: bool) -> OptimizerStack:
    """Megatron AdamW + schedule for ``ddp_model`` as configured by ``cfg``."""
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    mcfg = McoreOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad,
        decoupled_weight_decay=True, bf16=bf16, fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    with device_redirect():
        optimizer = get_megatron_optimizer(mcfg, [ddp_model])
    fuse_adam(optimizer)
    if cfg.lr_decay_style == "constant":
        # a constant rate ignores the decay span; Megatron only needs it past the warm-up
        decay_steps = cfg.lr_warmup_steps + 1
    elif cfg.lr_decay_steps is None:
        raise ValueError(f"lr_decay_steps: required for lr_decay_style={cfg.lr_decay_style!r} (a recipe sets it "
                         f"to grpo.max_num_steps when left out)")
    else:
        decay_steps = cfg.lr_decay_steps
    if cfg.lr_warmup_steps >= decay_steps:
        raise ValueError(f"lr_warmup_steps ({cfg.lr_warmup_steps}) must be < lr_decay_steps ({decay_steps})")
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr_warmup_init if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
    return OptimizerStack(optimizer, scheduler)
