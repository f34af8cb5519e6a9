"""Prompt sources: deterministic by seed, chat-templated, tasks matching their rewards."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rollout.rewards import RewardInput, math_exact, repeat_letter
from rollout.tasks import MAX_REPEAT_TARGETS, make_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("task", ["repeat_letter", "arithmetic"])
def test_prompts_are_deterministic_unique_and_chat_templated(tokenizer, task):
    a = make_prompts(task, tokenizer, 16, seed=3)
    b = make_prompts(task, tokenizer, 16, seed=3)
    c = make_prompts(task, tokenizer, 16, seed=4)
    assert [p.prompt_id for p in a] == [f"{task}-{i}" for i in range(16)]
    assert [(p.prompt_ids.tolist(), p.task) for p in a] == [(p.prompt_ids.tolist(), p.task) for p in b]
    assert [p.task for p in a] != [p.task for p in c]
    text = tokenizer.decode(a[0].prompt_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_repeat_letter_targets_are_single_tokens_and_perfect_answer_scores_one(tokenizer):
    prompts = make_prompts("repeat_letter", tokenizer, 32, seed=0)
    letters = {p.task["target"] for p in prompts}
    assert 1 < len(letters) <= MAX_REPEAT_TARGETS
    for p in prompts:
        assert f"Repeat the letter {p.task['target']}." in tokenizer.decode(p.prompt_ids)
        answer = " ".join([p.task["target"]] * 8)
        ids = tokenizer.encode(" " + answer, add_special_tokens=False)
        assert ids == [p.task["target_token_id"]] * 8
        assert repeat_letter([RewardInput(answer, ids, p.task)]) == [1.0]
        starting = [int(x) for x in p.task["target_token_ids"].split(",")]
        assert p.task["target_token_id"] in starting and len(starting) > 5
        assert all(tokenizer.decode([i]).strip().lower().startswith(p.task["target"]) for i in starting)


def test_arithmetic_answers_check_out(tokenizer):
    for p in make_prompts("arithmetic", tokenizer, 8, seed=1):
        text = tokenizer.decode(p.prompt_ids)
        a, b = (int(x) for x in text.split("What is ")[1].split("?")[0].split(" plus "))
        assert p.task["answer"] == a + b
        assert math_exact([RewardInput(f"\\boxed{{{a + b}}}", [], p.task)]) == [1.0]


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="data.dataset_name: expected one of"):
        make_prompts("chess", tokenizer, 2, 0)
    with pytest.raises(ValueError, match="num_prompts: expected >= 1, got 0"):
        make_prompts("arithmetic", tokenizer, 0, 0)


def test_validation_split_draws_other_prompts_with_val_ids(tokenizer):
    train = make_prompts("arithmetic", tokenizer, 8, seed=5)
    val = make_prompts("arithmetic", tokenizer, 8, seed=5, split="val")
    assert [p.prompt_id for p in val] == [f"val:arithmetic-{i}" for i in range(8)]
    assert [p.task for p in val] != [p.task for p in train]
    assert [p.task for p in val] == [p.task for p in make_prompts("arithmetic", tokenizer, 8, seed=5, split="val")]
    with pytest.raises(ValueError, match="split: expected one of"):
        make_prompts("arithmetic", tokenizer, 2, 0, split="test")
