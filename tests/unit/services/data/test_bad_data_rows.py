"""Bad data files and rows are named, never a raw reader error or a crash (issues 32.3 and 33.4): a JSONL line that
is not JSON and a row that is not UTF-8 name the file and the line, a glob whose files give a column two types
names the files, the column and the row, and a huge prompt is dropped before it is tokenized."""
from __future__ import annotations

import json

import pytest
from test_dataset import ChatTokenizer

from services.recipe.config import load_recipe
from services.data.dataset import DataError, load_rows
from services.data.prompt_source import PromptSource, TooLong, row_prompts

GOOD = b'{"input": "q", "output": "1"}\n'


def _load(path, tmp_path):
    return load_rows(str(path), cache_dir=str(tmp_path / "cache"))


def test_a_line_that_is_not_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(GOOD + b"\n" + GOOD + b'{"input": "q", "output":\n' + GOOD)
    with pytest.raises(DataError, match=r"data.train_data_path: .*r.jsonl: line 4: not valid JSON"):
        _load(path, tmp_path)
    path.write_bytes(GOOD + b'["a list"]\n')
    with pytest.raises(DataError, match=r"r.jsonl: line 2: expected a JSON object"):
        _load(path, tmp_path)
    doc = tmp_path / "d.json"
    doc.write_text('[\n {"input": "q", "output": "1"},\n {"input": "q" "output": "1"}\n]\n')
    with pytest.raises(DataError, match=r"d.json: line 3: not valid JSON"):
        _load(doc, tmp_path)


def test_a_row_that_is_not_utf8_names_file_row_line_and_key(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(GOOD + b"\n" + b'{"input": "bad \xff byte", "output": "2"}\n' + GOOD)
    recipe = load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={path}"])
    rows = row_prompts(recipe, ChatTokenizer(), str(path), "data.train_data_path", "row-")
    with pytest.raises(DataError, match=r"r.jsonl row 1: key 'input': invalid UTF-8 .*line 3 of .*r.jsonl"):
        PromptSource(rows, seed=0, shuffle=False).next(2, 1)
    skip = PromptSource(rows, seed=0, shuffle=False, skip_invalid=True)
    assert [p.prompt_id for p in skip.next(2, 1)] == ["row-0@0", "row-2@0"]
    assert skip.counts()["data_skipped_invalid"] == 1


def test_a_glob_with_a_column_of_two_types_names_the_files_column_and_row(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"input": "q", "output": "1"}) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"input": "q", "output": v}) + "\n" for v in ("2", 3)))
    (tmp_path / "c.jsonl").write_text(json.dumps({"input": "q", "output": 4}) + "\n")
    with pytest.raises(DataError) as e:
        load_rows(str(tmp_path / "*.jsonl"), cache_dir=str(tmp_path / "cache"))
    msg = str(e.value)
    assert f"column 'output' is string in {tmp_path / 'a.jsonl'} but " in msg, msg
    assert "b.jsonl (first at row 1, line 2)" in msg or "c.jsonl (first at row 0, line 1)" in msg, msg
    assert "features can't be aligned" not in msg


class CountingTokenizer(ChatTokenizer):
    """The stand-in tokenizer with a vocabulary (its longest token: 4 characters) that records what it tokenized."""

    def __init__(self):
        self.lengths: list[int] = []

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "ab": 1, "abcd": 2}

    def apply_chat_template(self, messages, **kwargs):
        self.lengths.append(sum(len(m["content"]) for m in messages))
        return super().apply_chat_template(messages, **kwargs)


@pytest.mark.parametrize("field", ["input", "messages"])
def test_a_huge_prompt_is_dropped_without_tokenizing_it(tmp_path, field, caplog):
    huge = "x" * 2_000_000
    rows = [{"input": "small", "output": "1"},
            {"input": huge, "output": "2"} if field == "input" else
            {"messages": [{"role": "user", "content": huge}], "output": "2"}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={path}",
                                "data.max_input_seq_length=100"])
    tok = CountingTokenizer()
    prompts = row_prompts(recipe, tok, str(path), "data.train_data_path", "row-")
    with pytest.raises(TooLong, match="2000000 characters > 400"):
        prompts.get(1)
    assert not tok.lengths  # never tokenized
    assert f"r.jsonl row 1: key '{field}': 2000000 characters" in caplog.text
    src = PromptSource(prompts, seed=0, shuffle=False)
    assert [p.prompt_id for p in src.next(1, 1)] == ["row-0@0"]
    assert [p.prompt_id for p in src.next(1, 2)] == ["row-0@1"] and src.counts()["data_dropped_too_long"] == 1
    assert max(tok.lengths) < 100
    assert prompts.max_chars == 400  # data.max_input_seq_length x the longest token
