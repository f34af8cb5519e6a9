"""``data.split_validation_size`` (a seeded hold-out of the training rows, NeMo-RL's ``train_test_split``), Hub
datasets ``hf://<owner>/<name>`` (offline: an error naming the dataset), dotted column paths and
``data.task_columns`` (services/data/dataset.py, prompt_source.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_dataset import ChatTokenizer

from services.recipe.config import RecipeError, load_recipe
from services.data.dataset import DataError, RowMapper, load_rows, lookup, split_rows
from services.data.prompt_source import PromptSource, row_prompts, validation_prompts

ROOT = Path(__file__).resolve().parents[4]


def _jsonl(tmp_path, n, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"input": f"q{i}", "output": str(i)}) + "\n" for i in range(n)))
    return path


def _recipe(path, *extra):
    return load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={path}", *extra])


def test_split_holds_out_a_seeded_share_and_no_row_is_in_both(tmp_path):
    rows = load_rows(str(_jsonl(tmp_path, 40)), cache_dir=str(tmp_path / "cache"))
    train, held = split_rows(rows, 0.05, seed=42)
    assert (len(train), len(held)) == (38, 2)                       # ceil(0.05 x 40) = 2 held out
    got = [held.source_row(i) for i in range(len(held))] + [train.source_row(i) for i in range(len(train))]
    assert sorted(got) == list(range(40))                            # every row once: in one part only
    assert got == list(np.random.default_rng(42).permutation(40))    # the permutation's first rows are held out
    assert held.row(0)["input"] == f"q{held.source_row(0)}" and "row" in held.where(0)
    order = [train.source_row(i) for i in range(len(train))]
    again, _ = split_rows(rows, 0.05, seed=42)
    assert [again.source_row(i) for i in range(len(again))] == order  # deterministic
    other, _ = split_rows(rows, 0.05, seed=7)
    assert [other.source_row(i) for i in range(len(other))] != order
    assert len(split_rows(rows, 5, seed=1)[1]) == 5                  # a whole number is a row count


def test_split_is_the_rows_of_datasets_train_test_split(tmp_path):
    import datasets

    rows = load_rows(str(_jsonl(tmp_path, 37)), cache_dir=str(tmp_path / "cache"))
    ds = datasets.Dataset.from_dict({"i": list(range(37))})
    for size in (0.05, 0.3, 4):
        want = ds.train_test_split(test_size=size, seed=3)
        train, held = split_rows(rows, size, seed=3)
        assert [held.source_row(i) for i in range(len(held))] == want["test"]["i"]
        assert [train.source_row(i) for i in range(len(train))] == want["train"]["i"]


def test_split_of_too_few_rows_is_an_error(tmp_path):
    rows = load_rows(str(_jsonl(tmp_path, 3)), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"data.split_validation_size \(3\).*3 of its 3 rows"):
        split_rows(rows, 3, seed=0)


def test_training_and_validation_prompts_come_from_the_two_parts(tmp_path):
    path = _jsonl(tmp_path, 40)
    recipe = _recipe(path, "data.split_validation_size=0.1", "data.split_validation_seed=5", "grpo.val_period=1",
                     "grpo.max_val_samples=3")
    val = validation_prompts(recipe, "", tokenizer=ChatTokenizer())
    held = [int(i) for i in np.random.default_rng(5).permutation(40)[:4]]
    assert [p.prompt_id for p in val] == [f"val:row-{i}" for i in held[:3]]   # the hold-out's order, original rows
    assert val[0].task["answer"] == str(held[0])
    train = row_prompts(recipe, ChatTokenizer(), str(path), "data.train_data_path", "row-", None, "train")
    assert len(train) == 36
    source = PromptSource(train, seed=1, shuffle=False)
    drawn = {int(p.prompt_id.split("@")[0].removeprefix("row-")) for p in source.next(36, step=1)}
    assert drawn == set(range(40)) - set(held)                                # never a held-out row


def test_split_seed_defaults_to_grpo_seed(tmp_path):
    recipe = _recipe(_jsonl(tmp_path, 20), "data.split_validation_size=2", "grpo.seed=9", "grpo.max_val_samples=2")
    got = [p.prompt_id for p in validation_prompts(recipe, "", tokenizer=ChatTokenizer())]
    assert got == [f"val:row-{i}" for i in np.random.default_rng(9).permutation(20)[:2]]


@pytest.mark.parametrize("extra, match", [
    (["data.split_validation_size=0.1", "data.val_data_path=v.jsonl"], "give one validation set"),
    (["data.split_validation_size=2.5"], "a fraction in \\(0, 1\\) or a whole number"),
    (["grpo.val_period=5"], "needs data.val_data_path or data.split_validation_size"),
    (["data.train_split=train"], "train_split: only for a Hugging Face Hub train_data_path"),
])
def test_data_keys_that_contradict_are_errors(tmp_path, extra, match):
    with pytest.raises(RecipeError, match=match):
        _recipe(_jsonl(tmp_path, 10), *extra)


def test_split_needs_a_data_file():
    with pytest.raises(RecipeError, match="holds out rows of data.train_data_path, which is not set"):
        load_recipe(None, ["data.split_validation_size=0.1"])


def test_hub_path_is_checked_without_the_network():
    r = load_recipe(None, ["data.dataset_name=null", "data.train_data_path=hf://nvidia/OpenMathInstruct-2",
                           "data.train_split=train_1M"])
    assert r.data.train_split == "train_1M"
    with pytest.raises(RecipeError, match="expected hf://<owner>/<name>"):
        load_recipe(None, ["data.dataset_name=null", "data.train_data_path=hf://just-a-name"])


def test_hub_dataset_offline_without_cache_names_the_dataset(tmp_path):
    code = ("from services.data.dataset import load_rows\n"
            "try:\n"
            "    load_rows('hf://nvidia/OpenMathInstruct-2', split='train_1M')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120).stdout
    assert out.startswith("DataError data.train_data_path 'hf://nvidia/OpenMathInstruct-2': Hugging Face Hub "
                          "dataset 'nvidia/OpenMathInstruct-2' (split 'train_1M') could not be loaded"), out
    assert "needs network access to the Hub, or a copy in the datasets cache (HF_DATASETS_CACHE" in out
    assert "HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set" in out


def test_dotted_paths_read_nested_columns_and_task_columns_keep_only_those_named(tmp_path):
    path = tmp_path / "dapo.jsonl"
    row = {"prompt": [{"role": "user", "content": "Solve 1+1. Answer: $Answer"}],
           "reward_model": {"ground_truth": "2", "style": "rule"}, "data_source": "math", "ability": "MATH"}
    path.write_text(json.dumps(row) + "\n")
    rows = load_rows(str(path), cache_dir=str(tmp_path / "cache"))
    assert lookup(rows.row(0), "prompt.0.content") == "Solve 1+1. Answer: $Answer"
    assert lookup(rows.row(0), "prompt.1.content") is None and lookup(rows.row(0), "nothing.here") is None
    mapper = RowMapper("prompt.0.content", "reward_model.ground_truth", "messages")
    mapper.check_columns(rows, "data.train_data_path")
    m = mapper.map(rows.row(0))
    assert m.text == "Solve 1+1. Answer: $Answer"
    assert m.task == {"data_source": "math", "ability": "MATH", "answer": "2"}   # prompt/reward_model: read, not sent
    only = RowMapper("prompt.0.content", "reward_model.ground_truth", "messages", ("ability",)).map(rows.row(0))
    assert only.task == {"ability": "MATH", "answer": "2"}
    assert RowMapper("prompt.0.content", "reward_model.ground_truth", "messages", ()).map(rows.row(0)).task == \
        {"answer": "2"}
    with pytest.raises(DataError, match="no column 'solution' \\(data.task_columns\\)"):
        RowMapper("prompt.0.content", "reward_model.ground_truth", "messages", ("solution",)).check_columns(
            rows, "data.train_data_path")
    with pytest.raises(DataError, match="no column 'answer.value' \\(data.output_key\\)"):
        RowMapper("prompt.0.content", "answer.value", "messages").check_columns(rows, "data.train_data_path")


def test_a_hub_dataset_is_read_through_load_dataset_with_its_split(tmp_path, monkeypatch):
    """The DAPO recipe's data (hf:// path, dotted columns, no task columns), with ``load_dataset`` answered
    locally: what the run reads once the Hub (or the cache) has the set."""
    import datasets

    calls = []

    def fake_load_dataset(repo, split=None, cache_dir=None):
        calls.append((repo, split))
        return datasets.Dataset.from_list([
            {"prompt": [{"role": "user", "content": f"Solve {i}+1."}], "reward_model": {"ground_truth": str(i + 1)},
             "data_source": "math_dapo"} for i in range(6)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    recipe = load_recipe(None, ["data.dataset_name=null", "data.train_data_path=hf://BytedTsinghua-SIA/DAPO-Math-17k",
                                "data.input_key=prompt.0.content", "data.output_key=reward_model.ground_truth",
                                "data.task_columns=[]", "data.val_data_path=hf://BytedTsinghua-SIA/AIME-2024",
                                "data.val_split=train", "grpo.max_val_samples=2"])
    train = row_prompts(recipe, ChatTokenizer(), recipe.data.train_data_path or "", "data.train_data_path", "row-",
                        recipe.data.train_split)
    first = train.get(0)
    assert first.prompt_id == "row-0" and first.task == {"answer": "1"}
    assert "Solve 0+1." in "".join(chr(c) for c in first.prompt_ids if c)
    val = validation_prompts(recipe, "", tokenizer=ChatTokenizer())
    assert [p.prompt_id for p in val] == ["val:row-0", "val:row-1"]
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", "train"), ("BytedTsinghua-SIA/AIME-2024", "train")]
    assert "split train" in train.rows.where(3)
