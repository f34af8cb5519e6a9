"""A session's earlier answers spliced back into its next prompt (services/pool/session_splice.py): the ids the
template re-rendered are replaced by the sampled ones when the text is the same (whitespace aside), the rest of
the prompt kept; an edited answer or an edited history is left as rendered, with the reason."""
from __future__ import annotations

from collections.abc import Sequence

from services.pool.session_splice import splice_answers
from services.pool.token_capture import CapturedChoice, CapturedCompletion

END = 0
"""The end-of-turn id (the model's stop id)."""
TEXT = {END: "<end>", 1: "<system>", 2: "<user>", 3: "<assistant>", 5: "\n", 21: "hi", 22: "more", 23: "again",
        10: "Hel", 11: "lo", 12: "Hello", 13: " world", 14: " ", 15: "world",
        40: "<tool_call>", 41: '{"name":', 42: ' "f",', 43: ' "arguments":', 44: " {}}", 45: "</tool_call>",
        47: '{"name":"f","arguments":{}}',
        50: "\ufffd", 51: "\ufffd", 52: "\ufffd"}  # 50, 51: lone bytes of no character; 52: U+FFFD's own id
SYSTEM = [1, 3]
TURN_1 = [5, 2, 22, 3]
"""The template's turn after an answer: newline, the user's next message, the assistant's turn."""
TURN_2 = [5, 2, 23, 3]


def decode(ids: Sequence[int]) -> str:
    return "".join(TEXT[i] for i in ids)


def call(prompt: list[int], sampled: list[int], n: int = 1) -> CapturedCompletion:
    return CapturedCompletion("r", list(prompt), {i: CapturedChoice(list(sampled)) for i in range(n)})


def splice(earlier: list[CapturedCompletion], rendered: list[int]):
    return splice_answers(earlier, rendered, {END}, decode)


def test_a_prompt_that_holds_the_sampled_answer_is_left_as_it_is():
    rendered = SYSTEM + [10, 11, END] + TURN_1
    got = splice([call(SYSTEM, [10, 11, END])], rendered)
    assert got.prompt_ids == rendered and got.spliced == 0 and not got.refused and got.stopped == ""


def test_a_re_rendered_answer_is_replaced_by_the_sampled_ids_and_the_rest_kept():
    got = splice([call(SYSTEM, [10, 11, END])], SYSTEM + [12, END] + TURN_1)  # "Hello": one id, sampled as two
    assert got.prompt_ids == SYSTEM + [10, 11, END] + TURN_1
    assert got.spliced == 1 and not got.refused and got.stopped == ""


def test_an_answer_ended_by_length_keeps_the_templates_end_of_turn():
    got = splice([call(SYSTEM, [10, 11])], SYSTEM + [12, END] + TURN_1)  # no stop id sampled
    assert got.prompt_ids == SYSTEM + [10, 11] + [END] + TURN_1 and got.spliced == 1


def test_two_earlier_answers_are_both_spliced_in_order_of_prompt_length():
    first = call(SYSTEM, [10, 11, END])
    second = call(SYSTEM + [10, 11, END] + TURN_1, [14, 15, END])  # its prompt as the engine served it: spliced
    rendered = SYSTEM + [12, END] + TURN_1 + [13, END] + TURN_2  # " world" rendered as one id
    got = splice([second, first], rendered)
    assert got.prompt_ids == SYSTEM + [10, 11, END] + TURN_1 + [14, 15, END] + TURN_2
    assert got.spliced == 2 and got.stopped == ""


def test_an_edited_answer_is_not_spliced_and_says_why():
    rendered = SYSTEM + [15, END] + TURN_1  # "world": the model said "Hello"
    got = splice([call(SYSTEM, [10, 11, END])], rendered)
    assert got.prompt_ids == rendered and got.spliced == 0 and got.refused
    assert "earlier call 0" in got.stopped and "edited answer" in got.stopped


def test_an_edited_history_is_not_spliced():
    rendered = [1, 2, 21, 3, 12, END] + TURN_1  # a user turn inserted before the first answer
    got = splice([call(SYSTEM, [10, 11, END])], rendered)
    assert got.prompt_ids == rendered and got.spliced == 0 and not got.refused
    assert "earlier call 0" in got.stopped and "edited history" in got.stopped


def test_splicing_stops_at_the_first_call_whose_history_was_edited():
    first = call(SYSTEM, [10, 11, END])
    second = call(SYSTEM + [10, 11, END] + TURN_1, [14, 15, END])
    rendered = SYSTEM + [12, END] + TURN_2 + [13, END] + TURN_1  # the second user message rewritten
    got = splice([first, second], rendered)
    assert got.prompt_ids == SYSTEM + [10, 11, END] + TURN_2 + [13, END] + TURN_1  # the first answer still spliced
    assert got.spliced == 1 and not got.refused and "earlier call 1" in got.stopped


def test_a_tool_calls_json_with_other_spacing_is_spliced():
    sampled = [40, 5, 41, 42, 43, 44, 5, 45, END]  # <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>
    got = splice([call(SYSTEM, sampled)], SYSTEM + [40, 5, 47, 5, 45, END] + TURN_1)  # re-serialised compactly
    assert got.prompt_ids == SYSTEM + sampled + TURN_1 and got.spliced == 1


def test_calls_of_several_answers_are_passed_over():
    rendered = SYSTEM + [12, END] + TURN_1
    got = splice([call(SYSTEM, [10, 11, END], n=2)], rendered)
    assert got.prompt_ids == rendered and got.spliced == 0 and got.stopped == ""


def test_an_answer_cut_inside_a_character_is_spliced():
    """Its text leaves the unfinished character out; a character of no text renders back as one U+FFFD."""
    sampled = [12, 50, 14, 51]  # "Hello" a stray byte " " then the first byte of a character, length-ended
    got = splice([call(SYSTEM, sampled)], SYSTEM + [12, 52, END] + TURN_1)  # the answer's text: "Hello\ufffd "
    assert got.prompt_ids == SYSTEM + sampled + [END] + TURN_1 and got.spliced == 1
