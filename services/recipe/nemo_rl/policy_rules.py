"""What :mod:`.table_policy`'s rules compute: which backend a NeMo-RL recipe trains with, its optimizer and schedule
in Megatron's terms, its generation resources as engines, and checks against the model's own ``config.json``.

Semantics are NeMo-RL's (commit 7ea279a): ``nemo_rl/models/policy/lm_policy.py`` picks the backend,
``nemo_rl/models/automodel/setup.py`` builds the DTensor optimizer and scheduler,
``nemo_rl/models/policy/workers/megatron_policy_worker.py`` steps Megatron's scheduler once per GRPO step,
``nemo_rl/algorithms/grpo.py`` (``setup``) sizes non-colocated generation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.recipe.nemo_rl.rules import Skip, Source, TranslationError

OPT = "policy.megatron_cfg.optimizer"


def nemo_rl(src: Source) -> bool:
    """A NeMo-RL recipe: its policy names a training backend (``dtensor_cfg`` is required there, and
    ``megatron_cfg.enabled`` says which one runs). Inflight recipes have neither."""
    return src.get("policy.dtensor_cfg") is not None or src.get("policy.megatron_cfg.enabled") is not None


def dtensor(src: Source) -> bool:
    """NeMo-RL trains this recipe with DTensor (``lm_policy.py``: ``dtensor_cfg.enabled`` and not
    ``megatron_cfg.enabled``)."""
    return src.get("policy.dtensor_cfg.enabled") is True and src.get("policy.megatron_cfg.enabled") is not True


def check_backend(value: Any, src: Source) -> list:
    """``policy.{dtensor,megatron}_cfg.enabled``: exactly one backend, as NeMo-RL requires."""
    m, d = src.get("policy.megatron_cfg.enabled") is True, src.get("policy.dtensor_cfg.enabled") is True
    if m and d:
        raise TranslationError("policy.megatron_cfg.enabled", "true together with policy.dtensor_cfg.enabled: "
                                                              "NeMo-RL trains with one backend, enable one of them")
    if not m and not d:
        raise TranslationError("policy.megatron_cfg.enabled", "false and policy.dtensor_cfg.enabled is false: "
                                                              "NeMo-RL needs one backend, enable one of them")
    return []


def optimizer_steps_per_grpo_step(src: Source) -> int:
    """NeMo-RL steps its LR schedule once per GRPO step (``train()`` call); Inflight once per optimizer step,
    of which a GRPO step has rollout batch / ``train_global_batch_size``."""
    batch = int(src.get("grpo.num_prompts_per_step", 1)) * int(src.get("grpo.num_generations_per_prompt", 1))
    size = src.get("policy.train_global_batch_size")
    return max(1, batch // int(size)) if size else 1


def in_optimizer_steps(target: str):
    """``lr_warmup_iters`` / ``lr_decay_iters`` (GRPO steps) -> ``target`` in optimizer steps; None stays None."""
    def fn(value: Any, src: Source) -> list:
        return [(target, None if value is None else int(value) * optimizer_steps_per_grpo_step(src))]
    return fn


def one_of(target: str, allowed: tuple[str, ...], why: str):
    """The value as ``target`` if it is one of ``allowed``; otherwise an error naming the NeMo-RL key."""
    def fn(value: Any, src: Source) -> list:
        if value not in allowed:
            raise TranslationError("", f"{value!r} is not supported ({why}); expected one of {allowed}")
        return [(target, value)]
    return fn


def same_weight_decay(value: Any, src: Source) -> list:
    """Megatron asserts ``start_weight_decay == end_weight_decay`` for a constant schedule; Inflight's decay is
    ``end_weight_decay`` throughout."""
    end = src.get("policy.megatron_cfg.scheduler.end_weight_decay")
    if end is not None and value != end:
        raise TranslationError("", f"{value!r} differs from end_weight_decay ({end!r}): Inflight keeps weight "
                                   f"decay constant (weight_decay_incr_style 'constant')")
    return []


def bf16_matches_precision(value: Any, src: Source) -> list:
    """Megatron's ``optimizer.bf16`` must agree with ``policy.precision`` (Inflight derives it from precision)."""
    bf16 = src.get("policy.precision") == "bfloat16"
    if bool(value) != bf16:
        raise TranslationError("", f"{value!r} with policy.precision {src.get('policy.precision')!r}: Inflight's "
                                   f"optimizer runs in bf16 exactly when policy.precision is 'bfloat16'")
    return []


def grad_clip(value: Any, src: Source) -> list:
    """DTensor's ``policy.max_grad_norm`` -> Megatron's ``clip_grad`` (null: no clipping, which Inflight lacks)."""
    if value is None or value <= 0:
        raise TranslationError("", f"{value!r}: Inflight always clips the gradient norm; give a positive value")
    return [(f"{OPT}.clip_grad", float(value))]


def adamw(value: Any, src: Source) -> list:
    """``policy.optimizer.name``: only ``torch.optim.AdamW`` (decoupled weight decay, as Megatron's Adam);
    without ``kwargs.lr`` torch's default 1e-3 applies, so it is set."""
    if value != "torch.optim.AdamW":
        raise TranslationError("", f"{value!r} is not supported: Inflight's learner runs Megatron's AdamW; "
                                   f"expected 'torch.optim.AdamW'")
    return [] if src.get("policy.optimizer.kwargs.lr") is not None else [(f"{OPT}.lr", 1e-3)]


def betas(value: Any, src: Source) -> list:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise TranslationError("", f"{value!r}: expected [beta1, beta2]")
    return [(f"{OPT}.adam_beta1", float(value[0])), (f"{OPT}.adam_beta2", float(value[1]))]


LINEAR, CONSTANT = "torch.optim.lr_scheduler.LinearLR", "torch.optim.lr_scheduler.ConstantLR"


def torch_schedule(value: Any, src: Source) -> list:
    """DTensor's ``policy.scheduler`` -> Megatron's warm-up. Expressible: nothing (constant rate), a
    ``ConstantLR(factor=1)``, or ``[LinearLR(start_factor=f, end_factor=1, total_iters=W), ConstantLR(factor=1),
    {milestones: [W]}]`` (NeMo-RL's recipes): rate ``f x lr`` rising linearly to ``lr`` over W GRPO steps, then
    constant — Megatron's linear warm-up from ``lr_warmup_init = f x lr``."""
    if value is None:
        return [(f"{OPT}.lr_warmup_steps", 0), (f"{OPT}.lr_decay_style", "constant")]
    expected = ("expected null, [ConstantLR(factor=1.0)] or [LinearLR(start_factor, end_factor=1.0, total_iters=W), "
                "ConstantLR(factor=1.0), {milestones: [W]}]")
    if not isinstance(value, list):
        raise TranslationError("", f"{value!r} is not supported; {expected}")
    steps = [s for s in value if isinstance(s, dict) and "name" in s]
    milestones = [m for s in value if isinstance(s, dict) and "milestones" in s for m in s["milestones"]]
    names = [s["name"] for s in steps]
    kw = [s.get("kwargs") or {} for s in steps]
    if names == [CONSTANT] and kw[0].get("factor", 1 / 3) == 1.0:
        return [(f"{OPT}.lr_warmup_steps", 0), (f"{OPT}.lr_decay_style", "constant")]
    if names != [LINEAR, CONSTANT] or kw[0].get("end_factor", 1.0) != 1.0 or kw[1].get("factor", 1 / 3) != 1.0 \
            or milestones != [kw[0].get("total_iters", 5)]:
        raise TranslationError("", f"{value!r} is not supported; {expected}")
    lr = src.get("policy.optimizer.kwargs.lr", 1e-3)
    warm = int(kw[0].get("total_iters", 5)) * optimizer_steps_per_grpo_step(src)
    return [(f"{OPT}.lr_warmup_steps", warm), (f"{OPT}.lr_warmup_init", float(kw[0].get("start_factor", 1 / 3)) * lr),
            (f"{OPT}.lr_decay_style", "constant")]


def engines(value: Any, src: Source) -> list:
    """``policy.generation.colocated.enabled`` and ``rollout_pool.num_engines``: NeMo-RL runs one vLLM engine per
    ``vllm_cfg.tensor_parallel_size x pipeline_parallel_size`` GPUs of what generation gets: every cluster GPU when
    colocated, else ``colocated.resources`` (``num_nodes`` (1 on a one-node cluster) x ``gpus_per_node``)."""
    g = "policy.generation"
    k = int(src.get(f"{g}.vllm_cfg.tensor_parallel_size", 1)) * int(src.get(f"{g}.vllm_cfg.pipeline_parallel_size", 1))
    nodes, per_node = int(src.get("cluster.num_nodes", 1)), int(src.get("cluster.gpus_per_node", 0))
    if value:
        gpus = nodes * per_node
    else:
        r_nodes = src.get(f"{g}.colocated.resources.num_nodes")
        r_gpus = src.get(f"{g}.colocated.resources.gpus_per_node")
        if not r_gpus or r_gpus <= 0:
            raise TranslationError(f"{g}.colocated.resources.gpus_per_node",
                                   f"{r_gpus!r}: non-colocated generation needs the GPUs per node it gets (> 0)")
        if nodes == 1 and r_nodes not in (None, 1):
            raise TranslationError(f"{g}.colocated.resources.num_nodes", f"{r_nodes!r}: on a one-node cluster "
                                                                         f"generation gets that node (1 or null)")
        if nodes > 1 and (not r_nodes or r_gpus != per_node):
            raise TranslationError(f"{g}.colocated.resources", f"num_nodes {r_nodes!r}, gpus_per_node {r_gpus!r}: on "
                                   f"several nodes generation gets whole nodes (num_nodes > 0, gpus_per_node = "
                                   f"cluster.gpus_per_node {per_node})")
        gpus = (r_nodes or 1) * r_gpus
    out: list = [(f"{g}.colocated.enabled", bool(value))]
    if not gpus:
        return out
    if gpus % k:
        raise TranslationError(f"{g}.vllm_cfg.tensor_parallel_size", f"engines of {k} GPUs do not divide the "
                                                                      f"{gpus} GPUs generation gets")
    return out + [("rollout_pool.num_engines", gpus // k)]


DEFERRED = ("depends on the model: checked against its config.json once policy.model_name is a local model "
            "directory (a run needs one)")


def model_config(src: Source, key: str) -> dict | None:
    """``config.json`` of ``policy.model_name`` merged over its ``generation_config.json``, for rules whose meaning
    depends on the model; None when the name is no local directory (the check waits for one: a run needs it)."""
    from services.models.source import parse_tiny

    name = str(src.get("policy.model_name", ""))
    try:
        folder = parse_tiny(name).cache_dir if name.startswith("tiny://") else Path(name).expanduser()
    except ValueError as err:
        raise TranslationError("policy.model_name", str(err)) from None
    if not (folder / "config.json").is_file():
        if name.startswith("tiny://"):
            raise TranslationError(key, f"depends on the model, and {name} is not built yet: build it with "
                                        f"inflight make-tiny-model and point policy.model_name at the directory")
        return None
    gen = folder / "generation_config.json"
    out = json.loads(gen.read_text()) if gen.is_file() else {}
    return {**out, **json.loads((folder / "config.json").read_text()), "_generation_eos": out.get("eos_token_id")}


def _eos_ids(cfg: dict) -> set[int]:
    ids: set[int] = set()
    for v in (cfg.get("eos_token_id"), cfg.get("_generation_eos")):
        ids |= set(v) if isinstance(v, list) else {v} if isinstance(v, int) else set()
    return ids


def stop_token_ids(value: Any, src: Source) -> list | Skip:
    """Inflight stops at the model's end-of-sequence ids (and ``stop_strings``); an extra stop id is accepted only
    when it changes nothing: it is one of those ids, or outside the vocabulary (it can never be sampled)."""
    if not value:
        return []
    cfg = model_config(src, "policy.generation.stop_token_ids")
    if cfg is None:
        return Skip(DEFERRED)
    eos, vocab = _eos_ids(cfg), int(cfg.get("vocab_size", 0))
    extra = [i for i in value if i not in eos and 0 <= i < vocab]
    if extra:
        raise TranslationError("", f"{extra} would end answers early: they are in the vocabulary of "
                                   f"{src.get('policy.model_name')!r} but not its end-of-sequence ids {sorted(eos)}; "
                                   f"Inflight has no stop_token_ids (use policy.generation.stop_strings)")
    return []


def engine_expert_parallel(value: Any, src: Source) -> list:
    """``vllm_cfg.expert_parallel_size``: NeMo-RL's vLLM EP is DP x TP over several engines' GPUs; an Inflight
    engine shards its experts over its own ``tensor_parallel_size`` GPUs, so only 1 or that size means the same."""
    tp = src.get("policy.generation.vllm_cfg.tensor_parallel_size", 1)
    if value not in (1, tp):
        raise TranslationError("", f"{value!r}: an Inflight engine shards experts over its own tensor_parallel_size "
                                   f"({tp}) GPUs; NeMo-RL's expert_parallel_size > tensor_parallel_size spans "
                                   f"several engines, which is not supported; expected 1 or {tp}")
    return [("policy.generation.vllm_cfg.expert_parallel_size", value)]


def engine_expert_parallel_switch(value: Any, src: Source) -> list:
    """Older NeMo-RL recipes' ``vllm_cfg.enable_expert_parallel``: true shards an engine's experts over its
    ``tensor_parallel_size`` GPUs (vLLM's ``enable_expert_parallel``), false does not."""
    if not isinstance(value, bool):
        raise TranslationError("", f"expected true or false, got {value!r}")
    tp = src.get("policy.generation.vllm_cfg.tensor_parallel_size", 1)
    return [("policy.generation.vllm_cfg.expert_parallel_size", tp if value else 1)]


def same_as(other: str, why: str):
    """The key must equal ``other`` (e.g. validation sampling, which Inflight shares with training)."""
    def fn(value: Any, src: Source) -> list:
        if value != src.get(other):
            raise TranslationError("", f"{value!r} differs from {other} ({src.get(other)!r}): {why}")
        return []
    return fn



def router_replay(value: Any, src: Source) -> list:
    """``router_replay.enabled`` -> routing replay on both sides: the engines return the experts they routed each
    token to, the learner's routers use them (docs/learner.md, "Routing replay")."""
    if not isinstance(value, bool):
        raise TranslationError("", f"expected true or false, got {value!r}")
    return [("policy.megatron_cfg.moe_enable_routing_replay", value),
            ("policy.generation.vllm_cfg.enable_return_routed_experts", value)]
