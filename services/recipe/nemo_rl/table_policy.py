"""NeMo-RL's ``policy.*`` keys: what each means for Inflight's learner (always Megatron-Core) and its vLLM pool.

NeMo-RL trains a recipe with Megatron when ``policy.megatron_cfg.enabled``, else with DTensor. Megatron recipes:
the ``megatron_cfg`` keys Inflight has pass through, its scheduler is mapped (iterations are GRPO steps there,
optimizer steps here), and the DTensor keys (``dtensor_cfg``, ``optimizer``, ``scheduler``, ``max_grad_norm``) are
ignored as NeMo-RL ignores them. DTensor recipes: the other way round — the DTensor optimizer, schedule and sizes
become Megatron's keys, and ``megatron_cfg`` is ignored. A layout or kernel knob that only changes memory or speed
is ignored with that reason; a setting that changes what is trained is accepted only at its "off" value.
"""
from __future__ import annotations

from services.recipe.nemo_rl import policy_rules as d
from services.recipe.nemo_rl.rules import Derive, Ignore, NeutralOnly, Rename, Rule, Table, When

P, M, G, V = "policy", "policy.megatron_cfg", "policy.generation", "policy.generation.vllm_cfg"
OPT = f"{M}.optimizer"
NOT_READ_ON_DTENSOR = ("a Megatron setting, and NeMo-RL trains this recipe with DTensor (megatron_cfg.enabled "
                       "false): it does not read it")
NOT_READ_ON_MEGATRON = ("the DTensor backend's, and NeMo-RL trains this recipe with Megatron "
                        "(megatron_cfg.enabled): it does not read it; Megatron's keys hold the same settings")
MEMORY = "memory/speed only: same model and same loss"
KERNEL = "a kernel or fusion choice: speed only"
LAYOUT = ("a parallel layout Inflight's learner does not use: memory/speed only (the GPUs serve as data parallel "
          "instead; a sequence must fit on one GPU)")
LOGGING = "logging only"
VLM_DATA = ("NeMo-RL's vision-language data path (processor, datasets) is not translated; Inflight trains on images "
            "from its own data.image_key rows (docs/multimodal.md)")
NEMO_IO = "NeMo-RL's own process, port or transfer plumbing; Inflight has its own"
MICRO_BATCH = ("micro-batch size: memory/speed only (the loss is normalised over the whole step); Inflight packs "
               "policy.sequence_packing.train_mb_tokens tokens per micro-batch, or one sequence each when packing "
               "is off (it was an Inflight key once and never read)")


def megatron_key(rule: Rule | None = None) -> When:
    """``rule`` (``None``: the key passes as Inflight's) unless NeMo-RL trains the recipe with DTensor."""
    return When(d.dtensor, Ignore(NOT_READ_ON_DTENSOR), rule, "read when NeMo-RL trains with Megatron")


def dtensor_key(rule: Rule) -> When:
    """``rule`` when NeMo-RL trains the recipe with DTensor; ignored otherwise."""
    return When(d.dtensor, rule, Ignore(NOT_READ_ON_MEGATRON), "read when NeMo-RL trains with DTensor")


def off(neutral: object, why: str) -> NeutralOnly:
    return NeutralOnly(neutral if isinstance(neutral, tuple) else (neutral,), why)


def each(rule: Rule | None, *paths: str) -> dict[str, Rule | None]:
    return dict.fromkeys(paths, rule)


BACKEND = ("which backend NeMo-RL trains with; Inflight's learner is always Megatron-Core (a DTensor recipe's "
           "settings are mapped onto it)")

MEGATRON: dict[str, Rule | None] = {
    # Inflight keys of the same name and meaning
    **each(None, "tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size",
           "activation_checkpointing", "optimizer.lr", "optimizer.min_lr", "optimizer.weight_decay",
           "optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.adam_eps", "optimizer.clip_grad",
           "optimizer.use_distributed_optimizer", "defer_fp32_logits", "moe_grouped_gemm", "bias_activation_fusion"),
    "scheduler.lr_warmup_iters": Derive(d.in_optimizer_steps(f"{OPT}.lr_warmup_steps"),
                                        "GRPO steps x optimizer steps per GRPO step -> optimizer.lr_warmup_steps"),
    "scheduler.lr_decay_iters": Derive(d.in_optimizer_steps(f"{OPT}.lr_decay_steps"),
                                       "GRPO steps x optimizer steps per GRPO step -> optimizer.lr_decay_steps"),
    "scheduler.lr_decay_style": Derive(d.one_of(f"{OPT}.lr_decay_style", ("constant", "linear", "cosine"),
                                                "Inflight's schedules"), "-> optimizer.lr_decay_style"),
    "scheduler.lr_warmup_init": Rename(f"{OPT}.lr_warmup_init"),
    "scheduler.end_weight_decay": Rename(f"{OPT}.weight_decay"),
    "scheduler.start_weight_decay": Derive(d.same_weight_decay, "equal to end_weight_decay (constant weight decay)"),
    "scheduler.weight_decay_incr_style": off("constant", "Inflight keeps weight decay constant"),
    "optimizer.optimizer": off("adam", "Inflight's optimizer is Megatron's Adam with decoupled weight decay"),
    "optimizer.bf16": Derive(d.bf16_matches_precision, "follows policy.precision"),
    "optimizer.fp16": off(False, "fp16 training is not supported"),
    "optimizer.params_dtype": off("float32", "Inflight keeps fp32 master weights"),
    "optimizer.sgd_momentum": Ignore("an SGD setting; the optimizer is Adam"),
    **each(Ignore(MEMORY), "optimizer.use_precision_aware_optimizer", "optimizer.optimizer_cpu_offload",
           "optimizer.optimizer_offload_fraction", "optimizer.overlap_cpu_optimizer_d2h_h2d",
           "empty_unused_memory_level",
           "fine_grained_activation_offloading", "offload_modules", "use_fused_linear_logprobs",
           "fused_linear_logprobs_chunk_size", "recompute_granularity", "recompute_modules",
           "distributed_data_parallel_config.*"),
    **each(Ignore(LAYOUT), "context_parallel_size", "sequence_parallel", "expert_tensor_parallel_size",
           "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_dtype"),
    **each(Ignore(KERNEL), "apply_rope_fusion", "gradient_accumulation_fusion",
           "use_fused_weighted_squared_relu", "moe_permute_fusion", "moe_enable_deepep", "moe_token_dispatcher_type",
           "moe_shared_expert_overlap", "moe_flex_dispatcher_backend", "moe_hybridep_num_sms",
           "cuda_graph_impl", "cuda_graph_modules", "cuda_graph_warmup_steps", "use_gloo_process_groups",
           "moe_router_dtype"),
    "moe_per_layer_logging": Ignore(LOGGING),
    "force_reconvert_from_hf": Ignore("NeMo-RL's cache of the converted checkpoint; Inflight converts at start"),
    "checkpoint.*": Ignore("Megatron checkpoint I/O options; Inflight's checkpoints are checkpointing.*"),
    "env_vars": Ignore("environment variables of NeMo-RL's Megatron workers: set them where Inflight's learner starts"),
    "env_vars.*": Ignore("environment variables of NeMo-RL's Megatron workers: set them where Inflight's learner "
                         "starts"),
    "moe_router_load_balancing_type": off("none", "Inflight adds no load-balancing loss"),
    "moe_router_bias_update_rate": off((0.0, 0), "Inflight does not update router biases"),
    "mtp_num_layers": off(0, "multi-token prediction is not supported"),
    **each(Ignore("multi-token prediction settings, and it is off (mtp_num_layers 0)"), "mtp_loss_scaling_factor",
           "mtp_use_repeated_layer", "mtp_detach_heads"),
    "peft.enabled": off(False, "LoRA is not supported"),
    "peft.*": Ignore("LoRA settings, and LoRA is off (peft.enabled false)"),
    "fp8_cfg.enabled": off(False, "FP8 training is not supported"),
    "fp8_cfg.*": Ignore("FP8 settings, and FP8 is off (fp8_cfg.enabled false)"),
    "model_overrides": off(({},), "Inflight builds the model from its config.json only"),
    "model_overrides.*": off((), "Inflight builds the model from its config.json only"),
}

DTENSOR: dict[str, Rule | None] = {
    "tensor_parallel_size": Rename(f"{M}.tensor_model_parallel_size"),
    "expert_parallel_size": Rename(f"{M}.expert_model_parallel_size"),
    "activation_checkpointing": Rename(f"{M}.activation_checkpointing"),
    **each(Ignore(LAYOUT), "context_parallel_size", "sequence_parallel", "custom_parallel_plan", "dp_replicate_size"),
    **each(Ignore(MEMORY), "cpu_offload", "defer_fsdp_grad_sync", "clear_cache_every_n_steps", "moe_parallelizer.*"),
    "_v2": Ignore("which DTensor worker NeMo-RL uses"),
    "env_vars": Ignore("environment variables of NeMo-RL's DTensor workers"),
    "env_vars.*": Ignore("environment variables of NeMo-RL's DTensor workers"),
    "lora_cfg.enabled": off(False, "LoRA is not supported"),
    "lora_cfg.*": Ignore("LoRA settings, and LoRA is off (lora_cfg.enabled false)"),
    "automodel_kwargs": Ignore("Automodel options (none set)"),
    "automodel_kwargs.*": Ignore(KERNEL + " (Automodel's layer implementations)"),
    "automodel_kwargs.freeze_config.*": off(False, "Inflight trains every weight"),
    "*": off((), "a DTensor setting Inflight does not know"),
}

POLICY_OPTIMIZER: dict[str, Rule | None] = {
    "optimizer": off((), "NeMo-RL's DTensor backend needs policy.optimizer"),
    "optimizer.name": Derive(d.adamw, "AdamW, as Megatron's Adam with decoupled weight decay"),
    "optimizer.kwargs.lr": Rename(f"{OPT}.lr"),
    "optimizer.kwargs.weight_decay": Rename(f"{OPT}.weight_decay"),
    "optimizer.kwargs.eps": Rename(f"{OPT}.adam_eps"),
    "optimizer.kwargs.betas": Derive(d.betas, "-> optimizer.adam_beta1, adam_beta2"),
    **each(Ignore(KERNEL), "optimizer.kwargs.foreach", "optimizer.kwargs.fused"),
    "optimizer.kwargs.*": off((), "an AdamW argument Inflight does not set"),
    "scheduler": Derive(d.torch_schedule, "LinearLR warm-up then ConstantLR -> Megatron's linear warm-up"),
    "scheduler.*": off((), "only the list form of policy.scheduler is translated"),
    "max_grad_norm": Derive(d.grad_clip, "-> policy.megatron_cfg.optimizer.clip_grad"),
}

GENERATION: dict[str, Rule | None] = {
    **each(None, f"{G}.temperature", f"{G}.top_p", f"{G}.top_k"),  # the learner scores under them, as NeMo-RL's
    f"{G}.val_temperature": Rename("grpo.val_temperature"),
    f"{G}.val_top_p": Derive(d.same_as(f"{G}.top_p", "Inflight validates with the training top_p"), "= top_p"),
    f"{G}.val_top_k": Derive(d.same_as(f"{G}.top_k", "Inflight validates with the training top_k"), "= top_k"),
    f"{G}.stop_strings": Rename(f"{G}.stop_strings", lambda v: [] if v is None else v),
    f"{G}.bad_words": Rename(f"{G}.bad_words", lambda v: [] if v is None else v),
    f"{G}.vllm_kwargs": Rename(f"{G}.vllm_kwargs", lambda v: v or {}),
    f"{G}.stop_token_ids": Derive(d.stop_token_ids, "no effect: end-of-sequence ids of the model, or outside its "
                                                    "vocabulary"),
    f"{G}.colocated.enabled": When(d.nemo_rl, Derive(d.engines, "-> rollout_pool.num_engines"), None,
                                   "a NeMo-RL recipe sizes its pool from its GPUs"),
    f"{G}.colocated.resources.*": Ignore("read with colocated.enabled to size rollout_pool.num_engines"),
    **each(Ignore(NEMO_IO), f"{G}.port_range_low", f"{G}.port_range_high", f"{G}.refit_transport",
           f"{G}.real_quant_export_cpu_offload", f"{G}.refit_cfg.*", f"{V}.http_refit_api_key_env_var",
           f"{V}.http_refit_server_port", f"{V}.zmq_refit_server_port"),
    f"{G}.mcore_generation_config.*": Ignore("the Megatron generation backend's; generation.backend is vllm"),
    f"{V}.expert_parallel_size": When(d.nemo_rl, Derive(d.engine_expert_parallel, "1 or tensor_parallel_size"), None,
                                      "checked in a NeMo-RL recipe"),
    f"{V}.async_engine": Ignore("Inflight's engines are always vLLM's async engine"),
    f"{V}.enable_expert_parallel": Derive(d.engine_expert_parallel_switch, "older NeMo-RL recipes' switch: false "
                                                                           "is an engine without expert parallelism"),
    f"{V}.kv_cache_dtype": off("auto", "a quantised KV cache changes the log-probs"),
    f"{V}.logprobs_mode": Ignore("Inflight sets it from temperature / top_k / top_p: processed log-probs when they "
                                 "change the sampled distribution, which the learner then scores under"),
    **each(Ignore(LOGGING), f"{V}.use_tqdm", f"{V}.enable_vllm_metrics_logger", f"{V}.vllm_metrics_logger_interval"),
    f"{V}.use_deep_gemm": Ignore(KERNEL),
    **each(Ignore("FP8 generation only, which Inflight does not run"), f"{V}.num_first_layers_in_bf16",
           f"{V}.num_last_layers_in_bf16"),
    f"{V}.reset_encoder_cache_after_weight_update": Ignore("multimodal encoders only"),
    f"{V}.skip_tokenizer_init": Ignore("Inflight's engines take token ids and return token ids either way"),
    f"{V}.cap_max_tokens_to_context": off(True, "Inflight always caps an answer at max_total_sequence_length minus "
                                                "its prompt (data.max_input_seq_length), as NeMo-RL does when true"),
}

TOP: dict[str, Rule | None] = {
    "precision": Derive(d.one_of(f"{M}.precision", ("bfloat16", "float32"), "the learner's precisions"),
                        "-> policy.megatron_cfg.precision"),
    "train_micro_batch_size": Ignore(MICRO_BATCH),
    "logprob_batch_size": Ignore(MEMORY),
    "logprob_chunk_size": Rename(f"{M}.logprob_chunk_size"),
    "offload_optimizer_for_logprob": Ignore(MEMORY),
    "generation_batch_size": Ignore("batch size of NeMo-RL's non-vLLM generation backends"),
    "make_sequence_length_divisible_by": Ignore("padding for tensor/sequence-parallel kernels: " + MEMORY),
    "refit_buffer_size_gb": Ignore(NEMO_IO),
    "tokenizer.chat_template": off("default", "Inflight applies the model's own chat template"),
    "tokenizer.chat_template_kwargs": Rename(f"{P}.tokenizer.chat_template_kwargs", lambda v: v or {}),
    "tokenizer.use_fastokens": Ignore("a faster tokenizer implementation: speed only"),
    "tokenizer.use_processor": off(False, VLM_DATA),
    **each(off((), "audio/video inputs are not supported"), "tokenizer.audio.*", "tokenizer.video.*"),
    "is_vlm": Ignore("NeMo-RL's switch to its vision-language model and data path; Inflight reads images whenever "
                     "data.image_key is set (vlm_hf_data_processor sets it from the dataset) and takes the vision "
                     "tower from the model's config"),
    "dynamic_batching.*": Ignore("length-sorted micro-batches: " + MEMORY),
    **each(Ignore(MEMORY), "sequence_packing.logprob_mb_tokens", "sequence_packing.algorithm",
           "sequence_packing.microbatch_order", "sequence_packing.sequence_length_round"),
    "draft.enabled": off(False, "training a speculative-decoding draft model is not supported"),
    "draft.*": Ignore("draft-model settings, and it is off (draft.enabled false)"),
    "router_replay.enabled": Derive(d.router_replay, f"{M}.moe_enable_routing_replay and "
                                    f"{V}.enable_return_routed_experts (routing replay)"),
    "reward_model_cfg.enabled": off(False, "reward models are not supported"),
    "reward_model_cfg.*": Ignore("reward-model settings, and it is off (reward_model_cfg.enabled false)"),
    "pretrained_checkpoint": off((None,), "Inflight loads weights from policy.model_name"),
    "pretrained_checkpoint.*": off((), "Inflight loads weights from policy.model_name (Hugging Face format)"),
    **each(off((None,), "quantisation-aware training is not supported"), "quant_cfg", "quant_calib_data",
           "quant_calib_size", "quant_batch_size", "quant_sequence_length"),
    "disable_modelopt_layer_spec": Ignore("quantisation-aware training option, and it is off"),
}


POLICY_RULES: Table = {
    f"{M}.enabled": Derive(d.check_backend, BACKEND),
    **{f"{M}.{k}": megatron_key(r) for k, r in MEGATRON.items()},
    f"{P}.dtensor_cfg.enabled": Derive(d.check_backend, BACKEND),
    **{f"{P}.dtensor_cfg.{k}": dtensor_key(r) for k, r in DTENSOR.items() if r is not None},
    **{f"{P}.{k}": dtensor_key(r) for k, r in POLICY_OPTIMIZER.items() if r is not None},
    **{k: r for k, r in GENERATION.items() if r is not None},
    **{f"{P}.{k}": r for k, r in TOP.items() if r is not None},
}
"""Every ``policy.*`` rule of NeMo-RL's GRPO recipes."""
