"""What a request asks vLLM for: ``policy.generation`` as ``SamplingParams`` (built without an engine)."""
from __future__ import annotations

from rollout.config import GenerationConfig
from rollout.labels import VersionLabels
from rollout.rewards.registry import get_reward_fn
from rollout.sampling import GroupSampler
from services.recipe.config import load_recipe


def sampler(generation: GenerationConfig) -> GroupSampler:
    return GroupSampler("t", generation, get_reward_fn("format"), 5.0, VersionLabels(), 256, llm=lambda: None,
                        version=lambda: 0, dead_reason=lambda: "")


def test_bad_words_reach_the_sampling_params():
    """NeMo-RL's ``policy.generation.bad_words`` is vLLM's ``SamplingParams.bad_words``; none set: none asked."""
    generation = load_recipe(None, ["policy.generation.bad_words=[' sorry', 'Sorry']"]).policy.generation
    s = sampler(generation)
    try:
        assert s._sampling_params(7).bad_words == [" sorry", "Sorry"]
        assert s._sampling_params(7, max_tokens=1, prompt_logprobs=0).bad_words == [" sorry", "Sorry"]
    finally:
        s.shutdown()
    plain = sampler(GenerationConfig())
    try:
        assert not plain._sampling_params(7).bad_words
    finally:
        plain.shutdown()


def test_a_nemo_rl_null_bad_words_is_none():
    from services.recipe.config import is_recipe_key
    from services.recipe.nemo_rl.rules import translate
    from services.recipe.nemo_rl.table import TABLE

    out, _ = translate({"policy": {"generation": {"bad_words": None, "vllm_kwargs": None}}}, TABLE, is_recipe_key)
    assert out["policy"]["generation"] == {"bad_words": [], "vllm_kwargs": {}}


def test_vllm_detokenizes_only_where_it_must():
    """With the engine's decoder set, vLLM's front end does not detokenize each token and its log-prob (the
    answer is decoded once); without it, or with stop strings (vLLM matches them on the text), vLLM does."""
    s = sampler(GenerationConfig())
    try:
        assert s._sampling_params(7).detokenize                          # no decoder yet (before the start)
        s.text_of = lambda ids: "decoded once"
        params = s._sampling_params(7)
        assert not params.detokenize and s._text(params, [5, 6], "") == "decoded once"
        s.generation = GenerationConfig(stop_strings=["</answer>"])
        assert s._text(params, [5, 6], "") == "decoded once"             # as the request was made
        params = s._sampling_params(7)
        assert params.detokenize and s._text(params, [5, 6], "vLLM's") == "vLLM's"
    finally:
        s.shutdown()
