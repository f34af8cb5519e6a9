"""Rows read through ``datasets`` and mapped to prompts (services/data/dataset.py, prompt_template.py)."""
from __future__ import annotations

import json

import pytest

from services.data.dataset import DataError, InvalidRow, RowMapper, load_rows, metadata_value
from services.data.prompt_template import PromptTemplate, read_template

MAPPER = RowMapper("input", "output", "messages")


class ChatTokenizer:
    """A stand-in tokenizer: one id per character of ``role:content|`` for every turn, plus a generation marker."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, return_dict):
        assert tokenize and add_generation_prompt and not return_dict
        text = "".join(f"{m['role']}:{m['content']}|" for m in messages)
        return [ord(c) for c in text] + [0]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_format_reads_the_same_rows(tmp_path):
    import datasets

    rows = [{"input": f"q{i}", "output": str(i), "level": i % 3} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "r.parquet"))
    ds.to_csv(str(tmp_path / "r.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "disk"))
    _jsonl(tmp_path / "r.jsonl", rows)
    for name in ("r.jsonl", "r.parquet", "r.csv", "disk"):
        got = load_rows(str(tmp_path / name), cache_dir=str(tmp_path / "cache"))
        assert [MAPPER.map(got.row(i)).task for i in range(len(got))] == \
            [{"level": i % 3, "answer": str(i)} for i in range(5)], name


def test_a_glob_concatenates_files_in_order_and_errors_name_the_file_and_row(tmp_path):
    _jsonl(tmp_path / "b.jsonl", [{"input": "x", "output": "1"}] * 2)
    _jsonl(tmp_path / "a.jsonl", [{"input": "y", "output": "2"}] * 3)
    rows = load_rows(str(tmp_path / "*.jsonl"), cache_dir=str(tmp_path / "cache"))
    assert len(rows) == 5 and rows.row(0)["input"] == "y" and rows.row(3)["input"] == "x"
    assert rows.where(4) == f"{tmp_path / 'b.jsonl'} row 1"
    with pytest.raises(FileNotFoundError, match="data.val_data_path .*no such file"):
        load_rows(str(tmp_path / "none.jsonl"), "data.val_data_path")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(DataError, match="one format"):
        load_rows(str(tmp_path / "*.*"))


def test_mapping_metadata_conversion_and_bad_rows():
    task = MAPPER.map({"input": "2+2?", "output": 4.0, "ok": True, "gone": None, "nan": float("nan"),
                       "tags": ["a", 1], "info": {"k": 2}, "x": 1.5, "answer": "stale"}).task
    assert task == {"ok": 1, "tags": '["a", 1]', "info": '{"k": 2}', "x": 1.5, "answer": "4"}
    assert metadata_value(float("inf"), "k") is None and metadata_value(7, "k") == 7
    cases = [({"output": "1"}, "input", "missing"), ({"input": 3, "output": "1"}, "input", "expected a string"),
             ({"input": "  ", "output": "1"}, "input", "empty prompt"), ({"input": "q"}, "output", "missing"),
             ({"input": "q", "output": [1]}, "output", "expected a string or number"),
             ({"messages": [], "output": "1"}, "messages", "non-empty list"),
             ({"messages": [{"role": "user"}], "output": "1"}, "messages", "turn 0"),
             ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
                 {"type": "text", "text": "what is said?"}, {"type": "input_audio", "input_audio": {}}]}],
               "output": "1"}, "messages", "turn 1: a 'input_audio' part: audio inputs are not supported"),
             ({"input": "q", "output": "1", "meta": "x" * 5000}, "meta", "longer than")]
    for row, key, why in cases:
        with pytest.raises(InvalidRow, match=why) as e:
            MAPPER.map(row)
        assert e.value.key == key, row


def test_missing_columns_fail_at_load(tmp_path):
    rows = load_rows(str(_jsonl(tmp_path / "r.jsonl", [{"question": "q", "output": "1"}])),
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"r.jsonl.*no column 'input' \(data.input_key\)"):
        MAPPER.check_columns(rows, "data.train_data_path")
    RowMapper("question", "output", "messages").check_columns(rows, "data.train_data_path")


def test_template_system_prompt_and_chat_turns(tmp_path):
    (tmp_path / "t.txt").write_text("Solve: {} Put the answer in \\boxed{{}}.")
    t = PromptTemplate(ChatTokenizer(), read_template(str(tmp_path / "t.txt")), "Be brief.")
    assert t.messages("2+2") == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Solve: 2+2 Put the answer in \\boxed{}."}]
    own = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.messages(turns=own) == own
    assert t.ids(turns=[{"role": "user", "content": "U"}]) == [ord(c) for c in "system:Be brief.|user:U|"] + [0]
    (tmp_path / "bad.txt").write_text("{} and {}")
    with pytest.raises(ValueError, match="exactly one"):
        read_template(str(tmp_path / "bad.txt"))
