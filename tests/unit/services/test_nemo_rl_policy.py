"""NeMo-RL ``policy.*`` keys on NeMo-RL's own recipes: backends, optimizer and schedule, engines, model checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.recipe.config import RecipeError, load_recipe_with_report

NEMO = Path(__file__).resolve().parents[2] / "data" / "nemo_rl"
DTENSOR = NEMO / "grpo_math_1B.yaml"
MEGATRON = NEMO / "grpo_math_1B_megatron.yaml"


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    """A model directory with just the ``config.json`` the policy rules read (no weights: nothing is built)."""
    out = tmp_path_factory.mktemp("dense")
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 448, "eos_token_id": 2,
                                                 "max_position_embeddings": 16384}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return str(out)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("moe")
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4, "vocab_size": 448}))
    return str(out)


def load(path: Path, model: str, *overrides: str):
    return load_recipe_with_report(path, [f"policy.model_name={model}", *overrides])


def why(report, key: str) -> str:
    return next(i.why for i in report.ignored if i.source == key)


def test_a_dtensor_recipe_trains_its_dtensor_optimizer_and_schedule_on_megatron(dense):
    r, report = load(DTENSOR, dense, "policy.optimizer.kwargs.betas=[0.8, 0.95]")
    o = r.policy.megatron_cfg.optimizer
    assert (o.lr, o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps, o.clip_grad) == (5e-6, 0.01, 0.8, 0.95,
                                                                                             1e-8, 1.0)
    # LinearLR(start_factor 0.1, 50 iters) -> ConstantLR: warm-up from 0.1 x lr over 50 GRPO steps (1 optimizer step
    # each: 32 x 16 samples = train_global_batch_size), then constant
    assert (o.lr_warmup_steps, o.lr_warmup_init, o.lr_decay_style) == (50, pytest.approx(5e-7), "constant")
    assert "trains this recipe with DTensor" in why(report, "policy.megatron_cfg.optimizer.lr")
    assert "trains this recipe with DTensor" in why(report, "policy.megatron_cfg.scheduler.lr_warmup_iters")


def test_a_megatron_recipe_keeps_megatron_keys_and_counts_its_schedule_in_grpo_steps(dense):
    r, report = load(MEGATRON, dense, "grpo.num_generations_per_prompt=64")  # 32 x 64 = 4 x 512: 4 optimizer steps
    o = r.policy.megatron_cfg.optimizer
    assert (o.lr, o.min_lr, o.lr_warmup_steps, o.lr_decay_steps, o.lr_warmup_init) == (5e-6, 5e-7, 52, 4000, 5e-7)
    assert "policy.megatron_cfg.optimizer.lr" in report.kept
    assert "trains this recipe with Megatron" in why(report, "policy.max_grad_norm")
    assert "trains this recipe with Megatron" in why(report, "policy.optimizer")


def test_megatron_clip_grad_follows_its_own_key_not_max_grad_norm(dense):
    r, _ = load(MEGATRON, dense, "policy.megatron_cfg.optimizer.clip_grad=0.5")
    assert r.policy.megatron_cfg.optimizer.clip_grad == 0.5


@pytest.mark.parametrize("recipe, overrides, key, words", [
    (MEGATRON, ["policy.dtensor_cfg.enabled=true"], "policy.megatron_cfg.enabled", "enable one of them"),
    (DTENSOR, ["policy.dtensor_cfg.enabled=false"], "policy.megatron_cfg.enabled", "NeMo-RL needs one backend"),
    (DTENSOR, ["policy.optimizer.name=torch.optim.SGD"], "policy.optimizer.name", "expected 'torch.optim.AdamW'"),
    (DTENSOR, ["policy.optimizer.kwargs.amsgrad=true"], "policy.optimizer.kwargs.amsgrad", "not supported"),
    (DTENSOR, ["policy.scheduler=[{name: torch.optim.lr_scheduler.CosineAnnealingLR, kwargs: {T_max: 9}}]"],
     "policy.scheduler", "is not supported; expected"),
    (DTENSOR, ["policy.max_grad_norm=null"], "policy.max_grad_norm", "always clips"),
    (DTENSOR, ["policy.dtensor_cfg.lora_cfg.enabled=true"], "policy.dtensor_cfg.lora_cfg.enabled", "LoRA"),
    (MEGATRON, ["policy.megatron_cfg.peft.enabled=true"], "policy.megatron_cfg.peft.enabled", "LoRA"),
    (MEGATRON, ["policy.megatron_cfg.scheduler.lr_decay_style=WSD"], "policy.megatron_cfg.scheduler.lr_decay_style",
     "expected one of"),
    (MEGATRON, ["policy.megatron_cfg.scheduler.start_weight_decay=0.5"],
     "policy.megatron_cfg.scheduler.start_weight_decay", "differs from end_weight_decay"),
    (MEGATRON, ["policy.megatron_cfg.moe_router_load_balancing_type=aux_loss"],
     "policy.megatron_cfg.moe_router_load_balancing_type", "no load-balancing loss"),
    (MEGATRON, ["policy.precision=float16"], "policy.precision", "expected one of"),
    (MEGATRON, ["policy.generation.val_top_p=0.9"], "policy.generation.val_top_p", "differs from"),
    (MEGATRON, ["policy.generation.stop_token_ids=[7]"], "policy.generation.stop_token_ids", "would end answers"),
])
def test_settings_that_change_training_are_errors_naming_the_key(dense, recipe, overrides, key, words):
    with pytest.raises(RecipeError) as err:
        load(recipe, dense, *overrides)
    assert err.value.path == key and words in err.value.reason


def test_sampling_settings_reach_the_engine_and_the_learners_step(dense):
    from services.job.learner_actor import LearnerSpec

    recipe, report = load(MEGATRON, dense, "policy.generation.temperature=0.7", "policy.generation.top_k=20",
                          "policy.generation.top_p=0.9", "policy.generation.val_top_k=20",
                          "policy.generation.val_top_p=0.9", "policy.generation.vllm_cfg.logprobs_mode=raw_logprobs")
    g = recipe.policy.generation
    assert (g.temperature, g.top_k, g.top_p, g.tempered) == (0.7, 20, 0.9, True)
    sampling = LearnerSpec.of(recipe, dense).step_config.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.7, 20, 0.9)
    assert "processed log-probs" in why(report, "policy.generation.vllm_cfg.logprobs_mode")


def test_settings_that_change_nothing_on_this_model_are_ignored(dense):
    _, report = load(MEGATRON, dense, "policy.generation.stop_token_ids=[5, 128009]")
    assert "end-of-sequence ids" in why(report, "policy.generation.stop_token_ids")
    assert "a kernel or fusion choice" in why(report, "policy.megatron_cfg.apply_rope_fusion")
    assert "memory/speed only" in why(report, "policy.megatron_cfg.sequence_parallel")
    assert "policy.sequence_packing.train_mb_tokens" in why(report, "policy.train_micro_batch_size")


def test_an_answer_may_take_the_whole_context_as_in_nemo_rl(dense):
    recipe, _ = load(MEGATRON, dense)
    assert recipe.policy.generation.max_new_tokens == recipe.policy.max_total_sequence_length == 512
    assert recipe.data.max_input_seq_length == 511  # NeMo-RL's answer cap: min(max_new_tokens, 512 - prompt)


def test_a_frozen_router_reaches_the_learner(moe):
    recipe, report = load(MEGATRON, moe)
    assert recipe.policy.megatron_cfg.freeze_moe_router is True
    assert "policy.megatron_cfg.freeze_moe_router" in report.kept


@pytest.mark.parametrize("overrides, engines, learner", [
    (["cluster.num_nodes=2", "cluster.gpus_per_node=8", "policy.generation.vllm_cfg.tensor_parallel_size=4"], 4, 16),
    (["cluster.gpus_per_node=8", "policy.generation.colocated.enabled=false", "grpo.async_grpo.enabled=true",
      "loss_fn.use_importance_sampling_correction=true",
      "policy.generation.colocated.resources.gpus_per_node=6", "policy.generation.vllm_cfg.tensor_parallel_size=2"],
     3, 2),
    (["cluster.num_nodes=3", "cluster.gpus_per_node=4", "policy.generation.colocated.enabled=false",
      "policy.generation.colocated.resources.num_nodes=1", "policy.generation.colocated.resources.gpus_per_node=4"],
     4, 8),
])
def test_generation_resources_become_engines(dense, overrides, engines, learner):
    r, _ = load(MEGATRON, dense, *overrides)
    assert (r.rollout_pool.num_engines, r.learner_gpus) == (engines, learner)


def test_non_colocated_generation_needs_its_gpus(dense):
    with pytest.raises(RecipeError, match="needs the GPUs per node it gets") as err:
        load(MEGATRON, dense, "policy.generation.colocated.enabled=false")
    assert err.value.path == "policy.generation.colocated.resources.gpus_per_node"


def test_engine_expert_parallelism_must_stay_inside_one_engine(dense):
    base = ["policy.generation.vllm_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=2"]
    r, _ = load(MEGATRON, dense, *base, "policy.generation.vllm_cfg.expert_parallel_size=2")
    assert r.policy.generation.vllm_cfg.expert_parallel_size == 2
    with pytest.raises(RecipeError, match="spans several engines") as err:
        load(MEGATRON, dense, *base, "policy.generation.vllm_cfg.expert_parallel_size=4")
    assert err.value.path == "policy.generation.vllm_cfg.expert_parallel_size"


def test_a_separate_tokenizer_and_config_overrides_are_kept_with_their_meaning(dense, tmp_path):
    """Issue 32.7: ``policy.tokenizer.name`` other than the model and ``policy.hf_config_overrides`` were refused;
    they are NeMo-RL's keys with the same meaning here (the run's model directory applies them:
    tests/unit/services/test_model_variant.py)."""
    r, report = load(MEGATRON, dense, f"policy.tokenizer.name={tmp_path}",
                     "policy.hf_config_overrides={rope_theta: 1000000.0, rope_scaling: {type: yarn, factor: 4.0}}")
    assert r.policy.tokenizer.name == str(tmp_path)
    assert r.policy.hf_config_overrides == {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert not [i for i in report.ignored if i.source.startswith(("policy.tokenizer.name", "policy.hf_config"))]


def test_the_seed_recipes_vllm_stack_chat_template_kwargs_and_bad_words_are_kept(dense):
    """Issue 36: NeMo-RL's ``vllm_kwargs`` block (the Nano-Omni recipes' tuned stack), ``chat_template_kwargs`` and
    ``bad_words`` are Inflight keys of the same meaning (checked against vLLM by ``validate``, not refused here)."""
    stack = ("{max_num_seqs: 64, max_num_batched_tokens: 8192, all2all_backend: flashinfer_nvlink_one_sided, "
             "kernel_config: {moe_backend: flashinfer_cutlass, enable_flashinfer_autotune: true}, "
             "mamba_ssm_cache_dtype: float32, limit_mm_per_prompt: {image: 1}, skip_mm_profiling: true, "
             "compilation_config: {backend: eager}}")
    recipe, report = load(MEGATRON, dense, f"policy.generation.vllm_kwargs={stack}",
                          "policy.tokenizer.chat_template_kwargs={enable_thinking: true}",
                          "policy.generation.bad_words=[foo]")
    kw = recipe.policy.generation.vllm_kwargs
    assert (kw.max_num_seqs, kw.max_num_batched_tokens, kw.mamba_ssm_cache_dtype) == (64, 8192, "float32")
    assert kw.kernel_config is not None and kw.kernel_config.moe_backend == "flashinfer_cutlass"
    assert kw.model_dump(exclude_none=True)["compilation_config"] == {"backend": "eager"}
    assert recipe.policy.tokenizer.chat_template_kwargs == {"enable_thinking": True}
    assert recipe.policy.generation.bad_words == ["foo"]
    assert not report.unknown and "policy.generation.vllm_kwargs.kernel_config.moe_backend" in report.kept


def test_http_server_keys_mean_the_pools_openai_endpoint(dense):
    """``vllm_cfg.expose_http_server`` and ``http_server_serving_chat_kwargs`` turn on and configure the pool's
    ``/v1/chat/completions`` (docs/agents.md); off by default."""
    chat = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs"
    recipe, report = load(MEGATRON, dense, "policy.generation.vllm_cfg.expose_http_server=true",
                          f"{chat}.enable_auto_tools=true", f"{chat}.tool_parser=hermes",
                          f"{chat}.reasoning_parser=qwen3")
    v = recipe.policy.generation.vllm_cfg
    assert v.expose_http_server and v.http_server_serving_chat_kwargs.tool_parser == "hermes"
    assert v.http_server_serving_chat_kwargs.enable_auto_tools and v.http_server_serving_chat_kwargs.reasoning_parser
    assert not any(i.source.startswith("policy.generation.vllm_cfg.")
                   and "http_server" in i.source for i in report.ignored)
    assert not load(MEGATRON, dense)[0].policy.generation.vllm_cfg.expose_http_server
    with pytest.raises(RecipeError, match="enable_auto_tools needs tool_parser"):
        load(MEGATRON, dense, f"{chat}.enable_auto_tools=true")
