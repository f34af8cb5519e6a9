"""The seeded, resumable prompt stream (services/data/prompt_source.py): built-in lists and data-file rows."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from test_dataset import ChatTokenizer

from protocol import PromptRequest
from services.recipe.config import load_recipe
from services.data.dataset import DataError, RowMapper, load_rows
from services.data.prompt_source import DataExhausted, PromptSource, RowPrompts, validation_prompts
from services.data.prompt_template import PromptTemplate


def _prompts(n):
    return [PromptRequest(f"p{i}", np.array([i + 1]), {"answer": str(i)}) for i in range(n)]


def _rows(tmp_path, rows, max_len=None, name="r.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_rows(str(path), cache_dir=str(tmp_path / "cache"))
    return RowPrompts(data, RowMapper("input", "output", "messages"), PromptTemplate(ChatTokenizer()), max_len)


def _problems(n):
    return [{"input": f"q{i}", "output": str(i), "level": i % 3} for i in range(n)]


def _ids(reqs):
    return [r.prompt_id for r in reqs]


def test_prompt_source_is_seeded_unique_and_resumable():
    a, b = PromptSource(_prompts(5), seed=7), PromptSource(_prompts(5), seed=7)
    first = [r.prompt_id for r in a.next(12, step=1)]
    assert first == [r.prompt_id for r in b.next(12, step=1)]
    assert len(set(first)) == 12  # ids stay unique across epochs
    assert {r.split("@")[1] for r in first} == {"0", "1", "2"}
    pos = a.position()
    c = PromptSource(_prompts(5), seed=7)
    c.seek(pos)
    assert [r.prompt_id for r in c.next(4, 3)] == [r.prompt_id for r in a.next(4, 3)]
    assert all(r.scheduled_step == 3 for r in c.next(2, 3))
    assert [r.prompt_id for r in PromptSource(_prompts(5), seed=8).next(5, 1)] != first[:5]
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], seed=0)


def test_builtin_order_is_unchanged():
    order = list(range(6))
    random.Random(3 * 100_003 + 0).shuffle(order)
    assert _ids(PromptSource(_prompts(6), seed=3).next(6, 1)) == [f"p{i}@0" for i in order]


def test_rows_shuffle_per_epoch_deterministically(tmp_path):
    rows = _rows(tmp_path, _problems(20))
    a = PromptSource(rows, seed=1)
    e0, e1 = _ids(a.next(20, 1)), _ids(a.next(20, 2))
    assert e0 == _ids(PromptSource(rows, seed=1).next(20, 1))
    assert sorted(e0) == sorted(f"row-{i}@0" for i in range(20)) and e0 != sorted(e0, key=lambda s: int(s[4:-2]))
    assert [s[:-2] for s in e0] != [s[:-2] for s in e1]
    assert e0 != _ids(PromptSource(rows, seed=2).next(20, 1))
    assert _ids(PromptSource(rows, seed=1, shuffle=False).next(3, 1)) == ["row-0@0", "row-1@0", "row-2@0"]
    req = PromptSource(rows, seed=1, shuffle=False).next(1, 5)[0]
    assert req.task == {"level": 0, "answer": "0"} and req.scheduled_step == 5


def test_resume_mid_epoch_continues_at_the_same_row(tmp_path):
    rows = _rows(tmp_path, _problems(10))
    a = PromptSource(rows, seed=4)
    a.next(7, 1)
    b = PromptSource(rows, seed=4)
    b.seek(a.position())
    assert _ids(b.next(6, 2)) == _ids(a.next(6, 2))
    assert b.position() == a.position() and b.epoch == 1
    with pytest.raises(ValueError, match="same data"):
        PromptSource(_rows(tmp_path, _problems(9), name="s.jsonl"), seed=4).seek(a.position())


def test_too_long_rows_are_dropped_and_counted(tmp_path):
    problems = _problems(6)
    problems[2]["input"] = "x" * 50
    src = PromptSource(_rows(tmp_path, problems, max_len=30), seed=0, shuffle=False)
    got = _ids(src.next(6, 1))
    assert "row-2@0" not in got and len(got) == 6
    assert src.counts() == {"data_epoch": 1, "data_dropped_too_long": 1, "data_skipped_invalid": 0}
    assert len(src.first_prompts(3)) == 3 and src.counts()["data_dropped_too_long"] == 1


def test_bad_rows_error_names_file_row_and_key_or_are_skipped_and_counted(tmp_path):
    problems = _problems(4)
    del problems[1]["output"]
    rows = _rows(tmp_path, problems)
    src = PromptSource(rows, seed=0, shuffle=False)
    with pytest.raises(DataError, match=r"data.train_data_path: .*r.jsonl row 1: key 'output': missing"):
        src.next(3, 1)
    assert src.position()["index"] == 0  # nothing drawn
    skip = PromptSource(rows, seed=0, shuffle=False, skip_invalid=True)
    assert _ids(skip.next(3, 1)) == ["row-0@0", "row-2@0", "row-3@0"]
    assert skip.counts()["data_skipped_invalid"] == 1
    assert [int(x.prompt_ids[0]) for x in skip.first_prompts(2)] == [ord("u")] * 2


def test_max_num_epochs_ends_the_stream(tmp_path):
    src = PromptSource(_rows(tmp_path, _problems(5)), seed=0, max_epochs=2)
    assert src.remaining() == 10
    src.next(8, 1)
    assert not src.exhausted and src.remaining() == 2
    before = src.position()
    with pytest.raises(DataExhausted, match="max_num_epochs"):
        src.next(3, 2)
    assert src.position() == before
    src.next(2, 2)
    assert src.exhausted and src.remaining() == 0
    assert PromptSource(_prompts(2), seed=0).remaining() is None


def test_validation_prompts_come_from_the_val_file_with_val_ids(tmp_path):
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _problems(5)))
    recipe = load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={tmp_path / 'v.jsonl'}",
                                f"data.val_data_path={tmp_path / 'v.jsonl'}", "grpo.max_val_samples=3"])
    got = validation_prompts(recipe, "", tokenizer=ChatTokenizer())
    assert _ids(got) == ["val:row-0", "val:row-1", "val:row-2"] and got[1].task["answer"] == "1"
