"""Environment turns as token ids (rollout.episodes.chat_turns): the delta of the chat template, tokenized once.

Round trip: prompt + sampled turn + environment ids equal, token for token, the tokenization of the whole
conversation as the template renders it, when the sampled turn is what the template would write -- for a turn
ended by EOS, a turn cut at the length limit, tool messages, and both ChatML (the tiny tokenizer's template) and
Qwen2.5's real template. Templates that cannot be rendered turn after turn are refused with a clear error."""
from __future__ import annotations

import copy

import pytest

from rollout.episodes.chat_turns import ChatTurns
from rollout.episodes.environment import Message

# Qwen2.5-Instruct's chat_template (tokenizer_config.json), as published.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from services.models.tiny_model import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("chat-turns-tok"))


@pytest.fixture(scope="module")
def qwen25(chatml):
    tok = copy.deepcopy(chatml)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


TOKENIZERS = ["chatml", "qwen25"]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def render(tok, messages: list[dict], tools=None, add_generation_prompt: bool = True) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)


def sampled_turn(tok, content: str, eos: bool) -> list[int]:
    """What the model samples when it writes ``content`` the way the template renders an assistant turn."""
    return encode(tok, content) + ([tok.convert_tokens_to_ids("<|im_end|>")] if eos else [])


CONVERSATIONS = {
    "user": [Message("user", "now say it again, twice.")],
    "tool": [Message("tool", "21", name="calculator"), Message("tool", "error: calculator: division by zero",
                                                                name="calculator")],
    "system+user": [Message("system", "be brief"), Message("user", "what is 2 plus 3?")],
}


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("eos", [True, False], ids=["eos", "length-cut"])
@pytest.mark.parametrize("kind", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True], ids=["", "tools"])
def test_prompt_turn_and_environment_ids_are_the_whole_conversation_tokenized(request, name, eos, kind,
                                                                              with_tools):
    tok = request.getfixturevalue(name)
    tools = [CALCULATOR_SCHEMA] if with_tools else None
    chat = ChatTurns(tok, tools=tools)
    first = [{"role": "user", "content": "Repeat the letter a."}]
    prompt = encode(tok, render(tok, first, tools))
    answer = "a a a" if eos else "a a a a a a"  # a cut turn: the template's text is the cut content
    turn1 = sampled_turn(tok, answer, eos)
    env = chat.after_turn(turn1, CONVERSATIONS[kind])
    turn2 = sampled_turn(tok, "a b", True)
    env2 = chat.after_turn(turn2, [Message("user", "ok")])
    whole = first + [{"role": "assistant", "content": answer}] + [m.to_chat() for m in CONVERSATIONS[kind]] + [
        {"role": "assistant", "content": "a b"}, {"role": "user", "content": "ok"}]
    assert prompt + turn1 + env + turn2 + env2 == encode(tok, render(tok, whole, tools))
    # the environment's ids are its rendered text tokenized once (no decode of the history)
    closing = chat.closing_text
    delta = render(tok, whole[:2] + [m.to_chat() for m in CONVERSATIONS[kind]], tools)
    before = render(tok, whole[:2], tools, add_generation_prompt=False)
    assert before.endswith(closing) and delta.startswith(before)
    rest = closing[len("<|im_end|>"):] if eos else closing
    assert env == encode(tok, rest + delta[len(before):])


@pytest.mark.parametrize("name", TOKENIZERS)
def test_closing_text_and_generation_prompt_are_the_templates(request, name):
    tok = request.getfixturevalue(name)
    chat = ChatTurns(tok)
    assert chat.closing_text == "<|im_end|>\n"
    assert chat.generation_prompt_ids == encode(tok, "<|im_start|>assistant\n")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # EOS sampled: only the newline is added; the turn's special tokens map to their ids, not to text
    assert chat.after_turn([eos], [Message("user", "x")]) == encode(tok, "\n<|im_start|>user\nx<|im_end|>\n"
                                                                       "<|im_start|>assistant\n")
    assert encode(tok, "<|im_start|>") == [tok.convert_tokens_to_ids("<|im_start|>")]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_opening_puts_the_reset_messages_in_the_prompt(request, name):
    tok = request.getfixturevalue(name)
    chat = ChatTurns(tok)
    first = [{"role": "user", "content": "Let us play."}]
    prompt = encode(tok, render(tok, first))
    opening = [Message("user", "Guess my number between 1 and 100.")]
    assert chat.opening(prompt, opening) == encode(tok, render(tok, first + [m.to_chat() for m in opening]))
    assert chat.opening(prompt, []) == prompt
    no_generation_prompt = encode(tok, render(tok, first, add_generation_prompt=False))
    with pytest.raises(ValueError, match="does not end with the generation prompt"):
        chat.opening(no_generation_prompt, opening)


def test_a_template_that_rewrites_the_history_is_refused(chatml):
    tok = copy.deepcopy(chatml)
    # renders only the last message: adding one changes what came before
    tok.chat_template = ("<|im_start|>{{ messages[-1]['role'] }}\n{{ messages[-1]['content'] }}<|im_end|>\n"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatTurns(tok)
    with pytest.raises(ValueError, match="changes the rendering of the ones before them"):
        chat.after_turn([1], [Message("user", "x")])


def test_a_template_without_the_assistant_content_or_no_template_is_refused(chatml):
    tok = copy.deepcopy(chatml)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="content does not appear"):
        ChatTurns(tok).after_turn([1], [Message("user", "x")])
    tok.chat_template = None
    chat = ChatTurns(tok)  # building never renders: an engine without a template still starts
    with pytest.raises(ValueError, match="has no chat template"):
        chat.opening([1, 2], [Message("user", "x")])
