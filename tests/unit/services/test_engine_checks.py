"""``inflight validate`` checks ``policy.generation.vllm_kwargs`` against the installed vLLM (no engine started):
an unknown argument is a problem naming it and its close match; the seed recipes' stack passes on CPU with its
GPU-only arguments noted as ignored."""
from __future__ import annotations

from services.recipe.config import load_recipe
from services.preflight.checks import check_recipe

SEED_STACK = ("{max_num_seqs: 64, max_num_batched_tokens: 8192, all2all_backend: flashinfer_nvlink_one_sided, "
              "kernel_config: {moe_backend: flashinfer_cutlass, enable_flashinfer_autotune: true}, "
              "mamba_ssm_cache_dtype: float32, limit_mm_per_prompt: {image: 1}, skip_mm_profiling: true}")


def test_an_unknown_vllm_argument_is_a_problem_with_its_close_match():
    checks = check_recipe(load_recipe(None, ["policy.generation.vllm_kwargs.max_num_seq=8"]), here=False)
    (problem,) = [p for p in checks.problems if "vllm_kwargs" in p.key]
    assert problem.key == "policy.generation.vllm_kwargs.max_num_seq" and problem.value == "8"
    assert "has no engine argument 'max_num_seq'; did you mean 'max_num_seqs'" in problem.why


def test_the_seed_stack_validates_and_says_what_it_ignores_here():
    from rollout.options import probe_vllm

    checks = check_recipe(load_recipe(None, [f"policy.generation.vllm_kwargs={SEED_STACK}"]), here=False)
    assert not [p for p in checks.problems if "vllm_kwargs" in p.key], checks.problems
    notes = "\n".join(checks.notes)
    assert "policy.generation.vllm_kwargs.max_num_seqs -> max_num_seqs=64" in notes
    if probe_vllm().platform == "cpu":
        assert "policy.generation.vllm_kwargs.kernel_config.moe_backend='flashinfer_cutlass' ignored on cpu" in notes
        assert "policy.generation.vllm_kwargs.all2all_backend='flashinfer_nvlink_one_sided' ignored on cpu" in notes
