"""Prompt sources: deterministic by seed, chat-templated, tasks matching their rewards."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rollout.episodes.calculator import CALCULATOR, evaluate
from rollout.episodes.environment import Turn
from rollout.episodes.envs.letter_relay import LetterRelay
from rollout.rewards.registry import RewardInput, math_exact, repeat_letter
from services.data.tasks import MAX_REPEAT_TARGETS, RELAY_ROUNDS, make_prompts, repeat_targets


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("task", ["repeat_letter", "arithmetic", "letter_relay", "multi_step_arithmetic"])
def test_prompts_are_deterministic_unique_and_chat_templated(tokenizer, task):
    a = make_prompts(task, tokenizer, 16, seed=3)
    b = make_prompts(task, tokenizer, 16, seed=3)
    c = make_prompts(task, tokenizer, 16, seed=4)
    assert [p.prompt_id for p in a] == [f"{task}-{i}" for i in range(16)]
    assert [(p.prompt_ids.tolist(), p.task) for p in a] == [(p.prompt_ids.tolist(), p.task) for p in b]
    assert [p.task for p in a] != [p.task for p in c]
    text = tokenizer.decode(a[0].prompt_ids)
    first = "<|im_start|>system\n# Tools" if task == "multi_step_arithmetic" else "<|im_start|>user\n"
    assert text.startswith(first) and text.endswith("<|im_start|>assistant\n")
    val = make_prompts(task, tokenizer, 16, seed=3, split="val")
    assert [p.prompt_id for p in val] == [f"val:{task}-{i}" for i in range(16)] and val[0].task != a[0].task


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


def test_letter_relay_tasks_name_the_first_letter_and_a_perfect_player_scores_one(tokenizer):
    targets = {letter: ids for letter, _, ids in repeat_targets(tokenizer)}
    prompts = make_prompts("letter_relay", tokenizer, 32, seed=0)
    assert len({p.task["letters"] for p in prompts}) > 4  # the rounds' letters vary within an episode and across
    env = LetterRelay()
    for p in prompts:
        letters = p.task["letters"].split(",")
        assert len(letters) == RELAY_ROUNDS and set(letters) <= set(targets)
        assert tokenizer.decode(p.prompt_ids).endswith(
            f"<|im_start|>user\nRepeat the letter {letters[0]}.<|im_end|>\n<|im_start|>assistant\n")
        assert all(p.task[f"target_token_ids_{x}"] == ",".join(map(str, targets[x])) for x in letters)
        state, opening = env.reset(p.task)
        assert opening == []
        for i, letter in enumerate(letters):
            ids = tokenizer.encode(" " + " ".join([letter] * 6), add_special_tokens=False)
            step = env.step(state, Turn(tokenizer.decode(ids), ids))
            if i + 1 < len(letters):
                assert step.observation[0].content == f"Good. Now repeat the letter {letters[i + 1]}."
        assert step.done and step.reward == 1.0


def test_multi_step_arithmetic_shows_the_calculator_and_its_answers_check_out(tokenizer):
    schema = CALCULATOR.schema()
    prompts = make_prompts("multi_step_arithmetic", tokenizer, 16, seed=2)
    assert len({p.task["expression"] for p in prompts}) > 8
    for p in prompts:
        text = tokenizer.decode(p.prompt_ids)
        assert f"<tools>\n{json.dumps(schema)}\n</tools>" in text and "<tool_call>" in text
        assert f"<|im_start|>user\nCompute {p.task['expression']}. You may call the calculator tool.<|im_end|>" in text
        assert p.task["answer"] == evaluate(p.task["expression"]) and isinstance(p.task["answer"], int)
        assert math_exact([RewardInput(f"\\boxed{{{p.task['answer']}}}", [], p.task)]) == [1.0]
    explicit = make_prompts("multi_step_arithmetic", tokenizer, 16, seed=2, tools=[schema])
    assert [x.prompt_ids.tolist() for x in explicit] == [x.prompt_ids.tolist() for x in prompts]
    bare = make_prompts("multi_step_arithmetic", tokenizer, 2, seed=2, tools=[])
    assert "<tools>" not in tokenizer.decode(bare[0].prompt_ids) and bare[0].task == prompts[0].task
    letters = make_prompts("repeat_letter", tokenizer, 2, seed=2, tools=[schema])  # tools on any task
    assert "<tools>" in tokenizer.decode(letters[0].prompt_ids)
    assert make_prompts("repeat_letter", tokenizer, 2, seed=2, tools=[])[0].prompt_ids.tolist() == \
        make_prompts("repeat_letter", tokenizer, 2, seed=2)[0].prompt_ids.tolist()


def test_a_chat_template_that_ignores_tools_is_refused(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"tools \['calculator'\]: the model's chat template does not show tools"):
        make_prompts("multi_step_arithmetic", tok, 2, seed=0)
    assert len(make_prompts("multi_step_arithmetic", tok, 2, seed=0, tools=[])) == 2
