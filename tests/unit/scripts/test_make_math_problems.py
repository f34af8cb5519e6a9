"""The word-problem generator (scripts/make_math_problems.py): deterministic per seed, answers that check out."""
from __future__ import annotations

import json
import re
from pathlib import Path

from repo_scripts import load_script


def _load():
    return load_script("scripts/make_math_problems.py", "make_math_problems")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_files_and_answers_check_out(tmp_path):
    gen = _load()
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        gen.main(["--out-dir", str(tmp_path / name), "--num-train", "300", "--num-val", "40", "--seed", str(seed)])
    a, b, c = (_rows(tmp_path / n / "train.jsonl") for n in "abc")
    assert a == b and a != c and len(a) == 300 and len(_rows(tmp_path / "a" / "val.jsonl")) == 40
    assert _rows(tmp_path / "a" / "val.jsonl") != a[:40]
    assert {r["operation"] for r in a} == {"add", "subtract", "multiply"} and {r["difficulty"] for r in a} == {1, 2, 3}
    op = {"add": lambda x, y: x + y, "subtract": lambda x, y: x - y, "multiply": lambda x, y: x * y}
    for r in a:
        x, y = (int(v) for v in re.findall(r"\d+", r["input"]))  # a then b, except in commutative stories
        assert r["output"] == str(op[r["operation"]](x, y)) and int(r["output"]) >= 0, r


def test_difficulty_zero_has_one_digit_answers_that_check_out(tmp_path):
    gen = _load()
    gen.main(["--out-dir", str(tmp_path), "--num-train", "300", "--num-val", "10", "--max-difficulty", "0"])
    rows = _rows(tmp_path / "train.jsonl")
    assert {r["operation"] for r in rows} == {"count", "add", "subtract"} and {r["difficulty"] for r in rows} == {0}
    for r in rows:
        numbers = [int(v) for v in re.findall(r"\d+", r["input"])]
        want = {"count": lambda n: n[0], "add": lambda n: n[0] + n[1], "subtract": lambda n: n[0] - n[1]}
        assert r["output"] == str(want[r["operation"]](numbers)) and 0 <= int(r["output"]) <= 9, r
