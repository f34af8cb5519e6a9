"""Recipe loading: defaults, overrides, bounds, cross-field checks, clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.recipe.config import RECIPES_DIR, Recipe, RecipeError, load_recipe, load_recipe_with_report

ALL_RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path):
    assert isinstance(load_recipe(path), Recipe)


def test_async_seed_recipe_matches_the_seed():
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml")
    assert r.grpo.async_grpo.enabled and r.grpo.async_grpo.max_trajectory_age_steps == 1
    assert r.grpo.async_grpo.in_flight_weight_updates
    assert (r.grpo.num_prompts_per_step, r.grpo.num_generations_per_prompt) == (64, 16)
    p = r.policy
    assert (p.max_total_sequence_length, p.generation.max_new_tokens,
            p.sequence_packing.train_mb_tokens) == (8192, 4096, 10240)
    assert (p.megatron_cfg.tensor_model_parallel_size, p.megatron_cfg.expert_model_parallel_size) == (1, 8)
    assert not p.megatron_cfg.activation_checkpointing
    v = p.generation.vllm_cfg
    assert (v.tensor_parallel_size, v.expert_parallel_size, v.enforce_eager, v.max_num_seqs) == (2, 2, False, 128)
    assert (v.moe_backend, v.all2all_backend) == ("flashinfer_cutlass", "flashinfer_nvlink_one_sided")
    assert r.learner_gpus == 16 and r.rollout_pool.num_engines * 2 == 16


def test_sync_seed_recipe_is_colocated_on_32_gpus():
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-sync-colocated.yaml")
    assert not r.grpo.async_grpo.enabled and r.policy.generation.colocated.enabled
    assert r.cluster.num_nodes * r.cluster.gpus_per_node == 32 and r.learner_gpus == 32


def test_overrides_are_typed_and_applied():
    r = load_recipe(None, ["grpo.async_grpo.enabled=false", "policy.megatron_cfg.optimizer.lr=1e-4",
                           "policy.generation.stop_strings=['</answer>']"])
    assert r.grpo.async_grpo.enabled is False
    assert r.policy.megatron_cfg.optimizer.lr == pytest.approx(1e-4)
    assert r.policy.generation.stop_strings == ["</answer>"]


@pytest.mark.parametrize("override, path, words", [
    ("grpo.num_generations_per_prompt=0", "grpo.num_generations_per_prompt", "greater than or equal to 2"),
    ("grpo.num_generation_per_prompt=4", "grpo.num_generation_per_prompt",
     "did you mean 'grpo.num_generations_per_prompt'"),
    ("policy.megatron_cfg.optimizer.lr=fast", "policy.megatron_cfg.optimizer.lr", "valid number"),
    ("loss_fn.ratio_clip_min=2", "loss_fn.ratio_clip_min", "less than or equal to 1"),
    ("policy.generation.temperature=0", "policy.generation", "temperature > 0"),
    ("rollout_pool.channel_send_timeout_s=0", "rollout_pool.channel_send_timeout_s", "greater than 0"),
    ("rollout_pool.channel_send_timeout_s=soon", "rollout_pool.channel_send_timeout_s", "valid number"),
    ("rollout_pool.route_prefix=pool", "rollout_pool.route_prefix", "should match pattern"),
    ("rollout_pool.route_prefix=/pool/", "rollout_pool.route_prefix", "(got '/pool/')"),
])
def test_bad_values_name_the_key(override, path, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, [override])
    assert err.value.path == path
    assert words in str(err.value)


@pytest.mark.parametrize("overrides, words", [
    (["policy.generation.max_new_tokens=200"], "max_new_tokens (200) must be <= policy.max_total_sequence_length"),
    (["data.max_input_seq_length=128"], "data.max_input_seq_length (128) must be < policy.max_total_sequence_length"),
    (["policy.sequence_packing.train_mb_tokens=64"],
     "train_mb_tokens (64) must be >= policy.max_total_sequence_length"),
    (["policy.generation.colocated.enabled=true"], "requires policy.generation.colocated.enabled=false"),
    (["loss_fn.use_importance_sampling_correction=false"], "requires loss_fn.use_importance_sampling_correction"),
    (["cluster.gpus_per_node=4", "rollout_pool.num_engines=8"], "no GPUs left for the learner"),
    (["rollout_pool.channel_send_timeout_s=120"],
     "rollout_pool.channel_send_timeout_s (120) must be < policy.generation.request_timeout_s (120)"),
])
def test_contradictions_are_rejected(overrides, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, overrides)
    assert words in str(err.value)


def test_gpu_totals_must_add_up():
    with pytest.raises(RecipeError, match="must equal num_nodes x gpus_per_node"):
        load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml", ["rollout_pool.learner_gpus=8"])
    with pytest.raises(RecipeError, match="expert_model_parallel_size"):
        load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml", ["policy.megatron_cfg.expert_model_parallel_size=32"])


def test_unreadable_and_malformed_files(tmp_path: Path):
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="mapping at the top level"):
        load_recipe(top)


def test_defaults_inherit_and_cycles_are_caught(tmp_path: Path):
    (tmp_path / "base.yaml").write_text("grpo:\n  num_prompts_per_step: 3\n  max_num_steps: 7\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\ngrpo:\n  max_num_steps: 9\n")
    r = load_recipe(tmp_path / "child.yaml")
    assert (r.grpo.num_prompts_per_step, r.grpo.max_num_steps) == (3, 9)
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_every_field_has_a_description():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")
    walk(Recipe)


def test_configuration_reference_is_up_to_date():
    from services.recipe.docs import render
    doc = (RECIPES_DIR.parent / "docs" / "configuration.md").read_text()
    assert doc == render(), ("docs/configuration.md is stale: run "
                             "`python -m services.recipe.docs > docs/configuration.md`")


def test_one_host_scale_downs_of_the_seed():
    a = load_recipe(RECIPES_DIR / "grpo-8gpu-async-4x4.yaml")
    assert a.learner_gpus == 4 and a.rollout_pool.num_engines * a.policy.generation.vllm_cfg.tensor_parallel_size == 4
    assert a.policy.megatron_cfg.expert_model_parallel_size == 4 and a.grpo.num_generations_per_prompt == 16
    s = load_recipe(RECIPES_DIR / "grpo-8gpu-sync-colocated.yaml")
    assert s.learner_gpus == 8 and s.policy.generation.colocated.enabled and not s.grpo.async_grpo.enabled
    assert load_recipe(RECIPES_DIR / "grpo-4gpu-async-2x2.yaml").learner_gpus == 2


@pytest.mark.parametrize("override, instead", [
    ("rollout_pool.gpus_per_engine=2", "tensor_parallel_size x pipeline_parallel_size"),
    ("env.task=arithmetic", "data.dataset_name"),
])
def test_removed_keys_are_errors_that_say_what_to_write_instead(override, instead):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, [override])
    assert err.value.path == override.split("=")[0] and "removed key" in str(err.value) and instead in str(err.value)


def test_train_micro_batch_size_is_ignored_with_what_decides_the_micro_batch():
    """Removed from Inflight, but every NeMo-RL recipe has it (memory/speed only there too): it is listed as
    ignored, with the same hint, instead of failing the recipe."""
    _, report = load_recipe_with_report(None, ["policy.train_micro_batch_size=2"])
    [item] = report.ignored
    assert item.source == "policy.train_micro_batch_size" and "policy.sequence_packing.train_mb_tokens" in item.why


def test_an_inflight_recipe_is_kept_as_it_is():
    recipe, report = load_recipe_with_report(RECIPES_DIR / "grpo-32gpu-async-1off.yaml")
    assert not report.ignored and not report.unknown and report.counts()["kept"] == report.counts()["leaves"] - len(
        {m.source for m in report.mapped})
    assert all(m.source == m.target for m in report.mapped)  # identity rules only (e.g. stop_strings)


def test_overrides_apply_before_interpolation_and_accept_hydra_prefixes(tmp_path: Path):
    (tmp_path / "r.yaml").write_text("policy:\n  max_total_sequence_length: 512\n  sequence_packing:\n"
                                     "    train_mb_tokens: ${mul:${policy.max_total_sequence_length}, 2}\n")
    r = load_recipe(tmp_path / "r.yaml", ["++policy.max_total_sequence_length=8192"])
    assert r.policy.sequence_packing.train_mb_tokens == 16384


def test_gpus_per_engine_is_tensor_x_pipeline_parallel():
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml", ["policy.generation.vllm_cfg.pipeline_parallel_size=2",
                                                                 "rollout_pool.num_engines=4"])
    assert r.gpus_per_engine == 4 and r.learner_gpus == 16


def test_lr_decay_steps_defaults_to_max_num_steps_and_must_outlast_the_warm_up():
    decay = "policy.megatron_cfg.optimizer.lr_decay_style=cosine"
    assert load_recipe(None, ["grpo.max_num_steps=7", decay]).policy.megatron_cfg.optimizer.lr_decay_steps == 7
    set_ = load_recipe(None, ["grpo.max_num_steps=7", decay, "policy.megatron_cfg.optimizer.lr_decay_steps=30"])
    assert set_.policy.megatron_cfg.optimizer.lr_decay_steps == 30
    with pytest.raises(RecipeError, match=r"lr_warmup_steps \(7\) must be < lr_decay_steps \(7; default grpo"):
        load_recipe(None, ["grpo.max_num_steps=7", decay, "policy.megatron_cfg.optimizer.lr_warmup_steps=7"])
    load_recipe(None, ["grpo.max_num_steps=7", "policy.megatron_cfg.optimizer.lr_warmup_steps=9"])  # constant: fine


def test_the_channel_holds_the_groups_generated_ahead():
    ahead = ["grpo.num_prompts_per_step=8", "grpo.async_grpo.max_trajectory_age_steps=3"]
    assert load_recipe(None, ahead + ["rollout_pool.max_inflight_groups=24"])
    with pytest.raises(RecipeError, match=r"max_inflight_groups \(23\) must be >= .* \(24\)"):
        load_recipe(None, ahead + ["rollout_pool.max_inflight_groups=23"])
    load_recipe(None, ahead + ["rollout_pool.max_inflight_groups=8", "grpo.async_grpo.enabled=false"])
