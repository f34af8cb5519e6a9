"""The tiny tokenizer's chat template with tools: Qwen2.5's system turn listing them and its ``tool`` messages;
without either it renders byte for byte as the template before tools did (prompts and checkpoints rely on it)."""
from __future__ import annotations

import json

import pytest

from rollout.episodes.calculator import CALCULATOR
from services.models.tiny_model import build_tokenizer

OLD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""The tiny template before tools, as a literal: the new one must render every tool-less chat the same."""

QWEN_TOOLS_TURN = (
    "<|im_start|>system\n{system}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
    "<|im_end|>\n")
"""Qwen2.5's tools system turn (without its default system text)."""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("tiny-tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat the letter i."}],
    [{"role": "user", "content": "Repeat the letter i."}, {"role": "assistant", "content": " i i i"},
     {"role": "user", "content": "Good. Now repeat the letter o."}],
    [{"role": "assistant", "content": "x"}, {"role": "system", "content": "late system"}],
]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation", [True, False])
def test_without_tools_the_rendering_is_byte_identical_to_the_old_template(tok, chat, generation):
    new = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)
    old = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation, chat_template=OLD_TEMPLATE)
    assert new == old
    assert tok.apply_chat_template(chat, tools=[], tokenize=False, add_generation_prompt=generation) == old
    ids = tok.apply_chat_template(chat, add_generation_prompt=generation, return_dict=False)
    assert ids == tok.apply_chat_template(chat, add_generation_prompt=generation, return_dict=False,
                                          chat_template=OLD_TEMPLATE)


def test_tools_render_a_qwen_system_turn(tok):
    schema = CALCULATOR.schema()
    chat = [{"role": "user", "content": "Compute (2 + 5) * 3."}]
    text = tok.apply_chat_template(chat, tools=[schema], tokenize=False, add_generation_prompt=True)
    assert text == (QWEN_TOOLS_TURN.format(system="", tools=json.dumps(schema))
                    + "<|im_start|>user\nCompute (2 + 5) * 3.<|im_end|>\n<|im_start|>assistant\n")
    two = tok.apply_chat_template(chat, tools=[schema, schema], tokenize=False, add_generation_prompt=False)
    assert f"<tools>\n{json.dumps(schema)}\n{json.dumps(schema)}\n</tools>" in two
    # a first system message goes into the tools turn, not a turn of its own
    chat = [{"role": "system", "content": "Be brief."}, *chat]
    text = tok.apply_chat_template(chat, tools=[schema], tokenize=False, add_generation_prompt=False)
    assert text == (QWEN_TOOLS_TURN.format(system="Be brief.\n\n", tools=json.dumps(schema))
                    + "<|im_start|>user\nCompute (2 + 5) * 3.<|im_end|>\n")
    assert text.count("<|im_start|>system") == 1


def test_tool_messages_render_as_qwens_one_user_turn_for_consecutive_results(tok):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 5"}}\n</tool_call>'
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "7", "name": "calculator"}, {"role": "tool", "content": "21"},
            {"role": "assistant", "content": "The answer is 21."}, {"role": "tool", "content": "error: x"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nq<|im_end|>\n"
                    f"<|im_start|>assistant\n{call}<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n21\n</tool_response>"
                    "<|im_end|>\n"
                    "<|im_start|>assistant\nThe answer is 21.<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\nerror: x\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    # environment messages alone (what the engine appends after a turn) start with the tool results' user turn
    alone = tok.apply_chat_template([{"role": "tool", "content": "7"}], tokenize=False, add_generation_prompt=True)
    assert alone == "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.apply_chat_template(chat, return_dict=False, add_generation_prompt=True)) == text
