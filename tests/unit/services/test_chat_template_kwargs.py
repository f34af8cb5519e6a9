"""``policy.tokenizer.chat_template_kwargs`` (NeMo-RL's key) reach every chat-template call: training and validation
prompts (rows and built-in sets), environment turns, and the engines a pool or ``eval``/``generate`` builds."""
from __future__ import annotations

import pytest

from rollout.episodes.chat_turns import ChatTurns
from rollout.episodes.environment import Message
from services.data.tasks import make_prompts
from services.recipe.config import RecipeError, load_recipe
from services.data.prompt_source import PromptSource, validation_prompts
from services.data.prompt_template import PromptTemplate
from services.pool.engine_actor import EngineActor, EngineSpec

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
"""Qwen3's rule, small: ``enable_thinking=False`` writes an empty thinking block after the generation prompt."""
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.models.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("thinking-tok")
    tok = build_tokenizer(out)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(str(out))
    (out / "config.json").write_text("{}")  # a model directory as the engine actor expects (never started here)
    return out


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def text(tok, ids) -> str:
    return tok.decode([int(t) for t in ids], skip_special_tokens=False)


def recipe(*extra: str):
    return load_recipe(None, ["data.dataset_name=arithmetic", "policy.tokenizer.chat_template_kwargs="
                                                              "{enable_thinking: false}", *extra])


def test_prompt_template_and_built_in_sets_pass_them(tok):
    assert text(tok, PromptTemplate(tok, template_kwargs=OFF).ids("hi")).endswith("assistant\n<think></think>")
    assert not text(tok, PromptTemplate(tok).ids("hi")).endswith("</think>")
    (p,) = make_prompts("arithmetic", tok, 1, 0, template_kwargs=OFF)
    assert text(tok, p.prompt_ids).endswith("<think></think>")


def test_recipe_training_and_validation_prompts_carry_them(tok, model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "What is 1 plus 2?", "output": "3"}\n{"input": "What is 2 plus 2?", "output": "4"}\n')
    for r in (recipe(), recipe("data.dataset_name=null", f"data.train_data_path={rows}",
                               f"data.val_data_path={rows}")):
        assert r.policy.tokenizer.chat_template_kwargs == OFF
        train = PromptSource.of_task(r, str(model_dir))
        assert text(tok, train.set.get(0).prompt_ids).endswith("<think></think>")
        val = validation_prompts(r, str(model_dir))
        assert val and all(text(tok, p.prompt_ids).endswith("<think></think>") for p in val)


def test_environment_turns_render_with_them(tok):
    turns = ChatTurns(tok, template_kwargs=OFF)
    assert text(tok, turns.generation_prompt_ids).endswith("<think></think>")
    after = turns.after_turn([], [Message("user", "next")])
    assert text(tok, after).endswith("user\nnext<|im_end|>\n<|im_start|>assistant\n<think></think>")


def test_pool_and_local_engines_get_them(model_dir):
    spec = EngineSpec.from_recipe(recipe("env.reward_fn=math_exact"), "e0", str(model_dir))
    assert spec.chat_template_kwargs == OFF
    assert EngineActor(spec).engine.chat_template_kwargs == OFF


def test_arguments_inflight_sets_itself_are_refused():
    with pytest.raises(RecipeError, match=r"chat_template_kwargs: \['tools'\] are set by Inflight itself"):
        load_recipe(None, ["policy.tokenizer.chat_template_kwargs={tools: []}"])
